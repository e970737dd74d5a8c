"""Train seeds of one config in one vmapped program and print their accuracies.

    python -m experiments.train --seeds=8 --out=runs/default
    python -m experiments.train --seeds=4 --n_pair_labels=5 --steps=750 --out=runs/np5

Any config field is a flag (see --helpfull). Results go to --out (config.json,
results.csv, curves.csv, params/, figures/); an existing result is never overwritten
unless --overwrite is given.
"""

from absl import app, flags

from jaxmech.cli import define_config_flags, setup_runtime, specs_from_flags
from jaxmech.config import Config, ConfigError
from jaxmech.report import report_run
from jaxmech.sweep import expand, run_grid

flags.DEFINE_integer("seeds", 8, "number of seeds (models) to train")
flags.DEFINE_integer("first_seed", 0, "seed of the first model")
flags.DEFINE_string("out", "runs/train", "results folder")
flags.DEFINE_bool("overwrite", False, "replace an existing results folder")
flags.DEFINE_integer("chunk_size", None, "models per compiled call (default: by backend)")
flags.DEFINE_integer("checkpoint_every", None, "steps between checkpoints (default eval_every)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (multi-host TPU pods)")
define_config_flags(sweep=False)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:
        specs = specs_from_flags(FLAGS)
        for name, text in specs.items():
            if "," in text or ":" in text:
                raise ConfigError(
                    f"--{name}={text!r}: experiments.train takes single values; "
                    "use experiments.sweep for several"
                )
        grid = expand(Config(), specs, FLAGS.seeds, FLAGS.first_seed)
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.distributed:
        import jax

        jax.distributed.initialize()
    out = run_grid(
        grid,
        FLAGS.out,
        overwrite=FLAGS.overwrite,
        chunk_size=FLAGS.chunk_size,
        checkpoint_every=FLAGS.checkpoint_every,
    )
    report_run(FLAGS.out, grid, out)


if __name__ == "__main__":
    app.run(main)
