"""Train seeds of one config in one vmapped program and print their accuracies.

    python -m experiments.train --seeds=8 --out=runs/default
    python -m experiments.train --seeds=4 --n_pair_labels=5 --steps=750 --out=runs/np5
    python -m experiments.train --preset=vlm --seeds_until=8 --max_seeds=24 --out=runs/vlm

`--seeds_until=N` trains seeds in chunks until at least N models pass `--pass_rule`
(default: the family's progress metric >= 0.9; the toy VLM's unseen_min_acc, the
unseen-pair accuracy of every relation), at most `--max_seeds` (default 4 N). The rule is
written to OUT/selection.json before training and fixed there: every report on OUT takes
the passing models as its main group, the failing ones beside them, "n = k of m trained".
The cap is a budget: rerun with a higher `--max_seeds` (same N and rule) and a run that
stopped at its cap short of N trains the next seeds, its trained models kept.

Any config field is a flag (see --helpfull). Results go to --out (config.json,
results.csv, curves.csv, params/, figures/); an existing result is never overwritten
unless --overwrite is given.
"""

from absl import app, flags

from jaxmech.cli import define_config_flags, define_run_flags, run_main, train_from_flags
from jaxmech.reports.summary import report_run

define_run_flags(default_out="runs/train", default_seeds=8)
define_config_flags(sweep=False)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    grid, out = train_from_flags(FLAGS, single_values=True, usage_error=app.UsageError)
    if out["writer"]:  # one process of a multi-process run writes the figures
        report_run(FLAGS.out, grid, out)


if __name__ == "__main__":
    run_main(main)
