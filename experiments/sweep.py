"""Train a grid of models (swept fields x seeds) in one compiled program.

    python -m experiments.sweep --n_pair=5:15 --seeds=4 --out=runs/npair
    python -m experiments.sweep --layouts_per_pair=1,3,5,10,15,30 --seeds=4 --out=runs/n2

Specs: `a:b` (inclusive), `a:b:step`, or `a,b,c`; several swept fields form a grid.
Sweepable fields: n_pair_labels (alias n_pair), layouts_per_pair (alias n_2),
single_frac, lr, weight_decay. Any other config field takes one value.
"""

from absl import app, flags

from jaxmech.cli import define_config_flags, define_run_flags, run_main, train_from_flags
from jaxmech.reports.summary import report_run

define_run_flags(default_out="runs/sweep", default_seeds=4)
define_config_flags(sweep=True)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    grid, out = train_from_flags(FLAGS, single_values=False, usage_error=app.UsageError)
    report_run(FLAGS.out, grid, out)


if __name__ == "__main__":
    run_main(main)
