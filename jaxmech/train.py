"""Training: one run is a `lax.scan` over steps; K models are a `vmap` over runs.

`train_models(config, settings)` trains K models, each with its own seed and sweepable
values (`config.Settings` of arrays `[K]`), in one compiled program whose model axis is
sharded over every device present (a one-axis `models` mesh; one device works too).
The compiled unit is one segment: `eval_every` steps (a `lax.scan`) then an evaluation;
a run of n evaluations calls it n times with the state left on the devices. So a run of
any length, a resumed run and a saved sweep all reuse one program per config and
model count (compiling is most of a short run's time, and all of the test suite's).

Training knows the model only through its family (`jaxmech.families`: init, loss,
evaluation, metric names) and the data only through its task (`data.tasks`: tables,
eval sets, batches), both chosen by the config; nothing here branches on either.

Randomness: model k's stream derives from its seed alone: init from
`fold_in(key(seed), 0)`, the batch of step t from `fold_in(fold_in(key(seed), 1), t)`.
So a model sees the same init and batches alone, in any batch of models, and resumed;
its arithmetic is bit-identical only within the same compiled program: XLA may round
differently for another number of vmapped models, which is why sweeps train in chunks
of a fixed size per backend (`sweep.default_chunk_size`; BUILD_NOTES.md, guarantees).

A model whose loss or gradient becomes non-finite stops updating (its params are the
last finite ones) and its `diverged_step` records the step; the host reports it by
index and settings (`diverged_models`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from jaxmech.config import SWEEPABLE, Config, ConfigError, Settings, TrainConfig
from jaxmech.data.tasks import Data, build_data, get_task
from jaxmech.families import TrainedFamily, family_for, trainable

# What every family's curves carry besides its metrics: the training health signals.
TRAIN_FIELDS = ("loss", "grad_norm", "param_norm", "update_norm")


def curve_fields(config: Config) -> tuple[str, ...]:
    """The per-evaluation curves of a run: the family's metrics, then TRAIN_FIELDS."""
    return tuple(family_for(config).metrics(config)) + TRAIN_FIELDS


class TrainState(NamedTuple):
    """One model's training carry (stacked over models under vmap)."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32, steps done
    diverged_step: jax.Array  # int32, -1 while finite


def make_optimizer(config: Config, lr, weight_decay, horizon=None) -> optax.GradientTransformation:
    """AdamW, linear warm-up then constant or cosine to 0 at `horizon` (`lr_decay`);
    weight decay on matrices and embeddings only.

    `lr`, `weight_decay` and `horizon` (the model's step budget; default `steps`) may be
    traced: they are sweepable, and a compiled program's own `steps` is canonical
    (`program_config`), so the budget must come from the caller.
    """
    t = config.train
    warm = max(t.warmup_steps, 1)

    def schedule(count):
        rise = jnp.minimum(1.0, (count + 1) / warm)
        if t.lr_decay == "constant":
            return lr * rise
        span = jnp.maximum((t.steps if horizon is None else horizon) - warm, 1)
        done = jnp.clip((count - warm) / span, 0.0, 1.0)
        return lr * rise * 0.5 * (1.0 + jnp.cos(jnp.pi * done))

    return optax.adamw(
        schedule,
        b1=t.b1,
        b2=t.b2,
        eps=t.eps,
        weight_decay=weight_decay,
        mask=lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params),
    )


def param_paths(params) -> list[str]:
    """Every leaf's path, `part/.../name`, in `tree_leaves` order."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    return ["/".join(str(getattr(k, "key", k)) for k in path) for path, _ in paths]


def trainable_mask(config: Config, params):
    """A pytree of Python bools like `params`: which leaves train under
    `config.train.train_only` (all when it is empty; never `static/...`), or None for
    all. ConfigError naming `train_only` for a pattern that matches no parameter."""
    spec = config.train.train_only
    return path_mask(params, spec) if spec else None


def path_mask(params, spec: str):
    """A pytree of Python bools like `params`: the leaves (never `static/...`) whose
    path (`param_paths`) matches one of `spec`'s '+'-separated glob patterns.
    ConfigError naming `train_only` for a pattern that matches no parameter."""
    patterns = [p.strip() for p in spec.split("+") if p.strip()]
    paths = param_paths(params)
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(p, pat) for p in paths):
            raise ConfigError(
                f"train_only = {spec!r}: {pat!r} matches no parameter (paths look like "
                f"{', '.join(paths[:3])}, ...)"
            )
    keep = [
        not p.startswith("static/") and any(fnmatch.fnmatchcase(p, q) for q in patterns)
        for p in paths
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(params), keep)


