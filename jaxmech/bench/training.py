"""Throughput measurements: training steps per second against the machine's matmul rate.

All numbers of one report are measured in the same process, so their ratios are
meaningful even on a noisy machine. FLOP counts:

* `dense_step_flops(config, readout_only)`: the textbook count of one training step
  (forward + backward = 3 x forward) with every projection done as a dense matmul over
  every token; `readout_only` computes the last layer's queries, attention and output
  projection for the CLS / EOT row only.
* XLA's own count of the compiled step (`cost_analysis`), i.e. what is executed. It is
  far lower than the dense count because the first layer's projections are looked up
  from `E W` and `P W` tables (`models.attention.block_forward`, `factored`).
"""

from __future__ import annotations

import functools
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp

from jaxmech.config import Config
from jaxmech.data.tasks.vocab import CAPTION_LEN
from jaxmech.families import family_for
from jaxmech.train import (
    build_data,
    init_program,
    init_state,
    model_mesh,
    split_models,
    stack_settings,
    step_batch,
    train_step,
)


def _tower_forward_flops(config: Config, seq: int, layers: int, readout_only: bool) -> float:
    m = config.model
    D, H, Dh = m.d_model, m.n_heads, m.d_head
    f = 0.0
    for layer in range(layers):
        q_rows = 1 if (readout_only and layer == layers - 1) else seq
        f += 2 * seq * D * 2 * H * Dh  # K, V
        f += 2 * q_rows * D * H * Dh  # Q
        f += 2 * 2 * q_rows * seq * H * Dh  # scores, pattern @ V
        f += 2 * q_rows * H * Dh * D  # W_O
        if m.mlp:
            f += 2 * 2 * q_rows * D * m.d_mlp
    return f + 2 * D * m.d_embed  # projection


def dense_step_flops(config: Config, readout_only: bool = True) -> float:
    """FLOPs of one training step done densely (see module docstring)."""
    t, m = config.task, config.model
    fwd = _tower_forward_flops(config, t.image_len + 1, m.n_layers, readout_only)
    fwd += _tower_forward_flops(config, CAPTION_LEN, m.text_layers, readout_only)
    B = config.train.batch_size
    return 3.0 * B * fwd + 2.0 * B * B * m.d_embed


def _steps_program(config: Config, k: int, n_steps: int, devices: int = 1):
    """A jitted function running n_steps training steps of k vmapped models, their
    model axis split over the first `devices` devices (as a sweep splits its chunk)."""
    data = jax.tree_util.tree_map(jnp.asarray, build_data(config))
    settings = split_models(
        stack_settings([config.replace(seed=i).settings() for i in range(k)]), model_mesh(devices)
    )
    state = init_program(settings, config)

    def run(state, settings):
        def body(st, _):
            return jax.vmap(lambda s_, x: train_step(s_, x, data, config)[0])(st, settings), None

        return jax.lax.scan(body, state, None, length=n_steps)[0]

    return functools.partial(jax.jit(run), settings=settings), state


def step_flops_xla(config: Config) -> float | None:
    """XLA's FLOP count of one compiled training step of one model (None if unknown)."""
    data = jax.tree_util.tree_map(jnp.asarray, build_data(config))
    s = config.settings()
    state = init_state(config, s)
    compiled = jax.jit(lambda st: train_step(st, s, data, config)).lower(state).compile()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    return None if not cost or "flops" not in cost else float(cost["flops"])


