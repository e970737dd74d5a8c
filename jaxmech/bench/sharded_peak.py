"""A checkpoint's memory per device, sharded over devices (`place="shard"`) against
one device (`place="one"`): the params' bytes each device holds (from the arrays'
shards), XLA's memory analysis of the compiled forward (one device's, as XLA
reports a sharded program), and the process's peak resident memory from the OS.

* `placement_bytes(params)`: the params' bytes in all, on each device, and what is
  replicated (every leaf not split: vectors, i.e. norms and biases, and matrices no
  axis of which the device count divides, `models.hub._sharding`; stacked blocks'
  vectors [L, D] where the leading block axis is never split), by leaf path. The
  leaves are read through `jax.tree_util`, so any params layout counts the same (a
  block per key or blocks stacked along a leading axis).
* `measure(folder, dtype, place, size, logits_out)`: in a process whose devices are set: the
  checkpoint loaded, its forward compiled and run once on one drawn `size` px scene and
  its question; `placement_bytes`, the compiled forward's memory analysis and the
  resident memory after the load and at the end.
* `sharded_peak(folder, dtype, devices, size, out)`: `measure` in two processes, one
  CPU device with `place="one"`, `devices` fake CPU devices with `place="shard"`
  (`--xla_force_host_platform_device_count`), each under `memory.peak_run`.

Fake CPU devices are one process's memory: its peak resident memory is the sum over
the devices, not one device's peak; the per-device figures are the shards' bytes and
XLA's analysis. Run as `python -m jaxmech.bench.sharded_peak FOLDER DTYPE PLACE SIZE
LOGITS (`measure`, one `RESULT {json}` line).
"""

from __future__ import annotations

import json
import os
import re
import sys

from jaxmech.bench.real_size import _result  # a child's `RESULT {json}` line
from jaxmech.memory import peak_run

GIB = 2**30
_COUNT_FLAG = "--xla_force_host_platform_device_count"


def placement_bytes(params) -> dict:
    """How `params` lie on the devices: "total" bytes, "per_device" [bytes of each
    device's shards] (devices in id order), "leaves", "split" (leaves split over the
    devices) and "replicated": {"vectors": (count, bytes), "matrices": (count, bytes)
    of the leaves of 2+ axes, "matrix_shapes": {their path: shape}} (bytes of one copy;
    each device holds one)."""
    import jax
    import numpy as np

    per: dict = {}
    total, split = 0, 0
    vectors, matrices, shapes = [0, 0], [0, 0], {}
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        total += x.nbytes
        for s in x.addressable_shards:
            per[s.device.id] = per.get(s.device.id, 0) + int(np.prod(s.data.shape)) * x.itemsize
        if len(x.sharding.device_set) > 1 and not x.sharding.is_fully_replicated:
            split += 1
            continue
        if len(x.sharding.device_set) == 1:
            continue  # one device: nothing is replicated
        part = vectors if x.ndim < 2 else matrices
        part[0], part[1] = part[0] + 1, part[1] + x.nbytes
        if x.ndim >= 2:
            shapes[jax.tree_util.keystr(path)] = list(x.shape)
    return {"total": int(total), "per_device": [int(per[d]) for d in sorted(per)],
            "leaves": len(jax.tree_util.tree_leaves(params)), "split": split,
            "replicated": {"vectors": tuple(vectors), "matrices": tuple(matrices),
                           "matrix_shapes": shapes}}  # fmt: skip


def _analysis(compiled) -> dict:
    m = compiled.memory_analysis()
    names = ("argument", "output", "temp", "alias", "generated_code")
    return {n: int(getattr(m, f"{n}_size_in_bytes")) for n in names}


