"""Paper 003's occlusion experiment (Fig. 8B) as the authors run it (their
`ground_truth_deviation/coco_blur.py`, `coco_blur.sh`, `fig_8b.ipynb`) on a real
checkpoint and COCO-Spatial's rows of both relations:

    python -m experiments.occlusion --checkpoint=llava-hf/llava-1.5-7b-hf \\
        --data=COCO --out=runs/llava7b [--questions=N] [--seed=42] [--max_new_tokens=250]

Per question: X's box blurred (radius 20) and 10 boxes of its size elsewhere, their
wording with the text before the image, log p of the correct / wrong answer word's first
token; the figure's min(cc[3:7]) - cc[1] split by Fig. 8A's verdict on a greedy reply of
--max_new_tokens (`jaxmech.reports.occlusion`). Writes OUT/occlusion_authors/
{questions.csv, summary.json}. LLaVA and Qwen2-VL checkpoints (their prompt checked);
the boxes elsewhere come from jaxmech's rng (--seed), not their hash-seeded draw.
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime

flags.DEFINE_string("checkpoint", None, "checkpoint folder, or Hub name ORG/NAME (required)")
flags.DEFINE_string("data", None, "COCO-Spatial folder: coco_qa_two_obj.json, val2017/, "
                    "annotations/instances_val2017.json (required)")  # fmt: skip
flags.DEFINE_string("out", None, "results folder (required)")
flags.DEFINE_integer("questions", None, "at most this many rows (default: every one)")
flags.DEFINE_integer("seed", 42, "seed of the boxes elsewhere")
flags.DEFINE_integer("max_new_tokens", 250, "Fig. 8A's reply length (theirs: 250)")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "the params' dtype")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    for name in ("checkpoint", "data", "out"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    if FLAGS.max_new_tokens < 1:
        raise app.UsageError(f"--max_new_tokens = {FLAGS.max_new_tokens}: expected at least 1")
    setup_runtime()
    import json

    import jax.numpy as jnp

    import jaxmech
    from jaxmech.data.datasets.coco_spatial import INSTANCES
    from jaxmech.data.datasets.questions import first_file, load_questions
    from jaxmech.hub_names import checkpoint_folder
    from jaxmech.model import checkpoint_family
    from jaxmech.reports.occlusion import check_family, run

    folder = checkpoint_folder(FLAGS.checkpoint)
    check_family(checkpoint_family(folder))  # before any weight is read
    model = jaxmech.load(folder, dtype=getattr(jnp, FLAGS.dtype))
    questions = load_questions("coco_spatial_all", FLAGS.data, FLAGS.questions).questions
    with open(first_file(FLAGS.data, INSTANCES, "COCO instances file")) as f:
        coco = json.load(f)
    run(model, questions, coco, FLAGS.out, FLAGS.seed, FLAGS.max_new_tokens)


if __name__ == "__main__":
    run_main(main)
