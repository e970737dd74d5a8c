"""Paper 003's attribute swapping (Fig. 4B, the mirror swap's control) on toy VLMs or a
real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.attribute_swapping --run=runs/vlm
    python -m experiments.attribute_swapping --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --protocol=authors --dtype=bfloat16 --out=runs/llava7b

Per LM layer and token group, each left / right question's residual stream is replaced
by its recoloured twin's (the same layout and answer; `--protocol=authors`: their
rainbow hue recolour, `mirror_attr_swapping/attribute_swapping.py`); read: the change
of log p(answer), the share of answers flipped, and the authors' normalised shift per
read word. Writes RUN/attribute_swapping/{results.csv, summary.json,
attribute_swapping.png, attribute_swapping_paper.png} (`jaxmech.reports.
attribute_swapping`); a checkpoint's into OUT/attribute_swapping/. A dataset's
photographs: `--questions_from=coco_spatial --data=COCO`.
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.attribute_swapping import REPORT
from jaxmech.reports.common import report_main

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