def check_train_only(config: Config) -> None:
    """`trainable_mask` on the family's parameter shapes (no compute): before training."""
    if config.train.train_only:
        shapes = jax.eval_shape(
            lambda k: family_for(config).init_params(config, k), jax.random.key(0)
        )
        trainable_mask(config, shapes)


def _tree_norm(tree):
    leaves = jax.tree_util.tree_leaves(trainable(tree))
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in leaves))


def init_state(config: Config, settings: Settings) -> TrainState:
    """A model's step-0 state from its seed (scalar settings; vmap for many)."""
    key = jax.random.key(jnp.asarray(settings.seed, jnp.uint32))
    params = family_for(config).init_params(config, jax.random.fold_in(key, 0))
    opt = make_optimizer(config, settings.lr, settings.weight_decay)
    return TrainState(params, opt.init(params), jnp.int32(0), jnp.int32(-1))


def step_budget(settings: Settings, config: Config):
    """Steps a model trains: `steps` when streaming, else its epochs over the finite set.

    With `epochs = E > 0`: ceil(E * n_items / per_batch) from the task's `epoch_items`
    (1D: n_items = N_pair (N_pair - 1) layouts_per_pair two-object items, per_batch =
    B - round(single_frac * B)). Works on scalars or arrays [K], traced or NumPy (then
    returns a jax array).
    """
    epochs = jnp.asarray(settings.epochs, jnp.int32)
    epoch_items = get_task(config.task.task_kind).epoch_items
    if epoch_items is None:  # a streaming-only task (the config refuses epochs > 0)
        return jnp.full(epochs.shape, config.train.steps, jnp.int32)
    n_items, per_batch = epoch_items(settings, config.train.batch_size)
    finite = -(-(epochs * n_items) // jnp.maximum(per_batch, 1))
    return jnp.where(epochs > 0, finite, config.train.steps).astype(jnp.int32)


def _step_keys(settings: Settings, step):
    """(batch key of `step`, epoch-order key) of a model: both from its seed alone."""
    seed_key = jax.random.key(jnp.asarray(settings.seed, jnp.uint32))
    return jax.random.fold_in(jax.random.fold_in(seed_key, 1), step), jax.random.fold_in(
        seed_key, 2
    )


def curriculum_settings(settings: Settings, step, train: TrainConfig) -> Settings:
    """The settings a model's batch of `step` is drawn with: under `curriculum_steps` =
    N > 0 its `single_frac` rises to 1 at step 0 and falls linearly back by step N
    (single-object questions first); with N = 0 `settings` itself (the default path
    stays the same program)."""
    n = train.curriculum_steps
    if n == 0:
        return settings
    early = jnp.clip(1.0 - jnp.asarray(step, jnp.float32) / n, 0.0, 1.0)
    frac = jnp.asarray(settings.single_frac, jnp.float32)
    return settings._replace(single_frac=frac + (1.0 - frac) * early)


def step_batch(step, settings: Settings, data: Data, config: Config):
    """The training batch of one model at `step` (a function of its seed and the step)."""
    key, order_key = _step_keys(settings, step)
    settings = curriculum_settings(settings, step, config.train)
    return get_task(config.task.task_kind).sample_batch(
        data.tables,
        key,
        settings,
        config.task,
        config.train.batch_size,
        finite=config.train.epochs > 0,
        step=step,
        order_key=order_key,
    )


def train_step(state: TrainState, settings: Settings, data: Data, config: Config, budget=None):
    """One optimiser step of one model; returns (state, per-step metrics).

    A model past its `budget` of steps (default `step_budget`: finite-set epochs done)
    keeps its params frozen; its step counter still advances with the program.
    """
    budget = step_budget(settings, config) if budget is None else budget
    batch = step_batch(state.step, settings, data, config)
    loss_fn = family_for(config).loss
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch, data.tables, settings, config)
    opt = make_optimizer(config, settings.lr, settings.weight_decay, budget)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    mask = trainable_mask(config, state.params)
    if mask is not None:  # frozen leaves keep their old values exactly (not old + 0)
        params = jax.tree_util.tree_map(
            lambda new, old, m: new if m else old, params, state.params, mask
        )
        updates = jax.tree_util.tree_map(lambda u, m: u if m else jnp.zeros_like(u), updates, mask)
    grad_norm = _tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite & (state.diverged_step < 0) & (state.step < budget)
    keep = lambda new, old: jax.tree_util.tree_map(  # noqa: E731
        lambda a, b: jnp.where(ok, a, b), new, old
    )
    new_state = TrainState(
        keep(params, state.params),
        keep(opt_state, state.opt_state),
        state.step + 1,
        jnp.where((state.diverged_step < 0) & ~finite, state.step, state.diverged_step),
    )
    return new_state, {"loss": loss, "grad_norm": grad_norm, "update_norm": _tree_norm(updates)}


