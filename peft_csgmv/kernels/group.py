"""Sibling groups: the LoRA of up to three layers that read the same input, in one shrink and one expand launch.

Projections such as a decoder block's q/k/v (or gate/up) take the same activations. Run layer by layer, each pays two
launches of a few microseconds that do little work each in decode; grouped, the shrink's programs run over the members
(each its own ``A`` stack, its own plane of ``t``) and the expand's column tiles over the members' outputs one after
another (each tile picks its member by its index: its ``B`` stack, its plane of ``t``, its output).

Semantics, for each member ``g`` (its stack's ranks, scalings, pooled ``A`` and ``B``; see :mod:`.shrink`)::

    t[g, p]  = x[rows, Kp] @ A_g[slot, :r]ᵀ                       (shrink_group, split-K planes p as in .shrink)
    out_g[i] = (Σ_p t[g, p, i, :r]) @ B_g[slot, :, :r]ᵀ · scaling_g[slot]   for every token i of a segment,
               0 for the tokens of base segments and of rank-0 slots   (expand_group: the LoRA alone, fp32)

Members' stacks are pooled (:class:`~.pool.Pooled`) and of one dtype; ``x`` is read through its strides, ``t`` and the
outputs are the contiguous buffers these functions allocate or are given. No programmatic dependent launch (the group
runs on a side stream inside CUDA graphs, as :func:`peft_csgmv.ops.lora_linear`'s LoRA does, or serially).
"""

from __future__ import annotations

import itertools

import torch
import triton
import triton.language as tl

from ..plan import BatchPlan
from .common import a_product, block_size, segment_rows
from .expand import expand_tiles
from .launch import Launcher
from .pool import ALIGN, Pooled
from .shrink import shrink_tiles

MAX_MEMBERS = 3


@triton.jit
def _shrink_group_kernel(
    x_ptr,  # (T, K) activations
    t_ptr,  # (G, P, T, R) fp32
    perm_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    a0_ptr,  # member g's pooled A data, its (S,) int64 offsets and (S,) int32 ranks
    a1_ptr,
    a2_ptr,
    ao0_ptr,
    ao1_ptr,
    ao2_ptr,
    r0_ptr,
    r1_ptr,
    r2_ptr,
    K,
    K_PER_SPLIT,
    stride_xm,
    stride_xk,
    stride_tg,
    stride_tp,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
):
    seg = tl.program_id(0)
    split = tl.program_id(1)
    g = tl.program_id(2)
    a_ptr = a0_ptr
    a_off_ptr = ao0_ptr
    rank_ptr = r0_ptr
    if g == 1:
        a_ptr = a1_ptr
        a_off_ptr = ao1_ptr
        rank_ptr = r1_ptr
    elif g == 2:
        a_ptr = a2_ptr
        a_off_ptr = ao2_ptr
        rank_ptr = r2_ptr
    live = tl.load(seg_indptr_ptr + seg + 1) > tl.load(seg_indptr_ptr + seg)
    seg_slot = tl.load(seg_slot_ptr + seg)
    slot = tl.maximum(seg_slot, 0)
    rank = tl.where(seg_slot < 0, 0, tl.load(rank_ptr + slot))
    rows, m_mask = segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)
    if not live:
        return
    if rank == 0:
        return
    k_start = split * K_PER_SPLIT
    k_len = tl.minimum(K - k_start, K_PER_SPLIT)
    acc = a_product(
        x_ptr, a_ptr, a_off_ptr, slot, rank, rows, m_mask, k_start, k_len, stride_xm, stride_xk, 0, K, 1,
        BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, True, ALIGN,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    t_ptrs = t_ptr + g * stride_tg + split * stride_tp + rows[:, None] * stride_tm + offs_r[None, :]
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & (offs_r < rank)[None, :])


