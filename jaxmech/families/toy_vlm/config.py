"""The toy VLM's config (`Config.model` when `model_kind = "toy_vlm"`): ViT, projector
and causal LM sizes, positions, and the spatial-ID loss site (`families.toy_vlm`)."""

from __future__ import annotations

import dataclasses

from jaxmech.config import TransformerConfig, choice, fail, float_in, int_in

VIT_POS = ("learned2d", "sincos2d", "rope2d")
PROJECTORS = ("linear", "mlp")
LM_POS_IDS = ("sequential", "mrope")


@dataclasses.dataclass(frozen=True)
class ToyVLMConfig(TransformerConfig):
    """The toy autoregressive VLM: the transformer sizes serve its ViT (`n_layers`
    blocks) and its LM (`lm_n_layers`). `vit_frames` reads the grid's rows as video
    frames (the ViT sees each frame alone, without a row code; the LM's three-part ids
    carry the frame); `id_site` > 0 adds the spatial-ID loss at that LM site
    (`families.toy_vlm.id_loss`), weighted by the sweepable `id_weight`.

    `label_smoothing` = eps > 0 trains the answer against (1 - eps) one-hot + eps
    uniform over the vocabulary (`families.toy_vlm.loss.answer_loss`); 0 (default):
    plain cross-entropy.

    `planted_route` (the planted-route control of paper 003's methods): question tokens
    other than the object words cannot attend to the image tokens, so position reaches
    the answer only through the object words (the route the papers describe).
    """

    model_kind: str = "toy_vlm"
    lm_n_layers: int = 2
    vit_pos: str = "learned2d"
    vit_window: int = 0
    vit_global_blocks: str = ""
    projector: str = "linear"
    lm_pos_ids: str = "sequential"
    tie_labels: bool = False
    vit_frames: bool = False
    id_site: int = 0
    planted_route: bool = False
    label_smoothing: float = 0.0

    @property
    def global_blocks(self) -> tuple[int, ...]:
        """`vit_global_blocks` ("1,3") as block indices: with `vit_window` > 0 these ViT
        blocks attend globally and the others inside their window."""
        text = self.vit_global_blocks.strip()
        try:
            return tuple(int(b) for b in text.split(",")) if text else ()
        except ValueError:
            fail("vit_global_blocks", self.vit_global_blocks, "a comma list of block indices")

    def __post_init__(self):
        super().__post_init__()
        for name in ("tie_labels", "vit_frames", "planted_route"):
            if not isinstance(getattr(self, name), bool):
                fail(name, getattr(self, name), "True or False")
        int_in("lm_n_layers", self.lm_n_layers, 1, 64)
        choice("vit_pos", self.vit_pos, VIT_POS)
        int_in("vit_window", self.vit_window, 0, 64, " (0: no window blocks)")
        choice("projector", self.projector, PROJECTORS)
        choice("lm_pos_ids", self.lm_pos_ids, LM_POS_IDS)
        float_in("label_smoothing", self.label_smoothing, 0.0, 0.5)
        int_in("id_site", self.id_site, 0, self.lm_n_layers, " (0: no spatial-ID loss)")
        for b in self.global_blocks:
            int_in("vit_global_blocks", b, 0, self.n_layers - 1, " (ViT block indices)")
