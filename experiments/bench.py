"""Training throughput: model-steps/s alone and vmapped, against the matmul rate.

Each K runs on one device, and split over every device where it divides (on CPU an
entry point has one device per core: `jaxmech.sizing.cpu_devices`).

    python -m experiments.bench                # K = 1, 4, 16, 64
    python -m experiments.bench --preset=vlm --ks=1,2 --timed_steps=50   # 2 cores: 1 vs 2 devices
    python -m experiments.bench --ks=1,16 --timed_steps=50
    python -m experiments.bench --ks= --sweep_models=8   # sweep-level models/hour
    python -m experiments.bench --ks= --ablation_models=64   # one ablation-table call
    python -m experiments.bench --accelerator  # GPU/TPU: K = 64..4096, memory, chunk
    python -m experiments.bench --preset=vlm --ks=1,4,8 --timed_steps=50   # the toy VLM
    python -m experiments.bench --preset=vlm --ks= --breakdown   # where one step's time goes
    python -m experiments.bench --preset=vlm --ks= --profile     # ... op by op (jax.profiler)
    python -m experiments.bench --preset=vlm --ks= --scaling_widths=32,64,128,256 \
        --scaling_batches=32,128,512   # the step's share of the matmul rate vs width, batch
    python -m experiments.bench --vlm_tables   # paper 003's patching table, random checkpoint
    python -m experiments.bench --real_size    # every report on Qwen2-VL-2B's stand-in
    python -m experiments.bench --real_size --reference \
        --reference_python=/path/to/venv/bin/python   # its forward against transformers'
    python -m experiments.bench --sharded_peak   # the stand-in's bytes per device, sharded
        # over 4 fake CPU devices (bfloat16: --real_dtype) against one device

Everything is measured in this one run; the report prints ratios between them.
"""

from absl import app, flags

from jaxmech.bench.training import (
    ablation_table_time,
    dense_step_flops,
    model_steps_per_second,
    scaling_configs,
    scaling_table,
    step_breakdown,
    step_flops_xla,
    step_profile,
    sweep_throughput,
)
from jaxmech.cli import define_config_flags, run_main, setup_runtime, specs_from_flags
from jaxmech.config import ConfigError
from jaxmech.presets import preset_config
from jaxmech.sizing import matmul_rate
from jaxmech.sweep import coerce

