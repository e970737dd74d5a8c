"""Seed 000's App. O on toy VLMs: the first ViT block's logit terms, where the horizontal
and vertical gradients live, and what removing each term does to left/right vs
above/below accuracy.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.vit_terms --run=runs/vlm

Writes RUN/vit_terms/{gradients,ablations}.csv, summary.json and two figures
(`jaxmech.reports.vlm_terms`). Diverged models are left out and named.
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.vlm_terms import analyse_vit_terms_run, vit_terms_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:  # every folder is checked before any compute
        runs = check_runs(FLAGS.run, vit_terms_refusal)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    for r in runs:
        print(f"\n=== {r}")
        analyse_vit_terms_run(r)


if __name__ == "__main__":
    run_main(main)
