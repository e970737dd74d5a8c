"""Paper 004's counterfactual table on toy VLMs or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.counterfactuals --run=runs/vlm
    python -m experiments.counterfactuals --checkpoint=Qwen2-VL-2B-Instruct \\
        --dtype=bfloat16 --out=runs/qwen2vl_2b

Every model answers the unseen-pair questions with the ViT's position codes mirrored
(or shifted half a cell), the LM's position ids or token order mirrored, the facings
flipped, and combinations, in one compiled call: the share of answers equal to the
mirrored image's and changed from the plain run's, per relation; and the binding
failures among the errors. Writes RUN/counterfactuals/{table,errors,relations}.csv
(relations.csv: each relation's mirror, its questions, why any were left out; on
photographs also posthoc.csv, paper 004's post-hoc rows over random token orders),
summary.json, counterfactuals.png (`jaxmech.reports.counterfactuals`); a checkpoint's
into OUT/counterfactuals/, on pictures of two objects (`data.inputs.pictures`), the ViT's
rotary width positions also mirrored in one block at a time.

On a dataset's photographs instead of drawn scenes (README: where each is published;
What'sUp's on / under and front / behind get rows of their own, and the content and
order flipped with the position codes not is the flipped photograph with the ViT's
codes mirrored back, facing_order_w / facing_order_h):

    python -m experiments.counterfactuals --checkpoint=Qwen2-VL-2B-Instruct \\
        --questions_from=cvbench --data=CV-Bench --out=runs/qwen2vl_2b
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.counterfactuals import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