@triton.jit
def _expand_group_kernel(
    t_ptr,  # (G, P, T, R) fp32
    perm_ptr,
    seg_indptr_ptr,
    seg_slot_ptr,
    b0_ptr,  # member g's pooled B data, offsets, ranks, scalings and (T, N_g) fp32 output
    b1_ptr,
    b2_ptr,
    bo0_ptr,
    bo1_ptr,
    bo2_ptr,
    r0_ptr,
    r1_ptr,
    r2_ptr,
    s0_ptr,
    s1_ptr,
    s2_ptr,
    o0_ptr,
    o1_ptr,
    o2_ptr,
    N0,
    N1,
    N2,
    T0,  # column tiles of member 0: [0, T0); member 1: [T0, T1); member 2: [T1, grid)
    T1,
    SPLITS,
    stride_tg,
    stride_tp,
    stride_tm,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ALIGN: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
):
    seg = tl.program_id(0)
    pid = tl.program_id(1)
    g = (pid >= T0).to(tl.int32) + (pid >= T1).to(tl.int32)
    tile = pid - tl.where(g == 0, 0, tl.where(g == 1, T0, T1))
    N = tl.where(g == 0, N0, tl.where(g == 1, N1, N2))
    b_ptr = b0_ptr
    b_off_ptr = bo0_ptr
    rank_ptr = r0_ptr
    scaling_ptr = s0_ptr
    out_ptr = o0_ptr
    if g == 1:
        b_ptr = b1_ptr
        b_off_ptr = bo1_ptr
        rank_ptr = r1_ptr
        scaling_ptr = s1_ptr
        out_ptr = o1_ptr
    elif g == 2:
        b_ptr = b2_ptr
        b_off_ptr = bo2_ptr
        rank_ptr = r2_ptr
        scaling_ptr = s2_ptr
        out_ptr = o2_ptr
    seg_slot = tl.load(seg_slot_ptr + seg)
    slot = tl.maximum(seg_slot, 0)
    rank = tl.where(seg_slot < 0, 0, tl.load(rank_ptr + slot))
    # Out of place: every token of a live segment is written (zeros for base segments and rank-0 slots).
    live = tl.load(seg_indptr_ptr + seg + 1) > tl.load(seg_indptr_ptr + seg)
    if not live:
        return
    scaling = tl.load(scaling_ptr + slot)
    rows, m_mask = segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + tl.multiple_of(tl.load(b_off_ptr + slot), ALIGN)
    b_ptrs = b_base + offs_r[:, None] + offs_n[None, :].to(tl.int64) * tl.multiple_of(rank, RANK_ALIGN)
    b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    t_ptrs = t_ptr + g * stride_tg + rows[:, None] * stride_tm + offs_r[None, :]
    t_mask = m_mask[:, None] & r_mask[None, :]
    t = tl.load(t_ptrs, mask=t_mask, other=0.0)
    for p in range(1, SPLITS):
        t += tl.load(t_ptrs + p * stride_tp, mask=t_mask, other=0.0)
    acc = tl.dot(t.to(b.dtype), b, input_precision=DOT_PRECISION) * scaling
    acc = tl.where(rank > 0, acc, 0.0)
    out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=m_mask[:, None] & n_mask[None, :])


_launch_shrink_group = Launcher(_shrink_group_kernel, num_tensors=14)
_launch_expand_group = Launcher(_expand_group_kernel, num_tensors=19)


def _padded(items: list, n: int = MAX_MEMBERS) -> list:
    """``items`` filled up to ``n`` with its first (the kernels' unused members: never read)."""
    return list(items) + [items[0]] * (n - len(items))


def group_splits(plan: BatchPlan, k: int) -> int:
    """How many split-K planes :func:`shrink_group` writes for ``plan`` and input width ``k``."""
    return shrink_tiles(block_size(plan.chunk_size), plan.num_segments, k, plan.permutation.device)[1]


