"""Paper 000's dual encoder under its own name: `jaxmech.dual_encoder.forward`,
`init_params`, `encode_images`, `encode_texts`, `evaluate`, `decompose`, `with_static`
(the family's own modules: `families.dual_encoder`)."""

from jaxmech.analysis.decompose import decompose
from jaxmech.families.dual_encoder.checks import with_static
from jaxmech.families.dual_encoder.evaluate import evaluate
from jaxmech.families.dual_encoder.model import encode_images, encode_texts, forward, init_params

__all__ = ["decompose", "encode_images", "encode_texts", "evaluate", "forward", "init_params",
           "with_static"]  # fmt: skip
