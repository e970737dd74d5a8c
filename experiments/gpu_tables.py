"""Paper 003's patching table at a real model's size with random weights, for a GPU: no
download needed. The model: a checkpoint family's "real" stand-in (`--family`; for
Qwen2-VL, Qwen2-VL-2B-Instruct's architecture). Prints the table's time and memory, and the loop's rate
on a few images for the ratio.

    python -m experiments.gpu_tables                      # 64 images, layers 6-16, bf16
    python -m experiments.gpu_tables --images=128 --batch=32 --layers=0:27

The table: the given LM layers x 4 token groups (image, question, objects, last) x the
images, 448 x 448 pictures (256 image tokens) of a 4 x 4 grid, mirror twin; `batch`
images per compiled call (`jaxmech.bench.patch_speed`). Memory: the compiled chunk's
temporaries (XLA's memory analysis) and the device's peak use.
"""

from absl import app, flags

from jaxmech.cli import parse_layers, run_main, setup_runtime

flags.DEFINE_integer("images", 64, "images in the table")
flags.DEFINE_integer("batch", 16, "images per compiled call")
flags.DEFINE_string(
    "layers",
    "6:16",
    "LM layers patched, both ends included (the authors' "
    "range for the 2B; layer L: the residual after L blocks)",
)
flags.DEFINE_integer("loop_images", 1, "images the one-forward-per-cell loop is timed on")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16"], "the params' dtype")
flags.DEFINE_string("family", None, "checkpoint family (default: the first with stand-ins)")
FLAGS = flags.FLAGS


def main(argv):
    del argv
    try:
        layers = parse_layers(FLAGS.layers)
        if FLAGS.images < 1 or FLAGS.batch < 1 or FLAGS.loop_images < 0:
            raise ValueError("--images and --batch must be at least 1, --loop_images 0 or more")
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    setup_runtime()
    import jax
    import jax.numpy as jnp

    from jaxmech.bench.patch_speed import patch_table_speed, real_layers

    try:
        real, n_layers = real_layers(FLAGS.family)
        if layers is not None and (min(layers) < 0 or max(layers) >= n_layers):
            raise ValueError(f"--layers = {FLAGS.layers!r}: {real} has LM layers 0..{n_layers - 1}")
    except ValueError as e:
        raise app.UsageError(str(e)) from None

    print(f"backend: {jax.default_backend()} x {jax.device_count()}: {jax.devices()[0]}")
    r = patch_table_speed(FLAGS.images, FLAGS.loop_images, 3, "real", getattr(jnp, FLAGS.dtype),
                          FLAGS.batch, layers, FLAGS.family)  # fmt: skip
    gib = 2.0**30
    print(
        f"{real} layout, random {FLAGS.dtype} weights: {r['cells']} cells ({r['layers']} "
        f"layers x 4 groups x {FLAGS.images} images), {r['tokens']} tokens "
        f"({r['image_tokens']} image), {FLAGS.batch} images per call"
    )
    print(f"  batched: {r['batched_s']:.1f} s ({r['batched_cells_per_s']:.1f} cells/s), "
          f"first call {r['first_call_s']:.1f} s (compile included)")  # fmt: skip
    print(f"  memory: chunk temporaries {r['temp_bytes'] / gib:.2f} GiB, arguments "
          f"{r['argument_bytes'] / gib:.2f} GiB, device peak {r['peak_bytes'] / gib:.2f} GiB")  # fmt: skip
    if "ratio" in r:
        print(f"  loop: {r['loop_cells_per_s']:.1f} cells/s over {r['loop_cells']} cells; "
              f"batched / loop {r['ratio']:.1f}x; max |log p diff| {r['max_abs_diff']:.1e}")  # fmt: skip


if __name__ == "__main__":
    run_main(main)
