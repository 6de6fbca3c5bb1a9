"""One launch that builds a :class:`~peft_csgmv.moe_plan.MoePlan`'s arrays (the eager decode path of MoE layers).

:meth:`MoePlan.from_groups <peft_csgmv.moe_plan.MoePlan.from_groups>` builds a plan with about twenty torch ops, each a
dispatch and (on a GPU) a launch: in eager decode, where the host sets the pace, they are most of what an experts
layer adds to the base model's step. :func:`moe_plan_arrays` computes the same arrays in one Triton program (the
role vLLM's ``moe_align_block_size`` kernel plays for its fused MoE), for steps small enough that one program holds
them: every routed pair in one block, every key of the sort in another.

What the program computes, with ``W = S + 1`` (``S`` slots, a base token in group slot ``S``) and ``E`` experts:

1. each pair's key ``group + expert * W``, pairs routed to no expert of the layer sent to key ``E * W`` (as the
   torch path's clamp and remainder do);
2. a histogram of the keys, and its exclusive running sum: ``below[k]``, how many pairs have a key under ``k`` (kept in
   a scratch buffer, read back by address);
3. each pair's sorted position ``below[key] + rank``, ``rank`` counting the earlier pairs of the same key (a stable
   sort), and ``permutation[position] = pair``;
4. each expert's end (``below[(e + 1) * W]``) and each adapter group's start and end (``below[e * W + s]``,
   ``below[e * W + s + 1]``), the segments each group needs (``ceil(size / chunk)``) and their running sum;
5. the segment arrays: every entry empty first (start = end = 0, slot -1, expert 0), then each group's segments at
   their place in the running sum.

The results are the torch path's, entry for entry (tests/test_moe_plan.py): the same stable order, the same segments
in the same places, the same empty tail.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .common import pow2
from .launch import Launcher

# The largest plan one program builds: routed pairs (decode steps; a prefill's pairs take the torch path, whose ops
# are few against its products) and sort keys ``E * (S + 1) + 2`` (every pair's, and one past them) / adapter groups
# ``E * S``, each rounded up to a power of two (one block each).
MAX_PAIRS = 1024
MAX_KEYS = 8192  # (a histogram of this many bins keeps bins / 32 counters per thread in registers)


@triton.jit
def _i32(x):
    """``x`` as int32 data. A no-op when compiled; under Triton 3.4's interpreter a histogram's (and numpy's running
    sums') int64 data labelled int32 would be stored 8 bytes an entry into 4-byte buffers, corrupting memory."""
    return x.to(tl.int64).to(tl.int32)


@triton.jit
def _keys(q, q_mask, group_ptr, index_ptr, top_k, stride_it, stride_ik, num_experts, width):
    """The sort key of pairs ``q`` (see the module docstring, step 1)."""
    t = q // top_k
    g = tl.load(group_ptr + t, mask=q_mask, other=0).to(tl.int64)
    e = tl.load(index_ptr + t * stride_it + (q % top_k) * stride_ik, mask=q_mask, other=0).to(tl.int64)
    last = num_experts * width
    key = tl.minimum(tl.maximum(g + e * width, -1), last)
    return tl.where(key < 0, last, key)


@triton.jit
def _moe_plan_kernel(
    group_ptr,  # (T,) each token's group slot: its slot, or S for a base token
    index_ptr,  # (T, top_k) the router's experts, any integer dtype and strides
    perm_ptr,  # (P,) int32 out
    offsets_ptr,  # (E,) int32 out
    seg_ptr,  # (4, M) int32 out, contiguous: start, end, slot, expert
    below_ptr,  # (BLOCK_KEYS,) int32 scratch
    num_pairs,
    top_k,
    stride_it,
    stride_ik,
    num_experts,
    num_slots,
    chunk,
    num_segments,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_KEYS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    width = num_slots + 1
    p = tl.arange(0, BLOCK_P)
    p_mask = p < num_pairs
    key = _keys(p, p_mask, group_ptr, index_ptr, top_k, stride_it, stride_ik, num_experts, width)

    # 2. how many pairs have a key below each key (the block's lanes past the pairs counted in its last key, which
    # no read reaches: a histogram's mask is not honoured by every Triton's interpreter)
    hist = _i32(tl.histogram(tl.where(p_mask, key, BLOCK_KEYS - 1).to(tl.int32), BLOCK_KEYS))
    below = _i32(tl.cumsum(hist, 0)) - hist
    keys = tl.arange(0, BLOCK_KEYS)
    tl.store(below_ptr + keys, below)
    # every segment empty first (the live ones are written over them below)
    for m0 in range(0, num_segments, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        m_mask = m < num_segments
        zero = tl.zeros([BLOCK_M], tl.int32)
        tl.store(seg_ptr + m, zero, mask=m_mask)
        tl.store(seg_ptr + num_segments + m, zero, mask=m_mask)
        tl.store(seg_ptr + 2 * num_segments + m, zero - 1, mask=m_mask)
        tl.store(seg_ptr + 3 * num_segments + m, zero, mask=m_mask)
    tl.debug_barrier()

    # 3. stable sorted positions
    rank = tl.zeros([BLOCK_P], tl.int32)
    for q0 in range(0, num_pairs, BLOCK_Q):
        q = q0 + tl.arange(0, BLOCK_Q)
        q_mask = q < num_pairs
        other = _keys(q, q_mask, group_ptr, index_ptr, top_k, stride_it, stride_ik, num_experts, width)
        same = (other[None, :] == key[:, None]) & (q[None, :] < p[:, None]) & q_mask[None, :]
        rank += _i32(tl.sum(same.to(tl.int32), axis=1))
    position = tl.load(below_ptr + key, mask=p_mask, other=0) + rank
    tl.store(perm_ptr + position, p.to(tl.int32), mask=p_mask)

    # 4. expert ends, adapter groups' starts and ends, their segments
    e = tl.arange(0, BLOCK_E)
    e_mask = e < num_experts
    tl.store(offsets_ptr + e, _i32(tl.load(below_ptr + (e + 1) * width, mask=e_mask, other=0)), mask=e_mask)
    g = tl.arange(0, BLOCK_G)
    g_mask = g < num_experts * num_slots
    g_expert = g // num_slots
    g_slot = g % num_slots
    start = tl.load(below_ptr + g_expert * width + g_slot, mask=g_mask, other=0)
    end = tl.load(below_ptr + g_expert * width + g_slot + 1, mask=g_mask, other=0)
    count = _i32(tl.where(g_mask, (end - start + chunk - 1) // chunk, 0))
    first = _i32(tl.cumsum(count, 0)) - count

    # 5. each group's segments at their place
    for k in range(0, tl.max(count, 0)):
        live = count > k
        m = first + k
        tl.store(seg_ptr + m, _i32(start + k * chunk), mask=live)
        tl.store(seg_ptr + num_segments + m, _i32(tl.minimum(start + (k + 1) * chunk, end)), mask=live)
        tl.store(seg_ptr + 2 * num_segments + m, _i32(g_slot), mask=live)
        tl.store(seg_ptr + 3 * num_segments + m, _i32(g_expert), mask=live)


_launch_moe_plan = Launcher(_moe_plan_kernel, num_tensors=6)


def fits(num_pairs: int, num_experts: int, num_slots: int) -> bool:
    """Whether :func:`moe_plan_arrays` builds a plan of these shapes (else the torch path)."""
    return 0 < num_pairs <= MAX_PAIRS and max(64, num_experts * (num_slots + 1) + 2) <= MAX_KEYS


@functools.lru_cache(maxsize=256)
def _constexprs(num_pairs: int, num_experts: int, num_slots: int) -> dict:
    """The plan kernel's tiles for these shapes, worked out once (a launch reads them, never changes them)."""
    block_p = pow2(num_pairs)
    return dict(
        BLOCK_P=block_p,
        BLOCK_Q=max(1, 8192 // block_p),
        # (one key past every pair's; at least 64 bins: a GPU histogram gives each thread of a warp a bin or more)
        BLOCK_KEYS=max(64, pow2(num_experts * (num_slots + 1) + 2)),
        BLOCK_E=pow2(num_experts),
        BLOCK_G=pow2(num_experts * num_slots),
        BLOCK_M=256,
    )


def moe_plan_arrays(
    token_group: torch.Tensor,
    top_k_index: torch.Tensor,
    num_experts: int,
    num_slots: int,
    chunk_size: int,
    num_segments: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plan's arrays in one launch (see the module docstring): ``(permutation (P,), expert_offsets (E,), segments
    (4, M))`` int32 on ``top_k_index``'s device, ``segments`` rows being ``seg_start``, ``seg_end``, ``seg_slot``,
    ``seg_expert``. ``token_group``: ``(T,)`` contiguous, each token's group slot (:func:`~peft_csgmv.moe_plan.
    token_groups`); ``top_k_index``: ``(T, top_k)`` integer, any strides. The shapes must :func:`fit`."""
    num_tokens, top_k = top_k_index.shape
    num_pairs = num_tokens * top_k
    constexprs = _constexprs(num_pairs, num_experts, num_slots)
    block_keys = constexprs["BLOCK_KEYS"]
    out = torch.empty(num_pairs + num_experts + 4 * num_segments + block_keys, dtype=torch.int32,
                      device=top_k_index.device)  # fmt: skip
    seg_at = num_pairs + num_experts
    permutation, offsets = out[:num_pairs], out[num_pairs:seg_at]
    segments, below = out[seg_at : seg_at + 4 * num_segments], out[seg_at + 4 * num_segments :]
    args = (token_group, top_k_index, permutation, offsets, segments, below, num_pairs, top_k, *top_k_index.stride(),
            num_experts, num_slots, chunk_size, num_segments)  # fmt: skip
    _launch_moe_plan((1, 1, 1), args, constexprs, (("num_warps", 8),))
    return permutation, offsets, segments.view(4, num_segments)
