"""Report of models with a rotary vision tower: accuracies, CLS-row position profiles,
rotation ablations.

    python -m experiments.train --vision_pos=rope --seeds=4 --out=runs/rope
    python -m experiments.rope --run=runs/rope

Prints the accuracies (mean +- std over models), per model and head the CLS-row
relative-position profile (the CLS logit to a lone object as it moves across the
image), and the accuracies with the rotation switched off in all heads / each head /
all heads but one; writes RUN/rope/{heads,ablations}.csv, summary.json and figures.
Diverged models are left out of every number and figure and named, one line each.
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.rope import analyse_rope_run, rope_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:  # every folder is checked before any compute
        runs = check_runs(FLAGS.run, rope_refusal)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    for r in runs:
        print(f"\n=== {r}")
        analyse_rope_run(r)


if __name__ == "__main__":
    run_main(main)
