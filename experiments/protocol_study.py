"""The protocol study: which training protocol makes label diversity matter?

    python -m experiments.protocol_study                      # the whole study, 4 seeds
    python -m experiments.protocol_study --seeds=16           # same spec, more seeds (GPU/TPU)
    python -m experiments.protocol_study --protocols=baseline,finite_e60 --n_pair=5,10,15
    python -m experiments.protocol_study --list               # the protocols and exit

Trains every protocol (`jaxmech.presets.PROTOCOLS`) on the cells (N_pair axis at the
first --n_2, n_2 axis at the first --n_pair), each as a resumable sweep in OUT/NAME/,
measures the EP gradient and EP / EP+BP ablations per model, and writes OUT/report.md
with one figure and verdict per factor. Re-running resumes; finished protocols are
not retrained.
"""

import time

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.config import ConfigError
from jaxmech.presets import BY_NAME, PROTOCOLS
from jaxmech.reports.protocol import cells_from, protocol_grid, run_study, write_report
from jaxmech.sweep import parse_spec

flags.DEFINE_string("protocols", "all", "comma list of protocol names, or 'all'")
flags.DEFINE_string("n_pair", "5,15", "N_pair values (spec), at the first --n_2 value")
flags.DEFINE_string("n_2", "15,45", "layouts per pair (spec), at the first --n_pair value")
flags.DEFINE_integer("seeds", 4, "seeds per cell")
flags.DEFINE_integer("first_seed", 0, "first seed")
flags.DEFINE_string("out", "runs/protocol", "study folder")
flags.DEFINE_bool("overwrite", False, "replace protocol folders holding a different sweep")
flags.DEFINE_integer("chunk_size", None, "models per compiled call (default: by backend)")
flags.DEFINE_bool("list", False, "print the protocols and exit")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    if FLAGS.list:
        for p in PROTOCOLS:
            print(f"{p.name:18s} {p.factor:13s} {p.label:40s} {dict(p.overrides)}")
        return
    setup_runtime()
    try:
        names = (
            [p.name for p in PROTOCOLS]
            if FLAGS.protocols == "all"
            else [n.strip() for n in FLAGS.protocols.split(",") if n.strip()]
        )
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise ConfigError(f"--protocols: unknown {unknown}; known: {', '.join(BY_NAME)}")
        cells = cells_from(
            parse_spec("n_pair_labels", FLAGS.n_pair), parse_spec("layouts_per_pair", FLAGS.n_2)
        )
        protocols = [BY_NAME[n] for n in names]
        for p in protocols:  # validates every override and cell before any compute
            protocol_grid(p, cells, FLAGS.seeds, FLAGS.first_seed)
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    t0 = time.perf_counter()
    merged = run_study(
        FLAGS.out,
        protocols,
        cells,
        FLAGS.seeds,
        first_seed=FLAGS.first_seed,
        overwrite=FLAGS.overwrite,
        chunk_size=FLAGS.chunk_size,
    )
    wall = time.perf_counter() - t0
    path = write_report(FLAGS.out, protocols, merged, cells, FLAGS.seeds, wall)
    print(f"\nstudy: {wall / 60:.1f} min; report: {path}")


if __name__ == "__main__":
    run_main(main)
