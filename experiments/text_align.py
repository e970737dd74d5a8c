"""Text-side mechanism of trained models: first-mention EOT heads and label alignment.

    python -m experiments.text_align --run=runs/default
    python -m experiments.text_align --run=runs/default,runs/left_right --n_random=100

For each results folder (written by experiments.train or experiments.sweep), for every
model and, as a control, the same models at their initialisation:

* text heads (`jaxmech.analysis.text_heads`): per text layer and head, the EOT row's
  attention to the first- minus the second-mentioned label over every ordered label
  pair (seen, unseen 16-20 and mixed pairs; each caption form), the fraction of
  captions where first > second (label independence), the logit difference's
  key-position part (label-independent) and the spread of its key-token part, and the
  head's role (first / second / none);
* alignment (`jaxmech.analysis.align`): Procrustes map fitted on labels
  1..n_labels - n_val_labels, tested on the validation labels, for raw token
  embeddings and for the towers' single-object output embeddings, against random
  orthogonal maps and shuffled-correspondence fits.

Prints the tables (mean +- std and 95% CI over models), writes
RUN/text_align/{text_heads,align}.csv, summary.json, text_heads.png and align.png.
Diverged models are left out of every number and figure and named, one line each.
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime
from jaxmech.reports.common import check_runs
from jaxmech.reports.text_align import analyse_text_run, text_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
flags.DEFINE_integer("n_random", 100, "random orthogonal maps (alignment control)")
flags.DEFINE_integer("n_shuffled", 20, "shuffled-correspondence fits (alignment control)")
flags.DEFINE_integer("seed", 0, "key of the random controls")
flags.DEFINE_float("min_pref", 0.05, "mean |first - second| EOT mass for a first/second head")
flags.DEFINE_float("min_frac", 0.95, "fraction of captions in every group with that sign")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:
        runs = check_runs(FLAGS.run, text_refusal)  # every folder, before any compute
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.n_random < 1 or FLAGS.n_shuffled < 1:
        raise app.UsageError("--n_random and --n_shuffled must be >= 1")
    if not 0.5 < FLAGS.min_frac <= 1.0:
        raise app.UsageError(f"--min_frac = {FLAGS.min_frac}: expected in (0.5, 1]")
    for r in runs:
        print(f"\n=== {r}")
        analyse_text_run(
            r,
            n_random=FLAGS.n_random,
            n_shuffled=FLAGS.n_shuffled,
            seed=FLAGS.seed,
            min_pref=FLAGS.min_pref,
            min_frac=FLAGS.min_frac,
        )


if __name__ == "__main__":
    run_main(main)
