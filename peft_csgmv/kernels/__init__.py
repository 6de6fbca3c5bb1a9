"""LoRA kernels over a :class:`~peft_csgmv.plan.BatchPlan`: Triton (``shrink``, ``expand``) and a plain-torch
reference with the same semantics."""

from .expand import expand
from .reference import expand_reference, shrink_reference
from .shrink import shrink

__all__ = ["shrink", "expand", "shrink_reference", "expand_reference"]
