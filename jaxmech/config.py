"""Frozen, validated configuration for the task, the model and training.

Every default is the value fixed by SPEC.md. A config is validated once, at
construction; a bad value raises `ConfigError` naming the field, the value and the
allowed range, before anything is compiled.

Field names are unique across the three groups, so a flat mapping
(`{"n_pair_labels": 5, "lr": 3e-4}`) addresses any field: that is how absl flags,
sweep specs and `config.json` files override them (`Config.from_flat`).

Sweepable fields (`SWEEPABLE`) are the ones that may differ between models trained in
one compiled program; they travel into jitted code as arrays (`train.Settings`), never
as static values. Every other field is static and shared by all models of a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any, Mapping, NamedTuple

import numpy as np

__all__ = [
    "ConfigError",
    "Settings",
    "TaskConfig",
    "ModelConfig",
    "TrainConfig",
    "Config",
    "SWEEPABLE",
]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the range."""


# Learning-rate shapes after the warm-up (`train.make_optimizer`).
LR_DECAYS = ("constant", "cosine")

# Fields that may vary per model inside one compiled program.
SWEEPABLE = (
    "seed",
    "n_pair_labels",
    "layouts_per_pair",
    "single_frac",
    "lr",
    "weight_decay",
    "epochs",
    "id_weight",
)

# Largest finite training set (items per part): data.relations1d.finite_order shuffles
# with a fixed number of swap-or-not rounds, chosen to mix sets up to this size well.
MAX_FINITE_ITEMS = 1 << 16

SINGLE_CAPTIONS = ("side", "label", "side_pair")
CAPTION_MODES = ("left", "left_right")
VISION_POS = ("learned", "rope")
VIT_POS = ("learned2d", "sincos2d", "rope2d")
PROJECTORS = ("linear", "mlp")
LM_POS_IDS = ("sequential", "mrope")
TASK_KINDS = ("1d", "2d", "three", "scenes", "video")
# task kinds on an H x W grid: image_len is derived, grid_h * grid_w
GRID_KINDS = ("2d", "scenes", "video")


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field} = {value!r} is invalid: allowed {allowed}")


def _int_in(field: str, value: Any, lo: int, hi: float = math.inf, why: str = "") -> None:
    """Checks `lo <= value <= hi` for an integer (NumPy ints too; bools are not ints here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        _fail(field, value, f"an integer in [{lo}, {hi}]{why}")
    if not lo <= value <= hi:
        _fail(field, value, f"an integer in [{lo}, {hi}]{why}")


def _float_in(
    field: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False
) -> None:
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
    ):
        _fail(field, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        _fail(field, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def _normalise(obj) -> None:
    """NumPy scalars -> Python scalars, so configs hash, compare and serialise plainly."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.generic):
            object.__setattr__(obj, f.name, v.item())


