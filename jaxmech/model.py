"""One model handle for every family: `jaxmech.load(folder)` for a checkpoint,
`jaxmech.init(kind, config, key)` for a trained family.

    model = jaxmech.load("Qwen2-VL-2B-Instruct", dtype=jnp.bfloat16)
    encoded = model.encode(["photo.jpg"], ["Is the cup left of the plate?"])
    logits, aux = model.forward(encoded.inputs, capture=["lm/resid_post.6"])

A `Model` holds its family (`families.contract`), config and params (one model, not
stacked) and, for a checkpoint, its folder and processor. `forward(inputs, *, edits,
capture)` is the family's one forward: `capture` a collection of site names (`sites()`;
True: every site), `edits` a `models.edits.Edits`. The handle holds no state beyond
that: analyses stay pure functions of `(model.params, inputs)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxmech.families.registry import checkpoint_family, get_family


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

    def describe(self) -> str:
        """One line for logs: the family's words for its config."""
        describe = getattr(self.family, "describe", None)
        return describe(self.config) if describe else self.name


def load(folder: str, *, dtype=None, place: str = "auto") -> Model:
    """The checkpoint in `folder` (a Hugging Face folder: config.json, safetensors,
    tokenizer.json, preprocessor_config.json) as a `Model`, its family found from
    config.json's `model_type`; `dtype` None: float32. Raises ValueError naming the
    folder or file for a folder no family reads."""
    import jax.numpy as jnp

    family = checkpoint_family(folder)
    config, params = family.load(folder, dtype=jnp.float32 if dtype is None else dtype,
                                 place=place)  # fmt: skip
    return Model(family, config, params, folder, family.processor(folder, config))


def init(kind: str, config, key) -> Model:
    """A trained family's model of `kind` (`model_kind`) with fresh params from `key`;
    `config` its `config.Config` (what `init_params` reads)."""
    family = get_family(kind)
    if family.kind != "trained":
        raise ValueError(f"kind = {kind!r} is a checkpoint family: open a folder with "
                         "jaxmech.load(folder)")  # fmt: skip
    return Model(family, config, family.init_params(config, key))
