"""Random stand-in checkpoints in the Hub's layout, for benchmarks and the real-size check:
a word-level tokenizer of the pictures' prompts with Qwen's special tokens
(`word_tokenizer`), and a whole checkpoint folder of a given Hub config with random
values (`write_stand_in`: Qwen2-VL-2B-Instruct's by default).

`write_stand_in(folder)` writes config.json (the Hub's config, with the special ids of
the word-level tokenizer written beside it), the safetensors shards and their index in
the Hub's names (`visual.*`, `model.*`), random bfloat16 values (norm weights 1),
tensor by tensor, so that the 4.4 GB are never held at once. No real weights: the
answers mean nothing; memory and time are what a download of the same size costs.
"""

from __future__ import annotations

import json
import os
import struct
import time

import ml_dtypes
import numpy as np

from jaxmech.data.inputs import pictures
from jaxmech.families.qwen2_vl.config import QwenVLConfig, from_hf
from jaxmech.families.qwen2_vl.load import key_map
from jaxmech.families.qwen2_vl.processor import chat_prompt

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
            "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")  # fmt: skip


def prompt_words() -> list[str]:
    """Every word the pictures' prompts use (`data.inputs.pictures`, the chat template)."""
    text = " ".join(pictures.TEMPLATES + (pictures.MIDDLE, chat_prompt("")))
    text += " " + " ".join(pictures.SHAPES + tuple(pictures.COLOURS))
    text += " Left Right Above Below Yes No an a"
    for s in SPECIALS:
        text = text.replace(s, " ")
    words = text.replace("{", " ").replace("}", " ").split()
    pieces = {p for w in words for p in _split_punct(w)}
    return sorted(pieces)


def _split_punct(word: str) -> list[str]:
    out, cur = [], ""
    for ch in word:
        if ch.isalnum() or ch == "_":
            cur += ch
        else:
            out += [cur] if cur else []
            out.append(ch)
            cur = ""
    return out + ([cur] if cur else [])


def word_tokenizer(folder: str) -> dict:
    """Writes a word-level tokenizer.json (the prompts' words, then `SPECIALS`) and a
    default preprocessor_config.json into `folder`; returns the special tokens' ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0} | {w: i + 1 for i, w in enumerate(prompt_words())}
    first = len(vocab)
    vocab |= {t: first + i for i, t in enumerate(SPECIALS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump({"patch_size": 14, "merge_size": 2, "temporal_patch_size": 2}, f)
    return {t: vocab[t] for t in SPECIALS}


# Qwen/Qwen2-VL-2B-Instruct's config.json (the fields jaxmech reads; 2,208,985,600
# parameters, 4,417,971,200 bytes in bfloat16)
QWEN2_VL_2B = {
    "architectures": ["Qwen2VLForConditionalGeneration"],
    "model_type": "qwen2_vl",
    "hidden_act": "silu",
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vision_config": {
        "depth": 32,
        "embed_dim": 1280,
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_chans": 3,
        "hidden_size": 1536,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
}
# Qwen2-VL's preprocessor_config.json
PREPROCESSOR = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "merge_size": 2,
    "temporal_patch_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
}
SHARDS = 2


def _hub_name(canonical: str) -> str:
    return "model." + canonical[3:] if canonical.startswith("lm.") else canonical


def _write_shard(path: str, tensors: list, rng) -> dict:
    """Writes one safetensors file of `tensors` [(name, shape)] with random bf16 values;
    returns {name: file name}."""
    table, offset = {}, 0
    for name, shape in tensors:
        n = int(np.prod(shape)) * 2
        table[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    header = json.dumps(table).encode()
    header += b" " * (-len(header) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, shape in tensors:
            norm = (
                name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name
            )
            if norm and name.endswith("weight"):
                x = np.ones(shape, np.float32)
            else:
                x = rng.standard_normal(shape, np.float32) * 0.02
            x.astype(ml_dtypes.bfloat16).tofile(f)
    os.replace(path + ".tmp", path)
    return {name: os.path.basename(path) for name, _ in tensors}


def write_stand_in(folder: str, hub: dict = QWEN2_VL_2B, seed: int = 0, log=print) -> str:
    """Writes the random stand-in checkpoint into `folder` (module docstring) unless its
    index is there already; returns `folder`."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        return folder
    os.makedirs(folder, exist_ok=True)
    ids = word_tokenizer(folder)
    with open(os.path.join(folder, "preprocessor_config.json"), "w") as f:
        json.dump(PREPROCESSOR, f)
    config = hub_config(ids, hub)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    shapes = {k.split("#")[0]: v[1] for k, v in key_map(from_hf(config)).items()}
    names = sorted(shapes)
    rng, t0, weight_map = np.random.default_rng(seed), time.perf_counter(), {}
    for s in range(SHARDS):
        part = [(_hub_name(n), shapes[n]) for n in names[s::SHARDS]]
        path = os.path.join(folder, f"model-{s + 1:05d}-of-{SHARDS:05d}.safetensors")
        log(f"  writing {path} ({len(part)} tensors), {time.perf_counter() - t0:.0f} s")
        weight_map |= _write_shard(path, part, rng)
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return folder


def bench_config(ids: dict) -> QwenVLConfig:
    """A small Qwen2-VL-layout config for the patching bench (ViT 4 blocks of width 256,
    LM 8 layers of width 512, 8 / 2 heads, MLP 2048, the real 151936-word vocabulary),
    special ids from `ids`."""
    return QwenVLConfig(
        vit_depth=4, vit_width=256, vit_heads=4, vit_mlp=1024, patch_size=14,
        vit_act="quick_gelu", lm_vocab=151936, lm_width=512, lm_layers=8, lm_heads=8,
        lm_kv_heads=2, lm_mlp=2048, lm_rope_theta=1e6, lm_mrope_section=(8, 12, 12),
        tie_embeddings=True,
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )  # fmt: skip


def hub_config(ids: dict, hub: dict = QWEN2_VL_2B) -> dict:
    """The config.json of a stand-in: `hub` with the word-level tokenizer's special ids."""
    return hub | {
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
    }


def qwen2_vl_2b_config(ids: dict) -> QwenVLConfig:
    """Qwen2-VL-2B-Instruct's architecture, read from its config.json (`QWEN2_VL_2B`;
    2.21 B parameters), special ids from `ids`: random weights at the real size."""
    return from_hf(hub_config(ids))


# the benches' random configs of the real layout: name -> (config of special ids, size)
BENCH_CONFIGS = {"bench": (bench_config, 224), "real": (qwen2_vl_2b_config, 448)}
