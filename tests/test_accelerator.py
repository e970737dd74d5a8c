"""Chunk sizing by measurement (`sizing`) and the accelerator check
(`bench.accelerator`, `python -m experiments.bench --accelerator`): on CPU
with fake devices and tiny model counts."""

import json
import os
import subprocess
import sys

import jax
import pytest
from conftest import TINY, subprocess_env, tiny_config

from jaxmech import sizing

ROOT = os.path.join(os.path.dirname(__file__), "..")
TINY_FLAGS = [f"--{k}={v}" for k, v in TINY.items()]


def test_the_chunk_is_the_largest_power_of_two_that_fits():
    # the program's own footprints are read in the CLI test below (a compile each)
    fp = sizing.fit_footprint({8: 8e6 + 5e5, 4: 4e6 + 5e5})
    assert fp.per_model == pytest.approx(1e6) and fp.fixed == pytest.approx(5e5)
    memory = fp.bytes(300) / sizing.MEMORY_SHARE
    chunk = sizing.chunk_for_memory(fp, memory)
    assert chunk == 256 and fp.bytes(2 * chunk) > sizing.MEMORY_SHARE * memory
    assert sizing.chunk_for_memory(fp, 1.0) == 1  # nothing fits: one model, training says
    assert sizing.chunk_for_memory(fp, 1e30) == sizing.MAX_CHUNK_PER_DEVICE


def test_the_default_chunk_is_measured_on_accelerators_and_fixed_on_cpu(monkeypatch):
    from jaxmech.sweep import default_chunk_size

    assert default_chunk_size(tiny_config()) == sizing.CPU_CHUNK_PER_DEVICE * jax.device_count()
    fp = sizing.Footprint(per_model=2**20, fixed=0.0)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(sizing, "footprint", lambda config: fp)
    monkeypatch.setattr(sizing, "device_memory", lambda device=None: 2**30)
    chunk, how = sizing.chunk_per_device(tiny_config())
    assert chunk == 512 and how.startswith("measured")  # 50% of 1 GiB at 1 MiB per model
    monkeypatch.setattr(sizing, "device_memory", lambda device=None: None)
    chunk, how = sizing.chunk_per_device(tiny_config())  # a device that reports no memory
    assert chunk == sizing.FALLBACK_CHUNK_PER_DEVICE and how.startswith("fallback")


def test_entry_points_ask_for_one_cpu_device_per_core_unless_told(monkeypatch):
    assert 1 <= sizing.usable_cores() <= os.cpu_count()
    monkeypatch.delenv(sizing.CPU_DEVICES_ENV, raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_xnnpack=false")
    monkeypatch.setattr(sizing, "usable_cores", lambda: 6)
    assert sizing.cpu_devices() == 6
    monkeypatch.setattr(sizing, "usable_cores", lambda: 64)
    assert sizing.cpu_devices() == sizing.MAX_DEFAULT_CPU_DEVICES
    monkeypatch.setenv(sizing.CPU_DEVICES_ENV, " 3 ")
    assert sizing.cpu_devices() == 3
    for bad in ("0", "-2", "two", "1.5"):
        monkeypatch.setenv(sizing.CPU_DEVICES_ENV, bad)
        with pytest.raises(ValueError, match=f"JAXMECH_CPU_DEVICES='{bad}' is invalid"):
            sizing.cpu_devices()
    # a device count forced through XLA's own flag is left to XLA, whatever else is set
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert sizing.cpu_devices() is None


# slow: the accelerator's own check (a subprocess compiling three training segments, ~40 s); run where a GPU is lent and in the slow set; its flags' refusals stay in the suite
@pytest.mark.slow
def test_the_accelerator_check_runs_on_fake_devices(tmp_path):
    """~60 s: a subprocess on 2 fake devices (none of the parent's programs apply) that
    compiles the footprint's two programs and the check's three training segments."""
    out = str(tmp_path / "accel")
    env = subprocess_env(devices=2)
    cmd = [sys.executable, "-m", "experiments.bench", "--accelerator", "--accel_ks=2,100000000"]
    cmd += [f"--accel_out={out}", *TINY_FLAGS, "--steps=20", "--eval_every=10"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cpu x 2 device(s)" in proc.stdout
    with open(os.path.join(out, "accelerator.json")) as f:
        res = json.load(f)
    ok, skipped = res["rows"]
    assert ok["status"] == "ok" and ok["model_steps_per_s"] > 0 and ok["models_per_hour"] > 0
    assert skipped["status"] == "skipped"  # its predicted footprint exceeds the memory
    assert res["largest_k"] == 2 and res["sharding"]["devices"] == 2
    assert res["sharding"]["equal_to_rounding"]
    # the footprint read from the compiled programs (K = 4 and 8 on one device)
    assert res["memory"]["per_model_bytes"] > 0 and res["memory"]["fixed_bytes"] >= 0
    assert res["memory"]["chunk_per_device"] == 4  # CPU keeps its constant
    assert res["memory"]["chunk_per_device_if_measured"] >= 1
    for share in ("evaluation_share", "checkpoint_and_host_share"):
        assert 0.0 <= res["shares"][share] <= 1.0
    assert res["shares"]["evaluation_s"] > 0  # one evaluation timed alone
    with open(os.path.join(out, "accelerator.csv")) as f:
        assert f.readline().startswith("k,status,")


def test_bad_accelerator_flags_fail_before_any_compute(tmp_path):
    bad = (
        ("--accel_ks=2,x", "accel_ks"),
        ("--accel_ks=0", "accel_ks"),
        ("--preset=nope", "--preset"),
    )
    for flag, message in bad:
        cmd = [sys.executable, "-m", "experiments.bench", "--accelerator", flag]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def _scaling_configs():
    from jaxmech.bench.training import scaling_configs

    return scaling_configs(tiny_config(), widths=(8, 16), batches=(8,))


def test_the_scaling_configs_vary_width_and_batch_and_refuse_bad_ones():
    from jaxmech.bench.training import scaling_configs
    from jaxmech.config import ConfigError

    config = tiny_config()
    with pytest.raises(ValueError, match="scaling width 6"):
        scaling_configs(config, widths=(8, 6))
    with pytest.raises(ConfigError, match="batch_size"):
        scaling_configs(config, batches=(0,))
    assert [(c.model.d_model, c.model.d_head, c.train.batch_size) for c in _scaling_configs()] == [
        (8, 2, 16),
        (16, 4, 16),
        (16, 4, 8),
    ]


@pytest.mark.slow
def test_the_scaling_table_times_each_width_and_batch():
    """Slow (~35 s in the suite: three training programs compiled for a benchmark's
    table); the configs it times are tested in the suite above."""
    from jaxmech.bench.training import scaling_table

    configs = _scaling_configs()
    rows = scaling_table(configs, k=1, n_steps=1, repeats=1)
    assert [r["d_model"] for r in rows] == [8, 16, 16]
    assert rows[0]["flops"] < rows[1]["flops"] and rows[2]["flops"] < rows[1]["flops"]
    assert all(r["seconds"] > 0 for r in rows)
