"""Loading Qwen-VL checkpoints: dtypes and layouts, every bad folder's clear error, and the
`experiments.ask` command (sharded over two fake devices)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import subprocess_env
from safetensors.numpy import save_file

from jaxmech.families import load_checkpoint
from jaxmech.families.qwen2_vl import load, processor

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "qwen2_vl")
HUB = os.path.join(FIXTURES, "qwen2_vl")
QUESTION = "Is the red circle to the left or the right of the blue square? Answer with one word."


def stored_tensors(folder: str) -> dict:
    """{stored name: float32 array} of a checkpoint folder."""
    s = load.Stored(load.weight_files(folder))
    return {entry[3]: np.asarray(s.array(key), np.float32) for key, entry in s.entries.items()}


def copy_with(tmp_path, tensors: dict, dtype=np.float32, name="ckpt") -> str:
    """The Hub fixture's folder with its weights replaced by `tensors` (one file)."""
    out = tmp_path / name
    shutil.copytree(HUB, out, ignore=shutil.ignore_patterns("*.safetensors", "reference.npz"))
    save_file({k: v.astype(dtype) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return str(out)


def hub_download(tmp_path) -> str:
    """The Hub fixture laid out as a download of Qwen/Qwen2-VL-2B-Instruct is: two shards
    and their index, and the files jaxmech does not read (generation / tokenizer configs,
    the chat template, BPE vocab and merges)."""
    out = tmp_path / "Qwen2-VL-2B-Instruct"
    shutil.copytree(HUB, out, ignore=shutil.ignore_patterns("*.safetensors", "reference.npz"))
    tensors = stored_tensors(HUB)
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:20],
        "model-00002-of-00002.safetensors": names[20:],
    }
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    index = {
        "metadata": {"total_size": 0},
        "weight_map": {k: f for f, ks in shards.items() for k in ks},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for extra in (
        "generation_config.json",
        "tokenizer_config.json",
        "chat_template.json",
        "vocab.json",
    ):
        (out / extra).write_text("{}")
    (out / "merges.txt").write_text("#version: 0.2\n")
    return str(out)


def test_float16_and_layouts(tmp_path):
    """A float16 copy in the newer key layout loads to the float16-rounded weights."""
    tensors = stored_tensors(HUB)
    renamed = {
        k.replace("visual.", "model.visual.", 1)
        if k.startswith("visual.")
        else k.replace("model.", "model.language_model.", 1): v
        for k, v in tensors.items()
    }
    _, _, want = load_checkpoint(HUB)
    _, _, got = load_checkpoint(copy_with(tmp_path, renamed, np.float16))
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(
            np.asarray(b), np.asarray(a).astype(np.float16).astype(np.float32)
        )


def test_bad_tensors(tmp_path):
    tensors = stored_tensors(HUB)
    missing = {k: v for k, v in tensors.items() if k != "visual.merger.mlp.2.bias"}
    with pytest.raises(
        ValueError, match=r"missing tensor visual\.merger\.mlp\.2\.bias \(shape \(32,\)\)"
    ):
        load_checkpoint(copy_with(tmp_path, missing, name="missing"))
    extra = {**tensors, "model.layers.9.mlp.up_proj.weight": np.zeros((2, 2), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"unexpected tensor model\.layers\.9\.mlp\.up_proj\.weight \(shape \(2, 2\)\)",
    ):
        load_checkpoint(copy_with(tmp_path, extra, name="extra"))
    wrong = {**tensors, "model.norm.weight": np.ones(31, np.float32)}
    with pytest.raises(
        ValueError, match=r"tensor model\.norm\.weight: shape \(31,\) in the file, expected \(32,\)"
    ):
        load_checkpoint(copy_with(tmp_path, wrong, name="wrong"))


def test_tied_checkpoint_with_a_stored_lm_head(tmp_path):
    """Some tied checkpoints store lm_head.weight too: it loads, the copy unused."""
    folder = os.path.join(FIXTURES, "qwen2_5_vl")
    tensors = stored_tensors(folder)
    tensors["lm_head.weight"] = tensors["model.language_model.embed_tokens.weight"]
    out = tmp_path / "tied"
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors*", "reference.npz"))
    save_file(tensors, str(out / "model.safetensors"))
    _, config, p = load_checkpoint(str(out))
    assert config.tie_embeddings and "W_U" not in p["lm"]


def test_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    folder = tmp_path / "noweights"
    shutil.copytree(HUB, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_checkpoint(str(folder))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "gone.safetensors"}})
    )
    with pytest.raises(ValueError, match="gone.safetensors, which is missing"):
        load_checkpoint(str(folder))
    (folder / "model.safetensors.index.json").unlink()
    (folder / "model.safetensors").write_bytes(b"\x05")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_checkpoint(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "molmo"}))
    with pytest.raises(ValueError, match="model_type = 'molmo' is not supported"):
        load_checkpoint(str(folder))
    with pytest.raises(ValueError, match="place = 'gpu'"):
        load.load_checkpoint(HUB, place="gpu")


def test_processor_errors():
    config = load.read_config(HUB)
    proc = processor.load_processor(HUB, config)
    small, big = np.zeros((56, 56, 3), np.uint8), np.zeros((56, 112, 3), np.uint8)
    with pytest.raises(ValueError, match="different patch grids"):
        processor.encode(proc, [small, big], [QUESTION, QUESTION])
    enc = processor.encode(proc, [small], [QUESTION])
    with pytest.raises(ValueError, match="'purple' is not a word"):
        processor.spans(enc, [("red", "purple")])
    sp = processor.spans(enc, [("red", "blue")], cells=(2, 2))
    tokens = [proc.tokenizer.id_to_token(int(t)) for t in enc.inputs.tokens_BxS[0]]
    assert (tokens[sp.x_B[0]], tokens[sp.y_B[0]], sp.answer_B[0]) == (
        "red",
        "blue",
        len(tokens) - 1,
    )
    assert [tokens[i] for i in np.flatnonzero(sp.question_BxS[0])][:3] == ["Is", "the", "red"]


def test_ask_sharded_over_two_devices(tmp_path):
    """`experiments.ask` on the Hub fixture laid out as a download, its params split over
    two fake CPU devices, prints the reference's likeliest next tokens and probabilities
    (the fixture's "single" case is this image and question). ~7 s: a subprocess with its
    own JAX start and compile, the only test of the sharded placement and of the command."""
    ref = np.load(os.path.join(HUB, "reference.npz"))["single/logits"][0, -1]
    p_ref = np.exp(ref - ref.max()) / np.exp(ref - ref.max()).sum()
    cmd = [
        sys.executable,
        "-m",
        "experiments.ask",
        f"--checkpoint={hub_download(tmp_path)}",
        "--place=shard",
        "--top=3",
        f"--image={os.path.join(FIXTURES, 'single0.png')}",
        f"--question={QUESTION}",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=subprocess_env(devices=2), timeout=300
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "on 2 device(s)" in lines[0]
    head = next(i for i, line in enumerate(lines) if line.split()[:3] == ["rank", "p", "id"])
    rows = [line.split() for line in lines[head + 1 : head + 4]]
    assert [int(r[2]) for r in rows] == list(np.argsort(-p_ref)[:3])
    np.testing.assert_allclose([float(r[1]) for r in rows], np.sort(p_ref)[::-1][:3], atol=2e-4)
