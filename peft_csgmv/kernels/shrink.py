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

from ..options import env
from ..plan import BatchPlan
from . import launch
from .launch import Launcher
from .pool import ALIGN, pool_offsets, pool_strides


@triton.jit
def _segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M: tl.constexpr):
    """The original token indices of segment ``seg`` (``BLOCK_M`` lanes, int64) and the mask of lanes in use."""
    start = tl.load(seg_indptr_ptr + seg)
    length = tl.load(seg_indptr_ptr + seg + 1) - start
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def _a_product(
    x_ptr,
    a_ptr,
    a_off_ptr,
    slot,
    rank,
    rows,
    m_mask,
    k_start,
    k_len,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    POOLED: tl.constexpr,
    ALIGN: tl.constexpr,
):
    """``x[rows, k_start : k_start + k_len] @ A[slot, :rank, k_start : k_start + k_len]ᵀ`` as a ``(BLOCK_M,
    BLOCK_R)`` fp32 tile (lanes past ``rank`` and masked rows are 0): the shrink's work, which the fused expand does
    too."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + offs_k[None, :]) * stride_xk
    if POOLED:
        a_base = a_ptr + tl.multiple_of(tl.load(a_off_ptr + slot), ALIGN)
    else:
        a_base = a_ptr + slot.to(tl.int64) * stride_as
    a_ptrs = a_base + offs_r[None, :] * stride_ar + (k_start + offs_k[:, None]) * stride_ak
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, tl.cdiv(k_len, BLOCK_K)):
        k_mask = offs_k < k_len - k * BLOCK_K
        a = tl.load(a_ptrs, mask=r_mask[None, :] & k_mask[:, None], other=0.0)
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        a_ptrs += BLOCK_K * stride_ak
    return acc


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
    rows, m_mask = _segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)  # no lanes for an empty segment
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
    acc = _a_product(
        x_ptr, a_ptr, a_off_ptr, slot, rank, rows, m_mask, k_start, k_len, stride_xm, stride_xk, stride_as,
        stride_ar, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, POOLED, ALIGN,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    t_ptrs = t_ptr + split * stride_tp + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & (offs_r < rank)[None, :])


_launch_shrink = Launcher(_shrink_kernel, num_tensors=8)


@functools.lru_cache(maxsize=None)
def _block(n: int) -> int:
    """Tile size for a dimension of ``n`` (at least 16, as ``tl.dot`` needs). Plain Python: Triton's own helpers
    cost microseconds per call on the launch path."""
    return max(16, 1 << (n - 1).bit_length())


def _dense(v: torch.Tensor) -> torch.Tensor:
    """``v`` where the kernels may read it densely (element ``i`` at ``ptr + i``, as they read the per-slot vectors
    and tables), else a contiguous copy of it."""
    return v.contiguous()


def _tiles(config: dict, block: str) -> tuple[int, tuple]:
    """``(block size, launch options)`` from a tuning override."""
    return config[block], tuple((k, config[k]) for k in ("num_warps", "num_stages") if k in config)


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
    sms = _sm_count(device)
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


def decode_tiles() -> dict:
    """A developer switch for tuning decode tiles inside compiled graphs, where kernels share the GPU with the base
    products: ``PEFT_CSGMV_DECODE_TILES="shrink_per_sm=2,expand_block_n=256"`` overrides the decode tiles' choices
    (keys ``shrink_per_sm`` (programs per SM the split-K aims at), ``shrink_block_k``, ``shrink_warps``,
    ``expand_block_n``, ``expand_warps``). Read when a tile is first chosen for a shape (the choices are cached:
    ``shrink_tiles.cache_clear()`` and ``expand_tiles.cache_clear()`` read it again)."""
    spec = env("PEFT_CSGMV_DECODE_TILES")
    items = (item.split("=") for item in spec.split(",") if item.strip())
    return {key.strip(): (float if key.strip() == "shrink_per_sm" else int)(value) for key, value in items}


_SM_COUNT: dict = {}


def _sm_count(device: torch.device) -> int:
    n = _SM_COUNT.get(device)
    if n is None:
        # Under the interpreter (CPU tensors) pretend to a small GPU, so CPU tests exercise split-K.
        n = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        _SM_COUNT[device] = n
    return n


def shrink_splits(plan: BatchPlan, k: int) -> int:
    """How many K splits (planes of the shrink output) ``split_k="auto"`` uses for ``plan`` and input width ``k``."""
    return shrink_tiles(_block(plan.chunk_size), plan.num_segments, k, plan.permutation.device)[1]


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
        BLOCK_M=_block(plan.chunk_size),
        BLOCK_R=_block(a.shape[1]),
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
    block_m = _block(plan.chunk_size)
    block_k, auto_split, k_per_split, options = shrink_tiles(block_m, plan.num_segments, k, x.device)
    if config is not None:
        block_k, options = _tiles(config, "block_k")
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
        _launch_shrink(*shrink_launch_args(x, a, _dense(ranks), plan, t, split_k, k_per_split, block_k, options))
    if t.dim() == 2 or t.shape[0] == split_k:
        return t
    return t[0] if split_k == 1 else t[:split_k]
