"""Report of models with a rotary vision tower: accuracies, CLS-row position profiles,
rotation ablations.

    python -m experiments.train --vision_pos=rope --seeds=4 --out=runs/rope
    python -m experiments.rope --run=runs/rope

Prints the accuracies (mean +- std over models), per model and head the CLS-row
relative-position profile (the CLS logit to a lone object as it moves across the
image), and the accuracies with the rotation switched off in all heads / each head /
all heads but one; writes RUN/rope/{heads,ablations}.csv, summary.json and figures.
"""

from absl import app, flags

from jaxmech.cli import setup_runtime
from jaxmech.reports.common import load_config
from jaxmech.reports.rope import analyse_rope_run, rope_refusal

flags.DEFINE_string("run", None, "results folder(s), comma-separated", required=True)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    runs = [r for r in FLAGS.run.split(",") if r]
    for r in runs:  # every folder is checked before any compute
        try:
            refusal = rope_refusal(load_config(r).model.vision_pos, r)
        except ValueError as e:
            raise app.UsageError(f"--run: {e}") from None
        if refusal:
            raise app.UsageError(f"--run: {refusal}")
    for r in runs:
        print(f"\n=== {r}")
        analyse_rope_run(r)


if __name__ == "__main__":
    app.run(main)
