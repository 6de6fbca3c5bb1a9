"""Chunked SGMV expand: add each segment's LoRA ``B`` product, scaled, onto the base output in place.

Semantics::

    for each segment s with slot = seg_slot[s], r = rank[slot], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        y[rows] += (t[rows, :r] @ B[slot, :, :r]ᵀ) * scaling[slot]     (fp32 accumulation, one rounding to y's dtype)

With split-K shrink output ``t`` has ``P`` planes of partial products and ``t = Σ_p t[p]`` is formed in fp32 first.
DoRA (``mag`` given): every slot also has a per-output-feature scale ``m[slot] = magnitude / ‖W + scaling·B·A‖``
(computed once per adapter when it is stacked; 1 for plain LoRA slots), applied to the whole layer output of its
rows, bias excluded::

        y[rows] = m[slot] · (y[rows] − bias + (t[rows, :r] @ B[slot, :, :r]ᵀ) · scaling[slot]) + bias

``lora_bias=True`` adapters (``lora_bias`` given): ``lora_B``'s bias of the slot is added before the scaling,
``(t[rows, :r] @ B[slot, :, :r]ᵀ + lbias[slot]) · scaling[slot]``.

Out of place (``out`` given): ``out[rows] = y[rows] + …`` for the segments' rows, ``y`` untouched; segments whose slot
is ``-1`` (the base rows, which a static plan cuts into segments too) or has rank 0 copy ``y[rows]`` to ``out[rows]``
exactly, so a plan whose segments cover every token writes all of ``out`` in one launch (no clone of ``y`` first).

``t`` is cast to ``B``'s dtype before the product (as PEFT feeds ``lora_A``'s output to ``lora_B`` in the adapter
dtype). Rows in no segment (base rows) and segments whose slot has rank 0 are left as they are. ``t``, ``B`` and ``y``
are addressed through their strides (``y`` may be a view of a wider, offset or transposed buffer: it is updated in place
there, and nothing else of that buffer is touched); the per-slot vectors and tables (``ranks``, ``scalings``, ``mag``,
``bias``, ``lora_bias``) are read densely, so a strided view of them is copied first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..plan import BatchPlan
from . import launch
from .common import a_product, block_size, decode_tiles, dense, override_tiles, segment_rows
from .launch import Launcher
from .pool import ALIGN, pool_offsets, pool_strides


@triton.jit
def _expand_kernel(
    t_ptr,  # (P, T, R) fp32 shrink output (P split-K planes)
    b_ptr,  # (S, N, R) stacked B, or a pool (POOLED: slot s's (N, r) matrix at element b_off[s])
    y_ptr,  # (T, N) base output, updated in place (or read, OUT_OF_PLACE)
    out_ptr,  # (T, N) output (written only when OUT_OF_PLACE)
    perm_ptr,  # (T,) int32
    seg_indptr_ptr,  # (num_segments + 1,) int32
    seg_slot_ptr,  # (num_segments,) int32
    rank_ptr,  # (S,) int32
    scaling_ptr,  # (S,) fp32
    mag_ptr,  # (S, N) fp32 DoRA scale (read only with HAS_DORA)
    bias_ptr,  # (N,) fp32 base-layer bias (read only with HAS_DORA)
    lbias_ptr,  # (S, N) fp32 lora_B bias per slot (read only with HAS_LORA_BIAS)
    b_off_ptr,  # (S,) int64 (read only when POOLED)
    x_ptr,  # (T, K) activations (read only when FUSED)
    a_ptr,  # stacked or pooled A, as the shrink's (read only when FUSED)
    a_off_ptr,  # (S,) int64 (read only when FUSED and POOLED)
    N,
    K,
    SPLITS,
    stride_tp,
    stride_tm,
    stride_tr,
    stride_bs,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    stride_om,
    stride_on,
    stride_ms,
    stride_lbs,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ar,
    stride_ak,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HAS_DORA: tl.constexpr,
    HAS_LORA_BIAS: tl.constexpr,
    POOLED: tl.constexpr,
    ALIGN: tl.constexpr,
    RANK_ALIGN: tl.constexpr,
    OUT_OF_PLACE: tl.constexpr,
    FUSED: tl.constexpr,  # t = x[rows] @ A[slot]ᵀ computed here over all of K (no shrink launch, no t in memory)
    BLOCK_K: tl.constexpr,
    ADD_Y: tl.constexpr,  # out = y + LoRA; else (out of place, no DoRA) out = the LoRA alone, y never read
    USE_GDC: tl.constexpr,  # launched with programmatic dependent launch (launch.pdl)
):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg_slot = tl.load(seg_slot_ptr + seg)
    slot = tl.maximum(seg_slot, 0)  # a base segment (-1) reads slot 0's entries, all masked or discarded below
    rank = tl.where(seg_slot < 0, 0, tl.load(rank_ptr + slot))
    # An empty segment (a static plan's grid covers the most segments its shape can have), or in place a rank-0 slot
    # (nothing to add; out of place, its rows are copied): the program exits, after the wait below.
    live = (tl.load(seg_indptr_ptr + seg + 1) > tl.load(seg_indptr_ptr + seg)) & (rank + OUT_OF_PLACE > 0)
    scaling = tl.load(scaling_ptr + slot)
    rows, m_mask = segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    if POOLED:  # row-major (N, rank) at b_off[slot]: the row stride is the slot's rank
        b_base = b_ptr + tl.multiple_of(tl.load(b_off_ptr + slot), ALIGN)
        b_ptrs = b_base + offs_r[:, None] + offs_n[None, :].to(tl.int64) * tl.multiple_of(rank, RANK_ALIGN)
    else:
        b_base = b_ptr + slot.to(tl.int64) * stride_bs
        b_ptrs = b_base + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn
    b = tl.load(b_ptrs, mask=(offs_r < tl.where(live, rank, 0))[:, None] & n_mask[None, :], other=0.0)
    if USE_GDC:
        # The plan and B above are not the previous kernel's output; t, x and y may be, and out may still be read by
        # the one before. Every program waits (see the shrink).
        tl.extra.cuda.gdc_wait()
    if not live:
        return
    if FUSED:  # rank 0 (a base segment copied out of place): no K steps
        t = a_product(
            x_ptr, a_ptr, a_off_ptr, slot, rank, rows, m_mask, 0, tl.where(rank > 0, K, 0), stride_xm, stride_xk,
            stride_as, stride_ar, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, POOLED, ALIGN,
        )  # fmt: skip
    else:
        t_ptrs = t_ptr + rows[:, None] * stride_tm + offs_r[None, :] * stride_tr
        t_mask = m_mask[:, None] & r_mask[None, :]
        t = tl.load(t_ptrs, mask=t_mask, other=0.0)
        for p in range(1, SPLITS):
            t += tl.load(t_ptrs + p * stride_tp, mask=t_mask, other=0.0)
    acc = tl.dot(t.to(b.dtype), b, input_precision=DOT_PRECISION)
    if HAS_LORA_BIAS:
        acc += tl.load(lbias_ptr + slot.to(tl.int64) * stride_lbs + offs_n, mask=n_mask, other=0.0)[None, :]
    acc = acc * scaling

    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    if ADD_Y:
        y_in = tl.load(y_ptrs, mask=mask, other=0.0)
    else:  # the LoRA alone: base and rank-0 rows get zeros
        y_in = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
    y = y_in.to(tl.float32)
    if HAS_DORA:
        mag = tl.load(mag_ptr + slot.to(tl.int64) * stride_ms + offs_n, mask=n_mask, other=1.0)
        bias = tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0)
        out = mag[None, :] * (y - bias[None, :] + acc) + bias[None, :]
    else:
        out = y + acc
    if OUT_OF_PLACE:
        # Base and rank-0 rows: y exactly (acc is 0 there, but DoRA's and a cast's roundings are not).
        out = tl.where(rank > 0, out.to(out_ptr.dtype.element_ty), y_in.to(out_ptr.dtype.element_ty))
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :] * stride_on, out, mask=mask)
    else:
        tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=mask)


_launch_expand = Launcher(_expand_kernel, num_tensors=16)


@functools.lru_cache(maxsize=None)
def expand_tiles(block_m: int, num_segments: int, r: int) -> tuple[int, tuple]:
    """``(BLOCK_N, launch options)`` of the expand kernel for a row tile, segment count and max rank.

    From the tile sweep on the H200 (``benchmarks/tune_kernels.py``): prefill tiles of 128 rows want BLOCK_N 128 with
    8 warps at ranks up to 32 and 4 warps above (10–30% over BLOCK_N 64); tiles of 64 rows (short runs) the other
    way round, 4 warps up to rank 32 and 8 above (~10%); decode tiles BLOCK_N 128 when many segments share the grid,
    64 when few (within a few percent either way)."""
    if block_m >= 128:
        return 128, (("num_warps", 8 if r <= 32 else 4),)
    if block_m == 64:
        return 128, (("num_warps", 4 if r <= 32 else 8),)
    tune = decode_tiles()
    block_n = tune.get("expand_block_n", 128 if num_segments >= 8 else 64)
    return block_n, (("num_warps", tune.get("expand_warps", 4)),)


def expand_launch_args(
    t, b, ranks, scalings, plan, y, mag, bias, lora_bias, has_dora, has_lora_bias, block_n, options, out=None,
    fused=None, act_dtype=None,
) -> tuple:  # fmt: skip
    """``(grid, args, constexprs, options)`` of one expand launch (checked arguments; unused ``mag``/``bias``/
    ``lora_bias`` are any fp32 tensor; ``out``: the out-of-place output, else ``y`` is updated in place; ``fused``:
    ``(x, A stack, BLOCK_K)`` where the kernel computes ``t`` itself, ``t`` then unused; ``y`` ``None``: ``out`` gets
    the LoRA alone, and ``act_dtype`` is the activations' dtype, which decides the products' precision as ``y``'s
    does)."""
    add_y = y is not None
    if not add_y:
        y = out  # never read: its strides stand in
    if t.dim() == 2:  # one plane: plane stride 0, no view needed
        splits, stride_tp, (stride_tm, stride_tr) = 1, 0, t.stride()
    else:
        splits, (stride_tp, stride_tm, stride_tr) = t.shape[0], t.stride()
    n = y.shape[1]
    pooled, stride_bs, stride_bn, stride_br = pool_strides(b)
    stride_ym, stride_yn = y.stride()
    out_of_place = out is not None
    stride_om, stride_on = out.stride() if out_of_place else (0, 0)
    if fused is None:  # never read: any tensors, zero strides
        x, a_data, a_off, k, x_strides, a_strides, block_k = t, t, ranks, 0, (0, 0), (0, 0, 0), 16
    else:
        x, a, block_k = fused
        a_pooled, *a_strides = pool_strides(a)
        if a_pooled != pooled:
            raise ValueError("expand: a fused launch takes A and B stacked the same way (both pooled, or neither)")
        a_data, a_off, k, x_strides = a.data if pooled else a, pool_offsets(a, ranks), x.shape[1], x.stride()
    args = (
        t, b.data if pooled else b, y, out if out_of_place else y, plan.permutation, plan.seg_indptr, plan.seg_slot,
        ranks, scalings, mag, bias, lora_bias, pool_offsets(b, ranks), x, a_data, a_off, n, k, splits, stride_tp,
        stride_tm, stride_tr, stride_bs, stride_bn, stride_br, stride_ym, stride_yn, stride_om, stride_on,
        mag.stride(0) if has_dora else 0, lora_bias.stride(0) if has_lora_bias else 0, *x_strides, *a_strides,
    )  # fmt: skip
    use_gdc, options = launch.with_pdl(y.device, options)
    constexprs = dict(
        BLOCK_M=block_size(plan.chunk_size),
        BLOCK_N=block_n,
        BLOCK_R=block_size(b.shape[2]),
        DOT_PRECISION="ieee" if b.dtype == (act_dtype or y.dtype) == torch.float32 else "tf32",  # as in the shrink
        HAS_DORA=has_dora,
        HAS_LORA_BIAS=has_lora_bias,
        POOLED=pooled,
        ALIGN=ALIGN if pooled else 1,
        RANK_ALIGN=b.rank_align if pooled else 1,
        OUT_OF_PLACE=out_of_place,
        FUSED=fused is not None,
        BLOCK_K=block_k,
        ADD_Y=add_y,
        USE_GDC=use_gdc,
    )
    return (plan.num_segments, -(-n // block_n), 1), args, constexprs, options


def expand(
    t: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    plan: BatchPlan,
    y: torch.Tensor | None,
    mag: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    lora_bias: torch.Tensor | None = None,
    config: dict | None = None,
    out: torch.Tensor | None = None,
    x: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    act_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Launch the expand kernel; ``y`` is updated in place and returned (or, with ``out``, ``out`` is written and
    returned, ``y`` only read; with ``y=None``, ``out`` gets the LoRA alone). With ``x`` and ``a``, *fused*: the
    kernel computes ``t = x @ A[slot]ᵀ`` itself over all of ``K`` (the shrink's product, in the same fp32
    accumulation), so one launch does the whole LoRA of a layer and ``t`` never goes through memory; each program of a
    segment repeats that product for its ``BLOCK_N`` columns, which pays where ``K`` is short and the segments few rows
    (decode: see :func:`fused_fits`).

    Args:
        t: ``(T, R)`` or ``(P, T, R)`` fp32, the shrink output (``R`` = the layer's max rank; ``P`` split-K planes,
            summed here), any strides.
        b: ``(S, N, R)`` stacked B weights (slot-major), fp16/bf16/fp32, any strides, or a
            :class:`~peft_csgmv.kernels.pool.Pooled` B stack (each slot at its own rank).
        ranks: ``(S,)`` int32 rank of each slot.
        scalings: ``(S,)`` fp32 scaling of each slot (this and the per-slot tensors below: a strided view is copied
            first).
        plan: the batch plan on ``y``'s device.
        y: ``(T, N)`` base output, fp16/bf16/fp32, any strides (updated in place through them); or ``None`` with
            ``out`` (not DoRA): ``out`` gets the LoRA alone, ``(t @ Bᵀ + lora_bias) · scaling`` rounded once to
            ``out``'s dtype (fp32 for a caller that adds it to the base output itself, as the out-of-place sum would),
            zeros for the rows of slot ``-1`` or of a rank-0 slot.
        mag: optional ``(S, N)`` fp32 DoRA scale per slot and output feature (1 for plain LoRA slots).
        bias: with ``mag``, the ``(N,)`` fp32 base-layer bias that ``y`` includes (zeros for none).
        lora_bias: optional ``(S, N)`` fp32 bias of each slot's ``lora_B`` (PEFT's ``lora_bias=True``; zeros for the
            others), added before the scaling.
        config: override the tile choice (for tuning): ``block_n``, ``num_warps``, ``num_stages`` (fused: and
            ``block_k``).
        out: optional ``(T, N)`` output of ``y``'s dtype, any strides: written out of place for every token of a
            segment (``y`` plus the LoRA; a copy of ``y`` for segments of slot ``-1`` or of a rank-0 slot). Tokens in
            no segment are not written: the caller's plan covers every token (as a static plan's base segments do).
        x: fused only, ``(T, K)`` activations, any strides, as :func:`~peft_csgmv.kernels.shrink` takes them (``t``
            is then not read and may be ``None``).
        a: fused only, the A stack, as :func:`~peft_csgmv.kernels.shrink` takes it, stacked as ``b`` is.
        act_dtype: with ``y=None``, the activations' dtype (fp32 activations and fp32 weights: full fp32 products,
            else TF32 for fp32 weights, as with ``y`` of that dtype).
    """
    alone = y is None
    if alone:
        if out is None or mag is not None:
            raise ValueError("expand: y=None (the LoRA alone) needs out, and is not for DoRA")
        num_tokens, n = out.shape
    else:
        num_tokens, n = y.shape
        if out is not None and (out.shape != y.shape or out.dtype != y.dtype):
            raise ValueError(f"expand: out {tuple(out.shape)} {out.dtype} is not like y {tuple(y.shape)} {y.dtype}")
    num_slots, n_b, r = b.shape
    fusing = x is not None
    if fusing:
        if a is None or a.shape[:2] != (num_slots, r) or x.shape != (num_tokens, a.shape[2]):
            raise ValueError(
                f"expand: fused x {tuple(x.shape)} and A {None if a is None else tuple(a.shape)} do not fit B "
                f"{tuple(b.shape)} and y {(num_tokens, n)}"
            )
        t = scalings.view(-1, 1)  # never read
    if n_b != n or (not fusing and t.shape[-2:] != (num_tokens, r)) or num_tokens != plan.num_tokens:
        raise ValueError(
            f"expand: t {tuple(t.shape)}, B {tuple(b.shape)} and y {(num_tokens, n)} do not fit a plan of "
            f"{plan.num_tokens} tokens"
        )
    if plan.num_segments == 0:
        return y if out is None else out
    has_dora = mag is not None
    if has_dora and (mag.shape != (num_slots, n) or bias is None or bias.shape != (n,)):
        raise ValueError(f"expand: DoRA needs mag ({num_slots}, {n}) and bias ({n},)")
    ranks, scalings = dense(ranks), dense(scalings)
    if has_dora:
        mag, bias = dense(mag), dense(bias)
    else:
        mag = bias = scalings  # never read
    has_lora_bias = lora_bias is not None
    if has_lora_bias and lora_bias.shape != (num_slots, n):
        raise ValueError(f"expand: lora_bias must be ({num_slots}, {n}), got {tuple(lora_bias.shape)}")
    lora_bias = dense(lora_bias) if has_lora_bias else scalings  # else never read
    block_m = block_size(plan.chunk_size)
    fused = None
    if fusing:
        block_n, block_k, options = fused_tiles(x.shape[1])
        if config is not None:
            (block_n, options), block_k = override_tiles(config, "block_n"), config.get("block_k", block_k)
        fused = (x, a, block_k)
    elif config is None:
        block_n, options = expand_tiles(block_m, plan.num_segments, r)
    else:
        block_n, options = override_tiles(config, "block_n")
    _launch_expand(
        *expand_launch_args(t, b, ranks, scalings, plan, y, mag, bias, lora_bias, has_dora, has_lora_bias, block_n,
                            options, out, fused, act_dtype)
    )  # fmt: skip
    return y if out is None else out


# Fused launches (one per layer) where both products are short: decode-sized plans (16-row tiles, fewer than 64
# tokens) over inputs of at most this width. Each program repeats its segment's whole A product, so wide inputs
# keep the split-K shrink and the expand.
FUSED_MAX_K = 4096


def fused_fits(num_tokens: int, k: int) -> bool:
    """Whether a layer of input width ``k`` over a plan of ``num_tokens`` tokens runs fused (one launch)."""
    return num_tokens < 64 and k <= FUSED_MAX_K


@functools.lru_cache(maxsize=None)
def fused_tiles(k: int) -> tuple[int, int, tuple]:
    """``(BLOCK_N, BLOCK_K, launch options)`` of a fused launch: wide column tiles (each repeats the A product),
    K in steps of 128 (64 for inputs narrower than 1024). Not yet tuned on the H200."""
    return 256, (128 if k >= 1024 else 64), (("num_warps", 4), ("num_stages", 3))
