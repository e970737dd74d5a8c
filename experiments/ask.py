"""Asks a real VLM checkpoint one question about one image and prints the likeliest next
tokens: the first check that a checkpoint loaded right.

    python -m experiments.ask --checkpoint=Qwen/Qwen2-VL-2B-Instruct --image=FILE
        --question="Is the red circle to the left or the right of the blue square?
        Answer with one word."

--checkpoint is a Hugging Face checkpoint folder (config.json, model.safetensors or a
sharded index, tokenizer.json, preprocessor_config.json) of a family jaxmech reads, or,
where no such folder exists, a Hub name ORG/NAME[@REVISION] resolved through the Hugging
Face cache (only the files jaxmech reads are fetched; HF_HUB_OFFLINE=1: the cached
snapshot or an error naming what is missing) (`jaxmech.load`); the prompt is that
family's chat template, as its reference feeds it. Weights that alone exceed the memory
budget (`--memory`: GB, a fraction or a percent; default as the reports') are refused
before any is read, naming the flags that would make them fit.
"""

from absl import app, flags

from jaxmech.cli import run_main, setup_runtime

flags.DEFINE_string(
    "checkpoint", None, "checkpoint folder, or Hub name ORG/NAME[@REVISION] (required)"
)
flags.DEFINE_string("image", None, "image file (required)")
flags.DEFINE_string("question", None, "the question (required)")
flags.DEFINE_integer("top", 10, "how many next tokens to print")
flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16", "float16"], "the params' dtype")
flags.DEFINE_enum(
    "place", "auto", ["auto", "one", "shard"], "one device, sharded over all, or auto"
)
flags.DEFINE_string("memory", None, "memory budget: GB, a fraction or a percent (default: 40%)")
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

    import jaxmech
    from jaxmech.hub_names import checkpoint_folder
    from jaxmech.memory import memory_budget
    from jaxmech.models.precision import describe

    budget = memory_budget(FLAGS.memory)
    folder = checkpoint_folder(FLAGS.checkpoint)  # a Hub name: its cached snapshot
    model = jaxmech.load(folder, dtype=getattr(jnp, FLAGS.dtype), place=FLAGS.place,
                         budget=budget)  # fmt: skip
    encoded = model.encode([FLAGS.image], [FLAGS.question])
    logprobs = model.next_token_logprobs(encoded)[0]
    leaves = jax.tree_util.tree_leaves(model.params)
    n_devices = max(len(x.sharding.device_set) for x in leaves)
    print(
        f"params: {sum(x.size for x in leaves) / 1e6:.2f} M in {FLAGS.dtype} on {n_devices} device(s)"
    )
    print(describe(FLAGS.dtype))  # which products, and why (models.precision)
    print(f"{model.describe()}: {encoded.describe()}")
    print(f"{'rank':>4}  {'p':>8}  {'id':>7}  token")
    for rank, (text, i, p) in enumerate(top_tokens(model.tokenizer, logprobs, FLAGS.top), 1):
        print(f"{rank:>4}  {p:8.4f}  {i:>7}  {text!r}")


def top_tokens(tokenizer, logprobs_V, k: int) -> list[tuple[str, int, float]]:
    """The k likeliest next tokens as (text, id, probability), likeliest first."""
    import numpy as np

    ids = np.argsort(-logprobs_V)[:k]
    decode = lambda i: tokenizer.decode([int(i)], skip_special_tokens=False)  # noqa: E731
    return [(decode(i), int(i), float(np.exp(logprobs_V[i]))) for i in ids]


if __name__ == "__main__":
    run_main(main)
