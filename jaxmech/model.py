"""One model handle for every family: `jaxmech.load(name)` for a checkpoint (a folder or
a Hub name), `jaxmech.init(kind, config, key)` for a trained family.

    model = jaxmech.load("Qwen/Qwen2-VL-2B-Instruct", dtype=jnp.bfloat16)
    encoded = model.encode(["photo.jpg"], ["Is the cup left of the plate?"])
    logits, aux = model.forward(encoded.inputs, capture=["lm/resid_post.6"])

A `Model` holds its family (`families.contract`), config and params (one model, not
stacked) and, for a checkpoint, its folder and processor. `forward(inputs, *, edits,
capture)` is the family's one forward: `capture` a collection of site names (`sites()`;
True: every site), `edits` a `models.edits.Edits`. The handle holds no state beyond
that: analyses stay pure functions of `(model.params, inputs)`. It is the one way a
checkpoint is opened: `experiments.ask` and the reports (`reports.checkpoints.
open_checkpoint`, whose subject holds the `Model`) both load through `load`, its weights
checked against a memory budget first (`check_fits`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmech.families.registry import checkpoint_family, get_family


def check_capture(capture, sites) -> None:
    """Refuses, by name, a `capture` entry that is neither a site of `sites` nor a site's
    part before its "." (e.g. "lm/resid_pre": that point of every block, as the site
    recorders read it): a name the forward never records would come back missing."""
    known = set(sites) | {s.split(".")[0] for s in sites}
    unknown = [name for name in capture if name not in known]
    if unknown:
        raise ValueError(f"capture: {', '.join(map(repr, unknown[:3]))} is not a site of this "
                         "model: allowed a name of model.sites() or its part before the "
                         "'.' (e.g. 'lm/resid_pre')")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Model:
    """A family, its config and one model's params (module docstring)."""

    family: Any
    config: Any
    params: Any
    folder: str | None = None
    processor: Any = None

    @property
    def name(self) -> str:
        return self.family.name

    def forward(self, inputs, *, edits=None, capture=()):
        """(out, aux): the family's forward on `inputs`; aux holds the `capture` sites."""
        if isinstance(capture, str):
            raise ValueError(f"capture = {capture!r}: expected a collection of site names "
                             "(e.g. [name]) or True")  # fmt: skip
        if capture and capture is not True:
            check_capture(capture, self.sites())
        return self.family.forward(
            self.params, inputs, edits=edits, capture=capture, config=self.config
        )

    def sites(self) -> tuple[str, ...]:
        """Every site the forward names (what `capture` and `Edits` accept), in order."""
        return tuple(self.family.sites(self.config, self.params))

    def view(self, grid=(4, 4), size: int | None = None, video: bool = False,
             wording: str = "jaxmech"):  # fmt: skip
        """The VLM view the paper 003 / 004 methods use (`families.vlm_view.VLMView`):
        a checkpoint's scenes on `grid` drawn `size` pixels square (None: the family's
        default); a trained VLM's from its config (`grid`, `size` are its task's)."""
        from jaxmech.data.spec import Grid

        if self.folder is not None:
            return self.family.view(self.folder, self.config, Grid(*grid), size,
                                    video=video, wording=wording)  # fmt: skip
        if getattr(self.family, "vlm_view", None) is None:
            raise ValueError(f"model {self.name!r} is not a VLM family (it has no VLM view)")
        return self.family.vlm_view(self.config)

    def _checkpoint(self, what: str) -> None:
        if self.processor is None:
            raise ValueError(f"{what}: model {self.name!r} is not a loaded checkpoint "
                             "(jaxmech.load)")  # fmt: skip

    def encode(self, images, questions):
        """The processor's encoding of `images` (paths or arrays) and `questions`, as the
        reference feeds them; `.inputs` is what `forward` takes."""
        self._checkpoint("encode")
        return self.family.encode(self.processor, images, questions)

    @property
    def tokenizer(self):
        self._checkpoint("tokenizer")
        return self.family.tokenizer(self.processor)

    def next_token_logprobs(self, encoded):
        """[B, V] log-probabilities of the token after each encoded prompt."""
        self._checkpoint("next_token_logprobs")
        return self.family.next_token(self.config, self.params, encoded)

    def generate(self, encoded, *, max_new_tokens: int, greedy: bool = True, **options):
        """Greedy generation after each encoded prompt (rows left-padded), as the
        reference's `generate(do_sample=False)`: a `models.generate.Generation`
        (`tokens_BxN`, pad after each row's end-of-sequence token; `n_B`; `logits_BxNxV`
        with `logits=True`). `options`: `eos_token_id`, `pad_token_id` (default: the
        folder's generation_config.json / config.json), `edits` (the prompt's forward
        only), `logits`. A key / value cache of S + max_new_tokens rows; one compiled
        program for the prompt, one for every step."""
        self._checkpoint("generate")
        if getattr(self.family, "generate", None) is None:
            raise ValueError(f"generate: family {self.name!r} offers no generation")
        return self.family.generate(self.config, self.params, encoded, folder=self.folder,
                                    max_new_tokens=max_new_tokens, greedy=greedy, **options)  # fmt: skip

    def describe(self) -> str:
        """One line for logs: the family's words for its config."""
        describe = getattr(self.family, "describe", None)
        return describe(self.config) if describe else self.name


