"""Expert LoRA over routed pairs: the shrink and the expand of every (expert, slot) segment of a :class:`MoePlan`.

A MoE layer's adapters hold one LoRA per expert (``A[slot, expert]``: ``(r, K)``, ``B[slot, expert]``: ``(N, r)``),
and each routed pair (a token sent to one expert) takes the LoRA of its token's slot for its expert. Both kernels run
one program per segment of the plan (one slot, one expert, up to ``chunk_size`` pairs; ``BLOCK_N`` columns each for
the expand) and skip empty segments, base pairs and unrouted pairs.

Rows: each operand's rows are addressed in one of three ways, named by the launchers' ``*_rows`` arguments, for the
pair ``p = permutation[q]`` at sorted position ``q`` of a segment:

- ``"token"``: row ``p // top_k``, the pair's token (``x`` is the layer input, ``(T, K)``: the gate/up LoRA);
- ``"pair"``: row ``p``, one row per pair in transformers' ``top_k_index.reshape(-1)`` order (``(T * top_k, ·)``);
- ``"sorted"``: row ``q``, one row per pair in the plan's sorted order (the order of a grouped base product that uses
  ``plan.permutation`` and ``plan.expert_offsets``).

The shrink's output ``t`` always has one row per pair (``"pair"``).

Semantics (shrink)::

    for each segment s with slot = seg_slot[s], e = seg_expert[s], r = rank[slot], q in seg_start[s]:seg_end[s],
            p = permutation[q]:
        t[p, :r] = x[row_x(q)] @ A[slot, e, :r, :]ᵀ               (x cast to A's dtype, fp32 accumulation, t fp32)

Semantics (expand)::

    for each segment s as above:
        y[row_y(q)] += (t[p, :r] @ B[slot, e, :, :r]ᵀ) * scaling[slot]   (t cast to B's dtype, fp32 accumulation,
                                                                        one rounding to y's dtype)

Layouts: by default ``A`` and ``B`` are ``(S, E, R, K)`` / ``(S, E, N, R)`` tensors read through their strides, each
slot padded to ``R``. With ``own_rank`` each slot holds its weights at its own rank ``r`` as PEFT stores them (``A``'s
expert ``e`` at rows ``e·r .. e·r + r`` of the slot, ``B``'s output row ``n`` at ``n·r`` rank strides): the slot's
block is PEFT's ``lora_A`` / ``lora_B`` weight itself, whatever its rank (see :meth:`~peft_csgmv.moe.MoeStack.slot_a`).

Rows in no segment (base pairs, unrouted pairs) and segments whose slot has rank 0 are not touched: ``t[p, r:]`` is
not written, ``y`` keeps its bits. ``x``, ``A``, ``t``, ``B`` and ``y`` are addressed through their strides (views of
wider, offset or transposed buffers, and ``B`` as a strided view of PEFT's ``lora_B`` weight, are read and written in
place); the per-slot ``ranks`` and ``scalings`` and the plan's arrays are read densely (a strided view is copied).
The caller combines the per-pair rows as the model does (activation between the two LoRA'd products, routing weights
after the second).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..moe_plan import MoePlan
from .common import a_product, block_size, dense
from .launch import Launcher

ROWS = {"token": 0, "pair": 1, "sorted": 2}


@triton.jit
def _pair_rows(seg, seg_start_ptr, seg_end_ptr, perm_ptr, BLOCK_M: tl.constexpr):
    """The sorted positions ``q`` of segment ``seg`` (``BLOCK_M`` lanes, int64), their pairs ``p`` (int64) and the
    mask of lanes in use (none for an empty segment)."""
    start = tl.load(seg_start_ptr + seg)
    length = tl.load(seg_end_ptr + seg) - start
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    q = (start + offs_m).to(tl.int64)
    p = tl.load(perm_ptr + q, mask=m_mask, other=0).to(tl.int64)
    return q, p, m_mask


@triton.jit
def _rows_of(q, p, top_k, MODE: tl.constexpr):
    """An operand's rows for positions ``q`` / pairs ``p``: ``ROWS`` mode 0 token, 1 pair, 2 sorted."""
    if MODE == 0:
        rows = p // top_k
    elif MODE == 1:
        rows = p
    else:
        rows = q
    return rows


