"""The next-token distribution of a Qwen-VL checkpoint at each prompt's answer position:
the first check that a checkpoint loaded right (`experiments.ask`)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxmech.families.qwen2_vl import model


@functools.partial(jax.jit, static_argnames="config")
def _logprobs(params, inputs, rows, config):
    logits, _ = model.forward(params, inputs, config=config, rows=rows)
    return jax.nn.log_softmax(logits.astype("float32"), -1)


def next_token_logprobs(config, params, encoded) -> np.ndarray:
    """[B, V] log-probabilities of the token after each prompt (one compiled call)."""
    inputs = encoded.inputs
    rows = np.full(inputs.tokens_BxS.shape[0], inputs.tokens_BxS.shape[1] - 1, np.int32)
    return np.asarray(_logprobs(params, inputs, rows, config))
