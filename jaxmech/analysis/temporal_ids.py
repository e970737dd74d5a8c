"""Temporal IDs (paper 003): the frame part of a video model's
spatial ID.

A video's grid rows are its frames (`data.video`), so the spatial ID `Delta_y(cell)`
(`analysis.spatial_ids`) of a video model holds where in time and where in the frame
an object is; its mean over each frame's cells is the temporal ID (`temporal_ids`).

Axis names (`jaxmech.shapes`): Y sites, L cells, T frames, D d_model.
"""

from __future__ import annotations

import numpy as np


def temporal_ids(delta_YxLxD, n_frames: int):
    """[Y, T, D] the temporal ID: the spatial ID averaged over each frame's cells."""
    Y, L, D = delta_YxLxD.shape
    return delta_YxLxD.reshape(Y, n_frames, L // n_frames, D).mean(2)


def id_stats(delta_YxLxD, n_frames: int) -> dict:
    """Per site: time share, linear R^2 and the frame means on the time axis [Y, T].
    NaN where the ID is rounding noise (mean square < 1e-10: the embedding site, whose
    word has seen no image)."""
    tid = temporal_ids(delta_YxLxD, n_frames)
    frame_len = delta_YxLxD.shape[1] // n_frames
    total = (delta_YxLxD**2).sum((1, 2))
    f = np.arange(n_frames) - (n_frames - 1) / 2
    slope = np.einsum("t,ytd->yd", f, tid) / (f**2).sum()
    resid = tid - f[None, :, None] * slope[:, None]
    energy = (tid**2).sum((1, 2))
    axis = slope / np.maximum(np.linalg.norm(slope, axis=-1, keepdims=True), 1e-30)
    noise = np.where(total / delta_YxLxD[0].size < 1e-10, np.nan, 1.0)
    return {
        "time_share": noise * frame_len * energy / np.maximum(total, 1e-30),
        "linear_r2": noise * (1.0 - (resid**2).sum((1, 2)) / np.maximum(energy, 1e-30)),
        "on_axis": noise[:, None] * np.einsum("ytd,yd->yt", tid, axis),
    }