@triton.jit
def _moe_shrink_kernel(
    x_ptr,  # (T, K) by token, or (P, K) by pair / sorted position; any float dtype
    a_ptr,  # (S, E, R, K) stacked A
    t_ptr,  # (P, R) fp32 output, by pair
    perm_ptr,  # (P,) int32
    seg_start_ptr,  # (M,) int32
    seg_end_ptr,  # (M,) int32
    seg_slot_ptr,  # (M,) int32
    seg_expert_ptr,  # (M,) int32
    rank_ptr,  # (S,) int32
    K,
    top_k,
    stride_xm,
    stride_xk,
    stride_as,
    stride_ae,
    stride_ar,
    stride_ak,
    stride_tm,
    stride_tr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    X_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OWN_RANK: tl.constexpr,
):
    seg = tl.program_id(0)
    q, p, m_mask = _pair_rows(seg, seg_start_ptr, seg_end_ptr, perm_ptr, BLOCK_M)
    live = tl.load(seg_end_ptr + seg) > tl.load(seg_start_ptr + seg)
    slot = tl.maximum(tl.load(seg_slot_ptr + seg), 0)  # an empty segment's -1 reads slot 0 and exits below
    rank = tl.where(live, tl.load(rank_ptr + slot), 0)
    if rank == 0:
        return
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    if OWN_RANK:  # the slot's (E, r, K) block at its own rank: expert e's rows start at row e·r
        expert_base = expert * rank.to(tl.int64) * stride_ar
    else:
        expert_base = expert * stride_ae
    rows = _rows_of(q, p, top_k, X_ROWS)
    acc = a_product(
        x_ptr, a_ptr + expert_base, a_ptr, slot, rank, rows, m_mask, 0, K, stride_xm, stride_xk, stride_as,
        stride_ar, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, False, 1,
    )  # fmt: skip
    offs_r = tl.arange(0, BLOCK_R)
    t_ptrs = t_ptr + p[:, None] * stride_tm + offs_r[None, :] * stride_tr
    tl.store(t_ptrs, acc, mask=m_mask[:, None] & (offs_r < rank)[None, :])


@triton.jit
def _moe_expand_kernel(
    t_ptr,  # (P, R) fp32 shrink output, by pair
    b_ptr,  # (S, E, N, R) stacked B
    y_ptr,  # (P, N) per-pair output (by pair or sorted position), updated in place
    perm_ptr,  # (P,) int32
    seg_start_ptr,  # (M,) int32
    seg_end_ptr,  # (M,) int32
    seg_slot_ptr,  # (M,) int32
    seg_expert_ptr,  # (M,) int32
    rank_ptr,  # (S,) int32
    scaling_ptr,  # (S,) fp32
    N,
    top_k,
    stride_tm,
    stride_tr,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    Y_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    OWN_RANK: tl.constexpr,
):
    seg = tl.program_id(0)
    pid_n = tl.program_id(1)
    q, p, m_mask = _pair_rows(seg, seg_start_ptr, seg_end_ptr, perm_ptr, BLOCK_M)
    live = tl.load(seg_end_ptr + seg) > tl.load(seg_start_ptr + seg)
    slot = tl.maximum(tl.load(seg_slot_ptr + seg), 0)
    rank = tl.where(live, tl.load(rank_ptr + slot), 0)
    if rank == 0:
        return
    expert = tl.load(seg_expert_ptr + seg).to(tl.int64)
    scaling = tl.load(scaling_ptr + slot)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N

    if OWN_RANK:  # the slot's (N, r, E) block at its own rank: output row n starts at n·r·E
        row_stride = rank.to(tl.int64) * stride_br
    else:
        row_stride = stride_bn
    b_base = b_ptr + slot.to(tl.int64) * stride_bs + expert * stride_be
    b_ptrs = b_base + offs_r[:, None] * stride_br + offs_n[None, :].to(tl.int64) * row_stride
    b = tl.load(b_ptrs, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
    t_ptrs = t_ptr + p[:, None] * stride_tm + offs_r[None, :] * stride_tr
    t = tl.load(t_ptrs, mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    acc = tl.dot(t.to(b.dtype), b, input_precision=DOT_PRECISION) * scaling

    rows = _rows_of(q, p, top_k, Y_ROWS)
    y_ptrs = y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + acc).to(y_ptr.dtype.element_ty), mask=mask)


