"""Helpers the kernel modules share: the Triton device functions two kernels use (a segment's rows, the ``A``
product), tile sizes, and the device facts tile choices read."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..options import env


@triton.jit
def segment_rows(seg, seg_indptr_ptr, perm_ptr, BLOCK_M: tl.constexpr):
    """The original token indices of segment ``seg`` (``BLOCK_M`` lanes, int64) and the mask of lanes in use."""
    start = tl.load(seg_indptr_ptr + seg)
    length = tl.load(seg_indptr_ptr + seg + 1) - start
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(perm_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return rows, m_mask


@triton.jit
def a_product(
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


def pow2(n: int) -> int:
    """The smallest power of two at least ``n`` (``n >= 1``): ``triton.next_power_of_2`` without its cost per call
    on the host (Triton's helpers are constexpr functions there)."""
    return 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def block_size(n: int) -> int:
    """Tile size for a dimension of ``n`` (at least 16, as ``tl.dot`` needs). Plain Python: Triton's own helpers
    cost microseconds per call on the launch path."""
    return max(16, pow2(n))


def dense(v: torch.Tensor) -> torch.Tensor:
    """``v`` where the kernels may read it densely (element ``i`` at ``ptr + i``, as they read the per-slot vectors
    and tables), else a contiguous copy of it."""
    return v.contiguous()


def override_tiles(config: dict, block: str) -> tuple[int, tuple]:
    """``(block size, launch options)`` from a tuning override."""
    return config[block], tuple((k, config[k]) for k in ("num_warps", "num_stages") if k in config)


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


def sm_count(device: torch.device) -> int:
    n = _SM_COUNT.get(device)
    if n is None:
        # Under the interpreter (CPU tensors) pretend to a small GPU, so CPU tests exercise split-K.
        n = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        _SM_COUNT[device] = n
    return n
