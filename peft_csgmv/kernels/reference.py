"""The same math as the Triton kernels, in plain torch.

It serves as the CPU backend and as the test oracle (call it on float64 tensors for an exact reference). It walks the
plan's runs (maximal groups of one slot in the permuted order), which is the same result as walking its segments.
Every tensor may be a view (any strides, a storage offset): rows are gathered by indexing, and ``t`` / ``y`` are
written in place through their own strides.

Semantics (see ``shrink.py`` / ``expand.py``)::

    t[rows, :r] = x[rows] @ A[slot, :r, :]ᵀ
    y[rows]    += (t[rows, :r] @ B[slot, :, :r]ᵀ) * scaling[slot]
    (DoRA: y[rows] = m[slot] · (y[rows] − bias + (t[rows, :r] @ B[slot, :, :r]ᵀ) · scaling[slot]) + bias)
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..plan import BatchPlan
from .pool import a_matrix, b_matrix


def _active_runs(plan: BatchPlan, ranks: Sequence[int]):
    """``(slot, rank, original token indices)`` of every run of one slot whose rank in this layer is not 0."""
    for slot, start, end in plan.runs:
        r = int(ranks[slot])
        if r:
            yield slot, r, plan.permutation[start:end].long()


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def shrink_reference(
    x: torch.Tensor, a: torch.Tensor, ranks: Sequence[int], plan: BatchPlan, t: torch.Tensor | None = None
) -> torch.Tensor:
    """``x``: (T, K); ``a``: (S, R, K); ``ranks``: host ints per slot. Returns ``t``: (T, R), fp32 (fp64 for fp64
    inputs); entries outside the segments or past a slot's rank are zero (a fresh buffer) or untouched (``t`` given)."""
    acc = _acc_dtype(x, a)
    if t is None:
        t = torch.zeros((x.shape[0], a.shape[1]), dtype=acc, device=x.device)
    for slot, r, rows in _active_runs(plan, ranks):
        t[rows, :r] = (x[rows].to(a.dtype).to(acc) @ a_matrix(a, slot, r).to(acc).T).to(t.dtype)
    return t


def expand_reference(
    t: torch.Tensor,
    b: torch.Tensor,
    ranks: Sequence[int],
    scalings: Sequence[float],
    plan: BatchPlan,
    y: torch.Tensor,
    mag: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    lora_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``t``: (T, R) or (P, T, R) split-K planes; ``b``: (S, N, R); ``y``: (T, N) updated in place (one rounding to
    its dtype) and returned. DoRA: ``mag`` (S, N) and ``bias`` (N,); ``lora_bias`` (S, N): as in ``expand.py``."""
    acc = _acc_dtype(t, b, y)
    if t.dim() == 3:
        t = t.sum(0)
    for slot, r, rows in _active_runs(plan, ranks):
        delta = t[rows, :r].to(b.dtype).to(acc) @ b_matrix(b, slot, r).to(acc).T
        if lora_bias is not None:
            delta = delta + lora_bias[slot].to(acc)
        delta = delta * scalings[slot]
        if mag is None:
            y[rows] = (y[rows].to(acc) + delta).to(y.dtype)
        else:
            m, bb = mag[slot].to(acc), bias.to(acc)
            y[rows] = (m * (y[rows].to(acc) - bb + delta) + bb).to(y.dtype)
    return y


def embedding_shrink_reference(
    ids: torch.Tensor, a: torch.Tensor, ranks: Sequence[int], plan: BatchPlan, t: torch.Tensor | None = None
) -> torch.Tensor:
    """``ids``: (T,) token ids; ``a``: (S, R, V). Returns ``t``: (T, R) with ``t[rows, :r] = A[slot, :r, ids[rows]]ᵀ``
    (fp32, fp64 for fp64 ``a``)."""
    acc = _acc_dtype(a)
    if t is None:
        t = torch.zeros((ids.shape[0], a.shape[1]), dtype=acc, device=ids.device)
    for slot, r, rows in _active_runs(plan, ranks):
        t[rows, :r] = a_matrix(a, slot, r)[:, ids[rows].long()].T.to(t.dtype)
    return t
