"""Chunked SGMV shrink: the LoRA ``A`` product of every segment, gathered through the plan's permutation.

Semantics::

    for each segment s with slot = seg_slot[s], r = rank[slot], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        t[rows, :r] = x[rows] @ A[slot, :r, :]ᵀ          (fp32 accumulation, t stored in fp32)

Rows that belong to no segment (base rows) and segments whose slot has rank 0 are not touched; ``t[:, r:]`` of a
segment is not written either. ``t`` is indexed by original token, so the expand step reads it through the same
permutation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import BatchPlan
from .launch import Launcher


@triton.jit
def _shrink_kernel(
    x_ptr,  # (T, K) activations, any float dtype
    a_ptr,  # (S, R, K) stacked A
    t_ptr,  # (T, R) fp32 output
    perm_ptr,  # (T,) int32
    seg_indptr_ptr,  # (num_segments + 1,) int32
    seg_slot_ptr,  # (num_segments,) int32
    rank_ptr,  # (S,) int32
    K,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_tm,
    stride_tr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seg = tl.program_id(0)
    slot = tl.load(seg_slot_ptr + seg)
    rank = tl.load(rank_ptr + slot)
    if rank == 0:
        return
    start = tl.load(seg_indptr_ptr + seg)
    length = tl.load(seg_indptr_ptr + seg + 1) - start

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + rows[:, None] * stride_xm + offs_k[None, :] * stride_xk
    a_ptrs = a_ptr + slot.to(tl.int64) * stride_as + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak

    t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & r_mask[None, :])


_launch_shrink = Launcher(_shrink_kernel)


def _block(n: int) -> int:
    """Tile size for a dimension of ``n`` (at least 16, as ``tl.dot`` needs). Plain Python: Triton's own helpers
    cost microseconds per call on the launch path."""
    return max(16, 1 << (n - 1).bit_length())


def shrink(x: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, plan: BatchPlan, t: torch.Tensor | None = None):
    """Launch the shrink kernel.

    Args:
        x: ``(T, K)`` activations, fp16/bf16/fp32, any strides; ``T = plan.num_tokens``.
        a: ``(S, R, K)`` stacked A weights (slot-major), fp16/bf16/fp32; ``x`` is cast to this dtype for the product.
        ranks: ``(S,)`` int32, the rank of each slot (``0`` = the slot does nothing in this layer).
        plan: the batch plan (permutation, segments, slot per segment) on ``x``'s device.
        t: optional ``(T, R)`` fp32 output buffer.

    Returns:
        ``t``: ``(T, R)`` fp32; only ``t[rows of segment s, :ranks[slot of s]]`` is written.
    """
    num_tokens, k = x.shape
    num_slots, r, k_a = a.shape
    if k_a != k or num_tokens != plan.num_tokens:
        raise ValueError(f"shrink: x {tuple(x.shape)} does not fit A {tuple(a.shape)} / plan of {plan.num_tokens} tokens")
    if t is None:
        t = torch.empty((num_tokens, r), dtype=torch.float32, device=x.device)
    if plan.num_segments == 0:
        return t
    block_m = _block(plan.chunk_size)
    _launch_shrink(
        (plan.num_segments, 1, 1),
        (
            x, a, t, plan.permutation, plan.seg_indptr, plan.seg_slot, ranks,
            k, x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), t.stride(0), t.stride(1),
        ),
        BLOCK_M=block_m,
        BLOCK_R=_block(r),
        BLOCK_K=64 if block_m >= 64 else 128,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    return t