def step_breakdown(config: Config, n_steps: int = 50, repeats: int = 3) -> dict:
    """{part: best-of seconds per step} of one model's training: "batch" (sampling it),
    "forward" (the loss), "backward" (value and gradient), "step" (the whole step:
    the optimiser, the norms and the divergence guard too). Each part runs `n_steps`
    times in one scan over the step index, so every step sees a new batch."""
    data = jax.tree_util.tree_map(jnp.asarray, build_data(config))
    s = jax.tree_util.tree_map(jnp.asarray, config.settings())
    state = init_state(config, s)
    loss = family_for(config).loss

    def at(i):
        return step_batch(i, s, data, config)

    parts = {
        "batch": lambda i: sum(jnp.sum(x) for x in jax.tree_util.tree_leaves(at(i))),
        "forward": lambda i: loss(state.params, at(i), data.tables, s, config),
        "backward": lambda i: jax.grad(loss)(state.params, at(i), data.tables, s, config),
        "step": lambda i: train_step(state._replace(step=i), s, data, config)[1],
    }
    out = {}
    for name, f in parts.items():
        run = jax.jit(lambda f=f: jax.lax.map(f, jnp.arange(n_steps)))
        jax.block_until_ready(run())  # compile + warm up
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            jax.block_until_ready(run())
            best = min(best, time.perf_counter() - t)
        out[name] = best / n_steps
    return out


RUNTIME_EVENTS = ("$", "Thunk", "Slinky")  # a trace's host and runtime events, not XLA ops


def step_profile(config: Config, n_steps: int = 20, top: int = 12) -> dict:
    """Where one model's value-and-gradient step spends its time, op by op: a
    `jax.profiler` trace (its Perfetto JSON) of `n_steps` steps in one scan, each op's
    time summed and divided by `n_steps`. {"by_kind": [(kind, ms per step, ops per
    step)] by the op name without its number (dot, copy_bitcast_fusion, ...), "top":
    [(op, ms per step, its line of the compiled HLO)]}. A timing helper run by hand."""
    import collections
    import glob
    import gzip
    import json
    import re
    import tempfile

    data = jax.tree_util.tree_map(jnp.asarray, build_data(config))
    s = jax.tree_util.tree_map(jnp.asarray, config.settings())
    params, loss = init_state(config, s).params, family_for(config).loss
    grad = lambda i: jax.grad(loss)(params, step_batch(i, s, data, config), data.tables, s, config)  # noqa: E731
    run = jax.jit(lambda: jax.lax.map(grad, jnp.arange(n_steps)))
    jax.block_until_ready(run())  # compile + warm up
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, create_perfetto_trace=True)
        jax.block_until_ready(run())
        jax.profiler.stop_trace()
        (path,) = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    ms, count = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and not e["name"].startswith(RUNTIME_EVENTS):
            ms[e["name"]] += e.get("dur", 0) / 1e3 / n_steps
            count[e["name"]] += 1
    kinds, kind_n = collections.Counter(), collections.Counter()
    for name, t in ms.items():
        kinds[re.sub(r"[.\d]+$", "", name)] += t
        kind_n[re.sub(r"[.\d]+$", "", name)] += count[name] / n_steps
    hlo = {m.group(2): line.strip() for line in run.lower().compile().as_text().splitlines()
           if (m := re.match(r"\s*(ROOT )?%?([\w.-]+) = ", line))}  # fmt: skip
    return {
        "by_kind": [(k, t, kind_n[k]) for k, t in kinds.most_common()],
        "top": [(name, t, hlo.get(name, "")) for name, t in ms.most_common(top)],
    }


def model_steps_per_second(
    config: Config, k: int, n_steps: int = 100, repeats: int = 3, devices: int = 1
) -> float:
    """Best-of throughput, in model-steps per second, of k models trained together
    (split over `devices` devices; k a multiple of it)."""
    if devices < 1 or k % devices:
        raise ValueError(f"k = {k} models over devices = {devices}: expected a multiple")
    run, state = _steps_program(config, k, n_steps, devices)
    state = jax.block_until_ready(run(state))  # compile + warm up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        state = jax.block_until_ready(run(state))
        best = min(best, time.perf_counter() - t)
    return k * n_steps / best


