"""The kernels as a torch custom op, for compiled code (``torch.compile``, transformers' static-cache decode).

``peft_csgmv::lora`` is one layer's LoRA over a plan given as tensors (a :class:`~peft_csgmv.executor.StaticPlan`'s
buffers): ``out = y + LoRA(x)`` for the rows of every live segment, ``y`` itself untouched. dynamo and inductor see it
as one opaque call with a fake (shape-only) implementation, so a patched layer traces into a graph without a break, and
a CUDA graph captures its launches as they are. The grid is the plan's most segments; empty segments exit at once.

Semantics (as :mod:`peft_csgmv.kernels`)::

    for each segment s with slot = seg_slot[s], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        out[rows] = y[rows] + (x[rows] @ A[slot]ᵀ) @ B[slot]ᵀ · scaling[slot]       (DoRA, lora_bias: as expand)
        (embedding: A[slot][:, x[rows]]ᵀ · embed_scale in place of x[rows] @ A[slot]ᵀ)
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from . import kernels
from .kernels.pool import Pooled
from .plan import BatchPlan


def _plan(permutation: torch.Tensor, seg_indptr: torch.Tensor, seg_slot: torch.Tensor, chunk: int, runs: bool):
    """The plan the kernels take, from its tensors. ``runs``: also the host-side runs the torch reference walks (read
    from the tensors: CPU only, where reading them costs no device sync)."""
    walk: tuple = ()
    if runs:
        bounds, slots = seg_indptr.tolist(), seg_slot.tolist()
        walk = tuple((slot, bounds[i], bounds[i + 1]) for i, slot in enumerate(slots) if bounds[i + 1] > bounds[i])
    return BatchPlan(
        rows=permutation.shape[0],
        tokens_per_row=1,
        chunk_size=chunk,
        num_segments=seg_slot.shape[0],
        permutation=permutation,
        seg_indptr=seg_indptr,
        seg_slot=seg_slot,
        runs=walk,
    )


@torch.library.custom_op("peft_csgmv::lora", mutates_args=())
def lora(
    x: torch.Tensor,
    y: torch.Tensor,
    data: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    permutation: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slot: torch.Tensor,
    mag: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    lora_bias: Optional[torch.Tensor],
    embed_scale: Optional[torch.Tensor],
    in_features: int,
    r_max: int,
    rank_align: int,
    chunk: int,
    embedding: bool,
    triton: bool,
) -> torch.Tensor:
    """``x``: (T, in) activations or (T,) token ids (``embedding``); ``y``: (T, out); ``data`` (the storage),
    ``a_off`` / ``b_off`` (S,) int64, ``ranks`` (S,) int32, ``scalings`` (S,) fp32, ``in_features`` / ``r_max`` /
    ``rank_align``: a layer's stack (:class:`~peft_csgmv.slots.LoraStack`, each slot at its own rank);
    ``permutation`` (T,), ``seg_indptr`` (M + 1,), ``seg_slot`` (M,) int32: the plan, empty segments past the live
    ones; ``mag``/``bias``/``lora_bias``: DoRA and ``lora_bias`` tables as in ``expand``; ``embed_scale``: a scaled
    embedding's factor (0-dim fp32); ``chunk``: the plan's row tile; ``triton``: the Triton kernels (else the torch
    reference, CPU). Returns ``y`` plus the LoRA."""
    out = y.clone()
    plan = _plan(permutation, seg_indptr, seg_slot, chunk, runs=not triton)
    host = () if triton else tuple(ranks.tolist())
    a_host, b_host = ((), ()) if triton else (tuple(a_off.tolist()), tuple(b_off.tolist()))
    shape = (ranks.shape[0], r_max)
    a = Pooled(data, a_off, a_host, host, (*shape, in_features), False, rank_align)
    b = Pooled(data, b_off, b_host, host, (shape[0], y.shape[1], r_max), True, rank_align)
    if triton:
        with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
            t = kernels.embedding_shrink(x, a, ranks, plan) if embedding else kernels.shrink(x, a, ranks, plan)
            if embed_scale is not None:
                t.mul_(embed_scale)
            kernels.expand(t, b, ranks, scalings, plan, out, mag, bias, lora_bias)
        return out
    ranks_h, scalings_h = host, scalings.tolist()
    shrink = kernels.embedding_shrink_reference if embedding else kernels.shrink_reference
    t = shrink(x, a, ranks_h, plan)
    if embed_scale is not None:
        t.mul_(embed_scale)
    kernels.expand_reference(t, b, ranks_h, scalings_h, plan, out, mag, bias, lora_bias)
    return out


@lora.register_fake
def _lora_fake(x, y, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(y)