flags.DEFINE_string("ks", "1,4,16,64", "numbers of vmapped models to measure")
flags.DEFINE_string("preset", None, "a named base config (jaxmech.presets; flags override it)")
flags.DEFINE_integer("timed_steps", 100, "training steps per timed call")
flags.DEFINE_bool(
    "breakdown", False, "time one model's step and its parts (batch, forward, backward)"
)
flags.DEFINE_bool("profile", False, "profile one model's gradient step op by op (jax.profiler)")
flags.DEFINE_string(
    "scaling_widths", "", "also time the step at these d_model (d_head, d_mlp scaled with it)"
)
flags.DEFINE_string("scaling_batches", "", "also time the step at these batch sizes")
flags.DEFINE_integer("sweep_models", 0, "also train this many models as a sweep (models/hour)")
flags.DEFINE_integer("chunk_size", None, "models per compiled call in the sweep measurement")
flags.DEFINE_integer(
    "ablation_models", 0, "also time one ablation-table call over this many models"
)
flags.DEFINE_bool(
    "accelerator",
    False,
    "run the accelerator check instead (jaxmech.bench.accelerator): models/hour for "
    "--accel_ks in one sharded program, memory per model, the chunk a sweep would choose, "
    "time shares, sharded vs unsharded",
)
flags.DEFINE_string("accel_ks", "64,256,1024,4096", "models per program in the accelerator check")
flags.DEFINE_integer("accel_segments", 2, "evaluation segments timed per K (accelerator check)")
flags.DEFINE_string("accel_out", "runs/accelerator", "folder of accelerator.csv / .json")
flags.DEFINE_bool(
    "vlm_tables",
    False,
    "time paper 003's patching table on a checkpoint family's random stand-in (--family), "
    "batched against the one-forward-per-condition loop (jaxmech.bench.patch_speed)",
)
flags.DEFINE_bool(
    "real_size",
    False,
    "write a random checkpoint of a real model's size and layout (--family's stand-in; "
    "Qwen2-VL-2B: bf16, 4.4 GB; --real_dir) and run experiments.ask and every checkpoint "
    "report on it, each in its own process: peak resident memory, wall time, the plan "
    "(jaxmech.bench.real_size)",
)
flags.DEFINE_string(
    "family", None, "checkpoint family of --vlm_tables / --real_size (default: the first "
    "registered one with random stand-ins)"
)  # fmt: skip
flags.DEFINE_string(
    "real_dir", None, "where --real_size's checkpoint is (default runs/real_size/FAMILY)"
)
flags.DEFINE_string("real_dtype", "bfloat16", "the dtype --real_size loads its checkpoint in")
flags.DEFINE_bool(
    "sharded_peak", False, "the --real_size stand-in (written once) loaded sharded over "
    "--sharded_devices fake CPU devices and on one device, each in its own process: bytes "
    "per device of its params and of its compiled forward, peak resident memory "
    "(jaxmech.bench.sharded_peak)"
)  # fmt: skip
flags.DEFINE_integer("sharded_devices", 4, "--sharded_peak: the fake CPU devices sharded over")
flags.DEFINE_integer("sharded_size", 448, "--sharded_peak: the forward's picture side in pixels")
flags.DEFINE_bool(
    "reference", False, "with --real_size: instead of the reports, time jaxmech's forward "
    "and the reference's (transformers, sdpa) on the same folder, float32 and bfloat16, "
    "each in its own process (jaxmech.bench.real_size.against_reference)"
)  # fmt: skip
flags.DEFINE_string(
    "reference_python", None, "the python that runs the reference (torch and transformers: "
    "the `fixtures` extra); default this one, if it has them"
)  # fmt: skip
flags.DEFINE_string("reference_dtypes", "float32,bfloat16", "--reference: the dtypes timed")
flags.DEFINE_integer("reference_repeats", 3, "--reference: calls timed after the first")
flags.DEFINE_integer("reference_size", 448, "--reference: the picture's side in pixels")
flags.DEFINE_string("reference_out", None, "--reference: where the logs and "
                    "reference.csv go (default runs/real_size/reference)")  # fmt: skip
flags.DEFINE_integer("table_images", 64, "images of the --vlm_tables patching table")
flags.DEFINE_integer("loop_images", 4, "images the --vlm_tables loop is timed on")
define_config_flags(sweep=False)
FLAGS = flags.FLAGS


def _reference_options() -> str:
    """--reference's flags checked (ValueError naming the flag): the python that runs
    the reference (`real_size.reference_python`)."""
    from jaxmech.bench.real_size import reference_python, reference_script

    if not FLAGS.real_size:
        raise ValueError("--reference times a checkpoint's forward: give it with --real_size")
    script = reference_script(FLAGS.family)  # the family's own, else refused by name
    dtypes = [d.strip() for d in FLAGS.reference_dtypes.split(",") if d.strip()]
    if not dtypes or set(dtypes) - {"float32", "bfloat16"}:
        raise ValueError(f"--reference_dtypes = {FLAGS.reference_dtypes!r}: expected "
                         "float32 and / or bfloat16, comma-separated")  # fmt: skip
    if FLAGS.reference_repeats < 1 or FLAGS.reference_size < 28:
        raise ValueError("--reference_repeats must be >= 1 and --reference_size >= 28")
    return reference_python(FLAGS.reference_python, script)


def _int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(k) for k in text.split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"--{name} = {text!r}: expected comma-separated integers") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--{name} = {text!r}: every model count must be >= 1")
    return values


def accelerator(config, ks):
    """The accelerator check: one table printed and written as CSV (+ JSON details)."""
    import jax

    from jaxmech.bench.accelerator import accelerator_check, write_check

    print(f"backend: {jax.default_backend()} x {jax.device_count()} device(s): {jax.devices()}")
    res = accelerator_check(config, ks, FLAGS.accel_segments)
    for line in write_check(res, FLAGS.accel_out):
        print(line)


