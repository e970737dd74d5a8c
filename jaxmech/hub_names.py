"""Checkpoints and datasets by their Hugging Face Hub names: `ORG/NAME[@REVISION]`
resolved to a local folder through huggingface_hub's own cache.

    checkpoint_folder("Qwen/Qwen2-VL-2B-Instruct")            # the cached snapshot's folder
    checkpoint_folder("Qwen/Qwen2-VL-2B-Instruct@a7a06a1")    # a branch, tag or commit
    dataset_folder("cvbench", "nyu-visionx/CV-Bench")          # --data for a Hub dataset

A name that is an existing folder is that folder (a folder wins over a repo id spelled
the same), and huggingface_hub is not imported: it is an optional extra
(`pip install 'jaxmech[hub]'`), imported only to resolve a name that is not a folder.

Only what jaxmech reads is fetched (`allow_patterns`): a checkpoint's `CHECKPOINT_FILES`,
then the weights its `model.safetensors.index.json` names (else `model.safetensors`); a
dataset's files from `HUB_DATASETS`. The cache, the offline switch and the token are
huggingface_hub's: HF_HUB_CACHE (else HF_HOME/hub, else its default), HF_HUB_OFFLINE=1
(nothing fetched: the cached snapshot or an error), HF_TOKEN or `hf auth login`'s token;
the environment is read at each call. Every failure is a `HubNameError` (a ValueError)
naming the argument, the repo, the revision and what is missing.
"""

from __future__ import annotations

import json
import os
import re

# what a checkpoint family reads beside its weights (families/*/processor.py, models/hub.py,
# data/inputs/prompts.py; generation_config.json: `models.generate.generation_ids`, the default
# end-of-sequence and pad ids); chat templates and BPE vocab files are not read
CHECKPOINT_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
NEEDED = ("config.json", "tokenizer.json")  # and the weights; the rest where a repo has them
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

# --questions_from source -> (its Hub dataset, the files its loader reads from it); a
# source not listed (COCO-Spatial, What'sUp, a manifest) is read from a folder only
HUB_DATASETS = {
    "cvbench": ("nyu-visionx/CV-Bench", ("test_2d.parquet",)),  # images embedded in the rows
}

_NAME = re.compile(
    r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@(?P<revision>[^@\s]+))?$"
)


class HubNameError(ValueError):
    """A Hub name that cannot be resolved: the message names the argument, the repo, the
    revision and what is missing."""


def is_hub_name(name: str) -> bool:
    """Whether `name` reads as `ORG/NAME` or `ORG/NAME@REVISION` (it may still be a folder)."""
    return isinstance(name, str) and _NAME.match(name) is not None


