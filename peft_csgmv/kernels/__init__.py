"""LoRA kernels over a :class:`~peft_csgmv.plan.BatchPlan`: Triton (``shrink``, ``expand``) and a plain-torch
reference with the same semantics."""

from .bound import BoundLayer
from .embedding import embedding_shrink
from .expand import expand
from .reference import embedding_shrink_reference, expand_reference, shrink_reference
from .shrink import shrink, shrink_splits

__all__ = [
    "BoundLayer",
    "disable_direct_launch",
    "embedding_shrink",
    "embedding_shrink_reference",
    "shrink",
    "shrink_splits",
    "expand",
    "shrink_reference",
    "expand_reference",
]


def disable_direct_launch() -> None:
    """Launch every kernel through Triton's own path from now on (see :mod:`.launch`)."""
    from .embedding import _launch_embedding_shrink
    from .expand import _launch_expand
    from .shrink import _launch_shrink

    for launcher in (_launch_shrink, _launch_expand, _launch_embedding_shrink):
        launcher.direct = False
