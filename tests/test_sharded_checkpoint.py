"""A checkpoint over several devices (`jaxmech.load(folder, place="shard")`): on 4 fake
CPU devices each fixture's matrices are split (the largest axis 4 divides; vectors and
what 4 divides nowhere replicated: `models.hub._sharding`) and its logits equal the
one-device load's."""

import json
import os
import subprocess
import sys

import pytest
from conftest import subprocess_env

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
QUESTION = "Is the red circle to the left or the right of the blue square? Answer with one word."

# In a subprocess: JAX takes its device count when it starts. Prints one JSON line per
# checkpoint: the largest difference of the forward's logits and of the next-token
# log-probabilities between the two placements, and how the params were laid out.
SCRIPT = """
import json, sys
from jaxmech.cli import setup_runtime
setup_runtime()
import jax, numpy as np
import jaxmech
folder, image, question = sys.argv[1:]
one, shard = (jaxmech.load(folder, place=p) for p in ("one", "shard"))
encoded = one.encode([image], [question])
diff = lambda a, b: float(np.abs(np.asarray(a) - np.asarray(b)).max())
leaves = jax.tree_util.tree_leaves(shard.params)
split = [x for x in leaves if not x.sharding.is_fully_replicated]
print(json.dumps({
    "devices": jax.device_count(),
    "logits": diff(one.forward(encoded.inputs)[0], shard.forward(encoded.inputs)[0]),
    "logprobs": diff(one.next_token_logprobs(encoded), shard.next_token_logprobs(encoded)),
    "scale": float(np.abs(np.asarray(one.forward(encoded.inputs)[0])).max()),
    "one_device": all(len(x.sharding.device_set) == 1
                      for x in jax.tree_util.tree_leaves(one.params)),
    "split": len(split), "leaves": len(leaves),
    "split_matrices_only": all(x.ndim >= 2 for x in split),
    "shard_bytes": [int(x.addressable_shards[0].data.nbytes) for x in split],
    "bytes": [int(x.nbytes) for x in split],
}))
"""


def _sharded_vs_one(folder, image):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.path.join(FIXTURES, folder),
         os.path.join(FIXTURES, image), QUESTION],
        env=subprocess_env(devices=4), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check(got):
    assert got["devices"] == 4 and got["one_device"]
    assert got["split"] > got["leaves"] // 2 and got["split_matrices_only"], got
    assert all(s * 4 == b for s, b in zip(got["shard_bytes"], got["bytes"]))  # a quarter each
    # the same sums in another order: float32 rounding, not a different model
    assert got["logits"] <= 1e-5 * max(got["scale"], 1.0), got
    assert got["logprobs"] <= 1e-5, got


@pytest.mark.slow
@pytest.mark.parametrize(
    "folder, image",
    [
        ("qwen2_vl/qwen2_vl", "qwen2_vl/single0.png"),
        ("llava/llava", "llava/single0.png"),
        ("internvl/internvl", "internvl/tiled0.png"),
        ("qwen3_vl/qwen3_vl", "qwen3_vl/single0.png"),
    ],
)
def test_a_checkpoint_sharded_over_four_devices_equals_one_device(folder, image):
    """Slow (~15 s of CPU each, 30-60 s on a shared 2-core machine): a subprocess with its
    own JAX start, two loads and two compiles per family. In the suite,
    test_qwen2_vl_load's test_ask_sharded_over_two_devices covers the sharded placement."""
    _check(_sharded_vs_one(folder, image))