_launch_moe_shrink = Launcher(_moe_shrink_kernel, num_tensors=9)
_launch_moe_expand = Launcher(_moe_expand_kernel, num_tensors=10)


def _check_rows(name: str, mode: str, rows: int, plan: MoePlan) -> None:
    if mode not in ROWS:
        raise ValueError(f"{name}_rows must be one of {sorted(ROWS)}, got {mode!r}")
    want = plan.num_tokens if mode == "token" else plan.num_pairs
    if rows != want:
        raise ValueError(f"{name} has {rows} rows; by {mode} a plan of {plan.num_tokens} × {plan.top_k} needs {want}")


def _precision(weight: torch.Tensor, act: torch.Tensor) -> str:
    # As in shrink.py: full fp32 products for fp32 weights and activations, TF32 for fp32 weights against
    # half-precision activations (bf16 / fp16 weights: the dtype's own products).
    return "ieee" if weight.dtype == act.dtype == torch.float32 else "tf32"


def moe_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: torch.Tensor,
    plan: MoePlan,
    t: torch.Tensor | None = None,
    x_rows: str = "token",
    config: dict | None = None,
    own_rank: bool = False,
) -> torch.Tensor:
    """Launch the MoE shrink kernel (see the module's Semantics).

    Args:
        x: activations, fp16/bf16/fp32, any strides: ``(T, K)`` for ``x_rows="token"`` (the layer input: the
            gate/up LoRA), ``(T * top_k, K)`` for ``"pair"`` / ``"sorted"`` (per-pair activations: the down LoRA).
        a: ``(S, E, R, K)`` stacked A weights (slot, expert, rank-padded to the largest rank ``R``), fp16/bf16/fp32,
            any strides; ``x`` is cast to its dtype for the product.
        ranks: ``(S,)`` int32, the rank of each slot (``0``: the slot does nothing in this layer).
        plan: the layer's :class:`~peft_csgmv.moe_plan.MoePlan`, on ``x``'s device, with ``S`` slots and ``E``
            experts.
        t: optional ``(T * top_k, R)`` fp32 output, any strides (written in place through them).
        x_rows: ``"token"``, ``"pair"`` or ``"sorted"``: how ``x``'s rows are addressed.
        config: override the tile choice (tuning): ``block_k``, ``num_warps``, ``num_stages``.
        own_rank: each slot's block holds its experts at the slot's own rank ``r``, as PEFT's ``lora_A.weight``
            ``(r·E, K)`` does: ``A[slot, e, j]`` is at row ``e·r + j`` of the slot, ``a``'s expert stride unused
            (:class:`~peft_csgmv.moe.MoeStack`'s layout: a slot stores any rank without padding rows between experts).

    Returns:
        ``t``: only ``t[p, :ranks[slot]]`` of the pairs ``p`` of live segments is written.
    """
    _check_rows("x", x_rows, x.shape[0], plan)
    num_slots, num_experts, r, k = a.shape
    if x.shape[1] != k or (num_slots, num_experts) != (plan.num_slots, plan.num_experts):
        raise ValueError(
            f"moe_shrink: x {tuple(x.shape)} / A {tuple(a.shape)} do not fit a plan of {plan.num_slots} slots × "
            f"{plan.num_experts} experts"
        )
    if t is None:
        t = torch.empty((plan.num_pairs, r), dtype=torch.float32, device=x.device)
    elif t.shape != (plan.num_pairs, r) or t.dtype != torch.float32:
        raise ValueError(f"moe_shrink: t {tuple(t.shape)} {t.dtype} is not ({plan.num_pairs}, {r}) float32")
    if plan.num_segments == 0:
        return t
    config = config or {}
    block_k = config.get("block_k", 64)
    options = tuple((key, config[key]) for key in ("num_warps", "num_stages") if key in config)
    args = (
        x, a, t, *plan.kernel_arrays, dense(ranks), k, plan.top_k, *x.stride(), *a.stride(), *t.stride(),
    )  # fmt: skip
    constexprs = dict(
        BLOCK_M=block_size(plan.chunk_size),
        BLOCK_R=block_size(r),
        BLOCK_K=block_k,
        X_ROWS=ROWS[x_rows],
        DOT_PRECISION=_precision(a, x),
        OWN_RANK=bool(own_rank),
    )
    _launch_moe_shrink((plan.num_segments, 1, 1), args, constexprs, options)
    return t


