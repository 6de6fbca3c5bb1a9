"""Chunked SGMV shrink: the LoRA ``A`` product of every segment, gathered through the plan's permutation.

Semantics::

    for each segment s with slot = seg_slot[s], r = rank[slot], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        t[rows, :r] = x[rows] @ A[slot, :r, :]ᵀ          (fp32 accumulation, t stored in fp32)

Rows that belong to no segment (base rows) and segments whose slot has rank 0 are not touched; ``t[:, r:]`` of a
segment is not written either. ``t`` is indexed by original token, so the expand step reads it through the same
permutation. ``x``, ``A`` and ``t`` are addressed through their strides (views of a wider, offset or transposed buffer
are read and written in place); the per-slot ``ranks`` are read densely, so a strided view of them is copied first.

Split-K: when there are too few segments to fill the GPU (decode with few adapters, wide inputs), the K range is cut
into ``split_k`` parts and each part writes its partial product to its own plane, ``t[p] = x[:, Kp] @ A[:, Kp]ᵀ``;
the expand kernel sums the planes (``t = Σ_p t[p]``). No atomics and no zero-fill are needed.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..plan import BatchPlan
from . import launch
from .common import a_product, block_size, decode_tiles, dense, override_tiles, segment_rows, sm_count
from .launch import Launcher
from .pool import ALIGN, pool_offsets, pool_strides


@triton.jit
def _shrink_kernel(
    x_ptr,  # (T, K) activations, any float dtype
    a_ptr,  # (S, R, K) stacked A, or a pool (POOLED: slot s's (r, K) matrix at element a_off[s])
    t_ptr,  # (P, T, R) fp32 output, one plane per K split
    perm_ptr,  # (T,) int32
    seg_indptr_ptr,  # (num_segments + 1,) int32
    seg_slot_ptr,  # (num_segments,) int32
    rank_ptr,  # (S,) int32
    a_off_ptr,  # (S,) int64 (read only when POOLED)
    K,
    K_PER_SPLIT,  # K elements per split (a multiple of BLOCK_K)
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    stride_tp,
    stride_tm,
    stride_tr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POOLED: tl.constexpr,
    ALIGN: tl.constexpr,
    USE_GDC: tl.constexpr,  # launched with programmatic dependent launch (launch.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()  # the expand may start now: it waits for this grid before reading t
    seg = tl.program_id(0)
    split = tl.program_id(1)
    live = tl.load(seg_indptr_ptr + seg + 1) > tl.load(seg_indptr_ptr + seg)  # a static plan's grid covers the most
    seg_slot = tl.load(seg_slot_ptr + seg)  # segments its shape can have: programs of empty ones exit
    slot = tl.maximum(seg_slot, 0)
    rank = tl.where(seg_slot < 0, 0, tl.load(rank_ptr + slot))
    rows, m_mask = segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)  # no lanes for an empty segment
    if USE_GDC:
        # The plan is not the previous kernel's output, x is, and t may still be read by the one before: wait for
        # it here, on every path (a grid that ends has waited, so the kernels after it wait for all before it).
        tl.extra.cuda.gdc_wait()
    if not live:
        return
    if rank == 0:
        return  # a base segment (slot -1: only an out-of-place expand reads it) or a slot with nothing here
    k_start = split * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)
    acc = a_product(
        x_ptr, a_ptr, a_off_ptr, slot, rank, rows, m_mask, k_start, k_len, stride_xm, stride_xk, stride_as,
        stride_ar, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, POOLED, ALIGN,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    t_ptrs = t_ptr + split * stride_tp + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & (offs_r < rank)[None, :])


_launch_shrink = Launcher(_shrink_kernel, num_tensors=8)


@functools.lru_cache(maxsize=None)
def shrink_tiles(block_m: int, num_segments: int, k: int, device: torch.device) -> tuple[int, int, int, tuple]:
    """``(BLOCK_K, split_k, k_per_split, launch options)`` of the shrink kernel for a row tile, segment count and input
    width: the automatic choice (``split_k="auto"``), which the patched layers use.

    From the tile sweep on the H200 (``benchmarks/tune_kernels.py``, bf16, all real layer shapes, ranks 16 and 64):
    a shrink program reads its rows of ``x`` and the slot's ``A`` once, so a grid of one program per segment leaves
    most SMs idle (64 programs for 8192 prefill tokens, 2–32 in decode). Splitting K until there are about 1.2
    programs per SM (prefill tiles) or 4 per SM (decode tiles, which do little work each) made the shrink 1.5× faster
    in prefill and 2–7× faster in decode; each split keeps at least 128 K elements. Prefill tiles: BLOCK_K 128 for
    inputs of 4096 and more (64 below), 4 warps, 3 stages; decode tiles: BLOCK_K 64, 2 warps when there are 8
    segments or more (else 4), 3 stages.
    """
    sms = sm_count(device)
    if block_m >= 64:
        block_k = 128 if k >= 4096 else 64
        target, options = sms * 6 // 5, (("num_warps", 4), ("num_stages", 3))
    else:
        tune = decode_tiles()
        block_k = tune.get("shrink_block_k", 64)
        warps = tune.get("shrink_warps", 2 if num_segments >= 8 else 4)
        target, options = int(sms * tune.get("shrink_per_sm", 4)), (("num_warps", warps), ("num_stages", 3))
    want = max(1, min(16, target // max(num_segments, 1), k // 128))
    split = 1 << (want.bit_length() - 1)  # a power of two, rounded down
    k_per_split = -(-(-(-k // split)) // block_k) * block_k
    return block_k, -(-k // k_per_split), k_per_split, options


def shrink_splits(plan: BatchPlan, k: int) -> int:
    """How many K splits (planes of the shrink output) ``split_k="auto"`` uses for ``plan`` and input width ``k``."""
    return shrink_tiles(block_size(plan.chunk_size), plan.num_segments, k, plan.permutation.device)[1]


def shrink_launch_args(x, a, ranks, plan, t, split_k, k_per_split, block_k, options) -> tuple:
    """``(grid, args, constexprs, options)`` of one shrink launch (checked arguments; ``t`` 2-D or 3-D)."""
    k = x.shape[1]
    if t.dim() == 2:  # one plane: plane stride 0, no view needed
        stride_tp, (stride_tm, stride_tr) = 0, t.stride()
    else:
        stride_tp, stride_tm, stride_tr = t.stride()
    stride_xm, stride_xk = x.stride()
    pooled, stride_as, stride_ar, stride_ak = pool_strides(a)
    args = (
        x, a.data if pooled else a, t, plan.permutation, plan.seg_indptr, plan.seg_slot, ranks, pool_offsets(a, ranks),
        k, k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_tp, stride_tm, stride_tr,
    )  # fmt: skip
    use_gdc, options = launch.with_pdl(x.device, options)
    constexprs = dict(
        BLOCK_M=block_size(plan.chunk_size),
        BLOCK_R=block_size(a.shape[1]),
        BLOCK_K=block_k,
        # fp32 weights: full fp32 products for fp32 activations (PEFT's numerics to accumulation order); TF32 for
        # half-precision activations, whose own rounding is far coarser (bf16/fp16 weights: the dtype's own products).
        DOT_PRECISION="ieee" if a.dtype == x.dtype == torch.float32 else "tf32",
        POOLED=pooled,
        ALIGN=ALIGN if pooled else 1,
        USE_GDC=use_gdc,
    )
    return (plan.num_segments, split_k, 1), args, constexprs, options


def shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    plan: BatchPlan,
    t: torch.Tensor | None = None,
    split_k: int | str = "auto",
    config: dict | None = None,
) -> torch.Tensor:
    """Launch the shrink kernel.

    Args:
        x: ``(T, K)`` activations, fp16/bf16/fp32, any strides; ``T = plan.num_tokens``.
        a: ``(S, R, K)`` stacked A weights (slot-major), fp16/bf16/fp32, any strides, or a
            :class:`~peft_csgmv.kernels.pool.Pooled` A stack (each slot at its own rank); ``x`` is cast to this dtype
            for the product.
        ranks: ``(S,)`` int32, the rank of each slot (``0`` = the slot does nothing in this layer); a strided view is
            copied first.
        plan: the batch plan (permutation, segments, slot per segment) on ``x``'s device.
        t: optional fp32 output buffer, ``(T, R)`` (then one split is used) or ``(P, T, R)`` with ``P >= split_k``;
            any strides (written in place through them).
        split_k: number of K splits, or ``"auto"`` (the default) for :func:`shrink_tiles`' choice by segment count
            and input width; :func:`shrink_splits` says how many planes that is.
        config: override the tile choice (for tuning): ``block_k``, ``num_warps``, ``num_stages``.

    Returns:
        ``t``: fp32, ``(T, R)`` when one split is used, else ``(P, T, R)`` partial products whose sum over ``P`` is
        the result (:func:`~peft_csgmv.kernels.expand` accepts both). Only ``t[..., rows of segment s,
        :ranks[slot of s]]`` is written.
    """
    num_tokens, k = x.shape
    num_slots, r, k_a = a.shape
    if k_a != k or num_tokens != plan.num_tokens:
        raise ValueError(
            f"shrink: x {tuple(x.shape)} does not fit A {tuple(a.shape)} / plan of {plan.num_tokens} tokens"
        )
    block_m = block_size(plan.chunk_size)
    block_k, auto_split, k_per_split, options = shrink_tiles(block_m, plan.num_segments, k, x.device)
    if config is not None:
        block_k, options = override_tiles(config, "block_k")
    if t is not None and t.dim() == 2 or plan.num_segments == 0:
        split_k = 1
    elif split_k == "auto":
        split_k = auto_split
    if split_k != auto_split or config is not None:
        k_per_split = -(-(-(-k // split_k)) // block_k) * block_k
        split_k = -(-k // k_per_split)
    if t is None:
        shape = (num_tokens, r) if split_k == 1 else (split_k, num_tokens, r)
        t = torch.empty(shape, dtype=torch.float32, device=x.device)
    if t.dim() == 2:
        if t.shape != (num_tokens, r):
            raise ValueError(f"shrink: t {tuple(t.shape)} is not ({num_tokens}, {r})")
    elif t.shape[0] < split_k or t.shape[1:] != (num_tokens, r):
        raise ValueError(f"shrink: t {tuple(t.shape)} cannot hold {split_k} splits of ({num_tokens}, {r})")
    if plan.num_segments:
        _launch_shrink(*shrink_launch_args(x, a, dense(ranks), plan, t, split_k, k_per_split, block_k, options))
    if t.dim() == 2 or t.shape[0] == split_k:
        return t
    return t[0] if split_k == 1 else t[:split_k]
