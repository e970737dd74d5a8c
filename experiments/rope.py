"""Report of models with a rotary vision tower: accuracies, CLS-row position profiles,
rotation ablations.

    python -m experiments.train --vision_pos=rope --seeds=4 --out=runs/rope
    python -m experiments.rope --run=runs/rope

Prints the accuracies (mean +- std over models), per model and head the CLS-row
relative-position profile (the CLS logit to a lone object as it moves across the
image), and the accuracies with the rotation switched off in all heads / each head /
all heads but one; writes RUN/rope/{heads,ablations}.csv, summary.json and figures.
"""

import os

from absl import app, flags

from jaxmech.cli import setup_runtime
from jaxmech.mechanism import analyse_rope_run, run_config

flags.DEFINE_string("run", None, "results folder(s), comma-separated", required=True)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    runs = [r for r in FLAGS.run.split(",") if r]
    for r in runs:
        if not os.path.isfile(os.path.join(r, "config.json")):
            raise app.UsageError(f"--run: {r!r} is not a results folder (no config.json)")
        vp = run_config(r).model.vision_pos
        if vp != "rope":
            raise app.UsageError(
                f"--run: {r!r} has vision_pos = {vp!r}; this report needs vision_pos = 'rope' "
                "(use experiments.mechanism)"
            )
    for r in runs:
        print(f"\n=== {r}")
        analyse_rope_run(r)


if __name__ == "__main__":
    app.run(main)
