"""Seed 003's spatial-ID diagnostics on toy VLMs (issue 13, part 4).

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.diagnostics --run=runs/vlm

On the unseen-pair questions: the signed deviation of the object words' believed IDs
from the true ones for wrong vs right answers (Mann-Whitney U), whether each error's
ID was already wrong (ViT / binding) or right (a later stage), and the answer's
sensitivity to occluding X's, Y's or a random free cell. Writes
RUN/diagnostics/{deviation,occlusion}.csv, summary.json, diagnostics.png
(`jaxmech.reports.diagnostics`).
"""

from absl import flags

from jaxmech.cli import run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.diagnostics import analyse_diagnostics_run, diagnostics_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
main = report_main(analyse_diagnostics_run, diagnostics_refusal)

if __name__ == "__main__":
    run_main(main)
