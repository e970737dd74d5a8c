"""Paper 000's App. O on toy VLMs: the first ViT block's logit terms, where the horizontal
and vertical gradients live, and what removing each term does to left/right vs
above/below accuracy.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.vit_terms --run=runs/vlm

Writes RUN/vit_terms/{gradients,ablations}.csv, summary.json and two figures
(`jaxmech.reports.vit_terms`). Diverged models are left out and named.
"""

from absl import flags

from jaxmech.cli import run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.vit_terms import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
