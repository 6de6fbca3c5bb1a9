"""The MoE kernels' math (``moe.py``) in plain torch: the CPU backend and the test oracle (float64 tensors give an exact
reference), as ``reference.py`` is for the dense kernels. It walks the plan's live segments on the host; every tensor
may be a view (rows are gathered by indexing, ``t`` / ``y`` written in place through their own strides).

Semantics (see ``moe.py``)::

    t[p, :r]     = x[row_x(q)] @ A[slot, e, :r, :]ᵀ
    y[row_y(q)] += (t[p, :r] @ B[slot, e, :, :r]ᵀ) * scaling[slot]
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..moe_plan import MoePlan


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _active_segments(plan: MoePlan, ranks: Sequence[int]):
    """``(slot, expert, rank, sorted positions, pairs)`` of each live segment whose slot has a rank in this layer."""
    permutation = plan.permutation.long()
    for slot, expert, start, end in plan.segments():
        r = int(ranks[slot])
        if r:
            q = torch.arange(start, end, device=permutation.device)
            yield slot, expert, r, q, permutation[start:end]


def slot_a(a: torch.Tensor, slot: int, r: int, own_rank: bool = False) -> torch.Tensor:
    """Slot ``slot``'s A ``(E, r, K)`` of the stacked ``a`` ``(S, E, R, K)`` (a view): rows ``:r`` of each expert, or
    with ``own_rank`` the slot's block at its own rank (expert ``e`` at rows ``e·r .. e·r + r``; see ``moe.py``)."""
    if not own_rank:
        return a[slot, :, :r]
    ss, _, sr, sk = a.stride()
    return a.as_strided((a.shape[1], r, a.shape[3]), (r * sr, sr, sk), a.storage_offset() + slot * ss)


def slot_b(b: torch.Tensor, slot: int, r: int, own_rank: bool = False) -> torch.Tensor:
    """Slot ``slot``'s B ``(E, N, r)`` of the stacked ``b`` ``(S, E, N, R)`` (a view): columns ``:r``, or with
    ``own_rank`` the slot's block at its own rank (output row ``n`` at ``n·r`` rank strides; see ``moe.py``)."""
    if not own_rank:
        return b[slot, :, :, :r]
    ss, se, _, sr = b.stride()
    return b.as_strided((b.shape[1], b.shape[2], r), (se, r * sr, sr), b.storage_offset() + slot * ss)


def _rows(mode: str, q: torch.Tensor, p: torch.Tensor, top_k: int) -> torch.Tensor:
    return {"token": lambda: p // top_k, "pair": lambda: p, "sorted": lambda: q}[mode]()


def moe_shrink_reference(
    x: torch.Tensor,
    a: torch.Tensor,
    ranks: Sequence[int],
    plan: MoePlan,
    t: torch.Tensor | None = None,
    x_rows: str = "token",
    own_rank: bool = False,
) -> torch.Tensor:
    """``x``: (T, K) or (T * top_k, K) as ``x_rows`` says; ``a``: (S, E, R, K) (``own_rank``: each slot at its own
    rank, :func:`slot_a`); ``ranks``: host ints per slot. Returns
    ``t``: (T * top_k, R), fp32 (fp64 for fp64 inputs); entries no segment writes are zero (a fresh buffer) or
    untouched (``t`` given)."""
    acc = _acc_dtype(x, a)
    if t is None:
        t = torch.zeros((plan.num_pairs, a.shape[2]), dtype=acc, device=x.device)
    for slot, expert, r, q, p in _active_segments(plan, ranks):
        rows = _rows(x_rows, q, p, plan.top_k)
        a_e = slot_a(a, slot, r, own_rank)[expert]
        t[p, :r] = (x[rows].to(a.dtype).to(acc) @ a_e.to(acc).T).to(t.dtype)
    return t


def moe_expand_reference(
    t: torch.Tensor,
    b: torch.Tensor,
    ranks: Sequence[int],
    scalings: Sequence[float],
    plan: MoePlan,
    y: torch.Tensor,
    y_rows: str = "pair",
    own_rank: bool = False,
) -> torch.Tensor:
    """``t``: (T * top_k, R); ``b``: (S, E, N, R) (``own_rank``: each slot at its own rank, :func:`slot_b`); ``y``:
    (T * top_k, N) by ``y_rows``, updated in place (one rounding to its dtype) and returned."""
    acc = _acc_dtype(t, b, y)
    for slot, expert, r, q, p in _active_segments(plan, ranks):
        rows = _rows(y_rows, q, p, plan.top_k)
        delta = t[p, :r].to(b.dtype).to(acc) @ slot_b(b, slot, r, own_rank)[expert].to(acc).T
        y[rows] = (y[rows].to(acc) + delta * float(scalings[slot])).to(y.dtype)
    return y
