"""Frozen, validated configuration for the task, the model and training.

Every default is the value fixed by SPEC. A config is validated once, at
construction; a bad value raises `ConfigError` naming the field, the value and the
allowed range, before anything is compiled.

`Config.model` is the active model family's own config and `Config.task` the active
task's: each family and task kind registers its config class (`register_model_config`,
`register_task_config`; the registries `families.registry` and `data.tasks` do), a
subclass of `ModelConfig` / `TaskConfig` holding the fields it reads. Field names are
unique across all of them, so a flat mapping (`{"n_pair_labels": 5, "lr": 3e-4}`)
addresses any field: that is how absl flags, sweep specs and `config.json` files
override them (`Config.replace`, `Config.from_flat`). A field that the chosen family or
task does not have is an error naming it.

Sweepable fields (`SWEEPABLE`) are the ones that may differ between models trained in
one compiled program; they travel into jitted code as arrays (`train.Settings`), never
as static values. Every other field is static and shared by all models of a run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from typing import Any, ClassVar, Mapping, NamedTuple

import numpy as np

__all__ = [
    "ConfigError",
    "Settings",
    "TaskConfig",
    "ModelConfig",
    "TransformerConfig",
    "TrainConfig",
    "Config",
    "SWEEPABLE",
    "register_model_config",
    "register_task_config",
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

# Largest finite training set (items per part): data.tasks.relations1d.finite_order shuffles
# with a fixed number of swap-or-not rounds, chosen to mix sets up to this size well.
MAX_FINITE_ITEMS = 1 << 16

DEFAULT_MODEL_KIND = "dual_encoder"  # SPEC's model and task
DEFAULT_TASK_KIND = "1d"


def fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{field} = {value!r} is invalid: allowed {allowed}")


def int_in(field: str, value: Any, lo: int, hi: float = math.inf, why: str = "") -> None:
    """Checks `lo <= value <= hi` for an integer (NumPy ints too; bools are not ints here)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        fail(field, value, f"an integer in [{lo}, {hi}]{why}")
    if not lo <= value <= hi:
        fail(field, value, f"an integer in [{lo}, {hi}]{why}")


def float_in(
    field: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False
) -> None:
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Real)
        or math.isnan(value)
    ):
        fail(field, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")
    ok = (value > lo if lo_open else value >= lo) and value <= hi
    if not ok:
        fail(field, value, f"a number in {'(' if lo_open else '['}{lo}, {hi}]")


def normalise(obj) -> None:
    """NumPy scalars -> Python scalars, so configs hash, compare and serialise plainly."""
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, np.generic):
            object.__setattr__(obj, f.name, v.item())