def load(name: str, *, revision: str | None = None, dtype=None, place: str = "auto",
         budget=None) -> Model:  # fmt: skip
    """The checkpoint `name` as a `Model`, its family found from config.json's
    `model_type`: a Hugging Face folder (config.json, safetensors, tokenizer.json,
    preprocessor_config.json), or, where no such folder exists, a Hub repo id
    `ORG/NAME` (`revision` or `ORG/NAME@REVISION`: a branch, tag or commit; None: main)
    resolved through huggingface_hub's cache, fetching only the files jaxmech reads
    (`hub_names.checkpoint_folder`: HF_HUB_CACHE / HF_HOME, HF_HUB_OFFLINE, the login's
    token). `dtype` None: float32. `place`: the weights on one device ("one"), each
    matrix split over every device ("shard"), or "auto" (sharded where they do not fit
    one device). `budget` (a `memory.Budget`; None: no check): weights that alone exceed
    it are refused (`memory.MemoryBudgetError`) before any is read. Raises ValueError
    naming the folder or file for a folder no family reads, or the repo, revision and
    missing files for a name that cannot be resolved."""
    import jax.numpy as jnp

    from jaxmech.hub_names import checkpoint_folder

    folder = checkpoint_folder(name, revision)
    family = checkpoint_family(folder)
    dtype = jnp.float32 if dtype is None else dtype
    if budget is not None:
        check_fits(folder, dtype, place, budget)
    config, params = family.load(folder, dtype=dtype, place=place)
    return Model(family, config, params, folder, family.processor(folder, config))


def check_fits(folder: str, dtype, place: str, budget) -> None:
    """Refuses (`memory.MemoryBudgetError`, naming what to change) the checkpoint in
    `folder` where its weights in `dtype` alone exceed `budget`, counted from the stored
    tensors' shapes (no weight read) and, placed by `place` over several devices, by
    one device's share."""
    import jax
    import jax.numpy as jnp

    from jaxmech.memory import check_weights_fit
    from jaxmech.models.hub import stored_elements

    dtype = jnp.dtype(dtype)
    devices = 1 if place == "one" else len(jax.devices())
    check_weights_fit(stored_elements(folder) * dtype.itemsize, budget, dtype.name,
                      f"checkpoint {folder}", devices)  # fmt: skip


def init(kind: str, config, key) -> Model:
    """A trained family's model of `kind` (`model_kind`) with fresh params from `key`;
    `config` its `config.Config` (what `init_params` reads)."""
    family = get_family(kind)
    if family.kind != "trained":
        raise ValueError(f"kind = {kind!r} is a checkpoint family: open a folder with "
                         "jaxmech.load(folder)")  # fmt: skip
    return Model(family, config, family.init_params(config, key))
