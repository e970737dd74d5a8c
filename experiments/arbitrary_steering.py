"""Paper 003's arbitrary spatial steering (Fig. 6) on toy VLMs, or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.arbitrary_steering --run=runs/vlm
    python -m experiments.arbitrary_steering --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --protocol=authors --dtype=bfloat16 --out=runs/llava7b

X's word is steered to every target cell in turn (`--targets=ROW:COL,...`: those only)
on the left / right questions; per target the share of answers that follow it and each
word's change of log p, against norm-matched noise. `--protocol=authors` follows their
`arbitrary_steering/batch_lr.py` (5 x (ID(t) - ID(t's mirror)) added to the output of
blocks 12-14). Writes RUN/arbitrary_steering/{results.csv, summary.json,
arbitrary_steering.png, arbitrary_steering_paper.png} (`jaxmech.reports.
arbitrary_steering`); a checkpoint's into OUT/arbitrary_steering/. A dataset's
photographs: `--questions_from=coco_spatial --data=COCO`.
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.arbitrary_steering import report
from jaxmech.reports.target_steering import targets_main

flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
flags.DEFINE_string("targets", None, "target cells ROW:COL, comma-separated (default: every cell)")
define_checkpoint_flags()
main = targets_main(report)

if __name__ == "__main__":
    run_main(main)
