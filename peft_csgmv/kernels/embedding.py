"""Chunked embedding shrink: the LoRA ``A`` lookup of an embedding layer for every segment.

Semantics::

    for each segment s with slot = seg_slot[s], r = rank[slot], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        t[rows, :r] = A[slot, :r, ids[rows]]ᵀ          (PEFT: F.embedding(ids, lora_embedding_A.T); stored in fp32)

``A`` is stacked as for linear layers, ``(S, R, vocab)`` (PEFT's ``lora_embedding_A`` is ``(r, vocab)``); the expand
kernel then adds ``t @ lora_embedding_B[slot]ᵀ · scaling`` (with a scaled embedding's ``embed_scale`` folded into the
scaling). Rows in no segment and rank-0 slots are not touched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..plan import BatchPlan
from .common import block_size, dense, segment_rows
from .launch import Launcher
from .pool import pool_offsets, pool_strides


@triton.jit
def _embedding_shrink_kernel(
    ids_ptr,  # (T,) int64/int32 token ids, read through stride_ids
    a_ptr,  # (S, R, V) stacked embedding A, or a pool (POOLED: slot s's (r, V) matrix at element a_off[s])
    t_ptr,  # (T, R) fp32 output
    perm_ptr,  # (T,) int32
    seg_indptr_ptr,  # (num_segments + 1,) int32
    seg_slot_ptr,  # (num_segments,) int32
    rank_ptr,  # (S,) int32
    a_off_ptr,  # (S,) int64 (read only when POOLED)
    stride_ids,
    stride_as,
    stride_ar,
    stride_av,
    stride_tm,
    stride_tr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    POOLED: tl.constexpr,
):
    seg = tl.program_id(0)
    if tl.load(seg_indptr_ptr + seg + 1) <= tl.load(seg_indptr_ptr + seg):
        return  # an empty segment: a static plan's grid covers the most segments its shape can have
    seg_slot = tl.load(seg_slot_ptr + seg)
    slot = tl.maximum(seg_slot, 0)
    rank = tl.where(seg_slot < 0, 0, tl.load(rank_ptr + slot))
    if rank == 0:
        return  # a base segment (slot -1, as in a static plan) or a slot with nothing here
    rows, m_mask = segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)
    ids = tl.load(ids_ptr + rows * stride_ids, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    mask = m_mask[:, None] & (offs_r < rank)[None, :]
    if POOLED:
        a_base = a_ptr + tl.load(a_off_ptr + slot)
    else:
        a_base = a_ptr + slot.to(tl.int64) * stride_as
    a = tl.load(a_base + offs_r[None, :] * stride_ar + ids[:, None] * stride_av, mask=mask, other=0.0)
    tl.store(t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr, a.to(tl.float32), mask=mask)


_launch_embedding_shrink = Launcher(_embedding_shrink_kernel, num_tensors=8)


def embedding_shrink(
    ids: torch.Tensor, a: torch.Tensor, ranks: torch.Tensor, plan: BatchPlan, t: torch.Tensor | None = None
) -> torch.Tensor:
    """Launch the embedding shrink kernel.

    Args:
        ids: ``(T,)`` int token ids (any integer dtype, any stride, e.g. ``seq[:, -1:].reshape(-1)``);
            ``T = plan.num_tokens``.
        a: ``(S, R, V)`` stacked embedding A weights, fp16/bf16/fp32, any strides, or a
            :class:`~peft_csgmv.kernels.pool.Pooled` A stack.
        ranks: ``(S,)`` int32 rank of each slot.
        plan: the batch plan on ``ids``' device.
        t: optional ``(T, R)`` fp32 output buffer, any strides.

    Returns:
        ``t``: ``(T, R)`` fp32; only ``t[rows of segment s, :ranks[slot of s]]`` is written.
    """
    (num_tokens,) = ids.shape
    num_slots, r, _ = a.shape
    if num_tokens != plan.num_tokens:
        raise ValueError(f"embedding_shrink: {num_tokens} ids do not fit a plan of {plan.num_tokens} tokens")
    if t is None:
        t = torch.empty((num_tokens, r), dtype=torch.float32, device=ids.device)
    elif t.shape != (num_tokens, r):
        raise ValueError(f"embedding_shrink: t {tuple(t.shape)} is not ({num_tokens}, {r})")
    if plan.num_segments:
        ranks = dense(ranks)
        pooled, stride_as, stride_ar, stride_av = pool_strides(a)
        _launch_embedding_shrink(
            (plan.num_segments, 1, 1),
            (
                ids, a.data if pooled else a, t, plan.permutation, plan.seg_indptr, plan.seg_slot, ranks,
                pool_offsets(a, ranks), ids.stride(0), stride_as, stride_ar, stride_av, t.stride(0), t.stride(1),
            ),
            dict(BLOCK_M=block_size(plan.chunk_size), BLOCK_R=block_size(r), POOLED=pooled),
        )  # fmt: skip
    return t
