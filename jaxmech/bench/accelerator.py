"""The accelerator check: how many models one program trains per hour on the devices
present, how large a chunk fits, and whether sharding changes the numbers.

Everything goes through the program sweeps use (`train.train_models`: K models
vmapped, sharded over every device, an evaluation every `eval_every` steps):

* per K in `ks`: the wall time of `n_chunks` evaluation segments (after a warm-up
  call that compiles), as model-steps/s and models/hour at the config's full step
  budget; a K whose predicted footprint (`sizing.footprint`) exceeds the memory is
  skipped (status "skipped"), and an out-of-memory error ends the list (the largest K
  that ran is reported);
* at the first K: the share of the time spent in evaluation (one evaluation timed
  alone, times `n_chunks`) and in saves and host work (the same models as a
  resumable sweep, `sweep.run_grid`, into a temporary folder, less its segments);
* sharded vs unsharded: the first K's models trained as in its row on every device
  and on the first device alone, params compared (equal to float rounding, within 1e-4 of
  each tensor's largest entry: XLA compiles another program; b_K, rounding noise by
  construction, left out);
* memory per model and the chunk a sweep would choose (`sizing.chunk_per_device`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import jax
import numpy as np

from jaxmech import sizing
from jaxmech.config import Config
from jaxmech.train import (
    build_data,
    evaluation_program,
    init_program,
    model_mesh,
    program_config,
    replicate,
    split_models,
    stack_settings,
    train_models,
)

ACCELERATOR_KS = (64, 256, 1024, 4096)


def is_out_of_memory(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _settings(config: Config, k: int):
    return stack_settings([config.replace(seed=i).settings() for i in range(k)])


def timed_train(config: Config, k: int, n_chunks: int, mesh=None) -> tuple[float, dict]:
    """(seconds of the second of two identical calls, params) of k models x n_chunks
    evaluation segments."""
    settings = _settings(config, k)
    train_models(config, settings, n_chunks=n_chunks, mesh=mesh)  # compile, warm up
    t = time.perf_counter()
    state, _ = train_models(config, settings, n_chunks=n_chunks, mesh=mesh)
    return time.perf_counter() - t, state.params


def memory_limit() -> tuple[float | None, str]:
    """(bytes one device may hold, where the figure comes from)."""
    device = sizing.device_memory()
    if device is not None:
        return float(device), "device"
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host RAM"
    except (ValueError, OSError, AttributeError):
        return None, "unknown"


def throughput_rows(config: Config, ks, n_chunks: int, fp: sizing.Footprint, log=print):
    """One row per K: status ok / skipped / out of memory, and the rates."""
    memory, _ = memory_limit()
    steps = n_chunks * config.train.eval_every
    rows = []
    for k in ks:
        per_device = -(-k // jax.device_count())
        row = {"k": k, "predicted_gib_per_device": fp.bytes(per_device) / 2**30}
        if memory is not None and fp.bytes(per_device) > 0.9 * memory:
            rows.append(row | {"status": "skipped"})  # predicted footprint > 90% of memory
            log(f"K={k}: skipped, predicted {row['predicted_gib_per_device']:.1f} GiB per device")
            continue
        try:
            wall, _ = timed_train(config, k, n_chunks)
        except Exception as e:  # noqa: BLE001 - only out-of-memory is expected here
            if not is_out_of_memory(e):
                raise
            rows.append(row | {"status": "out of memory"})
            log(f"K={k}: out of memory")
            break
        rate = k * steps / wall
        rows.append(
            row
            | {
                "status": "ok",
                "wall_s": wall,
                "model_steps_per_s": rate,
                "models_per_hour": rate * 3600 / config.train.steps,
            }
        )
        log(f"K={k}: {rate:.0f} model-steps/s, {rows[-1]['models_per_hour']:.0f} models/hour")
    return rows


def evaluation_seconds(config: Config, k: int, repeats: int = 3) -> float:
    """Median seconds of one evaluation of k models (`train.evaluation_program`, the
    segment's evaluation compiled alone, the models sharded as in training) at their
    step-0 params: its cost does not depend on their values."""
    mesh = model_mesh()
    settings = split_models(_settings(config, k), mesh)
    state = init_program(settings, config)
    data = replicate(build_data(config), mesh)
    prog = program_config(config)
    run = lambda: jax.block_until_ready(evaluation_program(state, settings, data, prog))  # noqa: E731
    run()  # compiles
    walls = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t)
    return float(np.median(walls))


def time_shares(config: Config, k: int, n_chunks: int) -> dict:
    """Shares of a sweep's time in evaluation (timed alone, `evaluation_seconds`: a
    difference of two trainings' walls was mostly their noise) and in saves + host
    work (the sweep's wall less its segments'), at k."""
    from jaxmech.sweep import expand, run_grid

    steps = n_chunks * config.train.eval_every
    with_evals, _ = timed_train(config, k, n_chunks)
    per_eval = evaluation_seconds(config, k)
    tmp = tempfile.mkdtemp(prefix="jaxmech-accel-")
    try:
        grid = expand(config.replace(steps=steps), {}, seeds=k)
        walls = []
        for name in ("warm", "timed"):  # the first warms the save and host paths
            t = time.perf_counter()
            run_grid(grid, os.path.join(tmp, name), chunk_size=k, log=lambda *_: None)
            walls.append(time.perf_counter() - t)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sweep = walls[1]
    return {
        "k": k,
        "sweep_s": sweep,
        "evaluation_s": per_eval,
        "evaluation_share": per_eval * n_chunks / sweep,
        # the key keeps saves' old name: accelerator.json files written before read the same
        "checkpoint_and_host_share": max(sweep - with_evals, 0.0) / sweep,
    }


def sharded_vs_unsharded(config: Config, k: int, n_chunks: int) -> dict:
    """Params of k models trained n_chunks segments on every device vs on the first
    alone (the first is the throughput rows' program, compiled already)."""
    settings = _settings(config, k)
    every = train_models(config, settings, n_chunks=n_chunks)[0].params
    one = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("models",))
    alone = train_models(config, settings, n_chunks=n_chunks, mesh=one)[0].params
    # b_K is skipped: its gradient is zero up to rounding, which Adam rescales into
    # full-size steps, so its value is rounding noise (BUILD_NOTES.md, "b_K is noise")
    flat = jax.tree_util.tree_flatten_with_path(every)[0]
    pairs = [
        (np.asarray(a), np.asarray(b))
        for (path, a), b in zip(flat, jax.tree_util.tree_leaves(alone))
        if "b_K" not in jax.tree_util.keystr(path)
    ]
    diff = max(float(np.max(np.abs(a - b))) for a, b in pairs)
    # relative to each tensor's scale: rounding differences grow over optimiser steps
    rel = max(float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)) for a, b in pairs)
    return {
        "devices": jax.device_count(),
        "models": k,
        "max_abs_diff": diff,
        "max_rel_diff": rel,
        "equal_to_rounding": bool(rel < 1e-4),
        "bit_equal": all(np.array_equal(a, b) for a, b in pairs),
    }


