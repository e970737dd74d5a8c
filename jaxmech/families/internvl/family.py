"""The InternVL (-hf) checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.internvl import checks, encode, load, model, params, processor
from jaxmech.families.internvl.config import MODEL_TYPES
from jaxmech.families.internvl.view import checkpoint_view
from jaxmech.models.layout import authors_vit_mlp


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out;
    no biases) of the ViT's last min(6, depth) blocks (`models.layout.authors_vit_mlp`),
    as for Qwen-VL; the projector and the LM frozen."""
    return "+".join(authors_vit_mlp(p))


def describe(c) -> str:
    """One line for logs: the variant and its size."""
    return (f"internvl, InternViT {c.vit_depth} blocks x {c.vit_width} at "
            f"{c.image_size} px, {c.lm_layers} LM blocks")  # fmt: skip


FAMILY = hf_vlm.checkpoint_family(
    "internvl",
    MODEL_TYPES,
    (load, params, checks, model, processor),
    view=checkpoint_view,
    encode=encode.encode,
    describe=describe,
    trainable=trainable,
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("internvl", 24, 896), ("internvl-1b", "OpenGVLab/InternVL3-1B-hf", (6, 16))),
        (("internvl", 28, 1536), ("internvl-2b", "OpenGVLab/InternVL3-2B-hf", (6, 16))),
        (("internvl", 28, 3584), ("internvl-8b", "OpenGVLab/InternVL3-8B-hf", (6, 16))),
        (("internvl", 48, 5120), ("internvl-14b", "OpenGVLab/InternVL3-14B-hf", (12, 24))),
    ),
)
