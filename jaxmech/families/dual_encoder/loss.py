"""The dual encoder's training loss: symmetric CLIP cross-entropy on a caption batch."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxmech.families.dual_encoder.model import forward


def clip_loss(params, images_BxL, caption_ids_B, captions_CxT, positives_BxB=None):
    """Symmetric CLIP cross-entropy; identical captions are positives of each other.

    `positives_BxB` (bool [image, caption], diagonal True) replaces that rule where a
    caption can be true of several different images (the three-object task:
    `relations3.positives`); each direction's target is uniform over its positives.
    """
    sims_BxB, _ = forward(
        params, images_BxL, jnp.asarray(captions_CxT)[caption_ids_B], readout_only=True
    )
    if positives_BxB is not None:
        pos = positives_BxB.astype(jnp.float32)
        i2t = -(pos / pos.sum(1, keepdims=True) * jax.nn.log_softmax(sims_BxB, axis=1))
        t2i = -(pos.T / pos.sum(0)[:, None] * jax.nn.log_softmax(sims_BxB.T, axis=1))
        return 0.5 * (i2t.sum(1).mean() + t2i.sum(1).mean())
    same = (caption_ids_B[:, None] == caption_ids_B[None, :]).astype(jnp.float32)
    target = same / same.sum(1, keepdims=True)  # symmetric, rows sum to 1
    i2t = -(target * jax.nn.log_softmax(sims_BxB, axis=1)).sum(1).mean()
    t2i = -(target * jax.nn.log_softmax(sims_BxB.T, axis=1)).sum(1).mean()
    return 0.5 * (i2t + t2i)


def batch_loss(params, batch, tables, settings, config):
    """`clip_loss` on a `data.tasks.CaptionBatch` (the family's loss; settings and config
    unused: every switch of the forward is read from params)."""
    del settings, config
    return clip_loss(
        params, batch.images_BxL, batch.caption_ids_B, tables.captions, batch.positives_BxB
    )