def moe_expand(
    t: torch.Tensor,
    b: torch.Tensor,
    ranks: torch.Tensor,
    scalings: torch.Tensor,
    plan: MoePlan,
    y: torch.Tensor,
    y_rows: str = "pair",
    config: dict | None = None,
    own_rank: bool = False,
) -> torch.Tensor:
    """Launch the MoE expand kernel (see the module's Semantics); ``y`` is updated in place and returned.

    Args:
        t: ``(T * top_k, R)`` fp32, the shrink's output (by pair), any strides.
        b: ``(S, E, N, R)`` stacked B weights, fp16/bf16/fp32, any strides (e.g. PEFT's ``lora_B.weight`` of ``(N,
            r * E)`` seen as ``.view(N, r, E).permute(2, 0, 1)`` for one slot's ``(E, N, r)``).
        ranks: ``(S,)`` int32 rank of each slot.
        scalings: ``(S,)`` fp32 scaling of each slot.
        plan: the layer's plan, on ``y``'s device.
        y: ``(T * top_k, N)`` per-pair output, fp16/bf16/fp32, any strides (updated in place through them).
        y_rows: ``"pair"`` or ``"sorted"``: how ``y``'s rows are addressed.
        config: override the tile choice (tuning): ``block_n``, ``num_warps``, ``num_stages``.
        own_rank: each slot's block holds its experts at the slot's own rank ``r``, as PEFT's ``lora_B.weight``
            ``(N, r·E)`` does: ``B[slot, e, n, j]`` is at ``n·r·E + j·E + e`` elements from the slot's start when
            ``b``'s rank stride is ``E`` (generally: output row ``n`` at ``n·r`` rank strides; ``b``'s output stride
            unused).
    """
    if y_rows == "token":
        raise ValueError("moe_expand writes one row per pair: y_rows is 'pair' or 'sorted'")
    _check_rows("y", y_rows, y.shape[0], plan)
    num_slots, num_experts, n, r = b.shape
    if (
        y.shape[1] != n
        or t.shape != (plan.num_pairs, r)
        or (num_slots, num_experts) != (plan.num_slots, plan.num_experts)
    ):
        raise ValueError(
            f"moe_expand: t {tuple(t.shape)} / B {tuple(b.shape)} / y {tuple(y.shape)} do not fit a plan of "
            f"{plan.num_pairs} pairs, {plan.num_slots} slots × {plan.num_experts} experts"
        )
    if plan.num_segments == 0:
        return y
    config = config or {}
    block_n = config.get("block_n", 64 if n <= 64 else 128)
    options = tuple((key, config[key]) for key in ("num_warps", "num_stages") if key in config)
    args = (
        t, b, y, *plan.kernel_arrays, dense(ranks), dense(scalings), n, plan.top_k, *t.stride(), *b.stride(),
        *y.stride(),
    )  # fmt: skip
    constexprs = dict(
        BLOCK_M=block_size(plan.chunk_size),
        BLOCK_N=block_n,
        BLOCK_R=block_size(r),
        Y_ROWS=ROWS[y_rows],
        DOT_PRECISION=_precision(b, y),
        OWN_RANK=bool(own_rank),
    )
    _launch_moe_expand((plan.num_segments, -(-n // block_n), 1), args, constexprs, options)
    return y