def choice(field: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        fail(field, value, "one of " + ", ".join(repr(o) for o in options))


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """What every task kind has: the labels, their split, the pair layouts and the share
    of single-object samples (SPEC). A task kind's config subclasses it with its own
    fields (`data.tasks.relations1d.LineConfig`, ...); the class variables say what the kind
    allows.

    `image_len` is the number of image positions (a grid kind derives it: grid_h x
    grid_w).
    """

    task_kind: str = DEFAULT_TASK_KIND
    image_len: int = 10
    n_labels: int = 20
    n_val_labels: int = 5
    n_pair_labels: int = 15
    n_single_holdout: int = 2
    layouts_per_pair: int = 15
    single_frac: float = 0.5
    data_seed: int = 0

    finite_sets: ClassVar[bool] = False  # epochs > 0 (a finite training set) allowed
    min_labels: ClassVar[int] = 2  # the fewest pair and validation labels
    min_image_len: ClassVar[int] = 2

    @property
    def n_layouts(self) -> int:
        """Number of two-object layouts (p_X < p_Y)."""
        return self.image_len * (self.image_len - 1) // 2

    @property
    def max_pair_labels(self) -> int:
        """Labels available for training pairs: all but the validation labels."""
        return self.n_labels - self.n_val_labels

    def __post_init__(self):
        normalise(self)
        n = self.min_labels
        int_in("image_len", self.image_len, self.min_image_len, 4096)
        int_in("n_labels", self.n_labels, 4, 100_000)
        why = f" (at least {n} for unseen pairs, at most n_labels - 2)"
        int_in("n_val_labels", self.n_val_labels, n, self.n_labels - 2, why)
        why = " (n_labels - n_val_labels)"
        int_in("n_pair_labels", self.n_pair_labels, n, self.max_pair_labels, why)
        why = " (image_len - 1: each label must keep a training position)"
        int_in("n_single_holdout", self.n_single_holdout, 0, self.image_len - 1, why)
        why = f" (the number of layouts, image_len*(image_len-1)/2 = {self.n_layouts})"
        int_in("layouts_per_pair", self.layouts_per_pair, 1, self.n_layouts, why)
        float_in("single_frac", self.single_frac, 0.0, 1.0)
        int_in("data_seed", self.data_seed, 0, 2**31 - 1)


def derive_grid(task: TaskConfig) -> None:
    """A grid kind's checks of `grid_h`, `grid_w` and its derived `image_len`."""
    int_in("grid_h", task.grid_h, 2, 64, " (above/below needs 2+ rows)")
    int_in("grid_w", task.grid_w, 2, 64, " (left/right needs 2+ columns)")
    object.__setattr__(task, "image_len", task.grid_h * task.grid_w)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What every model family's config has: its name (`model_kind`). A family's config
    subclasses it (or `TransformerConfig`) with its own fields."""

    model_kind: str = DEFAULT_MODEL_KIND

    def __post_init__(self):
        normalise(self)


@dataclasses.dataclass(frozen=True)
class TransformerConfig(ModelConfig):
    """The sizes and initialisation of explicit-parameter transformer blocks
    (`models.attention`), shared by the families built from them."""

    n_layers: int = 1
    n_heads: int = 4
    d_model: int = 128
    d_head: int = 32
    d_mlp: int = 512
    layernorm: bool = False
    mlp: bool = False
    init_E: float = 0.02
    init_P: float = 0.02
    rope_base: float = 10000.0

    def __post_init__(self):
        super().__post_init__()
        int_in("n_layers", self.n_layers, 1, 64)
        int_in("n_heads", self.n_heads, 1, 1024)
        int_in("d_model", self.d_model, 1, 65536)
        if self.d_model % self.n_heads:
            fail(
                "d_model",
                self.d_model,
                f"a multiple of n_heads = {self.n_heads} (d_model must divide into heads)",
            )
        int_in("d_head", self.d_head, 1, 65536)
        int_in("d_mlp", self.d_mlp, 1, 1 << 20)
        for name in ("layernorm", "mlp"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "True or False")
        float_in("init_E", self.init_E, 0.0, 100.0, lo_open=True)
        float_in("init_P", self.init_P, 0.0, 100.0, lo_open=True)
        float_in("rope_base", self.rope_base, 1.0, 1e12)


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

    `curriculum_steps = N > 0` puts single-object questions first: the share of a
    batch's single-object rows falls linearly from 1 at step 0 to `single_frac` at step
    N (`train.curriculum_settings`); 0 (default) keeps `single_frac` throughout.
    Streaming only (a finite set's epochs count fixed batches).

    `id_weight` (sweepable) weighs the spatial-ID loss of an autoregressive VLM with
    `id_site` > 0; 0 trains on the plain loss.

    `train_only`: "" trains every parameter; else "+"-separated glob patterns over the
    parameter paths (`part/name`, `part/block_i/name`, e.g. `proj/*+vit/block_1/W_in`):
    only the matching parameters train, the rest (and `params["static"]`) stay bit for
    bit as they started (`train.trainable_mask`; a pattern matching nothing is an error
    naming the field). The paper 003 ID-loss recipe freezes the LM this way.
    """

    steps: int = 1500
    batch_size: int = 256
    eval_every: int = 250
    lr: float = 1e-3
    warmup_steps: int = 100
    lr_decay: str = "constant"
    curriculum_steps: int = 0
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    weight_decay: float = 0.1
    epochs: int = 0
    seed: int = 0
    id_weight: float = 0.0
    train_only: str = ""

    @property
    def n_evals(self) -> int:
        return self.steps // self.eval_every

    def __post_init__(self):
        normalise(self)
        int_in("steps", self.steps, 1, 10**9)
        int_in("batch_size", self.batch_size, 2, 10**6, " (the CLIP loss needs 2+)")
        int_in("eval_every", self.eval_every, 1, self.steps, " (steps)")
        if self.steps % self.eval_every:
            fail(
                "eval_every",
                self.eval_every,
                f"a divisor of steps = {self.steps} (evaluation ends the run)",
            )
        float_in("lr", self.lr, 0.0, 10.0, lo_open=True)
        int_in("warmup_steps", self.warmup_steps, 0, 10**9)
        choice("lr_decay", self.lr_decay, LR_DECAYS)
        int_in("curriculum_steps", self.curriculum_steps, 0, 10**9, " (0: no curriculum)")
        float_in("b1", self.b1, 0.0, 1.0)
        float_in("b2", self.b2, 0.0, 1.0)
        float_in("eps", self.eps, 0.0, 1.0, lo_open=True)
        float_in("weight_decay", self.weight_decay, 0.0, 100.0)
        int_in("epochs", self.epochs, 0, 10**6, " (0 = streaming batches)")
        if self.curriculum_steps and self.epochs:
            fail(
                "curriculum_steps",
                self.curriculum_steps,
                f"0 with epochs = {self.epochs} (a finite set's epochs count fixed batches)",
            )
        int_in("seed", self.seed, 0, 2**31 - 1)
        float_in("id_weight", self.id_weight, 0.0, 1000.0)
        if not isinstance(self.train_only, str) or (
            self.train_only and not all(p.strip() for p in self.train_only.split("+"))
        ):
            fail(
                "train_only",
                self.train_only,
                '"" or "+"-separated glob patterns of parameter paths',
            )


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


# kind -> config class; filled by the registries (`families.registry`, `data.tasks`). A
# model kind may hold a function returning its class instead (a family not imported yet):
# it is called, and replaced by the class, when the kind is first used (`_class_of`).
MODEL_CONFIGS: dict[str, Any] = {}
TASK_CONFIGS: dict[str, type] = {}
# a renamed model kind's old name -> its name now (`register_model_config`'s `formerly`):
# results folders keep the kind their config.json / sweep.json was written with, so
# `Config.from_json` reads the old name as the new one and users' runs still load and
# resume. Only saved configs are read this way; a flag or spec must use the name now.
RENAMED_MODEL_KINDS: dict[str, str] = {}
_GROUPS = ("task", "model", "train")


def register_model_config(kind: str, cls, formerly: tuple[str, ...] = ()) -> None:
    """Makes `cls` (a `ModelConfig` subclass, or a function of no arguments returning
    one, called when the kind is first used) the config of `model_kind = kind`;
    `formerly`: the kind's old names, read as `kind` in saved configs (`from_json`)."""
    if isinstance(cls, type) and not issubclass(cls, ModelConfig):
        raise TypeError(f"{cls.__name__}: a model config must subclass ModelConfig")
    MODEL_CONFIGS[kind] = cls
    RENAMED_MODEL_KINDS.update(dict.fromkeys(formerly, kind))


def register_task_config(kind: str, cls: type) -> None:
    """Makes `cls` (a `TaskConfig` subclass) the config of `task_kind = kind`."""
    if not issubclass(cls, TaskConfig):
        raise TypeError(f"{cls.__name__}: a task config must subclass TaskConfig")
    TASK_CONFIGS[kind] = cls


def _names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _class_of(table: dict, field: str, kind: Any) -> type:
    if kind not in table:
        fail(field, kind, "one of " + ", ".join(repr(k) for k in table))
    if not isinstance(table[kind], type):  # a registered loader: its family's import
        cls = table[kind]()
        if not (isinstance(cls, type) and issubclass(cls, ModelConfig)):
            raise TypeError(f"{field} = {kind!r}: its config loader returned {cls!r}")
        table[kind] = cls
    return table[kind]


def all_classes() -> dict[str, type]:
    """{"train": TrainConfig, "model:KIND": ..., "task:KIND": ...}: every config class."""
    out = {"train": TrainConfig}
    out |= {f"model:{k}": _class_of(MODEL_CONFIGS, "model_kind", k) for k in MODEL_CONFIGS}
    return out | {f"task:{k}": c for k, c in TASK_CONFIGS.items()}


def field_default(name: str) -> Any:
    """A field's default (from the first config class that has it); KeyError if none."""
    for cls in all_classes().values():
        for f in dataclasses.fields(cls):
            if f.name == name:
                return f.default
    raise KeyError(name)


def _route(overrides: Mapping[str, Any], classes: dict[str, type], kinds: dict) -> dict:
    """{group: {field: value}} of flat overrides for the groups' classes; a ConfigError
    names a field that the chosen family or task does not have, or that none has."""
    groups: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
    for key, value in overrides.items():
        group = next((g for g in _GROUPS if key in _names(classes[g])), None)
        if group is None:
            owners = [k for k, c in all_classes().items() if key in _names(c)]
            if not owners:
                known = sorted({n for c in all_classes().values() for n in _names(c)})
                raise ConfigError(f"unknown config field {key!r}; known fields: {', '.join(known)}")
            side = owners[0].split(":")[0]
            field = f"{side}_kind"
            raise ConfigError(
                f"{key} is not a field of {field} = {kinds[side]!r} (it belongs to "
                + ", ".join(repr(o.split(":")[1]) for o in owners)
                + f"); its fields: {', '.join(_names(classes[side]))}"
            )
        groups[group][key] = value
    return groups


def _rebuilt(current, cls: type, values: dict):
    """`current` with `values`, as a `cls`; fields `cls` shares with another kind's
    config carry their values over."""
    if type(current) is cls:
        return dataclasses.replace(current, **values) if values else current
    carried = {n: getattr(current, n) for n in _names(cls) if hasattr(current, n)}
    return cls(**(carried | values))


@dataclasses.dataclass(frozen=True)
class Config:
    """Task, model and training settings of one run (all models of a sweep share it);
    `Config()` is SPEC's: the dual encoder on the 1D task."""

    task: TaskConfig = None
    model: ModelConfig = None
    train: TrainConfig = TrainConfig()

    def __post_init__(self):
        if self.task is None:
            object.__setattr__(
                self, "task", _class_of(TASK_CONFIGS, "task_kind", DEFAULT_TASK_KIND)()
            )
        if self.model is None:
            model = _class_of(MODEL_CONFIGS, "model_kind", DEFAULT_MODEL_KIND)()
            object.__setattr__(self, "model", model)
        for name, table, field, base in (
            ("task", TASK_CONFIGS, "task_kind", TaskConfig),
            ("model", MODEL_CONFIGS, "model_kind", ModelConfig),
        ):
            group = getattr(self, name)
            if not isinstance(group, base):
                fail(name, group, f"a {base.__name__}")
            cls = _class_of(table, field, getattr(group, field))
            if type(group) is not cls:
                fail(
                    name,
                    type(group).__name__,
                    f"a {cls.__name__} for {field} = {getattr(group, field)!r}",
                )
        if not isinstance(self.train, TrainConfig):
            fail("train", self.train, "a TrainConfig")
        if self.train.id_weight > 0 and getattr(self.model, "id_site", 0) == 0:
            fail(
                "id_weight",
                self.train.id_weight,
                "0 with id_site = 0 (the spatial-ID loss needs an LM site: set id_site)",
            )
        if self.train.epochs > 0:
            self._check_finite()

    def _check_finite(self) -> None:
        t = self.task
        if not t.finite_sets:
            fail(
                "epochs",
                self.train.epochs,
                f"0 (streaming) with task_kind = {t.task_kind!r}: the finite training "
                "set is defined for the 1D task only",
            )
        if round(t.single_frac * self.train.batch_size) >= self.train.batch_size:
            fail(
                "single_frac",
                t.single_frac,
                f"a fraction leaving two-object samples in a batch of "
                f"{self.train.batch_size} (epochs = {self.train.epochs} counts "
                "passes over the two-object set)",
            )
        n_two = t.n_pair_labels * (t.n_pair_labels - 1) * t.layouts_per_pair
        n_one = t.n_labels * (t.image_len - t.n_single_holdout)
        if max(n_two, n_one) > MAX_FINITE_ITEMS:
            fail(
                "epochs",
                self.train.epochs,
                f"0 (streaming) for this task: a finite training set of up to "
                f"{max(n_two, n_one)} items exceeds {MAX_FINITE_ITEMS}",
            )

    @staticmethod
    def field_names() -> tuple[str, ...]:
        """Every field of every registered config class (the flags), each once."""
        return tuple(dict.fromkeys(n for c in all_classes().values() for n in _names(c)))

    def flat(self) -> dict[str, Any]:
        """This config's fields as one flat dict (names are unique across groups)."""
        out = {}
        for g in _GROUPS:
            out.update(dataclasses.asdict(getattr(self, g)))
        return out

    def replace(self, **overrides: Any) -> "Config":
        """A new validated config with flat field overrides (`model_kind` / `task_kind`
        switch the group's class); a field the chosen family or task does not have, or
        an unknown one, is an error naming it."""
        kinds = {
            "model": overrides.get("model_kind", self.model.model_kind),
            "task": overrides.get("task_kind", self.task.task_kind),
        }
        classes = {
            "task": _class_of(TASK_CONFIGS, "task_kind", kinds["task"]),
            "model": _class_of(MODEL_CONFIGS, "model_kind", kinds["model"]),
            "train": TrainConfig,
        }
        groups = _route(overrides, classes, kinds)
        return Config(**{g: _rebuilt(getattr(self, g), classes[g], groups[g]) for g in _GROUPS})

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
        """The config a `to_json` text holds. Folders written before configs were split
        by family list every family's fields: those the run's family and task do not
        have are dropped if they hold their defaults (they were never read). A model
        kind's old name reads as its name now (`RENAMED_MODEL_KINDS`)."""
        raw = json.loads(text)
        unknown = sorted(set(raw) - set(_GROUPS))
        if unknown:
            raise ConfigError(f"unknown config group(s) {unknown}; known: {', '.join(_GROUPS)}")
        flat: dict[str, Any] = {}
        for g in _GROUPS:
            flat.update(raw.get(g, {}))
        kind = flat.get("model_kind", DEFAULT_MODEL_KIND)
        flat["model_kind"] = RENAMED_MODEL_KINDS.get(kind, kind) if isinstance(kind, str) else kind
        model = _class_of(MODEL_CONFIGS, "model_kind", flat["model_kind"])
        task = _class_of(TASK_CONFIGS, "task_kind", flat.get("task_kind", DEFAULT_TASK_KIND))
        own = set(_names(model)) | set(_names(task)) | set(_names(TrainConfig))
        for name in [n for n in flat if n not in own]:
            try:
                default = field_default(name)
            except KeyError:
                continue  # an unknown field: `replace` names it
            if flat[name] == default:
                del flat[name]
        return cls.from_flat(flat)
