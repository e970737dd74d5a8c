"""Probe inputs shared by the analyses: fixed images that isolate one factor.

Axis names (`jaxmech.shapes`): N labels, L image length.
"""

from __future__ import annotations

import jax.numpy as jnp


def single_object_images(n_labels: int, image_len: int):
    """Every label alone at every pixel on a blank image, int32 [N * L, L], label-major.

    Row `label_index * L + p` holds label `label_index + 1` at pixel p and background
    (0) elsewhere, so `.reshape(N, L, ...)` of any per-image result gives [label, pixel].
    """
    labels = jnp.arange(1, n_labels + 1)
    pos = jnp.arange(image_len)
    images = jnp.where(pos[None, None, :] == pos[None, :, None], labels[:, None, None], 0)
    return images.reshape(-1, image_len).astype(jnp.int32)
