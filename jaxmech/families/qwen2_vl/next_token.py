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


def top_tokens(tokenizer, logprobs_V, k: int) -> list[tuple[str, int, float]]:
    """The k likeliest next tokens as (text, id, probability), likeliest first."""
    ids = np.argsort(-logprobs_V)[:k]
    return [
        (
            tokenizer.decode([int(i)], skip_special_tokens=False),
            int(i),
            float(np.exp(logprobs_V[i])),
        )
        for i in ids
    ]
