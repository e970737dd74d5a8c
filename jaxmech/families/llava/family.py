"""The LLaVA-1.5 checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

import functools

from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, contract_forward
from jaxmech.families.llava import checks, load, model, params, processor, view
from jaxmech.families.llava.view import checkpoint_view
from jaxmech.models.decoder import next_token_logprobs
from jaxmech.models.generate import generate
from jaxmech.models.layout import authors_vit_mlp


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out;
    no biases) of the ViT's last min(6, depth) blocks (`models.layout.authors_vit_mlp`)
    and the whole projector. Their selector also takes, unless --no_projector (their run
    scripts do not pass it), every parameter whose name holds `multi_modal_projector`:
    LLaVA's projector (Qwen's merger has another name and stays frozen). Their 30%
    budget holds all of them."""
    return "+".join(authors_vit_mlp(p) + [f"proj/{name}" for name in p["proj"]])


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
    next_token=functools.partial(next_token_logprobs, model.forward),
    generate=functools.partial(generate, model.decoding),
    describe=lambda c: f"llava, {c.lm_layers} LM blocks, {c.grid} x {c.grid} patches",
    trainable=trainable,
    forward=functools.partial(contract_forward, model.forward),
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=None,
    reports=tuple(r for r in VLM_REPORTS if r != "temporal_ids"),  # no video view
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("llava", 32, 4096), ("llava-7b", "llava-hf/llava-1.5-7b-hf", (8, 20))),
        (("llava", 40, 5120), ("llava-13b", "llava-hf/llava-1.5-13b-hf", (10, 20))),
    ),
    # mirror_swapping.py / attribute_swapping.py's prompt, for jaxmech.reports.patching
    authors_wordings=(("patching", view.MIRROR),),
)
