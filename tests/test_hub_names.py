"""Checkpoints and datasets by their Hub names (`jaxmech.hub_names`), without a network: a
Hugging Face cache laid out in a temporary folder as a download leaves it (blobs,
`snapshots/COMMIT/` links, `refs/NAME`), HF_HUB_OFFLINE=1. What is asserted: a name
resolves to the snapshot its revision names (not main's), only the files jaxmech reads
are asked for, a folder wins over a repo id spelled the same, huggingface_hub is imported
only for a name that is not a folder, and every failure names the argument, the repo, the
revision and what is missing."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import types

import pytest
from conftest import subprocess_env

import jaxmech
from jaxmech import hub_names
from jaxmech.hub_names import HubNameError, checkpoint_folder, dataset_folder

HERE = os.path.dirname(__file__)
LLAVA = os.path.join(HERE, "fixtures", "llava", "llava")  # the smallest: one file
QWEN = os.path.join(HERE, "fixtures", "qwen2_vl", "qwen2_vl")
QWEN3 = os.path.join(HERE, "fixtures", "qwen3_vl", "qwen3_vl")  # two shards and an index
CVBENCH = os.path.join(HERE, "fixtures", "datasets", "cvbench")
A, B = "a" * 40, "b" * 40  # two commits
QUESTION = "Is the red circle to the left or the right of the blue square? Answer with one word."


def lay_out(cache, repo: str, commit: str, folder: str, refs=("main",), kind="model", skip=()):
    """`folder`'s files as the Hugging Face cache holds a download of `repo` at `commit`:
    content-addressed blobs, `snapshots/COMMIT/NAME` links to them, `refs/REF` holding the
    commit (no newline, as huggingface_hub writes it). The references (*.npz) are left out."""
    storage = os.path.join(cache, f"{kind}s--{repo.replace('/', '--')}")
    snapshot = os.path.join(storage, "snapshots", commit)
    os.makedirs(os.path.join(storage, "blobs"), exist_ok=True)
    os.makedirs(snapshot, exist_ok=True)
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not os.path.isfile(path) or name.endswith(".npz") or name in skip:
            continue
        with open(path, "rb") as f:
            data = f.read()
        blob = hashlib.sha256(data).hexdigest()
        with open(os.path.join(storage, "blobs", blob), "wb") as f:
            f.write(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), os.path.join(snapshot, name))
    for ref in refs:
        os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
        with open(os.path.join(storage, "refs", ref), "w") as f:
            f.write(commit)
    return snapshot


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache in tmp_path, offline."""
    path = tmp_path / "hf" / "hub"
    path.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_CACHE", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return str(path)


def test_a_hub_name_loads_its_cached_snapshot_offline(cache):
    snapshot = lay_out(cache, "org/tiny-llava", A, LLAVA)
    model = jaxmech.load("org/tiny-llava")
    assert model.folder == snapshot and model.name == "llava"
    assert model.describe() == jaxmech.load(LLAVA).describe()


def test_a_revision_pins_its_snapshot_not_mains(cache):
    old = lay_out(cache, "org/m", A, QWEN, refs=("v1",))
    new = lay_out(cache, "org/m", B, LLAVA)  # main
    assert checkpoint_folder("org/m") == new
    assert checkpoint_folder("org/m@v1") == old
    assert checkpoint_folder("org/m", revision=A) == old  # a commit
    assert checkpoint_folder("org/m@" + B) == new
    assert jaxmech.load("org/m", revision="v1").name == "qwen2_vl"  # main's is llava
    with pytest.raises(ValueError, match=r"revision = 'main': checkpoint = 'org/m@v1' already"):
        checkpoint_folder("org/m@v1", revision="main")


def test_offline_and_not_cached_names_the_repo_and_what_is_missing(cache):
    with pytest.raises(HubNameError) as e:
        jaxmech.load("org/absent")
    msg = str(e.value)
    for part in ("checkpoint = 'org/absent'", "revision 'main'", "nothing of org/absent",
                 "offline (HF_HUB_OFFLINE=1)", "config.json, tokenizer.json and the "
                 "safetensors weights", "hf download org/absent"):  # fmt: skip
        assert part in msg, msg
    lay_out(cache, "org/m", A, LLAVA)
    with pytest.raises(HubNameError, match=r"revision 'v9'.*holds revision\(s\) main and "
                       r"snapshot\(s\) aaaaaaaaaaaa"):  # fmt: skip
        checkpoint_folder("org/m@v9")