def split_name(name: str, revision: str | None = None, what: str = "checkpoint"):
    """(repo id, revision or None) of `ORG/NAME[@REVISION]`; `revision` given beside an
    `@REVISION` must agree with it."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None:
        raise HubNameError(f"{what} = {name!r}: no such folder, and not a Hub repo id "
                           "(ORG/NAME or ORG/NAME@REVISION)")  # fmt: skip
    pinned = m["revision"]
    if pinned is not None and revision is not None and pinned != revision:
        raise HubNameError(f"revision = {revision!r}: {what} = {name!r} already names "
                           f"revision {pinned!r}")  # fmt: skip
    return m["repo"], pinned if revision is None else revision


def checkpoint_folder(name: str, revision: str | None = None, what: str = "checkpoint") -> str:
    """The local folder of checkpoint `name`: `name` itself where it is a folder, else the
    Hub repo `ORG/NAME[@REVISION]` (`revision`: a branch, tag or commit; None: main)
    fetched into, or found in, huggingface_hub's cache. Fetches `CHECKPOINT_FILES`, then
    the weights the index names (else `model.safetensors`). Raises `HubNameError` naming
    `what`, the repo, the revision and what is missing (offline and not cached; no such
    repo or revision; a gated repo without a token; a snapshot without the files)."""
    if isinstance(name, str) and os.path.isdir(name):
        if revision is not None:
            raise HubNameError(f"revision = {revision!r}: only for a Hub name; {what} = "
                               f"{name!r} is a folder")  # fmt: skip
        return name
    repo, revision = split_name(name, revision, what)
    at = _Fetch(what, name, repo, revision, "model")
    folder = at.snapshot(list(CHECKPOINT_FILES), NEEDED)
    weights = _weight_files(folder)
    # the same commit as the first fetch, so the weights match the index and the config
    folder = at.snapshot(weights, weights, commit=os.path.basename(folder))
    at.require(folder, (*NEEDED, *weights))
    return folder


def dataset_folder(source: str, data: str | None) -> str | None:
    """`--data` as a local folder for `--questions_from=source`: `data` itself where it is a
    folder (or not a Hub name: the loader says what is wrong), else the Hub dataset
    `ORG/NAME[@REVISION]` with the files `HUB_DATASETS` lists for `source`, fetched into or
    found in the cache. A Hub name for a source with no Hub dataset is refused, naming
    the folder layout to give instead."""
    if not data or source == "drawn" or os.path.isdir(data) or not is_hub_name(data):
        return data
    if source not in HUB_DATASETS:
        known = ", ".join(f"{s}: {r}" for s, (r, _) in HUB_DATASETS.items())
        raise HubNameError(f"data = {data!r}: no such folder; a Hub dataset is read for "
                           f"--questions_from={', '.join(HUB_DATASETS)} only ({known}); "
                           f"{source}'s is a folder (its layout: README, \"A paper's "
                           "table\")")  # fmt: skip
    repo, revision = split_name(data, None, "data")
    files = list(HUB_DATASETS[source][1])
    at = _Fetch("data", data, repo, revision, "dataset")
    folder = at.snapshot(files, files)
    at.require(folder, files)
    return folder


def _weight_files(folder: str) -> list[str]:
    """The safetensors files the folder's index names (sorted), else the single file."""
    index = os.path.join(folder, INDEX)
    if not os.path.isfile(index):
        return [SINGLE]
    try:
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise HubNameError(f"{index}: not a safetensors index (weight_map: {e})") from None


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir() -> str | None:
    """The cache huggingface_hub would use under the environment as it is now (its own
    constants are read once, at import); None: its default."""
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return os.path.expanduser(os.path.expandvars(os.environ[var]))
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.path.expandvars(os.environ["HF_HOME"])), "hub")
    return None


def _import_hub(what: str, name: str):
    try:
        import huggingface_hub
    except ImportError:
        raise HubNameError(f"{what} = {name!r}: no such folder; reading it from the Hugging "
                           "Face Hub needs huggingface_hub: pip install 'jaxmech[hub]'") from None  # fmt: skip
    return huggingface_hub