def vlm_tables():
    """The batched patching table against the loop, one table printed."""
    import jax

    from jaxmech.bench.patch_speed import patch_table_speed

    print(f"backend: {jax.default_backend()} x {jax.device_count()} device(s)")
    r = patch_table_speed(FLAGS.table_images, FLAGS.loop_images, family=FLAGS.family)
    print(
        f"patching table: {r['cells']} cells ({r['layers']} LM layers x 4 token groups x "
        f"{FLAGS.table_images} images), {r['tokens']} tokens ({r['image_tokens']} image)"
    )
    print(f"{'(medians)':>28} {'cells/s':>9} {'s':>8}")
    print(
        f"{'batched (one call, median)':>28} {r['batched_cells_per_s']:>9.1f} {r['batched_s']:>8.1f}"
    )
    print(f"{'first call (compile incl.)':>28} {'':>9} {r['first_call_s']:>8.1f}")
    print(f"{'loop, ' + str(r['loop_cells']) + ' cells':>28} {r['loop_cells_per_s']:>9.1f}")
    turns = ", ".join(f"{x:.1f}" for x in r["ratios"])
    print(
        f"batched / loop: {r['ratio']:.1f}x (median of turns {turns}); max |log p "
        f"difference| {r['max_abs_diff']:.1e}"
    )


def print_scaling(configs, rate: float) -> None:
    """The step's share of the matmul rate as the width or the batch changes."""
    k, repeats = 4, 3
    print(
        f"the training step by width and batch ({k} vmapped models, one device, medians of {repeats}):"
    )
    print(
        f"{'d_model':>8} {'batch':>6} {'GFLOP':>8} {'ms/model-step':>14} {'us/row':>7} {'exec/matmul':>12}"
    )
    for r in scaling_table(configs, k=k, repeats=repeats):
        flops, sec = r["flops"] or float("nan"), r["seconds"]
        print(
            f"{r['d_model']:>8} {r['batch_size']:>6} {flops / 1e9:>8.3f} {1e3 * sec:>14.2f} "
            f"{1e6 * sec / r['batch_size']:>7.1f} {flops / sec / rate:>12.2f}"
        )


