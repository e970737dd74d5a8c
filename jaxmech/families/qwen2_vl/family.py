"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint family
(`families.contract.CheckpointFamily`): what the registry and the model handle
(`jaxmech.load`) know of it. Its variants (`config.VARIANTS`, the `model_type`s it
reads) share the processor, the M-RoPE ids, the loader and the view; their differences
are config fields the forward reads (`config` docstring)."""

from __future__ import annotations

import functools
import os

from jaxmech.families import hf_vlm
from jaxmech.families.contract import VLM_REPORTS, StandIn
from jaxmech.families.qwen2_vl import checks, load, model, params, processor
from jaxmech.families.qwen2_vl import stand_in as stand_ins
from jaxmech.families.qwen2_vl.config import VARIANTS
from jaxmech.families.qwen2_vl.view import checkpoint_view
from jaxmech.models.layout import authors_vit_mlp


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out,
    and Qwen2.5-VL's W_gate) of the ViT's last min(6, depth) blocks
    (`models.layout.authors_vit_mlp`). Their selector's projector names (mm_projector,
    multi_modal_projector, ...) miss Qwen's `visual.merger`, so the merger stays frozen.
    Their 30% parameter budget holds all of them (79M of Qwen2-VL-2B's 2.2B)."""
    return "+".join(authors_vit_mlp(p))


FAMILY = hf_vlm.checkpoint_family(
    "qwen2_vl",
    VARIANTS,
    (load, params, checks, model, processor),
    view=checkpoint_view,
    describe=lambda c: f"{c.variant}, {c.lm_layers} LM blocks",
    trainable=trainable,
    reports=VLM_REPORTS,  # with videos: temporal_ids too
    stand_in=StandIn(
        stand_ins.BENCH_CONFIGS,
        stand_ins.word_tokenizer,
        write=stand_ins.write_stand_in,
        real_name="Qwen2-VL-2B-Instruct",
        reference_script=os.path.join("tests", "fixtures", "qwen2_vl", "reference_speed.py"),
    ),
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("qwen2_vl", 28, 1536), ("qwen2-2b", "Qwen/Qwen2-VL-2B-Instruct", (6, 16))),
        (("qwen2_5_vl", 36, 2048), ("qwen-3b", "Qwen/Qwen2.5-VL-3B-Instruct", (8, 18))),
        (("qwen2_5_vl", 28, 3584), ("qwen-7b", "Qwen/Qwen2.5-VL-7B-Instruct", (6, 16))),
    ),
    answer_turn=processor.answer_turn,
    # the template keeps a message's order: its text before the image where it comes first
    encode_text_first=functools.partial(processor.encode, text_first=True),
)
