"""The LLaVA-1.5 checkpoint family (`families.contract.CheckpointFamily`): what the
registry and the model handle (`jaxmech.load`) know of it."""

from __future__ import annotations

from jaxmech.families import hf_vlm
from jaxmech.families.llava import checks, load, model, params, processor, view

FAMILY = hf_vlm.checkpoint_family(
    "llava",
    ("llava",),
    (load, params, checks, model, processor),
    view=view.checkpoint_view,
    describe=lambda c: f"llava, {c.lm_layers} LM blocks, {c.grid} x {c.grid} patches",
    # the authors' ViT MLPs and projector; their selector's `multi_modal_projector`
    # (taken unless --no_projector, which their run scripts do not pass) is LLaVA's
    trainable=hf_vlm.authors_vit_and_projector,
    authors_windows=(  # adversarial_steering.sh's CONFIG, for jaxmech.reports.steering
        (("llava", 32, 4096), ("llava-7b", "llava-hf/llava-1.5-7b-hf", (8, 20))),
        (("llava", 40, 5120), ("llava-13b", "llava-hf/llava-1.5-13b-hf", (10, 20))),
    ),
    # mirror_swapping.py / attribute_swapping.py's prompt, for jaxmech.reports.patching
    authors_wordings=(("patching", view.MIRROR),),
    answer_turn=processor.answer_turn,
    # llava-hf's template writes every image first, whatever the message's order
    encode_text_first=processor.encode,
)
