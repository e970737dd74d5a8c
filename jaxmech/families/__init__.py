"""Model families: one wing per family behind one contract (`registry`), and the VLM
view that the paper 003 / 004 methods use (`vlm_view`)."""

from jaxmech.families.registry import (  # noqa: F401
    FAMILIES,
    CheckpointFamily,
    TrainedFamily,
    family_for,
    get_family,
    load_checkpoint,
    register,
    trainable,
    view_for,
)
