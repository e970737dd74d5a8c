"""Training: one run is a `lax.scan` over steps; K models are a `vmap` over runs.

`train_models(config, settings)` trains K models, each with its own seed and sweepable
values (`config.Settings` of arrays `[K]`), in one compiled program whose model axis is
sharded over every device present (a one-axis `models` mesh; one device works too).
Evaluation runs inside the scan every `eval_every` steps, so the curves come back with
the final params.

Randomness: model k's stream derives from its seed alone: init from
`fold_in(key(seed), 0)`, the batch of step t from `fold_in(fold_in(key(seed), 1), t)`.
So a model trains identically alone, in any batch of models, and resumed.

A model whose loss or gradient becomes non-finite stops updating (its params are the
last finite ones) and its `diverged_step` records the step; the host reports it by
index and settings (`diverged_models`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as PS

from jaxmech.config import SWEEPABLE, Config, Settings
from jaxmech.data import relations1d, relations2d, relations3
from jaxmech.data.relations1d import (
    DataTables,
    EvalSets,
    n_two_object_items,
    singles_per_batch,
)
from jaxmech.evaluate import METRICS, evaluate
from jaxmech.models.dual_encoder import forward, init_params

CURVE_FIELDS = METRICS + ("loss", "grad_norm", "param_norm", "update_norm")

# The data generator of each task kind (`TaskConfig.task_kind`): every one provides
# build_tables, build_eval_sets and a jittable sample_batch with the same signatures.
GENERATORS = {"1d": relations1d, "2d": relations2d, "three": relations3}


def generator(config: Config):
    """The data module of the config's task kind."""
    return GENERATORS[config.task.task_kind]


class TrainState(NamedTuple):
    """One model's training carry (stacked over models under vmap)."""

    params: Any
    opt_state: Any
    step: jax.Array  # int32, steps done
    diverged_step: jax.Array  # int32, -1 while finite


class Data(NamedTuple):
    """The arrays every model of a run shares (replicated over devices)."""

    tables: DataTables  # or the task kind's tables (relations2d.GridTables)
    evals: EvalSets  # or the task kind's grouped sets (data.grouped.GroupedEvalSets)


def build_data(config: Config) -> Data:
    """Tables and validation sets for the config's task (host NumPy, built once)."""
    gen = generator(config)
    tables = gen.build_tables(config.task)
    return Data(tables, gen.build_eval_sets(config.task, tables))


def make_optimizer(config: Config, lr, weight_decay) -> optax.GradientTransformation:
    """AdamW, linear warm-up then constant; decay on matrices and embeddings only.

    `lr` and `weight_decay` may be traced (they are sweepable).
    """
    t = config.train
    warm = max(t.warmup_steps, 1)

    def schedule(count):
        return lr * jnp.minimum(1.0, (count + 1) / warm)

    return optax.adamw(
        schedule,
        b1=t.b1,
        b2=t.b2,
        eps=t.eps,
        weight_decay=weight_decay,
        mask=lambda params: jax.tree_util.tree_map(lambda x: x.ndim >= 2, params),
    )


