"""Per-slot matrices of their own rank, back to back in one flat buffer: the kernels' pooled weight layout.

A layer's adapters are stored at their own ranks, nothing padded: slot ``s`` of rank ``r`` has its ``A`` as an
``(r, K)`` row-major matrix at element ``a_off[s]`` of the buffer and its ``B`` as an ``(N, r)`` row-major matrix at
``b_off[s]`` (PEFT's own ``lora_A.weight`` / ``lora_B.weight`` layouts, so PEFT's parameters can be plain contiguous
views of them). Every matrix starts at a multiple of :data:`ALIGN` elements, which the kernels are told, so their loads
vectorize as they would over a padded stack.

A :class:`Pooled` stands in for a padded ``(S, R, K)`` A stack or ``(S, N, R)`` B stack wherever the kernels and the
torch reference take one: ``shape`` is that stack's shape (``R`` = the largest rank), and :meth:`Pooled.slot` is slot
``s``'s matrix (``A[s, :r]`` / ``B[s, :, :r]`` of the padded stack).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

ALIGN = 16  # elements: every pooled matrix starts at a multiple of this (64 bytes in fp32, 32 in bf16)


class Pooled(NamedTuple):
    """One pooled weight stack (see the module docstring)."""

    data: torch.Tensor  # 1-D buffer holding every slot's matrix
    offsets: torch.Tensor  # (S,) int64 on data's device: element offset of each slot's matrix (a multiple of ALIGN)
    offsets_host: tuple[int, ...]  # the same offsets, on the host
    ranks_host: tuple[int, ...]  # each slot's rank (0: no matrix)
    shape: tuple[int, int, int]  # (S, R, K) for an A stack, (S, N, R) for a B stack; R = the largest rank
    is_b: bool  # a B stack: slot s holds an (N, r) matrix, else an (r, K) one
    rank_align: int = 1  # a power of two (up to ALIGN) dividing every rank: B's row stride, which the kernels are told

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def slot(self, s: int, r: int | None = None) -> torch.Tensor:
        """Slot ``s``'s matrix: ``(r, K)`` for A, ``(N, r)`` for B (``r``: its rank, by default the stored one)."""
        r = self.ranks_host[s] if r is None else r
        off = self.offsets_host[s]
        if self.is_b:
            n = self.shape[1]
            return self.data[off : off + n * r].view(n, r)
        k = self.shape[2]
        return self.data[off : off + r * k].view(r, k)


def rank_align(ranks) -> int:
    """The largest power of two up to :data:`ALIGN` that divides every rank in ``ranks``."""
    align = ALIGN
    for r in ranks:
        while r % align:
            align //= 2
    return align


def pool_strides(w) -> tuple[bool, int, int, int]:
    """``(pooled, stride over slots, stride over dim 1, stride over dim 2)`` of a padded stack or a :class:`Pooled`.
    For a pooled B stack the stride over ``N`` is its slot's rank, which the kernels read per slot (returned as 0)."""
    if isinstance(w, Pooled):
        if w.is_b:
            return True, 0, 0, 1
        return True, 0, w.shape[2], 1
    return (False, *w.stride())


def pool_offsets(w, fallback: torch.Tensor) -> torch.Tensor:
    """The per-slot offsets the kernels read for ``w`` (``fallback``, never read, for a padded stack)."""
    return w.offsets.contiguous() if isinstance(w, Pooled) else fallback


def a_matrix(w, s: int, r: int) -> torch.Tensor:
    """Slot ``s``'s ``A`` as ``(r, K)``, from a padded ``(S, R, K)`` stack or a pooled one."""
    return w.slot(s, r) if isinstance(w, Pooled) else w[s, :r]


def b_matrix(w, s: int, r: int) -> torch.Tensor:
    """Slot ``s``'s ``B`` as ``(N, r)``, from a padded ``(S, N, R)`` stack or a pooled one."""
    return w.slot(s, r) if isinstance(w, Pooled) else w[s, :, :r]
