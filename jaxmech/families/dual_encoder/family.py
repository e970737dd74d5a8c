"""The dual encoder (paper 000) as a trained family (`families.contract.TrainedFamily`)."""

from __future__ import annotations

import numpy as np

from jaxmech.families.contract import TrainedFamily
from jaxmech.families.dual_encoder import loss as contrastive
from jaxmech.families.dual_encoder import model
from jaxmech.families.dual_encoder.checks import POINTS, TOWER_POINTS, TOWERS
from jaxmech.families.dual_encoder.config import DualEncoderConfig
from jaxmech.families.dual_encoder.evaluate import METRICS, evaluate
from jaxmech.models.edits import NO_EDITS


def forward(params, inputs, *, edits=None, capture=(), config=None):
    """The family contract's forward: `inputs` (images [B, L], captions [C, T]) ->
    (similarities [B, C], the sites `capture` names; True: every site of `sites`, not
    the model's other values such as its logit scale)."""
    images, captions = inputs
    sims, aux = model.forward(params, images, captions, edits=NO_EDITS if edits is None else edits)
    keep = sites(config, params) if capture is True else capture
    return sims, {k: aux[k] for k in keep if k in aux}


def sites(config, params) -> tuple[str, ...]:
    """Every site the forward names: per tower its parts (`TOWER_POINTS`) and each
    block's points (`rot_q`, `rot_k` in a rotary tower only)."""
    del config
    out = []
    for tower in TOWERS:
        rotary = model.is_rotary(params[tower])
        points = [p for p in POINTS if rotary or not p.startswith("rot_")]
        blocks = sorted(int(k[6:]) for k in params[tower] if k.startswith("block_"))
        out += [f"{tower}/{p}" for p in TOWER_POINTS]
        out += [f"{tower}/{p}.{i}" for i in blocks for p in points]
    return tuple(out)


def _evaluate(params, evals, tables, settings, config):
    del config
    return evaluate(params, evals, tables.captions, settings)


def _complete(params_K, config):
    """Folders written before `params["static"]` existed: add it from their config."""
    if "static" in params_K or "logit_scale" not in params_K:
        return params_K
    k = np.asarray(params_K["logit_scale"]).shape[0]
    static = {n: np.full((k,), v, np.float32) for n, v in model.static_params(config).items()}
    return {**params_K, "static": static}


FAMILY = TrainedFamily(
    name="dual_encoder",
    init_params=model.init_params,
    loss=contrastive.batch_loss,
    evaluate=_evaluate,
    metrics=lambda config: METRICS,
    task_kinds=("1d", "2d", "three"),
    progress_metric="unseen_acc",
    complete_params=_complete,
    reports=("mechanism", "relations", "rope", "text"),
    config=DualEncoderConfig,
    forward=forward,
    sites=sites,
)
