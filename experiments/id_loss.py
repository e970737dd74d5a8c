"""Seed 003's spatial-ID loss on toy VLMs (issue 14, part 1): with it and without.

From scratch, plain and ID-loss models side by side in one sweep, then the report:

    python -m experiments.sweep --preset=vlm --id_site=1 --id_weight=0,1 --seeds=8 \\
        --out=runs/id_scratch
    python -m experiments.id_loss --run=runs/id_scratch

Fine-tuning trained (e.g. weak) models towards the ID extracted from each beforehand,
once per weight, then the report:

    python -m experiments.train --preset=vlm --seeds=8 --steps=750 --out=runs/weak
    python -m experiments.id_loss --base=runs/weak --out=runs/id_finetune \\
        --weights=0,1 --id_site=1 --steps=1000 --lr=1e-3

The fine-tuning is a sweep from the base's params (`sweep.run_grid` with `init_from`):
checkpointed at every evaluation, so the same command resumes an interrupted run (and
finds a finished one done); a resume against a changed --base is refused.

Writes RUN/id_loss/{table,curves}.csv, summary.json, curves.png
(`jaxmech.reports.id_loss`).
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import report_main
from jaxmech.reports.id_loss import analyse_id_loss_run, finetune, id_loss_refusal

flags.DEFINE_string("run", None, "results folder(s) to report on, comma-separated")
flags.DEFINE_string("base", None, "a trained run to fine-tune (with --out)")
flags.DEFINE_string("out", None, "the fine-tuned run's results folder (with --base)")
flags.DEFINE_string("weights", "0,1", "ID-loss weights to fine-tune with (0 among them)")
flags.DEFINE_integer("id_site", 1, "LM site of the ID loss (fine-tuning)")
flags.DEFINE_integer("steps", 1000, "fine-tuning steps")
flags.DEFINE_float("lr", 1e-3, "fine-tuning peak learning rate")
flags.DEFINE_string(
    "train_only", "", "parameters that train ('+'-separated globs, e.g. 'proj/*'); default all"
)
flags.DEFINE_bool("overwrite", False, "replace an existing --out")
FLAGS = flags.FLAGS


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise app.UsageError(f"--weights={text!r}: expected numbers, e.g. 0,1") from None


report = report_main(analyse_id_loss_run, id_loss_refusal)


def main(argv):
    if (FLAGS.run is None) == (FLAGS.base is None):
        raise app.UsageError("give --run=RUN (report) or --base=RUN --out=DIR (fine-tune)")
    if FLAGS.run is not None:
        return report(argv)
    if not FLAGS.out:
        raise app.UsageError("--base needs --out (the fine-tuned run's folder)")
    setup_runtime()
    overrides = dict(
        id_site=FLAGS.id_site, steps=FLAGS.steps, lr=FLAGS.lr, train_only=FLAGS.train_only
    )
    out = finetune(FLAGS.base, FLAGS.out, _weights(FLAGS.weights), overrides, FLAGS.overwrite)
    print(f"\n=== {out}")
    analyse_id_loss_run(out)


if __name__ == "__main__":
    run_main(main)