def measure(folder: str, dtype: str, place: str, size: int, logits_out: str) -> dict:
    """The checkpoint `folder` loaded in `dtype` with `place` on this process's devices,
    its forward compiled and run once on one drawn `size` px scene (module docstring);
    the last position's logits [V] written to `logits_out` (.npy, float32)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxmech.data.inputs import pictures
    from jaxmech.data.spec import Grid, pair_questions
    from jaxmech.memory import compiled_bytes, held_bytes, peak_bytes, release_freed
    from jaxmech.model import load

    model = load(folder, dtype=getattr(jnp, dtype), place=place)
    release_freed()  # the tensors' host copies
    after_load = {"held": held_bytes(), "peak": peak_bytes()}
    grid = Grid(4, 4)
    spec = pair_questions(grid, 1, len(pictures.SHAPES), len(pictures.COLOURS))["examples"]
    enc = model.encode([pictures.draw(grid, spec, size)[0]], [pictures.questions(spec)[0]])
    fwd = jax.jit(lambda p, x: model.family.forward(p, x, config=model.config)[0][:, -1])
    compiled = fwd.lower(model.params, enc.inputs).compile()
    np.save(logits_out, np.asarray(compiled(model.params, enc.inputs), np.float32)[0])
    return {"place": place, "dtype": dtype, "devices": jax.device_count(), "size": size,
            "tokens": int(enc.inputs.tokens_BxS.shape[1]),
            "params": placement_bytes(model.params),
            "xla": _analysis(compiled) | {"total": compiled_bytes(compiled)},
            "after_load": after_load,
            "end": {"held": held_bytes(), "peak": peak_bytes()}}  # fmt: skip


def _env(devices: int) -> dict:
    """This environment with `devices` CPU devices and no compilation cache (a 2B
    forward's executable is not worth keeping)."""
    flags = re.sub(_COUNT_FLAG + r"=\S+", "", os.environ.get("XLA_FLAGS", "")).strip()
    return os.environ | {"XLA_FLAGS": f"{flags} {_COUNT_FLAG}={devices}".strip(),
                         "JAX_PLATFORMS": "cpu", "JAXMECH_CACHE_DIR": ""}  # fmt: skip


def sharded_peak(folder: str, dtype: str = "bfloat16", devices: int = 4, size: int = 448,
                 out: str = "runs/sharded_peak", log=print) -> list[dict]:  # fmt: skip
    """`measure` on checkpoint `folder` in two processes (module docstring): one CPU
    device with place="one", then `devices` fake CPU devices with place="shard"; one
    row each with the process's OS peak resident bytes ("os_peak"), its exit code and
    log file, the sharded row with "logits_diff": the largest difference of its last
    logits from the one-device run's. ValueError for `devices` < 2."""
    if devices < 2:
        raise ValueError(f"devices = {devices}: a sharded load needs at least 2")
    os.makedirs(out, exist_ok=True)
    import numpy as np

    rows, logits = [], []
    for place, n in (("one", 1), ("shard", devices)):
        logits.append(os.path.join(out, f"logits_{place}.npy"))
        cmd = [sys.executable, "-m", "jaxmech.bench.sharded_peak", folder, dtype, place,
               str(size), logits[-1]]  # fmt: skip
        log_path = os.path.join(out, f"{place}_{n}.log")
        log(f"  {place} on {n} CPU device(s): {' '.join(cmd[1:])}")
        code, _, peak_gb, text = peak_run(cmd, log_path, env=_env(n))
        row = _result(text) | {"exit": code, "os_peak": peak_gb * GIB, "log": log_path}
        if code:
            log("    " + "\n    ".join(text.strip().splitlines()[-5:]))
        rows.append(row)
    if not any(r["exit"] for r in rows):
        rows[1]["logits_diff"] = float(np.abs(np.load(logits[0]) - np.load(logits[1])).max())
    with open(os.path.join(out, "sharded_peak.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return rows


def table(rows: list[dict]) -> list[str]:
    """The lines `experiments.bench --sharded_peak` prints for `sharded_peak`'s rows."""
    gb = lambda b: f"{b / GIB:.3f}"  # noqa: E731
    lines = [f"{'place':>6} {'devices':>7} {'params GB':>9} {'per device GB (shards)':>28} "
             f"{'XLA args/temp/out GB':>22} {'XLA total GB':>12} {'OS peak GB':>10}"]  # fmt: skip
    for r in rows:
        if r.get("exit"):
            lines.append(f"{'?':>6} exit {r['exit']}: see {r['log']}")
            continue
        p, x = r["params"], r["xla"]
        per = ", ".join(gb(b) for b in p["per_device"])
        lines.append(f"{r['place']:>6} {r['devices']:>7} {gb(p['total']):>9} {per:>28} "
                     f"{gb(x['argument']) + '/' + gb(x['temp']) + '/' + gb(x['output']):>22} "
                     f"{gb(x['total']):>12} {gb(r['os_peak']):>10}")  # fmt: skip
    for r in rows:
        if r.get("exit") or r["devices"] == 1:
            continue
        rep, p = r["params"]["replicated"], r["params"]
        lines.append(
            f"sharded over {r['devices']}: {p['split']} of {p['leaves']} leaves split; "
            f"replicated on every device: {rep['vectors'][0]} vectors (norms, biases) "
            f"{rep['vectors'][1] / 2**20:.2f} MiB, {rep['matrices'][0]} arrays of 2+ axes "
            f"(blocks' stacked vectors, or no axis of which {r['devices']} divides) "
            f"{rep['matrices'][1] / 2**20:.2f} MiB {rep['matrix_shapes'] or ''}; last "
            f"logits max |diff| from one device {r.get('logits_diff', float('nan')):.2e}; "
            f"the OS peak is the {r['devices']} "
            "fake devices' sum (one process's memory)"
        )
    return lines


def main(argv) -> None:
    folder, dtype, place, size, logits_out = argv
    print("RESULT " + json.dumps(measure(folder, dtype, place, int(size), logits_out)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
