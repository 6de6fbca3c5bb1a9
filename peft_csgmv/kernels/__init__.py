"""LoRA kernels over a :class:`~peft_csgmv.plan.BatchPlan`: Triton (``shrink``, ``expand``) and a plain-torch
reference with the same semantics; expert LoRA over a :class:`~peft_csgmv.moe_plan.MoePlan` (``moe_shrink``,
``moe_expand`` and their reference)."""

from .bound import BoundLayer
from .embedding import embedding_shrink
from .expand import expand, fused_fits
from .moe import moe_expand, moe_shrink
from .moe_reference import moe_expand_reference, moe_shrink_reference
from .reference import embedding_shrink_reference, expand_reference, shrink_reference
from .shrink import shrink, shrink_splits

__all__ = [
    "BoundLayer",
    "embedding_shrink",
    "embedding_shrink_reference",
    "shrink",
    "shrink_splits",
    "expand",
    "fused_fits",
    "shrink_reference",
    "expand_reference",
    "moe_shrink",
    "moe_expand",
    "moe_shrink_reference",
    "moe_expand_reference",
]