def accelerator_check(config: Config, ks=ACCELERATOR_KS, n_chunks: int = 2, log=print) -> dict:
    """The whole check (module docstring): {"rows": per K, "shares", "sharding",
    "memory": {per_model_bytes, fixed_bytes, limit_bytes, limit_from, chunk_per_device,
    chosen_by}}."""
    _ = model_mesh()  # fails early if the devices cannot form the mesh
    fp = sizing.footprint(config)
    limit, source = memory_limit()
    chunk, how = sizing.chunk_per_device(config)
    memory = {
        "per_model_bytes": fp.per_model,
        "fixed_bytes": fp.fixed,
        "limit_bytes": limit,
        "limit_from": source,
        "chunk_per_device": chunk,
        "chosen_by": how,
        "chunk_per_device_if_measured": (
            sizing.chunk_for_memory(fp, limit) if limit is not None else None
        ),
    }
    log(
        f"memory: {fp.per_model / 2**20:.2f} MiB per model + {fp.fixed / 2**20:.1f} MiB fixed "
        f"(XLA memory analysis); {source} {limit / 2**30 if limit else float('nan'):.1f} GiB; "
        f"chunk per device {chunk} ({how})"
    )
    rows = throughput_rows(config, ks, n_chunks, fp, log)
    ok = [r["k"] for r in rows if r["status"] == "ok"]
    if not ok:
        raise ValueError(f"ks = {list(ks)}: no K fits on this machine; try smaller ones")
    shares = time_shares(config, ok[0], max(n_chunks, 2))
    sharding = sharded_vs_unsharded(config, ok[0], n_chunks)
    return {
        "rows": rows,
        "largest_k": max(ok),
        "shares": shares,
        "sharding": sharding,
        "memory": memory,
    }


COLUMNS = (
    "k",
    "status",
    "predicted_gib_per_device",
    "wall_s",
    "model_steps_per_s",
    "models_per_hour",
)


def write_check(res: dict, out: str) -> list[str]:
    """Writes `out/accelerator.csv` (one row per K) and `out/accelerator.json` (all of
    `res`); returns the printed table's lines."""
    from jaxmech.results import write_csv, write_json

    os.makedirs(out, exist_ok=True)
    rows = [{c: r.get(c, "") for c in COLUMNS} for r in res["rows"]]
    write_csv(os.path.join(out, "accelerator.csv"), rows)
    write_json(os.path.join(out, "accelerator.json"), res)
    fmt = lambda v, f: f.format(v) if v != "" else "-"  # noqa: E731
    lines = [
        f"{'K':>6} {'status':>12} {'GiB/device':>10} {'model-steps/s':>14} {'models/hour':>12}"
    ]
    for r in rows:
        lines.append(
            f"{r['k']:>6} {r['status'][:12]:>12} {r['predicted_gib_per_device']:>10.2f} "
            f"{fmt(r['model_steps_per_s'], '{:.0f}'):>14} {fmt(r['models_per_hour'], '{:.0f}'):>12}"
        )
    m, s, sh = res["memory"], res["shares"], res["sharding"]
    lines += [
        f"largest K that ran: {res['largest_k']}",
        f"memory per model {m['per_model_bytes'] / 2**20:.2f} MiB (+ {m['fixed_bytes'] / 2**20:.1f} MiB "
        f"fixed); chunk per device a sweep chooses: {m['chunk_per_device']} ({m['chosen_by']})",
        f"time shares at K={s['k']}: evaluation {s['evaluation_share']:.1%} "
        f"({1000 * s['evaluation_s']:.0f} ms each), saves and host "
        f"{s['checkpoint_and_host_share']:.1%}",
        f"sharded over {sh['devices']} device(s) vs one, {sh['models']} models: max |diff| "
        f"{sh['max_abs_diff']:.2e} ({sh['max_rel_diff']:.1e} of the tensor's scale), equal "
        f"to rounding {sh['equal_to_rounding']}, bit-equal "
        f"{sh['bit_equal']}",
        f"written: {os.path.join(out, 'accelerator.csv')}, accelerator.json",
    ]
    return lines
