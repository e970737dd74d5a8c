"""Temporal IDs (paper 003): the frame part of a video model's
spatial ID.

A video's grid rows are its frames (`data.tasks.video`), so the spatial ID `Delta_y(cell)`
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


def frame_ids(states_YxNxD, label_N, frame_N, n_frames: int) -> np.ndarray:
    """[Y, T, D] the authors' temporal IDs (`extraction_pca.py`): the raw (uncentred)
    object word's state per frame, first averaged per object label over the videos
    showing it in that frame, then over the labels seen there; NaN for a frame no
    object appears in. `states_YxNxD`: each word's residual stream at every site
    (`spatial_ids.word_states`), `label_N` its object's label, `frame_N` its frame."""
    states = np.asarray(states_YxNxD, np.float64)
    label, frame = np.asarray(label_N), np.asarray(frame_N)
    if states.shape[1] != len(label) or len(label) != len(frame):
        raise ValueError(f"states {states.shape}, labels {label.shape}, frames {frame.shape}: "
                         "expected one label and frame per word state")  # fmt: skip
    if len(frame) and not (0 <= frame.min() and frame.max() < n_frames):
        raise ValueError(
            f"frame_N: values in [{frame.min()}, {frame.max()}], expected [0, {n_frames})"
        )
    out = np.full((states.shape[0], n_frames, states.shape[2]), np.nan)
    for f in range(n_frames):
        labels = np.unique(label[frame == f])
        if len(labels):
            per = [states[:, (frame == f) & (label == c)].mean(1) for c in labels]
            out[:, f] = np.mean(per, 0)
    return out


def mirror_steer(ids_TxD, frame: int, scale: float) -> np.ndarray:
    """[D] the authors' steering vector (`temporal_steering.py`): `scale x (ID(frame) -
    ID(mirror frame))`, the mirror frame T - 1 - frame (theirs: 8 - id of 1..7)."""
    ids = np.asarray(ids_TxD)
    return scale * (ids[frame] - ids[len(ids) - 1 - frame])


def pca_line(ids_TxD, marks_MxD=None) -> dict:
    """Fig. 10B's 1D PCA (`fig10.ipynb`'s `plot_1d_pca`) of the frame IDs [T, D]: each
    frame on the first principal component, signed so that the first frame lies below
    the last, scaled to [0, 1] over the frames; `marks_MxD` (the words "before" /
    "after") projected on the same scale. {"frames": [T], "marks": [M], "explained":
    the component's share of the variance}."""
    ids = np.asarray(ids_TxD, np.float64)
    centre = ids.mean(0)
    _, s, vt = np.linalg.svd(ids - centre, full_matrices=False)
    axis = vt[0]
    on = (ids - centre) @ axis
    if on[0] > on[-1]:
        on, axis = -on, -axis
    lo, span = on.min(), max(on.max() - on.min(), 1e-30)
    marks = np.zeros((0, ids.shape[1])) if marks_MxD is None else np.asarray(marks_MxD, np.float64)
    return {
        "frames": (on - lo) / span,
        "marks": ((marks - centre) @ axis - lo) / span,
        "explained": float(s[0] ** 2 / max((s**2).sum(), 1e-30)),
    }