def real_size(python=None):
    """The --real_size check: the stand-in written (once), every command run on it, or
    with --reference its forward against the reference's (`python` runs that)."""
    import csv
    import os

    from jaxmech.bench.real_size import reference_script, run_reports, write_stand_in
    from jaxmech.families.registry import stand_in_family

    name = stand_in_family(FLAGS.family).name
    folder = FLAGS.real_dir or os.path.join("runs", "real_size", name)
    if FLAGS.reference and os.path.exists(os.path.join(folder, "config.json")):
        return against_reference(folder, python, reference_script(name))  # as it is
    folder, real = write_stand_in(folder, name)
    if FLAGS.reference:
        return against_reference(folder, python, reference_script(name))
    print(f"stand-in checkpoint: {folder} (random bf16 weights, {real}'s layout)")
    out = os.path.join(os.path.dirname(os.path.normpath(folder)), f"reports_{FLAGS.real_dtype}")
    rows = run_reports(folder, out, FLAGS.real_dtype)
    print(
        f"\n{'command':>16} {'exit':>4} {'wall s':>7} {'peak GB':>8} {'plan GB':>8} {'plan/peak':>9}"
    )
    for r in rows:
        print(f"{r['command']:>16} {r['exit']:>4} {r['wall_s']:>7.0f} {r['peak_gb']:>8.2f} "
              f"{r['plan_gb']:>8.2f} {r['plan_gb'] / r['peak_gb']:>9.2f}")  # fmt: skip
    with open(os.path.join(out, "real_size.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"results: {os.path.join(out, 'real_size.csv')}")


def sharded_peak() -> None:
    """--sharded_peak: the stand-in written (once), measured sharded and on one device."""
    import os

    from jaxmech.bench.real_size import write_stand_in
    from jaxmech.bench.sharded_peak import sharded_peak as measure
    from jaxmech.bench.sharded_peak import table
    from jaxmech.families.registry import stand_in_family

    name = stand_in_family(FLAGS.family).name
    folder, real = write_stand_in(FLAGS.real_dir or os.path.join("runs", "real_size", name), name)
    out = os.path.join(os.path.dirname(os.path.normpath(folder)), "sharded_peak")
    print(f"stand-in checkpoint: {folder} (random weights, {real}'s layout), {FLAGS.real_dtype}")
    rows = measure(folder, FLAGS.real_dtype, FLAGS.sharded_devices, FLAGS.sharded_size, out)
    print("\n".join(table(rows)))
    print(f"results: {os.path.join(out, 'sharded_peak.json')}")


def against_reference(folder: str, python: str, script: str) -> None:
    """--real_size --reference: one row per dtype printed and written as reference.csv
    (`script`: the family's reference forward)."""
    import csv
    import os

    from jaxmech.bench.real_size import against_reference as run

    out = FLAGS.reference_out or os.path.join("runs", "real_size", "reference")
    print(f"jaxmech's forward against the reference's on {folder}; reference python {python}")
    dtypes = [d.strip() for d in FLAGS.reference_dtypes.split(",") if d.strip()]
    rows = run(
        folder, python, out, dtypes, FLAGS.reference_repeats, FLAGS.reference_size, script=script
    )
    print(f"\n{rows[0]['tokens']} tokens; seconds: first call (compile / warm-up included), "
          f"median of {FLAGS.reference_repeats} after it; torch {rows[0]['threads']} threads")  # fmt: skip
    print(f"{'dtype':>9} {'side':>9} {'first s':>8} {'median s':>9} {'peak GB':>8}")
    for r in rows:
        for side in ("jaxmech", "reference"):
            print(f"{r['dtype']:>9} {side:>9} {r[side + '_first_s']:>8.3g} "
                  f"{r[side + '_median_s']:>9.3g} {r[side + '_peak_gb']:>8.2f}")  # fmt: skip
        print(f"{r['dtype']:>9} jaxmech / reference: {r['ratio']:.2f}x; max |log p difference| "
              f"at the last row {r['max_logp_diff']:.2e}, top 5 "
              f"{'the same' if r['top5_same'] else 'different'}; {r['products']}")  # fmt: skip
    with open(os.path.join(out, "reference.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"results: {os.path.join(out, 'reference.csv')}")


def main(argv):
    del argv
    setup_runtime()
    try:
        base = preset_config(FLAGS.preset)
        config = base.replace(**{n: coerce(n, v) for n, v in specs_from_flags(FLAGS).items()})
        ks = _int_list("ks", FLAGS.ks)
        accel_ks = _int_list("accel_ks", FLAGS.accel_ks)
        widths = _int_list("scaling_widths", FLAGS.scaling_widths)
        batches = _int_list("scaling_batches", FLAGS.scaling_batches)
        scaling = scaling_configs(config, widths, batches)  # bad values fail before timing
        if FLAGS.accelerator and not accel_ks:
            raise ValueError("--accel_ks is empty: give model counts, e.g. 64,256")
        if FLAGS.vlm_tables or FLAGS.real_size or FLAGS.sharded_peak:
            from jaxmech.families.registry import stand_in_family

            stand_in_family(FLAGS.family)  # an unknown --family fails here
        if FLAGS.vlm_tables and min(FLAGS.table_images, FLAGS.loop_images) < 1:
            raise ValueError("--table_images and --loop_images must be at least 1")
        if FLAGS.sharded_peak and (FLAGS.sharded_devices < 2 or FLAGS.sharded_size < 28):
            raise ValueError("--sharded_devices must be >= 2 and --sharded_size >= 28")
        if FLAGS.accel_segments < 1:
            raise ValueError(f"--accel_segments = {FLAGS.accel_segments}: expected >= 1")
        python = _reference_options() if FLAGS.reference else None
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    import jax

    if FLAGS.accelerator:
        return accelerator(config, accel_ks)
    if FLAGS.vlm_tables:
        return vlm_tables()
    if FLAGS.real_size:
        return real_size(python)
    if FLAGS.sharded_peak:
        return sharded_peak()

    print(f"backend: {jax.default_backend()} x {jax.device_count()} device(s)")
    rate = matmul_rate()
    # the textbook dense count is the dual encoder's; other families: XLA's count only
    dual = config.model.model_kind == "dual_encoder"
    dense = dense_step_flops(config, readout_only=True) if dual else float("nan")
    dense_full = dense_step_flops(config, readout_only=False) if dual else float("nan")
    xla = step_flops_xla(config)
    print(f"f32 matmul rate (2048^3, best of 10): {rate / 1e9:.1f} GFLOP/s")
    print(
        f"FLOPs per training step of one model (batch {config.train.batch_size}): dense "
        f"full attention {dense_full / 1e9:.3f} G, dense readout-only {dense / 1e9:.3f} G, "
        f"executed (XLA count) {xla / 1e9 if xla else float('nan'):.3f} G"
    )
    base = None
    print(
        f"{'K':>4} {'devices':>7} {'model-steps/s':>14} {'ms/model-step':>14} {'vs first':>8} "
        f"{'dense GFLOP/s':>14} {'dense/matmul':>12} {'exec/matmul':>12}"
    )
    n_dev = jax.device_count()
    # each K on one device, and split over every device where it divides (a sweep's way)
    rows = [(k, d) for k in ks for d in sorted({1, n_dev}) if k % d == 0]
    for k, d in rows:
        sps = model_steps_per_second(config, k, FLAGS.timed_steps, devices=d)
        base = base or sps
        print(
            f"{k:>4} {d:>7} {sps:>14.1f} {1000 / sps:>14.2f} {sps / base:>8.2f} "
            f"{sps * dense / 1e9:>14.1f} {sps * dense / rate:>12.2f} "
            f"{(sps * xla / rate if xla else float('nan')):>12.2f}"
        )

    if FLAGS.breakdown:
        parts = step_breakdown(config, FLAGS.timed_steps)
        total = parts["step"]
        print(
            "one model's training step, by part (best of 3, ms per step; each part includes the ones before it):"
        )
        for name, sec in parts.items():
            print(f"  {name:>9} {1000 * sec:8.2f} ms  {sec / total:6.1%} of the step")

    if FLAGS.profile:
        prof = step_profile(config)
        total = sum(t for _, t, _ in prof["by_kind"])
        print(f"one model's value-and-gradient step by XLA op ({total:.2f} ms of ops per step):")
        for kind, t, n in prof["by_kind"][:12]:
            print(f"  {kind:<28} {t:7.3f} ms  {t / total:6.1%}  {n:6.0f} ops per step")
        print("the longest ops (ms per step; the compiled HLO):")
        for name, t, line in prof["top"]:
            print(f"  {t:6.3f}  {line[:200] or name}")

    if scaling:
        print_scaling(scaling, rate)

    if FLAGS.sweep_models:
        sw = sweep_throughput(config, FLAGS.sweep_models, FLAGS.chunk_size)
        sps = sw["model_steps_per_s"]
        print(
            f"sweep of {FLAGS.sweep_models} models x {config.train.steps} steps (evaluation, "
            f"saves and compile included): {sw['wall_s']:.0f} s, "
            f"{sw['models_per_hour']:.0f} models/hour, {sps:.1f} model-steps/s, "
            f"dense {sps * dense / rate:.2f} / executed "
            f"{(sps * xla / rate if xla else float('nan')):.2f} of the matmul rate"
        )

    if FLAGS.ablation_models:
        at = ablation_table_time(config, FLAGS.ablation_models)
        print(
            f"ablation table, {FLAGS.ablation_models} models x {at['evaluations'] // FLAGS.ablation_models} "
            f"ablations x 4 validation sets in one compiled call: {at['first_s']:.1f} s "
            f"(compile included), {at['second_s']:.1f} s (second call)"
        )


if __name__ == "__main__":
    run_main(main)
