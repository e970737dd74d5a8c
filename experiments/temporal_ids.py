"""Paper 003's temporal IDs on toy video VLMs.

    python -m experiments.train --preset=vlm_video --seeds=8 --out=runs/video
    python -m experiments.temporal_ids --run=runs/video
    python -m experiments.patching --run=runs/video      # mirror = time reversal
    python -m experiments.temporal_ids --checkpoint=Qwen2-VL-2B-Instruct --layers=6:16 \
        --dtype=bfloat16 --out=runs/qwen2vl_2b
    python -m experiments.temporal_ids --checkpoint=Qwen2.5-VL-7B-Instruct --protocol=authors \
        --grid=8x4 --dtype=bfloat16 --out=runs/qwen25vl_7b     # Fig. 10 as the authors do it

Per LM site, the object word's ID from probe videos, its frame part (the temporal ID:
share of the ID, linearity in the frame index) and steering with it against
norm-matched controls. Writes RUN/temporal_ids/{ids,flips,curves}.csv, summary.json,
temporal_ids.png (`jaxmech.reports.temporal_ids`); a checkpoint's into
OUT/temporal_ids/, on videos of two objects in different frames (each scene grid row a
frame: `data.inputs.pictures.draw_video`), asked "Does the red circle appear before or after
the blue square?". Under `--protocol=authors`, Fig. 10A-C as the authors' scripts do
them (`jaxmech.reports.temporal_authors`): mirror_swap.csv, steering.csv, pca.csv,
temporal_ids.png and temporal_ids_paper.png.
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.temporal_ids import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
