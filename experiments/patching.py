"""Seed 003's mirror-swap activation patching on toy VLMs (issue 13, part 1).

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.patching --run=runs/vlm

Per LM layer and token group (image, question, object words, all), the belief shift of
the answer word when the residual stream there comes from the mirrored image's run,
with the recolour twin as the control; writes RUN/patching/shifts.csv, summary.json and
shifts.png (`jaxmech.reports.patching`).
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.patching import analyse_patching_run, patching_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:  # every folder is checked before any compute
        runs = check_runs(FLAGS.run, patching_refusal)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    for r in runs:
        print(f"\n=== {r}")
        analyse_patching_run(r)


if __name__ == "__main__":
    run_main(main)
