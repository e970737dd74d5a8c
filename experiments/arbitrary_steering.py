"""Paper 003's arbitrary spatial steering (Fig. 6) on toy VLMs, or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.arbitrary_steering --run=runs/vlm
    python -m experiments.arbitrary_steering --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --protocol=authors --dtype=bfloat16 --out=runs/llava7b
    python -m experiments.arbitrary_steering --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --sets=near_far,in_between --out=runs/llava7b

X's word is steered to every target cell in turn (`--targets=ROW:COL,...`: those only)
on the left / right questions (`--sets`: also near / far, Fig. 6C, and in between,
Fig. 6D, a checkpoint's on drawn scenes; `--sets=pair`: Fig. 6A, both words steered at
a sweep of layers); per target the share of answers that follow
it and each word's change of log p, against norm-matched noise. `--protocol=authors`
follows their `arbitrary_steering/batch_lr.py` (5 x (ID(t) - ID(t's mirror)) added to
the output of blocks 12-14; `batch_nearfar.py`, `batch_inbetween.py` likewise). Writes
RUN/arbitrary_steering/{results.csv, summary.json, arbitrary_steering[_SET].png,
arbitrary_steering[_SET]_paper.png} (`jaxmech.reports.arbitrary_steering`); a
checkpoint's into OUT/arbitrary_steering/. A dataset's photographs (left / right only):
`--questions_from=coco_spatial --data=COCO`.
"""

from absl import app, flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.arbitrary_steering import parse_sets, report
from jaxmech.reports.target_steering import targets_main

flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
flags.DEFINE_string("targets", None, "target cells ROW:COL, comma-separated (default: every cell)")
flags.DEFINE_string("sets", "left_right", "question sets, comma-separated: left_right (Fig. "
                    "6B), near_far (6C), in_between (6D); or pair alone (6A)")  # fmt: skip
define_checkpoint_flags()


def main(argv):
    try:
        sets = parse_sets(flags.FLAGS.sets)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return targets_main(lambda text: report(text, sets))(argv)


if __name__ == "__main__":
    run_main(main)
