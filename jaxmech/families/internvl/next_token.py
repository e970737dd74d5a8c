"""The next-token distribution of an InternVL checkpoint at each prompt's answer
position: the first check that a checkpoint loaded right (`experiments.ask`)."""

from __future__ import annotations

import functools

import jax
import numpy as np

from jaxmech.families.internvl import model


@functools.partial(jax.jit, static_argnames="config")
def _logprobs(params, inputs, config):
    logits, _ = model.forward(params, inputs, config=config, last_row=True)
    return jax.nn.log_softmax(logits.astype("float32"), -1)


def next_token_logprobs(config, params, encoded) -> np.ndarray:
    """[B, V] log-probabilities of the token after each prompt (one compiled call)."""
    return np.asarray(_logprobs(params, encoded.inputs, config))
