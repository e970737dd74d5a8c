"""The Llama-3.2-Vision (mllama) checkpoint family (`families.contract.CheckpointFamily`):
what the registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

import functools

from jaxmech.families.contract import VLM_REPORTS, CheckpointFamily, contract_forward
from jaxmech.families.mllama import checks, load, model, params, processor
from jaxmech.families.mllama.view import checkpoint_view
from jaxmech.models.decoder import next_token_logprobs


def trainable(p) -> str:
    """The authors' trained leaves as a `train_only` spec: the MLP weights (W_in, W_out)
    of the last min(6, depth) local vision layers and the projector (their selector's
    `multi_modal_projector`)."""
    blocks = sorted(int(k.split("_")[1]) for k in p["vit"] if k.startswith("block_"))
    mlp = [f"vit/block_{i}/{w}" for i in blocks[-6:] for w in ("W_in", "W_out")]
    return "+".join(mlp + [f"proj/{name}" for name in p["proj"]])


FAMILY = CheckpointFamily(
    name="mllama",
    checkpoint_types=("mllama",),
    read_config=load.read_config,
    load=load.load_checkpoint,
    init_params=params.init_params,
    view=checkpoint_view,
    processor=processor.load_processor,
    encode=processor.encode,
    tokenizer=lambda proc: proc.tokenizer,
    next_token=functools.partial(next_token_logprobs, model.forward),
    describe=lambda c: (
        f"mllama, {c.lm_layers} LM layers ({len(c.cross_layers)} cross-attention), "
        f"{c.max_tiles} tiles of {c.grid} x {c.grid} patches"
    ),  # fmt: skip
    trainable=trainable,
    forward=functools.partial(contract_forward, model.forward),
    sites=lambda config, p=None: checks.site_names(config),
    stand_in=None,
    reports=tuple(r for r in VLM_REPORTS if r != "temporal_ids"),  # no video view
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("mllama", 40, 4096), ("llama-11b", "meta-llama/Llama-3.2-11B-Vision-Instruct", (10, 20))),
    ),
)
