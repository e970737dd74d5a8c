"""The Llama-3.2-Vision (mllama) checkpoint family (`families.contract.CheckpointFamily`):
what the registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.mllama import checks, load, model, params, processor
from jaxmech.families.mllama.view import checkpoint_view


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out)
    of the last min(6, depth) local vision layers and the projector (their selector's
    `multi_modal_projector`)."""
    blocks = sorted(int(k.split("_")[1]) for k in p["vit"] if k.startswith("block_"))
    mlp = [f"vit/block_{i}/{w}" for i in blocks[-6:] for w in ("W_in", "W_out")]
    return "+".join(mlp + [f"proj/{name}" for name in p["proj"]])


FAMILY = hf_vlm.checkpoint_family(
    "mllama",
    ("mllama",),
    (load, params, checks, model, processor),
    view=checkpoint_view,
    describe=lambda c: (
        f"mllama, {c.lm_layers} LM layers ({len(c.cross_layers)} cross-attention), "
        f"{c.max_tiles} tiles of {c.grid} x {c.grid} patches"
    ),  # fmt: skip
    trainable=trainable,
    generates=False,  # not wired: tests/test_generate.py has no mllama case
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("mllama", 40, 4096), ("llama-11b", "meta-llama/Llama-3.2-11B-Vision-Instruct", (10, 20))),
    ),
)