def _width_config(config: Config, d_model: int) -> Config:
    """`config` at another width: d_head and d_mlp scaled with d_model, heads kept."""
    m = config.model
    if d_model < 1 or (d_model * m.d_head) % m.d_model or (d_model * m.d_mlp) % m.d_model:
        raise ValueError(
            f"scaling width {d_model}: expected a positive multiple of "
            f"{m.d_model // math.gcd(m.d_model, m.d_head, m.d_mlp)} (d_head {m.d_head} and "
            f"d_mlp {m.d_mlp} scale with d_model {m.d_model})"
        )
    return config.replace(
        d_model=d_model,
        d_head=d_model * m.d_head // m.d_model,
        d_mlp=d_model * m.d_mlp // m.d_model,
    )


def scaling_configs(config: Config, widths=(), batches=()) -> list[Config]:
    """`config` at each width in `widths` (d_head and d_mlp scaled with d_model, the
    batch kept), then at each batch size in `batches` (the width kept); a bad width or
    batch size is an error here, before anything is timed."""
    return [_width_config(config, w) for w in widths] + [
        config.replace(batch_size=b) for b in batches
    ]


def scaling_table(configs, k: int = 4, n_steps: int = 10, repeats: int = 3) -> list[dict]:
    """The training step's speed over `configs` (`scaling_configs`): whether the step
    is bound by fixed per-op costs (time flat in the batch) or by the speed of its
    small contractions (time linear in the batch, the share of the matmul rate rising
    with the width).

    One row per config: {"d_model", "batch_size", "flops" (XLA's count per
    model-step), "seconds" (median per model-step of k vmapped models on one device;
    the programs are timed in turns, so drift hits them alike)}.
    """
    programs = [_steps_program(c, k, n_steps) for c in configs]
    for run, state in programs:
        jax.block_until_ready(run(state))  # compile + warm up
    times = [[] for _ in programs]
    for _ in range(repeats):
        for (run, state), t in zip(programs, times):
            start = time.perf_counter()
            jax.block_until_ready(run(state))
            t.append((time.perf_counter() - start) / (n_steps * k))
    return [
        {
            "d_model": c.model.d_model,
            "batch_size": c.train.batch_size,
            "flops": step_flops_xla(c),
            "seconds": statistics.median(t),
        }
        for c, t in zip(configs, times)
    ]


def sweep_throughput(config: Config, n_models: int, chunk_size: int | None = None) -> dict:
    """Trains n_models seeds of `config` as a sweep (into a temporary folder, evaluation
    and saves included) and returns wall time, models/hour and model-steps/s."""
    import shutil
    import tempfile

    from jaxmech.sweep import expand, run_grid

    grid = expand(config, {}, seeds=n_models)
    tmp = tempfile.mkdtemp(prefix="jaxmech-bench-")
    try:
        t = time.perf_counter()
        run_grid(grid, os.path.join(tmp, "sweep"), chunk_size=chunk_size, log=lambda *_: None)
        wall = time.perf_counter() - t
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {
        "wall_s": wall,
        "models_per_hour": n_models * 3600 / wall,
        "model_steps_per_s": n_models * config.train.steps / wall,
    }


def ablation_table_time(config: Config, n_models: int, names=None) -> dict:
    """Wall time of one `ablation_table` call over n_models freshly initialised models
    (timing only: the accuracies of untrained models mean nothing), first call
    (compile included) and a second call."""
    from jaxmech.analysis.ablate import DEFAULT_ABLATIONS, ablation_table
    from jaxmech.train import init_program

    names = tuple(names or DEFAULT_ABLATIONS)
    settings = jax.tree_util.tree_map(
        jnp.asarray, stack_settings([config.replace(seed=i).settings() for i in range(n_models)])
    )
    params = init_program(settings, config).params
    data = build_data(config)
    out = {}
    for label in ("first_s", "second_s"):
        t = time.perf_counter()
        jax.block_until_ready(ablation_table(params, settings, data, names))
        out[label] = time.perf_counter() - t
    out["evaluations"] = n_models * len(names)
    return out