def test_a_partly_cached_snapshot_names_the_missing_shard(cache):
    lay_out(cache, "org/sharded", A, QWEN3, skip=("model-00002-of-00002.safetensors",))
    with pytest.raises(HubNameError, match=r"org/sharded.*lacks model-00002-of-00002"
                       r"\.safetensors; offline"):  # fmt: skip
        checkpoint_folder("org/sharded")
    lay_out(cache, "org/sharded", B, QWEN3)
    assert checkpoint_folder("org/sharded@" + B).endswith(B)


def test_a_folder_wins_over_a_repo_id_spelled_the_same(cache, tmp_path, monkeypatch):
    lay_out(cache, "org/m", A, QWEN)
    os.makedirs(tmp_path / "org")
    os.symlink(LLAVA, tmp_path / "org" / "m")
    monkeypatch.chdir(tmp_path)
    assert checkpoint_folder("org/m") == "org/m"
    assert jaxmech.load("org/m").name == "llava"  # the cache's is qwen2_vl
    with pytest.raises(ValueError, match=r"revision = 'v1': only for a Hub name; checkpoint = "
                       r"'org/m' is a folder"):  # fmt: skip
        jaxmech.load("org/m", revision="v1")


def test_huggingface_hub_is_imported_only_for_a_name_that_is_not_a_folder(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails: not installed
    assert checkpoint_folder(LLAVA) == LLAVA
    assert dataset_folder("cvbench", CVBENCH) == CVBENCH
    with pytest.raises(
        HubNameError, match=r"'org/m': no such folder.*pip install 'jaxmech\[hub\]'"
    ):
        checkpoint_folder("org/m")
    with pytest.raises(HubNameError, match=r"checkpoint = '/no/such/dir': no such folder, and "
                       r"not a Hub repo id"):  # fmt: skip
        jaxmech.load("/no/such/dir")


def test_only_the_files_jaxmech_reads_are_fetched(cache, monkeypatch):
    """Online (a stand-in for snapshot_download that finds what a download leaves): the
    small files first, then exactly the shards the index names, at the commit the first
    call resolved."""
    import huggingface_hub

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    snapshot = lay_out(cache, "org/q3", A, QWEN3)
    calls = []

    def download(repo, *, revision, allow_patterns, local_files_only, repo_type, cache_dir):
        calls.append((repo, revision, sorted(allow_patterns), local_files_only, repo_type))
        assert cache_dir == cache
        return snapshot

    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    assert checkpoint_folder("org/q3@v2") == snapshot
    (repo, rev, patterns, offline, kind), (_, rev2, weights, _, _) = calls
    assert (repo, rev, offline, kind) == ("org/q3", "v2", False, "model")
    assert patterns == sorted(hub_names.CHECKPOINT_FILES) and "*.safetensors" not in patterns
    assert rev2 == A  # the shards of the same commit
    assert weights == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_the_hubs_refusals_are_said_in_jaxmechs_words(cache, monkeypatch):
    import huggingface_hub
    from huggingface_hub import errors

    response = types.SimpleNamespace(headers={}, request=None)
    for error, said in ((errors.RevisionNotFoundError, "the Hub has no such revision"),
                        (errors.GatedRepoError, "a gated repo; accept its terms at "
                         "huggingface.co/org/m and log in"),
                        (errors.RepositoryNotFoundError, "no such repo on the Hub, or a private "
                         "one")):  # fmt: skip

        def refuse(*args, error=error, **kw):
            raise error("404 Client Error", response=response)

        monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
        with pytest.raises(HubNameError, match=rf"checkpoint = 'org/m@x' \(not a folder: Hub model org/m, "
                           rf"revision 'x'\): {said}"):  # fmt: skip
            checkpoint_folder("org/m@x")


def test_a_hub_dataset_resolves_for_its_source_only(cache):
    from jaxmech.data.datasets.questions import load_questions

    snapshot = lay_out(cache, "nyu-visionx/CV-Bench", A, os.path.join(CVBENCH, "parquet"),
                       kind="dataset")  # fmt: skip
    assert dataset_folder("cvbench", "nyu-visionx/CV-Bench") == snapshot
    hub = load_questions("cvbench", snapshot)
    local = load_questions("cvbench", os.path.join(CVBENCH, "parquet"))
    assert [q.question for q in hub.questions] == [q.question for q in local.questions]
    assert dataset_folder("drawn", "org/x") == "org/x"  # not read: the subject refuses it
    with pytest.raises(HubNameError, match=r"data = 'org/coco': no such folder; a Hub dataset is "
                       r"read for --questions_from=cvbench only .*coco_spatial's is a folder"):  # fmt: skip
        dataset_folder("coco_spatial", "org/coco")
    with pytest.raises(HubNameError, match=r"data = 'org/cvb' \(not a folder: Hub dataset org/cvb, revision "
                       r"'main'\): not in the Hugging Face cache.*Missing: test_2d.parquet.*"
                       r"--repo-type dataset"):  # fmt: skip
        dataset_folder("cvbench", "org/cvb")


class Flags(types.SimpleNamespace):
    def __contains__(self, name):
        return hasattr(self, name)


def checkpoint_flags(**kw):
    return Flags(**{"grid": "2x2", "size": 112, "questions": 1, "question_seed": 0,
                    "layers": None, "batch": 1, "dtype": "float32", "memory": None,
                    "protocol": "jaxmech", "questions_from": "drawn", "data": None,
                    "per_block": False, "out": None, "place": "auto", **kw})  # fmt: skip


def test_report_flags_resolve_hub_names_and_name_results_by_repo(cache):
    """`--checkpoint=ORG/NAME@REV` through the reports' driver: the pinned snapshot is
    opened, the results folder is named by the repo's NAME; `--data` resolves in the
    flags' options."""
    from jaxmech.cli import checkpoint_options
    from jaxmech.reports.driver import checkpoints_main

    old = lay_out(cache, "org/tiny-qwen", A, QWEN, refs=("v1",))
    lay_out(cache, "org/tiny-qwen", B, LLAVA)
    seen = []

    def on_checkpoint(run, out):
        seen.append((run.path, out, run.family.name))
        return {"summary": {}}

    checkpoints_main(checkpoint_flags(checkpoint="org/tiny-qwen@v1"), on_checkpoint, False)
    assert seen == [(old, os.path.join("runs", "checkpoints", "tiny-qwen@v1"), "qwen2_vl")]
    snapshot = lay_out(cache, "nyu-visionx/CV-Bench", A, os.path.join(CVBENCH, "parquet"),
                       kind="dataset")  # fmt: skip
    opts = checkpoint_options(checkpoint_flags(questions_from="cvbench",
                                               data="nyu-visionx/CV-Bench"))  # fmt: skip
    assert opts["data"] == snapshot


def test_ask_by_hub_name(cache, tmp_path):
    """`python -m experiments.ask --checkpoint=ORG/NAME` on the offline cache, and the error
    a missing repo prints last. ~10 s: two subprocesses, each with its own JAX start (the
    command's own environment is what reads HF_HUB_CACHE / HF_HUB_OFFLINE)."""
    lay_out(cache, "Qwen/Qwen2-VL-2B-Instruct", A, QWEN)
    image = os.path.join(os.path.dirname(QWEN), "single0.png")
    env = subprocess_env()
    run = lambda name: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "experiments.ask", f"--checkpoint={name}", "--top=2",
         f"--image={image}", f"--question={QUESTION}"],
        capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    out = run("Qwen/Qwen2-VL-2B-Instruct")
    assert out.returncode == 0, out.stderr
    assert "qwen2_vl, 2 LM blocks" in out.stdout and out.stdout.splitlines()[-3].startswith("rank")
    out = run("Qwen/Qwen2-VL-7B-Instruct")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: checkpoint = 'Qwen/Qwen2-VL-7B-Instruct' (not a folder: "
                           "Hub model Qwen/Qwen2-VL-7B-Instruct, revision 'main'): not in the "
                           "Hugging Face cache"), last  # fmt: skip
