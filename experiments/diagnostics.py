"""Paper 003's spatial-ID diagnostics on toy VLMs, or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.diagnostics --run=runs/vlm
    python -m experiments.diagnostics --checkpoint=Qwen2-VL-2B-Instruct --layers=6:16 \\
        --dtype=bfloat16 --out=runs/qwen2vl_2b [--protocol=authors]

On the unseen-pair questions: the signed deviation of the object words' believed IDs
from the true ones for wrong vs right answers (Mann-Whitney U), whether each error's
ID was already wrong (ViT / binding) or right (a later stage), and the answer's
sensitivity to occluding X's, Y's or a random free cell. Writes
RUN/diagnostics/{deviation,occlusion}.csv, summary.json, diagnostics.png, diagnostics_paper.png (Fig. 8A)
(`jaxmech.reports.diagnostics`); a checkpoint's into OUT/diagnostics/, on pictures of two
objects (`data.inputs.pictures`), with the IDs of the first half of the shapes, its intervals
bootstrapped over its questions (one model), at the sites of --layers (layer L: the
residual after L blocks; 0..n, layer 0 left out: it has no diagnostics).

On a dataset's photographs instead of drawn scenes (README: where each is published):

    python -m experiments.diagnostics --checkpoint=Qwen2-VL-2B-Instruct \\
        --questions_from=coco_spatial --data=COCO --out=runs/qwen2vl_2b
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.diagnostics import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
