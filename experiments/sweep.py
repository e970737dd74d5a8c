"""Train a grid of models (swept fields x seeds) in one compiled program.

    python -m experiments.sweep --n_pair=5:15 --seeds=4 --out=runs/npair
    python -m experiments.sweep --layouts_per_pair=1,3,5,10,15,30 --seeds=4 --out=runs/n2

Specs: `a:b` (inclusive), `a:b:step`, or `a,b,c`; several swept fields form a grid.
Sweepable fields: n_pair_labels (alias n_pair), layouts_per_pair (alias n_2),
single_frac, lr, weight_decay. Any other config field takes one value.
"""

from absl import app, flags

from jaxmech.cli import define_config_flags, setup_runtime, specs_from_flags
from jaxmech.config import Config, ConfigError
from jaxmech.report import report_run
from jaxmech.sweep import expand, run_grid

flags.DEFINE_integer("seeds", 4, "seeds per grid point")
flags.DEFINE_integer("first_seed", 0, "seed of the first model of each grid point")
flags.DEFINE_string("out", "runs/sweep", "results folder")
flags.DEFINE_bool("overwrite", False, "replace an existing results folder")
flags.DEFINE_integer("chunk_size", None, "models per compiled call (default: by backend)")
flags.DEFINE_integer("checkpoint_every", None, "steps between checkpoints (default eval_every)")
flags.DEFINE_bool("distributed", False, "call jax.distributed.initialize() (multi-host TPU pods)")
define_config_flags(sweep=True)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:
        grid = expand(Config(), specs_from_flags(FLAGS), FLAGS.seeds, FLAGS.first_seed)
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
