"""Paper 003's spatial IDs on toy VLMs or a real checkpoint.

    python -m experiments.train --preset=vlm --seeds=8 --out=runs/vlm
    python -m experiments.spatial_ids --run=runs/vlm
    python -m experiments.spatial_ids --checkpoint=Qwen2-VL-2B-Instruct --dtype=bfloat16 \\
        --out=runs/qwen2vl_2b --layers=6:8 --protocol=authors

Per LM site, the object word's position-dependent state Delta(cell) from probe scenes
of every label at every cell; its horizontal / vertical axes; the R^2 of a rank-k map
from the ViT position basis beside the same fit from one-hot rows + columns; the IDs of
training-pair vs validation labels compared. Writes RUN/spatial_ids/{r2,axes,analytic}
.csv, summary.json, spatial_ids.png, spatial_ids_paper.png (Fig. 5; `jaxmech.reports.spatial_ids`); a checkpoint's
into OUT/spatial_ids/, from pictures of every shape at every cell (`data.inputs.pictures`),
the two halves of the shapes compared, at the sites `--layers` names (inclusive, as
the authors index: layer L the residual after L blocks); `--protocol=authors` puts
the other object at every other cell once (factorial) instead of random cells.
"""

from absl import flags

from jaxmech.cli import define_checkpoint_flags, run_main
from jaxmech.reports.common import report_main
from jaxmech.reports.spatial_ids import REPORT

# checked by check_runs (absl's required=True would bind every entry point in one process)
flags.DEFINE_string("run", None, "results folder(s), comma-separated (required)")
define_checkpoint_flags()
main = report_main(REPORT)

if __name__ == "__main__":
    run_main(main)
