"""The LLaVA-1.5 checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily
from jaxmech.families.llava import checks, load, model, next_token, params, processor
from jaxmech.families.llava.view import checkpoint_view

# the authors' fine-tune (spatial_finetuning/train.py --last_k_blocks 6): the ViT's
# last 6 blocks' MLP weights
AUTHORS_VIT_BLOCKS = 6


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out;
    no biases) of the ViT's last min(6, depth) blocks and the whole projector. Their
    selector (vision_mlp_lastk) takes vision tensors named like an MLP's ending in
    `.weight` within the last 6 numbered blocks, and, unless --no_projector (their run
    scripts do not pass it), every parameter whose name holds `multi_modal_projector`:
    LLaVA's projector (Qwen's merger has another name and stays frozen). Their 30%
    budget holds all of them."""
    depth = sum(1 for k in p["vit"] if k.startswith("block_"))
    vit = [f"vit/block_{i}/{name}" for i in range(max(0, depth - AUTHORS_VIT_BLOCKS), depth)
           for name in ("W_in", "W_out")]  # fmt: skip
    return "+".join(vit + [f"proj/{name}" for name in p["proj"]])


def forward(p, inputs, *, edits=None, capture=(), config):
    """The family contract's forward: `model.forward` with `capture` a collection of
    site names (True: every site)."""
    return model.forward(p, inputs, edits, config=config, capture=capture)


FAMILY = CheckpointFamily(
    name="llava",
    checkpoint_types=("llava",),
    read_config=load.read_config,
    load=load.load_checkpoint,
    init_params=params.init_params,
    view=checkpoint_view,
    processor=processor.load_processor,
    encode=processor.encode,
    tokenizer=lambda proc: proc.tokenizer,
    next_token=next_token.next_token_logprobs,
    describe=lambda c: f"llava, {c.lm_layers} LM blocks, {c.grid} x {c.grid} patches",
    trainable=trainable,
    forward=forward,
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=None,
    reports=tuple(r for r in VLM_REPORTS if r != "temporal_ids"),  # no video view
)
