"""Paper 003's mirror-swap activation patching on toy VLMs or a real
checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.patching --run=runs/vlm
    python -m experiments.patching --checkpoint=Qwen2-VL-2B-Instruct --layers=6:16 \\
        --dtype=bfloat16 --out=runs/qwen2vl_2b

Per LM layer and token group (image, question, object words, all), the belief shift of
the answer word when the residual stream there comes from the mirrored image's run,
with the recolour twin as the control; writes RUN/patching/shifts.csv, summary.json and
shifts.png and shifts_paper.png (Fig. 4 as the paper draws it; `jaxmech.reports.patching`); a checkpoint's into OUT/patching/, on
`--questions` pictures of two objects (`data.inputs.pictures`).

On a dataset's photographs instead of drawn scenes (README: where each is published):

    python -m experiments.patching --checkpoint=Qwen2-VL-2B-Instruct \\
        --questions_from=coco_spatial --data=COCO --out=runs/qwen2vl_2b
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.patching import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
