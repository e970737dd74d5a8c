"""Paper 003's steering with spatial IDs on toy VLMs, or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.steering --run=runs/vlm
    python -m experiments.steering --checkpoint=Qwen2-VL-2B-Instruct --layers=6:16 \\
        --dtype=bfloat16 --out=runs/qwen2vl_2b

At every LM site after the first block, each model's object word X is moved by its own
spatial-ID difference `alpha * (Delta(target) - Delta(source))`: adversarial steering
(flip rate against norm-matched noise and an orthogonal direction, per alpha), ID
curves (the belief per steered-to cell), and steerability vs accuracy over models.
Writes RUN/steering/{flips,curves}.csv, summary.json, steering.png, steering_paper.png (Fig. 2)
(`jaxmech.reports.steering`); a checkpoint's into OUT/steering/, on pictures of two
objects (`data.inputs.pictures`), with the IDs of the first half of the shapes.

On a dataset's photographs instead of drawn scenes (README: where each is published):

    python -m experiments.steering --checkpoint=Qwen2-VL-2B-Instruct \\
        --questions_from=coco_spatial --data=COCO --out=runs/qwen2vl_2b

`--protocol=authors` judges greedy replies of `--max_new_tokens` tokens (default 250,
their `num_generate`) where the family's view can generate (LLaVA, Qwen2/2.5/3-VL,
InternVL, Gemma-3), else the top next token.
"""

from absl import app, flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.steering import MAX_NEW_TOKENS, report

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
flags.DEFINE_integer("max_new_tokens", MAX_NEW_TOKENS, "--protocol=authors: the tokens of "
                     "each greedy reply judged (default the authors' num_generate, "
                     f"{MAX_NEW_TOKENS}), where the checkpoint's family can generate")  # fmt: skip


def main(argv):
    """The report with `--max_new_tokens`, refused before any compute if not >= 1."""
    try:
        chosen = report(flags.FLAGS.max_new_tokens)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return report_main(chosen)(argv)


if __name__ == "__main__":
    run_main(main)
