"""Train a grid of models (swept fields x seeds) in one compiled program.

    python -m experiments.sweep --n_pair=5:15 --seeds=4 --out=runs/npair
    python -m experiments.sweep --layouts_per_pair=1,3,5,10,15,30 --seeds=4 --out=runs/n2

Specs: `a:b` (inclusive), `a:b:step`, or `a,b,c`; several swept fields form a grid.
Sweepable fields: n_pair_labels (alias n_pair), layouts_per_pair (alias n_2),
single_frac, lr, weight_decay. Any other config field takes one value.
`--seeds_until=N` (one grid point: no swept field) trains seeds until N models pass a
rule fixed before training (experiments.train's docstring).

Over several processes (every process runs the same command; process 0 writes --out):

    python -m experiments.sweep --n_pair=5:15 --seeds=64 --out=runs/npair --distributed
    python -m experiments.sweep --n_pair=5:15 --seeds=64 --out=runs/npair --distributed
        --coordinator_address=HOST0:8476 --num_processes=2 --process_id=I

The first on a TPU pod slice (or under SLURM / Open MPI: JAX finds its peers), the
second where nothing tells JAX (I = 0 on HOST0, 1 on the other host).
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
    if out["writer"]:  # one process of a multi-process run writes the figures
        report_run(FLAGS.out, grid, out)


if __name__ == "__main__":
    run_main(main)
