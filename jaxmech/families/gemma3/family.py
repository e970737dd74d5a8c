"""The Gemma-3 checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.gemma3 import checks, load, model, params, processor
from jaxmech.families.gemma3.view import checkpoint_view


def describe(c) -> str:
    n_global = sum(not c.sliding(i) for i in range(c.lm_layers))
    return (f"gemma3, {c.lm_layers} LM blocks ({n_global} global, window {c.lm_window}), "
            f"{c.grid} x {c.grid} patches pooled to {c.mm_tokens} image tokens")  # fmt: skip


FAMILY = hf_vlm.checkpoint_family(
    "gemma3",
    ("gemma3",),
    (load, params, checks, model, processor),
    view=checkpoint_view,
    describe=describe,
    # the authors' ViT MLPs and projector (`multi_modal_projector`, Gemma-3's name too)
    trainable=hf_vlm.authors_vit_and_projector,
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("gemma3", 34, 2560), ("gemma-4b", "google/gemma-3-4b-it", (10, 22))),
    ),
)
