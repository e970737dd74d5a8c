"""The Gemma-3 checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

import functools

from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, contract_forward
from jaxmech.families.gemma3 import checks, load, model, params, processor
from jaxmech.families.gemma3.view import checkpoint_view
from jaxmech.models.decoder import next_token_logprobs
from jaxmech.models.generate import generate
from jaxmech.models.layout import authors_vit_mlp


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out;
    no biases) of the ViT's last min(6, depth) blocks (`models.layout.authors_vit_mlp`)
    and the whole projector (their selector takes every parameter whose name holds
    `multi_modal_projector`, Gemma-3's projector's name)."""
    return "+".join(authors_vit_mlp(p) + [f"proj/{name}" for name in p["proj"]])


def describe(c) -> str:
    n_global = sum(not c.sliding(i) for i in range(c.lm_layers))
    return (f"gemma3, {c.lm_layers} LM blocks ({n_global} global, window {c.lm_window}), "
            f"{c.grid} x {c.grid} patches pooled to {c.mm_tokens} image tokens")  # fmt: skip


FAMILY = CheckpointFamily(
    name="gemma3",
    checkpoint_types=("gemma3",),
    read_config=load.read_config,
    load=load.load_checkpoint,
    init_params=params.init_params,
    view=checkpoint_view,
    processor=processor.load_processor,
    encode=processor.encode,
    tokenizer=lambda proc: proc.tokenizer,
    next_token=functools.partial(next_token_logprobs, model.forward),
    generate=functools.partial(generate, model.decoding),
    describe=describe,
    trainable=trainable,
    forward=functools.partial(contract_forward, model.forward),
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=None,
    reports=tuple(r for r in VLM_REPORTS if r != "temporal_ids"),  # no video view
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("gemma3", 34, 2560), ("gemma-4b", "google/gemma-3-4b-it", (10, 22))),
    ),
)