def shrink_group(x: torch.Tensor, a: list[Pooled], ranks: list[torch.Tensor], plan: BatchPlan, t: torch.Tensor):
    """Every member's shrink in one launch: ``t`` ``(G, P, T, R)`` fp32, ``P`` = :func:`group_splits`, ``R`` at least
    every member's largest rank (only each segment's rows and rank are written). ``a``: the members' pooled A stacks
    (one dtype, ``K`` = ``x``'s width); ``ranks``: their dense int32 per-slot ranks."""
    g, k = len(a), x.shape[1]
    if not 1 <= g <= MAX_MEMBERS or any(not isinstance(w, Pooled) or w.shape[2] != k for w in a):
        raise ValueError(f"shrink_group: 1 to {MAX_MEMBERS} pooled A stacks of width {k}")
    block_m = block_size(plan.chunk_size)
    block_k, splits, k_per_split, options = shrink_tiles(block_m, plan.num_segments, k, x.device)
    if t.shape[:2] != (g, splits) or t.shape[2] != plan.num_tokens or not t.is_contiguous():
        raise ValueError(f"shrink_group: t {tuple(t.shape)} is not a contiguous ({g}, {splits}, {plan.num_tokens}, R)")
    if plan.num_segments == 0:
        return t
    r = t.shape[3]
    args = (
        x, t, plan.permutation, plan.seg_indptr, plan.seg_slot, *_padded([w.data for w in a]),
        *_padded([w.offsets.contiguous() for w in a]), *_padded([v.contiguous() for v in ranks]), k, k_per_split,
        *x.stride(), t.stride(0), t.stride(1), t.stride(2),
    )  # fmt: skip
    constexprs = dict(
        BLOCK_M=block_m, BLOCK_R=block_size(r), BLOCK_K=block_k,
        DOT_PRECISION="ieee" if a[0].dtype == x.dtype == torch.float32 else "tf32", ALIGN=ALIGN,
    )  # fmt: skip
    _launch_shrink_group((plan.num_segments, splits, g), args, constexprs, options)
    return t


def expand_group(
    t: torch.Tensor,
    b: list[Pooled],
    ranks: list[torch.Tensor],
    scalings: list[torch.Tensor],
    plan: BatchPlan,
    outs: list[torch.Tensor],
    act_dtype: torch.dtype,
) -> list[torch.Tensor]:
    """Every member's expand in one launch, the LoRA alone: ``outs[g]`` ``(T, N_g)`` contiguous fp32 gets member
    ``g``'s LoRA of every token of the plan's segments (zeros on base rows and rank-0 slots). ``t``: what
    :func:`shrink_group` wrote; ``act_dtype``: the activations' dtype (fp32 activations and fp32 weights: full fp32
    products, else TF32 for fp32 weights, as :func:`~.expand.expand` decides)."""
    g = len(b)
    if len(outs) != g or g != t.shape[0] or any(
        not isinstance(w, Pooled) or o.shape != (plan.num_tokens, w.shape[1]) or o.dtype != torch.float32
        or not o.is_contiguous() for w, o in zip(b, outs)
    ):  # fmt: skip
        raise ValueError("expand_group: one contiguous fp32 (T, N) output per pooled B stack and plane group of t")
    if plan.num_segments == 0:
        return outs
    r = max(w.shape[2] for w in b)
    block_n, options = expand_tiles(block_size(plan.chunk_size), plan.num_segments, r)
    ends = list(itertools.accumulate(-(-w.shape[1] // block_n) for w in b))
    # Where members 1 and 2 start (a member past the last starts at the grid's end: no tile picks it).
    starts = (ends[:-1] + [ends[-1]] * MAX_MEMBERS)[: MAX_MEMBERS - 1]
    args = (
        t, plan.permutation, plan.seg_indptr, plan.seg_slot, *_padded([w.data for w in b]),
        *_padded([w.offsets.contiguous() for w in b]), *_padded([v.contiguous() for v in ranks]),
        *_padded([v.contiguous() for v in scalings]), *_padded(outs), *_padded([w.shape[1] for w in b]), *starts,
        t.shape[1], t.stride(0), t.stride(1), t.stride(2),
    )  # fmt: skip
    constexprs = dict(
        BLOCK_M=block_size(plan.chunk_size), BLOCK_N=block_n, BLOCK_R=block_size(t.shape[3]),
        DOT_PRECISION="ieee" if b[0].dtype == act_dtype == torch.float32 else "tf32", ALIGN=ALIGN,
        RANK_ALIGN=min(w.rank_align for w in b),
    )  # fmt: skip
    _launch_expand_group((plan.num_segments, ends[-1], 1), args, constexprs, options)
    return outs
