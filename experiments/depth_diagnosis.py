"""Paper 003's depth diagnosis (Fig. 7) on a real checkpoint: is depth read as height?

    python -m experiments.depth_diagnosis --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --protocol=authors --dtype=bfloat16 --out=runs/llava7b

The above / below questions' subject is steered with height IDs to each target cell
(`--targets=ROW:COL,...`; the authors' protocol: column 0, their
`depth_diagnosis/depth_diagnosis.py`), and the model asked above or below and, on the
same pictures, in front of or behind; the paper finds up read as "behind". Writes
OUT/depth_diagnosis/{results.csv, summary.json, depth_diagnosis.png,
depth_diagnosis_paper.png} (`jaxmech.reports.depth_diagnosis`). Drawn scenes only; a
toy VLM has no depth words (its `--run` is refused).
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.depth_diagnosis import report
from jaxmech.reports.target_steering import targets_main

flags.DEFINE_string("run", None, "results folder(s), comma-separated (refused: no depth words)")
flags.DEFINE_string("targets", None, "target cells ROW:COL, comma-separated (default: every "
                    "cell; the authors' protocol: column 0)")  # fmt: skip
define_checkpoint_flags()
main = targets_main(report)

if __name__ == "__main__":
    run_main(main)
