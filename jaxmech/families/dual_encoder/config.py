"""The dual encoder's config: its towers' sizes, the text tower's switches and how the
vision tower sees positions (`Config.model` when `model_kind = "dual_encoder"`)."""

from __future__ import annotations

import dataclasses
import math

from jaxmech.config import TransformerConfig, choice, fail, float_in, int_in

VISION_POS = ("learned", "rope")


@dataclasses.dataclass(frozen=True)
class DualEncoderConfig(TransformerConfig):
    """The CLIP-style dual encoder (SPEC; both towers share the transformer sizes).

    `text_n_layers` None means the text tower has `n_layers` layers too.

    `vision_pos` is how the vision tower sees pixel positions: `"learned"` (SPEC
    default: an additive learned `P`) or `"rope"` (no `P`; queries and keys of every
    vision block are rotated per frequency pair by position x `rope_base ** (-2i /
    d_head)`, with CLS at rotary position 0 and pixel i at i + 1). The text tower
    always uses a learned `P`.
    """

    text_n_layers: int | None = None
    d_embed: int = 128
    causal_text: bool = True
    cls_position: bool = False
    logit_scale_init: float = math.log(1 / 0.07)
    logit_scale_max: float = math.log(100.0)
    vision_pos: str = "learned"

    @property
    def text_layers(self) -> int:
        return self.n_layers if self.text_n_layers is None else self.text_n_layers

    def __post_init__(self):
        super().__post_init__()
        if self.text_n_layers is not None:
            int_in("text_n_layers", self.text_n_layers, 1, 64)
        int_in("d_embed", self.d_embed, 1, 65536)
        for name in ("causal_text", "cls_position"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "True or False")
        float_in("logit_scale_init", self.logit_scale_init, -20.0, 20.0)
        float_in("logit_scale_max", self.logit_scale_max, self.logit_scale_init, 20.0)
        choice("vision_pos", self.vision_pos, VISION_POS)
        if self.vision_pos == "rope":
            if self.d_head % 2:
                fail("d_head", self.d_head, "an even number with vision_pos = 'rope'")
            if self.cls_position:
                fail(
                    "cls_position",
                    self.cls_position,
                    "False with vision_pos = 'rope' (CLS sits at rotary position 0)",
                )
