"""Mechanism report of trained models: term ablations, head roles, EP gradients.

    python -m experiments.mechanism --run=runs/default
    python -m experiments.mechanism --run=runs/default,runs/big_init --ablations=ep,ep+bp

For each run folder (written by experiments.train or experiments.sweep) prints the
ablation table (mean +- std [min, max] over models) and the head table, and writes
RUN/mechanism/{ablations,heads,shares}.csv, summary.json and figures. With several
runs, also compares the EP gradient of generalising and non-generalising models pooled
over them (figure in --compare_out, default the first run's mechanism folder).
Diverged models are left out of every number and figure and named, one line each.
"""

import os

from absl import app, flags

from jaxmech.analysis.ablate import DEFAULT_ABLATIONS, parse_ablation
from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.mechanism import analyse_run, compare_runs, ep_report_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
flags.DEFINE_string("ablations", ",".join(DEFAULT_ABLATIONS), "ablations (e.g. ep,ep+bp,vp)")
flags.DEFINE_string("heads", None, "heads to ablate in (comma list; default all)")
flags.DEFINE_float("threshold", 0.9, "unseen-pair accuracy that counts as generalising")
flags.DEFINE_string("compare_out", None, "folder for the pooled comparison figure")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    ablations = [a.strip().lower() for a in FLAGS.ablations.split(",") if a.strip()]
    try:
        for a in ablations:
            parse_ablation(a)
        heads = None if FLAGS.heads is None else [int(h) for h in FLAGS.heads.split(",")]
        runs = check_runs(FLAGS.run, ep_report_refusal)  # every folder, before any compute
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if "none" not in ablations:
        ablations = ["none", *ablations]
    results = {}
    for r in runs:
        print(f"\n=== {r}")
        results[r] = analyse_run(r, ablations, heads, FLAGS.threshold)
    if len(runs) > 1:
        out = FLAGS.compare_out or os.path.join(runs[0], "mechanism")
        print("\n=== pooled EP gradient comparison")
        print("figure:", compare_runs(results, out, FLAGS.threshold))


if __name__ == "__main__":
    run_main(main)
