"""Reads a dataset's questions from the user's copy and prints what a report would ask:
the first check that a dataset folder is laid out right (no model is loaded).

    python -m experiments.questions --questions_from=coco_spatial --data=COCO_DIR [--n=100]
    python -m experiments.questions --questions_from=cvbench --data=nyu-visionx/CV-Bench
    python -m experiments.questions --questions_from=manifest --data=MY_PHOTOS

Sources (`jaxmech.data.datasets.questions.SOURCES`): coco_spatial, whatsup_a, whatsup_b,
whatsup_coco, whatsup_vg, cvbench, manifest. Prints the sample drawn, each file read
with its sha256, and the first `--show` questions. A malformed record is an error naming
the file, the line and the field.
"""

from absl import app, flags

from jaxmech.cli import run_main

flags.DEFINE_string("questions_from", None, "question source (required)")
flags.DEFINE_string(
    "data", None, "the dataset's folder, or its Hub dataset ORG/NAME[@REVISION] (required)"
)
flags.DEFINE_integer("n", None, "questions drawn (default: the source's: all, or 100)")
flags.DEFINE_integer("seed", 0, "seed of the sample")
flags.DEFINE_integer("show", 5, "questions printed")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    for name in ("questions_from", "data"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    from jaxmech.data.datasets.questions import load_questions
    from jaxmech.hub_names import dataset_folder

    data = dataset_folder(FLAGS.questions_from, FLAGS.data)
    qs = load_questions(FLAGS.questions_from, data, n=FLAGS.n, seed=FLAGS.seed)
    print(f"{qs.source}: {len(qs.questions)} question(s); sample {qs.sample}")
    for path, digest in qs.files.items():
        print(f"  read {path}  sha256 {digest}")
    for x in qs.questions[: FLAGS.show]:
        image = x.image if isinstance(x.image, str) else f"<{len(x.image)} embedded bytes>"
        words = x.question or f"(template) X = {x.objects[0]!r}, Y = {x.objects[1]!r}"
        print(f"- {x.where}: {image}\n    {words}\n    answers {x.answers}, boxes {x.boxes}")


if __name__ == "__main__":
    run_main(main)
