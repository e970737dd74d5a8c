"""Asks a real VLM checkpoint one question about one image and prints the likeliest next
tokens: the first check that a checkpoint loaded right.

    python -m experiments.ask --checkpoint=DIR --image=FILE --question="Is the red circle
        to the left or the right of the blue square? Answer with one word."

DIR is a Hugging Face checkpoint folder (config.json, model.safetensors or a sharded
index, tokenizer.json, preprocessor_config.json), e.g. a download of
Qwen/Qwen2-VL-2B-Instruct; the prompt is the Qwen chat template (`families.qwen2_vl`).
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime

flags.DEFINE_string("checkpoint", None, "checkpoint folder (required)")
flags.DEFINE_string("image", None, "image file (required)")
flags.DEFINE_string("question", None, "the question (required)")
flags.DEFINE_integer("top", 10, "how many next tokens to print")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "the params' dtype")
flags.DEFINE_enum(
    "place", "auto", ["auto", "one", "shard"], "one device, sharded over all, or auto"
)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    for name in ("checkpoint", "image", "question"):
        if not getattr(FLAGS, name):
            raise app.UsageError(f"--{name} is required")
    if FLAGS.top < 1:
        raise app.UsageError(f"--top = {FLAGS.top}: expected at least 1")
    setup_runtime()
    import jax
    import jax.numpy as jnp

    from jaxmech.families import load_checkpoint
    from jaxmech.families.qwen2_vl import next_token, processor

    _, config, params = load_checkpoint(
        FLAGS.checkpoint, dtype=getattr(jnp, FLAGS.dtype), place=FLAGS.place
    )
    proc = processor.load_processor(FLAGS.checkpoint, config)
    encoded = processor.encode(proc, [FLAGS.image], [FLAGS.question])
    logprobs = next_token.next_token_logprobs(config, params, encoded)[0]
    t, h, w = encoded.grid
    leaves = jax.tree_util.tree_leaves(params)
    n_devices = max(len(x.sharding.device_set) for x in leaves)
    print(
        f"params: {sum(x.size for x in leaves) / 1e6:.2f} M in {FLAGS.dtype} on {n_devices} device(s)"
    )
    print(
        f"{config.variant}: image {h * proc.images.patch_size} x {w * proc.images.patch_size} px, "
        f"{t * h * w} patches, {encoded.inputs.image_BxI.shape[1]} image tokens, "
        f"{encoded.inputs.tokens_BxS.shape[1]} tokens"
    )
    print(f"{'rank':>4}  {'p':>8}  {'id':>7}  token")
    for rank, (text, i, p) in enumerate(
        next_token.top_tokens(proc.tokenizer, logprobs, FLAGS.top), 1
    ):
        print(f"{rank:>4}  {p:8.4f}  {i:>7}  {text!r}")


if __name__ == "__main__":
    run_main(main)
