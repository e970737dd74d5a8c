"""Seed 003's steering with spatial IDs on toy VLMs (issue 13, part 3).

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.steering --run=runs/vlm

At every LM site after the first block, each model's object word X is moved by its own
spatial-ID difference `alpha * (Delta(target) - Delta(source))`: adversarial steering
(flip rate against norm-matched noise and an orthogonal direction, per alpha), ID
curves (the belief per steered-to cell), and steerability vs accuracy over models.
Writes RUN/steering/{flips,curves}.csv, summary.json, steering.png
(`jaxmech.reports.steering`).
"""

from absl import flags

from jaxmech.cli import run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.steering import analyse_steering_run, steering_refusal

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
main = report_main(analyse_steering_run, steering_refusal)

if __name__ == "__main__":
    run_main(main)
