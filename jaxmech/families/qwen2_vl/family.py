"""The Qwen2-VL / Qwen2.5-VL / Qwen3-VL checkpoint family
(`families.contract.CheckpointFamily`): what the registry and the model handle
(`jaxmech.load`) know of it. Its variants (`config.VARIANTS`, the `model_type`s it
reads) share the processor, the M-RoPE ids, the loader and the view; their differences
are config fields the forward reads (`config` docstring)."""

from __future__ import annotations

from jaxmech.families.contract import CheckpointFamily, StandIn
from jaxmech.families.qwen2_vl import checks, load, model, next_token, params, processor
from jaxmech.families.qwen2_vl import stand_in as stand_ins
from jaxmech.families.qwen2_vl.config import VARIANTS
from jaxmech.families.qwen2_vl.view import checkpoint_view

# the authors' fine-tune (spatial_finetuning/train.py --last_k_blocks 6): the ViT's
# last 6 blocks' MLP weights
AUTHORS_VIT_BLOCKS = 6


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out,
    and Qwen2.5-VL's W_gate) of the ViT's last min(6, depth) blocks. Their selector
    (vision_mlp_lastk) takes vision tensors named like an MLP's ending in `.weight`
    (no bias) within the last 6 numbered blocks; its projector names (mm_projector,
    multi_modal_projector, ...) miss Qwen's `visual.merger`, so the merger stays frozen.
    Their 30% parameter budget holds all of them (79M of Qwen2-VL-2B's 2.2B)."""
    depth = sum(1 for k in p["vit"] if k.startswith("block_"))
    return "+".join(
        f"vit/block_{i}/{name}"
        for i in range(max(0, depth - AUTHORS_VIT_BLOCKS), depth)
        for name in ("W_gate", "W_in", "W_out")
        if name in p["vit"][f"block_{i}"]
    )


def forward(p, inputs, *, edits=None, capture=(), config):
    """The family contract's forward: `model.forward` with `capture` a collection of
    site names (True: every site)."""
    return model.forward(p, inputs, edits, config=config, capture=capture)


FAMILY = CheckpointFamily(
    name="qwen2_vl",
    checkpoint_types=VARIANTS,
    read_config=load.read_config,
    load=load.load_checkpoint,
    init_params=params.init_params,
    view=checkpoint_view,
    processor=processor.load_processor,
    encode=processor.encode,
    tokenizer=lambda proc: proc.tokenizer,
    next_token=next_token.next_token_logprobs,
    describe=lambda c: f"{c.variant}, {c.lm_layers} LM blocks",
    trainable=trainable,
    forward=forward,
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=StandIn(
        stand_ins.BENCH_CONFIGS,
        stand_ins.word_tokenizer,
        write=stand_ins.write_stand_in,
        real_name="Qwen2-VL-2B-Instruct",
    ),
)