def evaluate_state(
    state: TrainState, settings: Settings, data: Data, family: TrainedFamily, config
):
    """One model's metrics at `state` plus its parameter norm and step."""
    ev = family.evaluate(state.params, data.evals, data.tables, settings, config)
    return {**ev, "param_norm": _tree_norm(state.params), "step": state.step}


def run_segment(state: TrainState, settings: Settings, data: Data, config: Config, budget=None):
    """`eval_every` steps, then an evaluation, for one model.

    `budget`: the model's steps (default `step_budget(settings, config)`).

    Returns (state, curves) with curves a dict of scalars (`curve_fields` plus `step`,
    and any further keys the family's evaluate returns): losses and norms are means over
    the segment's steps.
    """
    state, m = jax.lax.scan(
        lambda s, _: train_step(s, settings, data, config, budget),
        state,
        None,
        length=config.train.eval_every,
    )
    out = evaluate_state(state, settings, data, family_for(config), config)
    return state, {**out, **{k: v.mean() for k, v in m.items()}}


def model_mesh(n_devices: int | None = None) -> jax.sharding.Mesh:
    """A one-axis mesh named `models` over the first `n_devices` devices (default: every
    device present)."""
    n = jax.device_count() if n_devices is None else n_devices
    # Auto axes: XLA propagates the model-axis sharding through the vmapped program
    # (Explicit axes would demand sharding annotations on every intermediate).
    return jax.make_mesh(
        (n,), ("models",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


def stack_settings(settings_list: list[Settings]) -> Settings:
    """K scalar settings -> one Settings of arrays [K] (ints int32, floats float32)."""
    cols = list(zip(*settings_list))
    ints = {"seed", "n_pair_labels", "layouts_per_pair", "epochs"}
    return Settings(
        *(
            np.asarray(col, np.int32 if name in ints else np.float32)
            for name, col in zip(SWEEPABLE, cols)
        )
    )


def program_config(config: Config) -> Config:
    """The config a compiled program is keyed on. What only sets a run's length
    (`steps`, the number of `epochs`) and the sweepable values (which reach the program
    as `Settings` arrays; families and tasks read them from there, never from the
    config) take canonical values, so runs of another length or base settings reuse
    the same program. Budgets travel as arrays (`step_budget`)."""
    t = config.task
    return config.replace(
        steps=config.train.eval_every,
        epochs=min(config.train.epochs, 1),
        seed=0,
        n_pair_labels=type(t).min_labels,  # the fewest its task's config accepts
        layouts_per_pair=1,
        single_frac=0.0,
        lr=1e-3,
        weight_decay=0.0,
        id_weight=0.0,
    )


def init_config(config: Config) -> Config:
    """The config an init program is keyed on: the training group at its defaults. A
    fresh state reads only the model and task (the optimiser's state is zeros shaped
    like the params), so runs that differ in steps, batch or optimiser constants share
    one init program (it compiles for 5-10 s on a 2-core CPU)."""
    return dataclasses.replace(config, train=TrainConfig())


@functools.partial(jax.jit, static_argnames=("config",))
def _init_program(settings, config: Config):
    return jax.vmap(lambda s: init_state(config, s))(settings)


def init_program(settings, config: Config):
    """Step-0 states [K, ...] of K models (settings arrays [K]), in one compiled call."""
    return _init_program(settings, init_config(config))


@functools.partial(jax.jit, static_argnames=("config",))
def _train_program(state, settings, budget, data, config: Config):
    # One compiled segment for any settings values, budgets (arrays) and run length of a
    # given K; curves come back as {name: [K]}.
    run = lambda st, s, b: run_segment(st, s, data, config, b)  # noqa: E731
    return jax.vmap(run)(state, settings, budget)


@functools.partial(jax.jit, static_argnames=("config",))
def evaluation_program(state, settings, data, config: Config):
    """The evaluation a segment ends with, for K models alone ({name: [K]}): keyed on
    `program_config(config)` like `_train_program`; the accelerator check times it."""
    family = family_for(config)
    return jax.vmap(lambda st, s: evaluate_state(st, s, data, family, config))(state, settings)


@functools.partial(jax.jit, static_argnames=("config",))
def _restart_program(params, settings, config: Config):
    def one(p, s):
        opt = make_optimizer(config, s.lr, s.weight_decay)
        return TrainState(p, opt.init(p), jnp.int32(0), jnp.int32(-1))

    return jax.vmap(one)(params, settings)


def restart_state(config: Config, settings: Settings, params) -> TrainState:
    """Step-0 states [K, ...] around given stacked params (fine-tuning trained models):
    a fresh optimiser state, the step counter at 0; host NumPy, for `train_models`."""
    return fetch(_restart_program(params, settings, program_config(config)))


def pad_models(tree, k_padded: int):
    """Pads the leading model axis to k_padded by repeating the last model (host NumPy)."""

    def pad(x):
        x = np.asarray(x)
        extra = k_padded - x.shape[0]
        return x if extra == 0 else np.concatenate([x, np.repeat(x[-1:], extra, 0)])

    return jax.tree_util.tree_map(pad, tree)


def _to_global(tree, sharding):
    """Host arrays -> global jax Arrays with `sharding`; every process holds the same host
    copy and supplies its own devices' shards (works on one host and on many)."""

    def put(x):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree_util.tree_map(put, tree)


def split_models(tree, mesh: jax.sharding.Mesh):
    """Host arrays [K, ...] -> global arrays split over the mesh's `models` axis, the
    model axis padded to a multiple of its devices (`pad_models`)."""
    n = mesh.devices.size
    k = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return _to_global(pad_models(tree, -(-k // n) * n), NamedSharding(mesh, PS("models")))


def replicate(tree, mesh: jax.sharding.Mesh):
    """Host arrays -> global arrays held whole by every device of the mesh (shared data)."""
    return _to_global(tree, NamedSharding(mesh, PS()))


def fetch(tree):
    """Global arrays -> host NumPy on every process (gathers across hosts if needed)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(tree, tiled=True)
    return jax.tree_util.tree_map(np.asarray, jax.device_get(tree))


def train_models(
    config: Config,
    settings: Settings,
    *,
    data: Data | None = None,
    state: TrainState | None = None,
    n_chunks: int | None = None,
    mesh: jax.sharding.Mesh | None = None,
):
    """Trains K models in one compiled program, sharded over the `models` mesh axis.

    Args:
      config: static settings shared by all models (validated).
      settings: `Settings` of arrays [K] (see `stack_settings`).
      data: shared tables and validation sets (default: built from config.task).
      state: a stacked `TrainState` to continue from (default: fresh init).
      n_chunks: segments of `eval_every` steps (each then evaluated) to run (default:
        up to `steps`); each is one call of the same compiled program.
      mesh: device mesh (default: all devices).

    Returns:
      (state, curves) as host NumPy: stacked final state [K, ...] and curves
      {name: [K, n_chunks]}.
    """
    family_for(config)  # an unknown model_kind or task pairing fails before any compute
    check_train_only(config)
    finite = np.asarray(settings.epochs) > 0
    if finite.any() != finite.all() or finite.any() != (config.train.epochs > 0):
        raise ValueError(
            f"settings.epochs = {np.asarray(settings.epochs).tolist()} and config epochs = "
            f"{config.train.epochs}: a run's models must all stream (0) or all train on the "
            "finite set (> 0), as the config says"
        )
    done = 0 if state is None else int(np.asarray(state.step).max())
    if n_chunks is None:
        n_chunks = (config.train.steps - done) // config.train.eval_every
    if n_chunks < 1:
        raise ValueError(f"n_chunks = {n_chunks}: nothing to train (steps done: {done})")
    data = build_data(config) if data is None else data
    k = int(np.asarray(settings.seed).shape[0])
    mesh = model_mesh() if mesh is None else mesh
    # The programs follow their inputs' shardings: models split over devices, data replicated.
    settings_d = split_models(settings, mesh)
    state_d = init_program(settings_d, config) if state is None else split_models(state, mesh)
    data_d = replicate(data, mesh)
    budget_d = split_models(np.asarray(step_budget(settings, config)), mesh)
    prog = program_config(config)
    segments = []
    for _ in range(n_chunks):  # the state stays on the devices between segments
        state_d, curves = _train_program(state_d, settings_d, budget_d, data_d, prog)
        segments.append(curves)
    state_out = fetch(state_d)
    curves = {n: np.stack([c[n] for c in fetch(segments)], axis=1) for n in segments[0]}
    trim = lambda tree: jax.tree_util.tree_map(lambda x: x[:k], tree)  # noqa: E731
    return trim(state_out), trim(curves)


def diverged_models(diverged_step, settings: Settings) -> list[str]:
    """One line per model whose loss went non-finite (`diverged_step` [K] >= 0): index,
    step and settings."""
    out = []
    div = np.asarray(diverged_step)
    for i in np.flatnonzero(div >= 0):
        vals = ", ".join(f"{n}={np.asarray(v)[i].item()}" for n, v in zip(SWEEPABLE, settings))
        out.append(
            f"model {i} ({vals}) diverged at step {int(div[i])}: loss or gradient non-finite"
        )
    return out