def _choice(field: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        _fail(field, value, "one of " + ", ".join(repr(o) for o in options))


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The left/right image-caption task of SPEC.md and its 2D and three-object kinds.

    `task_kind` selects the generator (`train.build_data`): `"1d"` (SPEC.md,
    `data.relations1d`), `"2d"` (objects on a `grid_h x grid_w` grid flattened row-major
    into the image sequence; left/right and above/below; `data.relations2d`),
    `"three"` (1D images with a third, distractor object; `data.relations3`),
    `"scenes"` (grid scenes with questions for an autoregressive VLM; `data.scenes`) or
    `"video"` (the scenes with rows as frames and before / after questions;
    `data.video`). With the grid kinds (`GRID_KINDS`), `image_len` is derived: it is always set
    to `grid_h * grid_w` (a given value is replaced), so everything sized by the image
    length (P, layouts, holdouts) follows the grid. `grid_h` and `grid_w` must stay at their defaults for the other kinds.
    """

    image_len: int = 10
    n_labels: int = 20
    n_val_labels: int = 5
    n_pair_labels: int = 15
    n_single_holdout: int = 2
    layouts_per_pair: int = 15
    single_captions: str = "side"
    caption_mode: str = "left"
    single_frac: float = 0.5
    data_seed: int = 0
    task_kind: str = "1d"
    grid_h: int = 4
    grid_w: int = 4
    n_colours: int = 4
    third_frac: float = 0.0
    present_frac: float = 0.0
    absent_frac: float = 0.0
    eval_size: int = 512

    @property
    def n_layouts(self) -> int:
        """Number of two-object layouts (p_X < p_Y)."""
        return self.image_len * (self.image_len - 1) // 2

    @property
    def max_pair_labels(self) -> int:
        """Labels available for training pairs: all but the validation labels."""
        return self.n_labels - self.n_val_labels

    def __post_init__(self):
        _normalise(self)
        _choice("task_kind", self.task_kind, TASK_KINDS)
        if self.task_kind in GRID_KINDS:
            _int_in("grid_h", self.grid_h, 2, 64, " (2d / scenes: above/below needs 2+ rows)")
            _int_in("grid_w", self.grid_w, 2, 64, " (2d / scenes: left/right needs 2+ columns)")
            object.__setattr__(self, "image_len", self.grid_h * self.grid_w)
        else:
            for name in ("grid_h", "grid_w"):
                if getattr(self, name) != 4:
                    _fail(
                        name,
                        getattr(self, name),
                        "4 (the default) unless task_kind is one of " + ", ".join(GRID_KINDS),
                    )
        _int_in("image_len", self.image_len, 3 if self.task_kind == "three" else 2, 4096)
        _int_in("n_labels", self.n_labels, 4, 100_000)
        _int_in(
            "n_val_labels",
            self.n_val_labels,
            2,
            self.n_labels - 2,
            " (at least 2 for unseen pairs, at most n_labels - 2)",
        )
        _int_in(
            "n_pair_labels",
            self.n_pair_labels,
            2,
            self.max_pair_labels,
            " (n_labels - n_val_labels)",
        )
        _int_in(
            "n_single_holdout",
            self.n_single_holdout,
            0,
            self.image_len - 1,
            " (image_len - 1: each label must keep a training position)",
        )
        _int_in(
            "layouts_per_pair",
            self.layouts_per_pair,
            1,
            self.n_layouts,
            f" (the number of layouts, image_len*(image_len-1)/2 = {self.n_layouts})",
        )
        _choice("single_captions", self.single_captions, SINGLE_CAPTIONS)
        _choice("caption_mode", self.caption_mode, CAPTION_MODES)
        _float_in("single_frac", self.single_frac, 0.0, 1.0)
        _int_in("data_seed", self.data_seed, 0, 2**31 - 1)
        # scene fields (task_kind "scenes", `data.scenes`); other kinds ignore them
        _int_in("n_colours", self.n_colours, 2, 1024, " (the recolour twin needs 2+)")
        _float_in("third_frac", self.third_frac, 0.0, 1.0)
        _float_in("present_frac", self.present_frac, 0.0, 1.0)
        _float_in("absent_frac", self.absent_frac, 0.0, 1.0)
        _int_in("eval_size", self.eval_size, 8, 1 << 20)
        if self.task_kind == "three":
            # a distractor needs a third label of the same kind
            _int_in("n_pair_labels", self.n_pair_labels, 3, self.max_pair_labels, " (three: 3+)")
            _int_in("n_val_labels", self.n_val_labels, 3, self.n_labels - 2, " (three: 3+)")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model family (`model_kind`, `jaxmech.families`) and its sizes.

    The default family is the CLIP-style dual encoder (both towers share these sizes).

    `text_n_layers` None means the text tower has `n_layers` layers too.

    `vision_pos` is how the vision tower sees pixel positions: `"learned"` (SPEC
    default: an additive learned `P`) or `"rope"` (no `P`; queries and keys of every
    vision block are rotated per frequency pair by position x `rope_base ** (-2i /
    d_head)`, with CLS at rotary position 0 and pixel i at i + 1). The text tower
    always uses a learned `P`.

    Autoregressive VLM only (`families.toy_vlm.model`): `vit_frames` reads the grid's rows as
    video frames (the ViT sees each frame alone, without a row code; the LM's
    three-part ids carry the frame); `id_site` > 0 adds the spatial-ID loss at that LM
    site (`families.toy_vlm.id_loss`), weighted by the sweepable `id_weight`.
    """

    n_layers: int = 1
    text_n_layers: int | None = None
    n_heads: int = 4
    d_model: int = 128
    d_head: int = 32
    d_embed: int = 128
    d_mlp: int = 512
    layernorm: bool = False
    mlp: bool = False
    causal_text: bool = True
    cls_position: bool = False
    init_E: float = 0.02
    init_P: float = 0.02
    logit_scale_init: float = math.log(1 / 0.07)
    logit_scale_max: float = math.log(100.0)
    vision_pos: str = "learned"
    rope_base: float = 10000.0
    model_kind: str = "dual_encoder"
    lm_n_layers: int = 2
    vit_pos: str = "learned2d"
    vit_window: int = 0
    vit_global_blocks: str = ""
    projector: str = "linear"
    lm_pos_ids: str = "sequential"
    tie_labels: bool = False
    vit_frames: bool = False
    id_site: int = 0

    @property
    def text_layers(self) -> int:
        return self.n_layers if self.text_n_layers is None else self.text_n_layers

    @property
    def global_blocks(self) -> tuple[int, ...]:
        """`vit_global_blocks` ("1,3") as block indices: with `vit_window` > 0 these ViT
        blocks attend globally and the others inside their window."""
        text = self.vit_global_blocks.strip()
        try:
            return tuple(int(b) for b in text.split(",")) if text else ()
        except ValueError:
            _fail("vit_global_blocks", self.vit_global_blocks, "a comma list of block indices")

    def __post_init__(self):
        _normalise(self)
        # the registry (jaxmech.families) checks the name itself, before any compute
        if not isinstance(self.model_kind, str) or not self.model_kind:
            _fail("model_kind", self.model_kind, "the name of a registered model family")
        _int_in("n_layers", self.n_layers, 1, 64)
        if self.text_n_layers is not None:
            _int_in("text_n_layers", self.text_n_layers, 1, 64)
        _int_in("n_heads", self.n_heads, 1, 1024)
        _int_in("d_model", self.d_model, 1, 65536)
        if self.d_model % self.n_heads:
            _fail(
                "d_model",
                self.d_model,
                f"a multiple of n_heads = {self.n_heads} (d_model must divide into heads)",
            )
        _int_in("d_head", self.d_head, 1, 65536)
        _int_in("d_embed", self.d_embed, 1, 65536)
        _int_in("d_mlp", self.d_mlp, 1, 1 << 20)
        for name in ("layernorm", "mlp", "causal_text", "cls_position", "tie_labels", "vit_frames"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "True or False")
        _float_in("init_E", self.init_E, 0.0, 100.0, lo_open=True)
        _float_in("init_P", self.init_P, 0.0, 100.0, lo_open=True)
        _float_in("logit_scale_init", self.logit_scale_init, -20.0, 20.0)
        _float_in("logit_scale_max", self.logit_scale_max, self.logit_scale_init, 20.0)
        _choice("vision_pos", self.vision_pos, VISION_POS)
        # autoregressive VLM fields (model_kind "ar_vlm", `families.toy_vlm.model`)
        _int_in("lm_n_layers", self.lm_n_layers, 1, 64)
        _choice("vit_pos", self.vit_pos, VIT_POS)
        _int_in("vit_window", self.vit_window, 0, 64, " (0: no window blocks)")
        _choice("projector", self.projector, PROJECTORS)
        _choice("lm_pos_ids", self.lm_pos_ids, LM_POS_IDS)
        _int_in("id_site", self.id_site, 0, self.lm_n_layers, " (0: no spatial-ID loss)")
        for b in self.global_blocks:
            _int_in("vit_global_blocks", b, 0, self.n_layers - 1, " (ViT block indices)")
        _float_in("rope_base", self.rope_base, 1.0, 1e12)
        if self.vision_pos == "rope":
            if self.d_head % 2:
                _fail("d_head", self.d_head, "an even number with vision_pos = 'rope'")
            if self.cls_position:
                _fail(
                    "cls_position",
                    self.cls_position,
                    "False with vision_pos = 'rope' (CLS sits at rotary position 0)",
                )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """AdamW with linear warm-up, in-run evaluation; streaming or finite-set batches.

    `epochs = 0` (SPEC default) draws every batch fresh (streaming) for `steps` steps.
    `epochs = E > 0` trains on the fixed finite training set (every training pair at
    each of its training layouts once, plus the single-object images) for E epochs of
    its two-object part: a model trains `ceil(E * n_two / pairs_per_batch)` steps
    (`train.step_budget`), so with a fixed E a smaller N_pair also means fewer steps.
    Models that finish early are frozen; the sweep derives `steps` (the program length)
    from the largest budget.

    `id_weight` (sweepable) weighs the spatial-ID loss of an autoregressive VLM with
    `id_site` > 0; 0 trains on the plain loss.
    """

    steps: int = 1500
    batch_size: int = 256
    eval_every: int = 250
    lr: float = 1e-3
    warmup_steps: int = 100
    lr_decay: str = "constant"
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.1
    epochs: int = 0
    seed: int = 0
    id_weight: float = 0.0

    @property
    def n_evals(self) -> int:
        return self.steps // self.eval_every

    def __post_init__(self):
        _normalise(self)
        _int_in("steps", self.steps, 1, 10**9)
        _int_in("batch_size", self.batch_size, 2, 10**6, " (the CLIP loss needs 2+)")
        _int_in("eval_every", self.eval_every, 1, self.steps, " (steps)")
        if self.steps % self.eval_every:
            _fail(
                "eval_every",
                self.eval_every,
                f"a divisor of steps = {self.steps} (evaluation ends the run)",
            )
        _float_in("lr", self.lr, 0.0, 10.0, lo_open=True)
        _int_in("warmup_steps", self.warmup_steps, 0, 10**9)
        _choice("lr_decay", self.lr_decay, LR_DECAYS)
        _float_in("b1", self.b1, 0.0, 1.0)
        _float_in("b2", self.b2, 0.0, 1.0)
        _float_in("eps", self.eps, 0.0, 1.0, lo_open=True)
        _float_in("weight_decay", self.weight_decay, 0.0, 100.0)
        _int_in("epochs", self.epochs, 0, 10**6, " (0 = streaming batches)")
        _int_in("seed", self.seed, 0, 2**31 - 1)
        _float_in("id_weight", self.id_weight, 0.0, 1000.0)


class Settings(NamedTuple):
    """The sweepable values of one model (scalars) or of K models (arrays `[K]`).

    These reach jitted code as arrays, so models with different settings share one
    compiled program. Field order is `SWEEPABLE`.
    """

    seed: Any
    n_pair_labels: Any
    layouts_per_pair: Any
    single_frac: Any
    lr: Any
    weight_decay: Any
    epochs: Any
    id_weight: Any = 0.0


_GROUPS = {"task": TaskConfig, "model": ModelConfig, "train": TrainConfig}
_FIELD_GROUP = {f.name: g for g, cls in _GROUPS.items() for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class Config:
    """Task, model and training settings of one run (all models of a sweep share it)."""

    task: TaskConfig = TaskConfig()
    model: ModelConfig = ModelConfig()
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                _fail(name, getattr(self, name), f"a {cls.__name__}")
        if self.train.id_weight > 0 and self.model.id_site == 0:
            _fail(
                "id_weight",
                self.train.id_weight,
                "0 with id_site = 0 (the spatial-ID loss needs an LM site: set id_site)",
            )
        if self.train.epochs > 0:
            t = self.task
            if t.task_kind != "1d":
                _fail(
                    "epochs",
                    self.train.epochs,
                    f"0 (streaming) with task_kind = {t.task_kind!r}: the finite training "
                    "set is defined for the 1D task only",
                )
            if round(t.single_frac * self.train.batch_size) >= self.train.batch_size:
                _fail(
                    "single_frac",
                    t.single_frac,
                    f"a fraction leaving two-object samples in a batch of "
                    f"{self.train.batch_size} (epochs = {self.train.epochs} counts "
                    "passes over the two-object set)",
                )
            n_two = t.n_pair_labels * (t.n_pair_labels - 1) * t.layouts_per_pair
            n_one = t.n_labels * (t.image_len - t.n_single_holdout)
            if max(n_two, n_one) > MAX_FINITE_ITEMS:
                _fail(
                    "epochs",
                    self.train.epochs,
                    f"0 (streaming) for this task: a finite training set of up to "
                    f"{max(n_two, n_one)} items exceeds {MAX_FINITE_ITEMS}",
                )

    @staticmethod
    def field_names() -> tuple[str, ...]:
        return tuple(_FIELD_GROUP)

    def flat(self) -> dict[str, Any]:
        """All fields as one flat dict (names are unique across groups)."""
        out = {}
        for g in _GROUPS:
            out.update(dataclasses.asdict(getattr(self, g)))
        return out

    def replace(self, **overrides: Any) -> "Config":
        """A new validated config with flat field overrides; unknown names are errors."""
        groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        for key, value in overrides.items():
            if key not in _FIELD_GROUP:
                raise ConfigError(
                    f"unknown config field {key!r}; known fields: {', '.join(_FIELD_GROUP)}"
                )
            groups[_FIELD_GROUP[key]][key] = value
        return Config(
            **{
                g: dataclasses.replace(getattr(self, g), **kw) if kw else getattr(self, g)
                for g, kw in groups.items()
            }
        )

    @classmethod
    def from_flat(cls, values: Mapping[str, Any]) -> "Config":
        return cls().replace(**dict(values))

    def settings(self) -> Settings:
        """This config's own sweepable values, as Python scalars."""
        flat = self.flat()
        return Settings(*(flat[name] for name in SWEEPABLE))

    def to_json(self) -> str:
        raw = {g: dataclasses.asdict(getattr(self, g)) for g in _GROUPS}
        return json.dumps(raw, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Config":
        raw = json.loads(text)
        unknown = sorted(set(raw) - set(_GROUPS))
        if unknown:
            raise ConfigError(f"unknown config group(s) {unknown}; known: {', '.join(_GROUPS)}")
        flat: dict[str, Any] = {}
        for g in _GROUPS:
            flat.update(raw.get(g, {}))
        return cls.from_flat(flat)