def clip_loss(params, images_BxL, caption_ids_B, captions_CxT, config: Config, positives_BxB=None):
    """Symmetric CLIP cross-entropy; identical captions are positives of each other.

    `positives_BxB` (bool [image, caption], diagonal True) replaces that rule where a
    caption can be true of several different images (the three-object task:
    `relations3.positives`); each direction's target is uniform over its positives.
    """
    sims_BxB, _ = forward(
        params,
        images_BxL,
        jnp.asarray(captions_CxT)[caption_ids_B],
        causal_text=config.model.causal_text,
        readout_only=True,
        logit_scale_max=config.model.logit_scale_max,
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


def _tree_norm(tree):
    return jnp.sqrt(sum(jnp.sum(jnp.square(x)) for x in jax.tree_util.tree_leaves(tree)))


def init_state(config: Config, settings: Settings) -> TrainState:
    """A model's step-0 state from its seed (scalar settings; vmap for many)."""
    key = jax.random.key(jnp.asarray(settings.seed, jnp.uint32))
    params = init_params(config, jax.random.fold_in(key, 0))
    opt = make_optimizer(config, settings.lr, settings.weight_decay)
    return TrainState(params, opt.init(params), jnp.int32(0), jnp.int32(-1))


def step_budget(settings: Settings, config: Config):
    """Steps a model trains: `steps` when streaming, else its epochs over the finite set.

    With `epochs = E > 0`: ceil(E * n_two / (B - round(single_frac * B))), n_two =
    N_pair (N_pair - 1) layouts_per_pair. Works on scalars or arrays [K], traced or
    NumPy (then returns a jax array).
    """
    epochs = jnp.asarray(settings.epochs, jnp.int32)
    per_batch = config.train.batch_size - singles_per_batch(settings, config.train.batch_size)
    n_two = n_two_object_items(settings)
    finite = -(-(epochs * n_two) // jnp.maximum(per_batch, 1))
    return jnp.where(epochs > 0, finite, config.train.steps).astype(jnp.int32)


def train_step(state: TrainState, settings: Settings, data: Data, config: Config):
    """One optimiser step of one model; returns (state, per-step metrics).

    A model past its `step_budget` (finite-set epochs done) keeps its params frozen;
    its step counter still advances with the program.
    """
    seed_key = jax.random.key(jnp.asarray(settings.seed, jnp.uint32))
    key = jax.random.fold_in(jax.random.fold_in(seed_key, 1), state.step)
    gen = generator(config)
    images, caption_ids = gen.sample_batch(
        data.tables,
        key,
        settings,
        config.task,
        config.train.batch_size,
        finite=config.train.epochs > 0,
        step=state.step,
        order_key=jax.random.fold_in(seed_key, 2),
    )
    # a task whose captions can be true of several images says which (else: equal ids)
    true_of = getattr(gen, "positives", None)
    positives = None if true_of is None else true_of(images, caption_ids, config.task)
    loss, grads = jax.value_and_grad(clip_loss)(
        state.params, images, caption_ids, data.tables.captions, config, positives
    )
    opt = make_optimizer(config, settings.lr, settings.weight_decay)
    updates, opt_state = opt.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    grad_norm = _tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    ok = finite & (state.diverged_step < 0) & (state.step < step_budget(settings, config))
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


def run_chunks(state: TrainState, settings: Settings, data: Data, config: Config, n_chunks: int):
    """`n_chunks` x (`eval_every` steps, then an evaluation) for one model.

    Returns (state, curves) with curves a dict of `[n_chunks]` arrays (`CURVE_FIELDS`
    plus `step`): losses and norms are means over the chunk's steps.
    """

    def chunk(state, _):
        state, m = jax.lax.scan(
            lambda s, _: train_step(s, settings, data, config),
            state,
            None,
            length=config.train.eval_every,
        )
        ev = evaluate(
            state.params,
            data.evals,
            data.tables.captions,
            settings,
            causal_text=config.model.causal_text,
        )
        out = {**ev, **{k: v.mean() for k, v in m.items()}}
        out["param_norm"] = _tree_norm(state.params)
        out["step"] = state.step
        return state, out

    return jax.lax.scan(chunk, state, None, length=n_chunks)


def model_mesh() -> jax.sharding.Mesh:
    """A one-axis mesh named `models` over every device present."""
    # Auto axes: XLA propagates the model-axis sharding through the vmapped program
    # (Explicit axes would demand sharding annotations on every intermediate).
    return jax.make_mesh(
        (jax.device_count(),), ("models",), axis_types=(jax.sharding.AxisType.Auto,)
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


@functools.partial(jax.jit, static_argnames=("config",))
def _init_program(settings, config: Config):
    return jax.vmap(lambda s: init_state(config, s))(settings)


@functools.partial(jax.jit, static_argnames=("config", "n_chunks"))
def _train_program(state, settings, data, config: Config, n_chunks: int):
    # One compiled program for any settings values (they are arrays) of a given K.
    return jax.vmap(lambda st, s: run_chunks(st, s, data, config, n_chunks))(state, settings)


def _pad_models(tree, k_padded: int):
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
      n_chunks: chunks of `eval_every` steps to run (default: up to `steps`).
      mesh: device mesh (default: all devices).

    Returns:
      (state, curves) as host NumPy: stacked final state [K, ...] and curves
      {name: [K, n_chunks]}.
    """
    finite = np.asarray(settings.epochs) > 0
    if finite.any() != finite.all() or finite.any() != (config.train.epochs > 0):
        raise ValueError(
            f"settings.epochs = {np.asarray(settings.epochs).tolist()} and config epochs = "
            f"{config.train.epochs}: a run's models must all stream (0) or all train on the "
            "finite set (> 0), as the config says"
        )
    data = build_data(config) if data is None else data
    k = int(np.asarray(settings.seed).shape[0])
    done = 0 if state is None else int(np.asarray(state.step).max())
    if n_chunks is None:
        n_chunks = (config.train.steps - done) // config.train.eval_every
    mesh = model_mesh() if mesh is None else mesh
    n_dev = mesh.devices.size
    k_pad = -(-k // n_dev) * n_dev
    shard = NamedSharding(mesh, PS("models"))
    replicated = NamedSharding(mesh, PS())
    # The programs follow their inputs' shardings: models split over devices, data replicated.
    settings_d = _to_global(_pad_models(settings, k_pad), shard)
    if state is None:
        state_d = _init_program(settings_d, config)
    else:
        state_d = _to_global(_pad_models(state, k_pad), shard)
    data_d = _to_global(data, replicated)
    state_out, curves = _train_program(state_d, settings_d, data_d, config, n_chunks)
    trim = lambda tree: jax.tree_util.tree_map(lambda x: x[:k], tree)  # noqa: E731
    return trim(fetch(state_out)), trim(fetch(curves))


def diverged_models(state: TrainState, settings: Settings) -> list[str]:
    """One line per model whose loss went non-finite: index, step and settings."""
    out = []
    div = np.asarray(state.diverged_step)
    for i in np.flatnonzero(div >= 0):
        vals = ", ".join(f"{n}={np.asarray(v)[i].item()}" for n, v in zip(SWEEPABLE, settings))
        out.append(
            f"model {i} ({vals}) diverged at step {int(div[i])}: loss or gradient non-finite"
        )
    return out
