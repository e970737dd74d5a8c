"""Paper 003's spatial-ID loss on toy VLMs: with it and without.

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
saved at every evaluation, so the same command resumes an interrupted run (and
finds a finished one done); a resume against a changed --base is refused.

Writes RUN/id_loss/{table,curves}.csv, summary.json, curves.png
(`jaxmech.reports.id_loss`).

On a real checkpoint, the authors' recipe (spatial_finetuning/train.py with
run_vision_spatial_loss.sh: the MLP weights of the ViT's last 6 blocks train, the merger
and the LM are frozen; the ID loss at LM layer 11, lm/resid_pre.11) once per weight from
the checkpoint, towards its own universal ID, evaluated before and after on held-out
pictures (`jaxmech.reports.id_finetune`):

    python -m experiments.id_loss --checkpoint=Qwen2-VL-2B-Instruct --out=runs/qwen_id \\
        --weights=0,1 --steps=200 --dtype=bfloat16

(--id_site, --lr and --train_only override the authors' layer, rate 5e-5 and leaves; an
LM of other than 28 blocks gets their layer at the same depth, round(11 n / 28).)

Their fine-tune itself, on their data (`jaxmech.reports.authors_finetune`: their
training folder "obj1_x1-y1_obj2_x2-y2.png", their selection, batches, loss, AdamW and
schedule; weight 0 their run_vision_baseline.sh, w > 0 run_vision_spatial_loss.sh with
--spatial_id_weight=w; the ID loss at their layer 11 unless --id_site; universal IDs
from an npz of the derivation's arrays):

    python -m experiments.id_loss --checkpoint=Qwen2-VL-2B-Instruct --protocol=authors \
        --train_dir=data/train --universal_ids=qwen2-2b_ids.npz --weights=0,1 \
        --epochs=1 --out=runs/qwen_authors_ft
"""

from absl import app, flags

from jaxmech.cli import checkpoint_options, define_checkpoint_flags, run_main, setup_runtime
from jaxmech.reports.common import analyse, open_checkpoint, report_main
from jaxmech.reports.id_loss import REPORT, finetune

flags.DEFINE_string("run", None, "results folder(s) to report on, comma-separated")
flags.DEFINE_string("base", None, "a trained run to fine-tune (with --out)")
flags.DEFINE_string("out", None, "the fine-tuned run's results folder (with --base)")
flags.DEFINE_string("weights", "0,1", "ID-loss weights to fine-tune with (0 among them)")
flags.DEFINE_integer(
    "id_site", 1, "LM site of the ID loss (layer L: the residual after L blocks). --base: "
    "default 1. --checkpoint: default the authors' layer 11 of 28 (train.py's "
    "--spatial_id_layer), in an LM of n blocks round(11 n / 28), at least 1"
)  # fmt: skip
flags.DEFINE_integer("steps", 1000, "fine-tuning steps")
flags.DEFINE_float("lr", 1e-3, "fine-tuning peak learning rate")
flags.DEFINE_string(
    "train_only", "", "parameters that train ('+'-separated globs, e.g. 'proj/*'); default "
    "all (--base), the authors' MLP weights of the ViT's last 6 blocks (--checkpoint)"
)  # fmt: skip
flags.DEFINE_bool("overwrite", False, "replace an existing --out")
flags.DEFINE_string("train_dir", None, "--protocol=authors: their training folder "
                    "(obj1_x1-y1_obj2_x2-y2.png pictures)")  # fmt: skip
flags.DEFINE_string("universal_ids", None, "--protocol=authors: npz of universal IDs "
                    "(layers, cells_Cx2, universal_LxCxD) for weights above 0")  # fmt: skip
flags.DEFINE_integer("epochs", 1, "--protocol=authors: epochs over their training folder")
flags.DEFINE_integer("batch_size", 15, "--protocol=authors: their --batch_size")
flags.DEFINE_string("remat", "on", "--checkpoint: rematerialise each scanned ViT / LM block "
                    "in the training step's backward (on, off; or a policy: full, dots)")  # fmt: skip
define_checkpoint_flags(own_out=False)
FLAGS = flags.FLAGS


def _weights(text: str) -> list[float]:
    try:
        return [float(w) for w in text.split(",")]
    except ValueError:
        raise app.UsageError(f"--weights={text!r}: expected numbers, e.g. 0,1") from None


report = report_main(REPORT)


def on_checkpoint():
    """The ID-loss fine-tunes of a checkpoint (`reports.id_finetune`) into --out."""
    from jaxmech.reports.id_finetune import run_id_loss

    if not FLAGS.out:
        raise app.UsageError("--checkpoint needs --out (the results folder)")
    from jaxmech.finetune import remat_setting

    weights = _weights(FLAGS.weights)
    try:
        remat_setting(FLAGS.remat)  # refused before the weights are read
    except ValueError as e:
        raise app.UsageError(f"--{e}") from None
    setup_runtime()
    if FLAGS.protocol == "authors":
        return on_checkpoint_authors(weights)
    try:
        run = open_checkpoint(FLAGS.checkpoint, **checkpoint_options(FLAGS))
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    lr = FLAGS.lr if FLAGS["lr"].present else 5e-5  # the authors' rate for a checkpoint
    site = FLAGS.id_site if FLAGS["id_site"].present else None  # None: the authors' layer
    run_id_loss(run, FLAGS.out, weights, site, FLAGS.steps, lr, FLAGS.train_only or None,
                FLAGS.remat)  # fmt: skip


def on_checkpoint_authors(weights):
    """Their fine-tune of --checkpoint on --train_dir (`reports.authors_finetune`)."""
    import jaxmech
    from jaxmech.reports.authors_finetune import Recipe, run_authors_finetune

    if not FLAGS.train_dir:
        raise app.UsageError("--protocol=authors needs --train_dir (their training folder)")
    try:
        recipe = Recipe(epochs=FLAGS.epochs, batch_size=FLAGS.batch_size,
                        lr=FLAGS.lr if FLAGS["lr"].present else 5e-5,
                        layer=FLAGS.id_site if FLAGS["id_site"].present else 11)  # fmt: skip
        model = jaxmech.load(FLAGS.checkpoint, dtype=FLAGS.dtype)
        run_authors_finetune(model, FLAGS.out, FLAGS.train_dir, weights, recipe,
                             FLAGS.universal_ids, FLAGS.remat)  # fmt: skip
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def main(argv):
    if FLAGS.checkpoint:
        if FLAGS.run or FLAGS.base:
            raise app.UsageError("give --checkpoint alone (not with --run or --base)")
        return on_checkpoint()
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
    analyse(REPORT, out)


if __name__ == "__main__":
    run_main(main)
