"""The InternVL (-hf) checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily
from jaxmech.families.internvl import checks, encode, load, model, next_token, params, processor
from jaxmech.families.internvl.config import MODEL_TYPES
from jaxmech.families.internvl.view import checkpoint_view

AUTHORS_VIT_BLOCKS = 6  # the authors' fine-tune: the ViT's last 6 blocks' MLP weights


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out;
    no biases) of the ViT's last min(6, depth) blocks, as for Qwen-VL; the projector
    and the LM frozen."""
    depth = sum(1 for k in p["vit"] if k.startswith("block_"))
    return "+".join(f"vit/block_{i}/{name}" for i in range(max(0, depth - AUTHORS_VIT_BLOCKS), depth)
                    for name in ("W_in", "W_out"))  # fmt: skip


def forward(p, inputs, *, edits=None, capture=(), config):
    """The family contract's forward: `model.forward` with `capture` a collection of
    site names (True: every site)."""
    return model.forward(p, inputs, edits, config=config, capture=capture)


def describe(c) -> str:
    """One line for logs: the variant and its size."""
    return (f"internvl, InternViT {c.vit_depth} blocks x {c.vit_width} at "
            f"{c.image_size} px, {c.lm_layers} LM blocks")  # fmt: skip


FAMILY = CheckpointFamily(
    name="internvl",
    checkpoint_types=MODEL_TYPES,
    read_config=load.read_config,
    load=load.load_checkpoint,
    init_params=params.init_params,
    view=checkpoint_view,
    processor=processor.load_processor,
    encode=encode.encode,
    tokenizer=lambda proc: proc.tokenizer,
    next_token=next_token.next_token_logprobs,
    describe=describe,
    trainable=trainable,
    forward=forward,
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=None,
    reports=tuple(r for r in VLM_REPORTS if r != "temporal_ids"),  # no video view
)
