"""Named training protocols: config overrides under a name (`--preset=NAME`).

The protocol study (`jaxmech.reports.protocol`) trains a grid under each of these; the
training entry points take one as their base config. Kept apart from the study so that
reading flags never loads a report.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from jaxmech.config import Config, ConfigError


@dataclasses.dataclass(frozen=True)
class Protocol:
    """A training protocol: config overrides (flat field names) under a factor."""

    name: str  # folder name
    factor: str  # the factor it varies (one figure per factor)
    label: str  # legend text
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)


BASELINE = Protocol("baseline", "baseline", "SPEC defaults (streaming, 1500 steps)")

# Ordered by how directly each tests a protocol difference the paper may have had:
# the study runs them in this order, so a cut-short run still has the first ones.
PROTOCOLS = (
    BASELINE,
    Protocol("finite_e60", "dataset", "finite set, 60 epochs", {"epochs": 60}),
    Protocol("finite_e20", "dataset", "finite set, 20 epochs", {"epochs": 20}),
    Protocol("steps150", "length", "streaming, 150 steps", {"steps": 150, "eval_every": 50}),
    Protocol("steps500", "length", "streaming, 500 steps", {"steps": 500}),
    Protocol(
        "left_right_t1", "captions", "left_right, 1-layer text", {"caption_mode": "left_right"}
    ),
    Protocol(
        "left_right_t2",
        "captions",
        "left_right, 2-layer text",
        {"caption_mode": "left_right", "text_n_layers": 2},
    ),
    Protocol("single_label", "singles", 'singles captioned "X"', {"single_captions": "label"}),
    Protocol(
        "single_side_pair",
        "singles",
        "side captions on pair labels only",
        {"single_captions": "side_pair"},
    ),
    Protocol("single_frac0.1", "singles", "single_frac 0.1", {"single_frac": 0.1}),
    Protocol("wd0", "weight_decay", "weight decay 0", {"weight_decay": 0.0}),
    Protocol("init_E0.1_P0.01", "init", "init E 0.1, P 0.01", {"init_E": 0.1, "init_P": 0.01}),
    Protocol("d64", "width", "d_model 64 (d_head 16)", {"d_model": 64, "d_head": 16}),
    Protocol("cls_position", "cls_position", "CLS has a position row", {"cls_position": True}),
)
BY_NAME = {p.name: p for p in PROTOCOLS}

# The toy autoregressive VLM: bases for `--preset`, not protocols of the
# dual encoder's study. `vlm` is the recipe chosen by measurement (BUILD_NOTES.md,
# Results, paper 003): tied label words, single-object questions about absent labels (the only
# signal binding a validation label's word to its picture), a cosine learning rate
# (generalisation decays under a constant one). `vlm_window` adds paper 004's shape, a
# window block followed by a global block. `vlm_deep` has 4 LM blocks, so that paper
# 003's layer-by-layer analyses have middle layers to find (about 1.9x the cost per
# model-step). `vlm_route` is the planted-route control: only the object
# words attend to the image, so position can reach the answer only through them.
# `vlm_video` is the same recipe on the video task: the ViT
# sees each frame alone, and the LM's three-part position ids carry the frame.
VLM = {
    "task_kind": "scenes",
    "model_kind": "toy_vlm",
    "d_model": 32,
    "d_head": 8,
    "n_heads": 4,
    "d_mlp": 128,
    "n_layers": 2,
    "lm_n_layers": 2,
    "layernorm": True,
    "mlp": True,
    "batch_size": 128,
    "rope_base": 100.0,
    "tie_labels": True,
    "absent_frac": 0.5,
    "lr": 3e-3,
    "lr_decay": "cosine",
    "steps": 2500,
}
MODEL_PRESETS = {
    "vlm": Protocol("vlm", "model", "toy VLM (ViT 2 + LM 2 blocks, d 32)", VLM),
    "vlm_window": Protocol(
        "vlm_window",
        "model",
        "toy VLM, ViT block 0 in 2x2 windows, block 1 global",
        {**VLM, "vit_window": 2, "vit_global_blocks": "1"},
    ),
    "vlm_deep": Protocol(
        "vlm_deep", "model", "toy VLM with 4 LM blocks", {**VLM, "lm_n_layers": 4}
    ),
    "vlm_route": Protocol(
        "vlm_route",
        "model",
        "toy VLM, planted route: only the object words see the image (paper 003's control)",
        {**VLM, "planted_route": True},
    ),
    "vlm_video": Protocol(
        "vlm_video",
        "model",
        "toy VLM on video: 4 frames of 4 cells, frames seen alone, time in three-part LM ids",
        {**VLM, "task_kind": "video", "vit_frames": True, "lm_pos_ids": "mrope"},
    ),
}


def preset_config(name: str | None) -> Config:
    """SPEC defaults with the named protocol's overrides (None: SPEC defaults).

    Raises ConfigError naming `--preset`, the value and the known names.
    """
    if name is None:
        return Config()
    known = {**BY_NAME, **MODEL_PRESETS}
    if name not in known:
        raise ConfigError(f"--preset={name!r} is unknown; known: {', '.join(known)}")
    return Config().replace(**known[name].overrides)
