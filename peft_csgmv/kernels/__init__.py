"""LoRA kernels over a :class:`~peft_csgmv.plan.BatchPlan`: Triton (``shrink``, ``expand``) and a plain-torch
reference with the same semantics."""

from .bound import BoundLayer
from .embedding import embedding_shrink
from .expand import expand, fused_fits
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
]
