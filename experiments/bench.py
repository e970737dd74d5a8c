"""Training throughput: model-steps/s alone and vmapped, against the matmul rate.

    python -m experiments.bench                # K = 1, 4, 16, 64
    python -m experiments.bench --ks=1,16 --timed_steps=50

Everything is measured in this one run; the report prints ratios between them.
"""

from absl import app, flags

from jaxmech.benchmark import (
    dense_step_flops,
    matmul_rate,
    model_steps_per_second,
    step_flops_xla,
)
from jaxmech.cli import define_config_flags, setup_runtime, specs_from_flags
from jaxmech.config import Config, ConfigError
from jaxmech.sweep import coerce

flags.DEFINE_string("ks", "1,4,16,64", "numbers of vmapped models to measure")
flags.DEFINE_integer("timed_steps", 100, "training steps per timed call")
define_config_flags(sweep=False)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    setup_runtime()
    try:
        config = Config().replace(**{n: coerce(n, v) for n, v in specs_from_flags(FLAGS).items()})
        ks = [int(k) for k in FLAGS.ks.split(",")]
    except (ConfigError, ValueError) as e:
        raise app.UsageError(str(e)) from None
    import jax

    print(f"backend: {jax.default_backend()} x {jax.device_count()} device(s)")
    rate = matmul_rate()
    dense = dense_step_flops(config, readout_only=True)
    dense_full = dense_step_flops(config, readout_only=False)
    xla = step_flops_xla(config)
    print(f"f32 matmul rate (2048^3, best of 10): {rate / 1e9:.1f} GFLOP/s")
    print(
        f"FLOPs per training step (batch {config.train.batch_size}): dense full attention "
        f"{dense_full / 1e9:.3f} G, dense readout-only {dense / 1e9:.3f} G, "
        f"executed (XLA count) {xla / 1e9 if xla else float('nan'):.3f} G"
    )
    base = None
    print(
        f"{'K':>4} {'model-steps/s':>14} {'ms/model-step':>14} {'vs K=1':>8} "
        f"{'dense GFLOP/s':>14} {'dense/matmul':>12} {'exec/matmul':>12}"
    )
    for k in ks:
        sps = model_steps_per_second(config, k, FLAGS.timed_steps)
        base = base or sps
        print(
            f"{k:>4} {sps:>14.1f} {1000 / sps:>14.2f} {sps / base:>8.2f} "
            f"{sps * dense / 1e9:>14.1f} {sps * dense / rate:>12.2f} "
            f"{(sps * xla / rate if xla else float('nan')):>12.2f}"
        )


if __name__ == "__main__":
    app.run(main)
