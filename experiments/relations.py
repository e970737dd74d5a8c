"""Per-relation ablations and CLS-row EP maps of a 2D or three-object run.

    python -m experiments.train --task_kind=2d --seeds=4 --out=runs/2d
    python -m experiments.relations --run=runs/2d
    python -m experiments.relations --run=runs/three --ablations=ep,ep+bp --per_head=

Prints the ablation table (mean +- std over models) per relation (2D: left/right `h`
and above/below `v` on single, seen-pair and unseen-pair sets, label-set) or per
distractor place (three objects: `zl` left of, `zm` between, `zr` right of the named
pair), the same per single head for `--per_head` ablations, and the CLS-row EP term's
fit per head; writes RUN/relations/ (see jaxmech.reports.relations). Diverged models
are left out of every number and figure and named, one line each.
"""

from absl import app, flags

from jaxmech.analysis.ablate import parse_ablation
from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.relations import DEFAULT_ABLATIONS, analyse_relations_run, relations_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
flags.DEFINE_string("ablations", ",".join(DEFAULT_ABLATIONS), "ablations in all heads")
flags.DEFINE_string("per_head", "ep+bp", "ablations also run in one head at a time ('' none)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    ablations = [a.strip().lower() for a in FLAGS.ablations.split(",") if a.strip()]
    per_head = [a.strip().lower() for a in FLAGS.per_head.split(",") if a.strip()]
    try:
        for a in ablations + per_head:
            parse_ablation(a)
        runs = check_runs(FLAGS.run, relations_refusal)  # every folder, before any compute
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if "none" not in ablations:
        ablations = ["none", *ablations]
    for r in runs:
        print(f"\n=== {r}")
        analyse_relations_run(r, tuple(ablations), tuple(per_head))


if __name__ == "__main__":
    run_main(main)