class _Fetch:
    """One repo at one revision: `snapshot` fetches (or finds) files, `require` checks them;
    huggingface_hub's errors become `HubNameError`s in jaxmech's words."""

    def __init__(self, what: str, name: str, repo: str, revision: str | None, repo_type: str):
        self.hub = _import_hub(what, name)
        from huggingface_hub import constants

        self.what, self.name, self.repo, self.repo_type = what, name, repo, repo_type
        self.revision = revision
        self.cache = _cache_dir() or constants.HF_HUB_CACHE
        env = _truthy(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
        self.offline = env or bool(constants.HF_HUB_OFFLINE)

    def head(self) -> str:
        rev = "main" if self.revision is None else self.revision
        kind = "dataset" if self.repo_type == "dataset" else "model"
        return (
            f"{self.what} = {self.name!r} (not a folder: Hub {kind} {self.repo}, revision {rev!r})"
        )

    def how_to_fetch(self, files) -> str:
        rev = "" if self.revision is None else f" --revision {self.revision}"
        kind = " --repo-type dataset" if self.repo_type == "dataset" else ""
        include = " ".join(f'"{f}"' for f in files)
        unset = " (unset HF_HUB_OFFLINE)" if self.offline else ""
        return (f"Fetch it once online{unset}, or: hf download {self.repo}{kind}{rev} "
                f"--include {include}")  # fmt: skip

    def snapshot(self, patterns, needed, commit: str | None = None) -> str:
        """The snapshot folder holding `patterns` (those the repo has), fetched unless
        offline; `needed`: what to name when nothing is cached."""
        from huggingface_hub import errors

        try:
            return self.hub.snapshot_download(
                self.repo,
                repo_type=self.repo_type,
                revision=commit or self.revision,
                cache_dir=self.cache,
                allow_patterns=list(patterns),
                local_files_only=self.offline,
            )
        except errors.RevisionNotFoundError:
            raise HubNameError(f"{self.head()}: the Hub has no such revision (a branch, tag "
                               "or commit)") from None  # fmt: skip
        except errors.GatedRepoError:
            raise HubNameError(f"{self.head()}: a gated repo; accept its terms at "
                               f"huggingface.co/{self._path()} and log in (hf auth login, or "
                               "HF_TOKEN)") from None  # fmt: skip
        except errors.RepositoryNotFoundError:
            raise HubNameError(f"{self.head()}: no such repo on the Hub, or a private one "
                               "(log in: hf auth login, or HF_TOKEN)") from None  # fmt: skip
        except errors.LocalEntryNotFoundError as e:
            why = ("offline (HF_HUB_OFFLINE=1), so nothing was fetched" if self.offline else
                   f"the Hub could not be reached ({type(e.__cause__ or e).__name__})")  # fmt: skip
            raise HubNameError(f"{self.head()}: not in the Hugging Face cache ({self._cached()});"
                               f" {why}. Missing: {self._needed(needed)}. "
                               f"{self.how_to_fetch(self._patterns(needed))}") from None  # fmt: skip
        except errors.HfHubHTTPError as e:
            raise HubNameError(f"{self.head()}: the Hub answered {e}") from None
        except ValueError as e:  # huggingface_hub's own check of the repo id
            raise HubNameError(f"{self.head()}: {e}") from None

    def require(self, folder: str, files) -> None:
        """Refuses a snapshot without `files` (a partly cached one, or a repo that lacks them)."""
        missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
        if not missing:
            return
        if self.offline:
            raise HubNameError(f"{self.head()}: the cached snapshot {folder} lacks "
                               f"{', '.join(missing)}; offline (HF_HUB_OFFLINE=1), so nothing "
                               f"was fetched. {self.how_to_fetch(missing)}")  # fmt: skip
        raise HubNameError(f"{self.head()}: the repo has no {', '.join(missing)} (jaxmech reads "
                           f"{', '.join(files)})")  # fmt: skip

    def _path(self) -> str:
        return ("datasets/" if self.repo_type == "dataset" else "") + self.repo

    def _patterns(self, needed) -> tuple:
        """What `hf download --include` should fetch for a first download."""
        return ("*.json", "*.safetensors") if self.repo_type == "model" else tuple(needed)

    def _needed(self, needed) -> str:
        if self.repo_type == "model" and "config.json" in needed:
            return ", ".join(needed) + " and the safetensors weights"
        return ", ".join(needed)

    def _cached(self) -> str:
        """What the cache holds of this repo, for the error."""
        storage = os.path.join(self.cache, f"{self.repo_type}s--{self.repo.replace('/', '--')}")
        if not os.path.isdir(storage):
            return f"nothing of {self.repo} under {self.cache}"
        refs = os.path.join(storage, "refs")
        names = sorted(os.path.relpath(os.path.join(d, f), refs)
                       for d, _, fs in os.walk(refs) for f in fs)  # fmt: skip
        snaps = os.path.join(storage, "snapshots")
        commits = sorted(os.listdir(snaps)) if os.path.isdir(snaps) else []
        return (f"{storage} holds revision(s) {', '.join(names) or 'none'} and snapshot(s) "
                f"{', '.join(c[:12] for c in commits) or 'none'}")  # fmt: skip
