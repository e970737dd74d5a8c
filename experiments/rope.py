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

from absl import flags

from jaxmech.cli import run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.rope import analyse_rope_run, rope_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")

main = report_main(analyse_rope_run, rope_refusal)

if __name__ == "__main__":
    run_main(main)
