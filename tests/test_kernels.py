"""The Triton kernels (``shrink`` / ``expand``) and the torch reference against an independent float64 oracle.

On a machine without CUDA the kernels run under the Triton interpreter (tests/conftest.py sets ``TRITON_INTERPRET``),
where ``tl.dot`` on bf16 operands is unreliable, so the CPU grid covers fp32 and fp16 (bf16 joins on a GPU); shapes are
kept small. Kernel inputs live on ``DEVICE``; the oracle always runs on the CPU in float64.
"""

from __future__ import annotations

import importlib
import math
import random
import time

import pytest
import torch
from helpers import assert_close

from peft_csgmv.kernels import expand, expand_reference, shrink, shrink_reference
from peft_csgmv.plan import BatchPlan

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# ----------------------------------------------------------------------------------------------------------------------
# Oracle: a plain per-token loop over the Semantics of shrink.py / expand.py, in float64.
#
# It works from the slot of every original token (``token_slot[i]``, -1 = base), not from the plan's segments: the
# segments partition the adapter tokens by slot (tests/test_plan.py checks that), so "for each segment, for each row of
# it" is the same as "for each token with a slot". That keeps the oracle independent of the plan as well.
# ----------------------------------------------------------------------------------------------------------------------


def oracle_shrink(x, a, ranks, token_slot, t_before):
    """``t[i, :r] = x[i] (cast to A's dtype) @ A[slot, :r, :]ᵀ`` for each adapter token ``i`` of a slot with rank
    ``r > 0``; every other entry keeps its value from ``t_before``. Returns float64."""
    t = t_before.cpu().double().clone()
    x64 = x.cpu().to(a.dtype).double()
    a64 = a.cpu().double()
    for i, slot in enumerate(token_slot):
        if slot < 0:
            continue
        r = int(ranks[slot])
        for j in range(r):
            t[i, j] = torch.dot(x64[i], a64[slot, j])
    return t


def oracle_expand(t, b, ranks, scalings, token_slot, y_before):
    """``y[i] += (t[i, :r] (cast to B's dtype) @ B[slot, :, :r]ᵀ) * scaling[slot]`` for each adapter token ``i`` of a
    slot with rank ``r > 0``; other rows keep ``y_before``. Returns float64 (no rounding to y's dtype)."""
    y = y_before.cpu().double().clone()
    b64 = b.cpu().double()
    t = t.cpu()
    for i, slot in enumerate(token_slot):
        if slot < 0:
            continue
        r = int(ranks[slot])
        if r == 0:
            continue
        ti = t[i, :r].to(b.dtype).double()
        y[i] += (b64[slot, :, :r] @ ti) * float(scalings[slot])
    return y


def written_mask(token_slot, ranks, width):
    """``(T, width)`` bool: the entries of ``t`` that shrink writes (adapter tokens, columns below their slot's
    rank)."""
    mask = torch.zeros(len(token_slot), width, dtype=torch.bool)
    for i, slot in enumerate(token_slot):
        if slot >= 0:
            mask[i, : int(ranks[slot])] = True
    return mask.to(DEVICE)


def touched_rows(token_slot, ranks):
    """``(T,)`` bool: the rows of ``y`` that expand updates."""
    return torch.tensor([slot >= 0 and int(ranks[slot]) > 0 for slot in token_slot], dtype=torch.bool, device=DEVICE)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern (so -0.0 ≠ +0.0 and NaN == NaN)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def magnitude(expected: torch.Tensor) -> float:
    """Tolerance scale: the largest result magnitude (at least 1), since accumulated rounding error grows with it."""
    finite = expected[torch.isfinite(expected)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def check_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    """``actual`` (any device) against the float64 oracle with ``dtype``'s tolerance scaled by the result magnitude."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert_close(actual, expected, dtype=dtype, scale=magnitude(expected), what=what)


def device_mask(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.bool, device=DEVICE)


# ----------------------------------------------------------------------------------------------------------------------
# Parameter grid (kept apart from the oracle)
# ----------------------------------------------------------------------------------------------------------------------

NUM_SLOTS = 4


def _zipf_rows(n, seed, base_fraction=0.0):
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 1.5 for k in range(NUM_SLOTS)]
    return [-1 if rng.random() < base_fraction else rng.choices(range(NUM_SLOTS), weights)[0] for _ in range(n)]


# name → (row_slots, tokens_per_row, chunk_size override)
PLANS = {
    "distinct": ([2, 0, 3, 1], 3, None),
    "identical": ([1] * 5, 3, None),
    "zipf": (_zipf_rows(16, seed=0), 2, None),
    "base-interleaved": ([2, -1, 0, -1, 3, -1, 1, 2], 2, None),
    "single-token-rows": ([3, 0, 2, 0, 1, -1, 3, 0, 0, 2], 1, None),
    "runs-16-17-32-33-chunk16": ([0] * 16 + [1] * 17 + [2] * 32 + [3] * 33, 1, 16),
    "runs-33-66-chunk32": ([1, 2, 2, -1], 33, None),
    "docstring-chunk3": ([1, -1, 0, 1], 2, 3),
    "all-base": ([-1, -1], 3, None),
}

# name → (rank of each slot, padded max rank R of the stack)
RANKS = {
    "r1-3-8-16": ([1, 3, 8, 16], 16),
    "r8-1-3-8-pad16": ([8, 1, 3, 8], 16),
    "r64-1-3-8": ([64, 1, 3, 8], 64),
    "r8-0-3-16": ([8, 0, 3, 16], 16),
    "r128-3-0-64": ([128, 3, 0, 64], 128),
    "r16-32-16-0": ([16, 32, 16, 0], 32),
}

DIMS = {"in33-out47": (33, 47), "in123-out431": (123, 431), "in257-out33": (257, 33)}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}
if DEVICE.type == "cuda":  # the interpreter's tl.dot on bf16 is unreliable
    DTYPES["bf16"] = torch.bfloat16
SCALINGS = [0.5, 2.0, 1.25, 0.75]


def dtype_params():
    return [pytest.param(dt, id=name) for name, dt in DTYPES.items()]


def plan_params(*names):
    return [pytest.param(name, id=name) for name in (names or PLANS)]


def make_plan(name):
    row_slots, tokens_per_row, chunk_size = PLANS[name]
    plan = BatchPlan.build(row_slots, tokens_per_row, device=DEVICE, chunk_size=chunk_size)
    token_slot = [row_slots[i // tokens_per_row] for i in range(len(row_slots) * tokens_per_row)]
    return plan, token_slot


def make_weights(ranks, r_max, k, n, dtype, seed, pad=0.0):
    """``A (S, R, K)``, ``B (S, N, R)`` with ``pad`` past each slot's rank; ranks int32, scalings fp32."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, r_max, k, generator=g) / math.sqrt(k)
    b = torch.randn(NUM_SLOTS, n, r_max, generator=g) / math.sqrt(r_max)
    for s, r in enumerate(ranks):
        a[s, r:] = pad
        b[s, :, r:] = pad
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor(SCALINGS, dtype=torch.float32, device=DEVICE)
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks_t, scalings


def randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def full(shape, value, dtype=torch.float32):
    return torch.full(shape, value, dtype=dtype, device=DEVICE)


SENTINEL = -7777.0  # what an entry of t that shrink must not write holds before and after


def pooled(a, b, ranks, scalings):
    """The same weights as a layer stores them (:class:`~peft_csgmv.slots.LoraStack`): each slot at its own rank, back
    to back in one flat buffer; the kernels get its pooled views."""
    from peft_csgmv.slots import LoraStack

    k, n = a.shape[2], b.shape[1]
    need = sum(LoraStack.slot_elements(r, k, n) for r in ranks if r)
    stack = LoraStack(k, n, a.shape[0], a.dtype, a.device, reserve=need)
    for s, r in enumerate(ranks):
        if r:
            stack.set_slot(s, a[s, :r], b[s, :, :r], float(scalings[s]))
    stack.refresh()
    return stack


def run_and_check_end_to_end(plan, token_slot, ranks, r_max, k, n, dtype, seed=0, what="", pool=False):
    """shrink then expand on fresh data; compare each step with the oracle; untouched entries bit-identical.
    ``pool``: the kernels read the weights pooled at their own ranks (the oracle: padded with NaN past each rank)."""
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed, pad=math.nan if pool else 0.0)
    a_k, b_k = a, b
    if pool:
        stack = pooled(a, b, ranks, scalings)
        a_k, b_k, ranks_t = stack.a, stack.b, stack.ranks
        assert stack.data.numel() == sum(stack.slot_elements(r, k, n) for r in ranks if r), "padded storage"
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=seed + 1)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=seed + 2)
    y0 = y.clone()
    t = full((plan.num_tokens, r_max), SENTINEL)

    t_out = shrink(x, a_k, ranks_t, plan, t=t)
    assert t_out is t
    t_exp = oracle_shrink(x, a, ranks, token_slot, torch.full_like(t, SENTINEL))
    check_close(t, t_exp, dtype, what=f"{what} shrink t")
    unwritten = ~written_mask(token_slot, ranks, r_max)
    assert torch.equal(bits(t[unwritten]), bits(torch.full_like(t[unwritten], SENTINEL))), (
        f"{what}: t written past rank"
    )

    # "t stored in fp32": the oracle's expand consumes the oracle's t rounded to fp32.
    y_exp = oracle_expand(t_exp.float(), b, ranks, scalings, token_slot, y0)
    y_out = expand(t, b_k, ranks_t, scalings, plan, y)
    assert y_out is y
    check_close(y, y_exp, dtype, what=f"{what} expand y")
    untouched = ~touched_rows(token_slot, ranks)
    assert torch.equal(bits(y[untouched]), bits(y0[untouched])), f"{what}: rows outside the segments changed"
    touched = touched_rows(token_slot, ranks)
    if touched.any():
        assert not torch.equal(y[touched], y0[touched]), f"{what}: expand changed nothing"


# ----------------------------------------------------------------------------------------------------------------------
# shrink / expand over the plan grid
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("plan_name", plan_params())
def test_shrink_matches_oracle(plan_name, dtype):
    plan, token_slot = make_plan(plan_name)
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    a, _, ranks_t, _ = make_weights(ranks, r_max, k, n, dtype, seed=10)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=11)
    t = full((plan.num_tokens, r_max), SENTINEL)
    x0 = x.clone()

    out = shrink(x, a, ranks_t, plan, t=t)

    assert out is t and out.dtype == torch.float32
    expected = oracle_shrink(x, a, ranks, token_slot, torch.full_like(t, SENTINEL))
    check_close(t, expected, dtype, what=f"shrink[{plan_name}]")
    unwritten = ~written_mask(token_slot, ranks, r_max)
    assert torch.equal(bits(t[unwritten]), bits(torch.full_like(t[unwritten], SENTINEL)))
    assert torch.equal(bits(x), bits(x0)), "shrink modified x"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("plan_name", plan_params())
def test_expand_matches_oracle(plan_name, dtype):
    plan, token_slot = make_plan(plan_name)
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=20)
    t = randn(plan.num_tokens, r_max, dtype=torch.float32, seed=21)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=22)
    y0, t0 = y.clone(), t.clone()

    out = expand(t, b, ranks_t, scalings, plan, y)

    assert out is y
    expected = oracle_expand(t0, b, ranks, scalings, token_slot, y0)
    check_close(y, expected, dtype, what=f"expand[{plan_name}]")
    untouched = ~touched_rows(token_slot, ranks)
    assert torch.equal(bits(y[untouched]), bits(y0[untouched])), "base rows changed"
    assert torch.equal(bits(t), bits(t0)), "expand modified t"
    if plan.is_empty:
        assert torch.equal(bits(y), bits(y0))
    else:
        assert not torch.equal(y, y0)


# ----------------------------------------------------------------------------------------------------------------------
# Odd dims × mixed ranks (incl. a rank-0 slot), shrink → expand end to end
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("ranks_name", ["r1-3-8-16", "r8-1-3-8-pad16", "r64-1-3-8", "r8-0-3-16"])
@pytest.mark.parametrize("dims_name", list(DIMS))
def test_dims_and_ranks(dims_name, ranks_name, dtype):
    # zipf-skewed slots with base rows interleaved, 36 tokens (default chunk 16 → several segments per busy slot)
    row_slots = _zipf_rows(12, seed=5, base_fraction=0.25)
    assert -1 in row_slots and len(set(row_slots)) == NUM_SLOTS + 1
    plan = BatchPlan.build(row_slots, tokens_per_row=3, device=DEVICE)
    token_slot = [row_slots[i // 3] for i in range(plan.num_tokens)]
    ranks, r_max = RANKS[ranks_name]
    k, n = DIMS[dims_name]
    run_and_check_end_to_end(plan, token_slot, ranks, r_max, k, n, dtype, seed=30, what=f"{dims_name}/{ranks_name}")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("ranks_name", ["r1-3-8-16", "r8-0-3-16", "r64-1-3-8", "r16-32-16-0"])
@pytest.mark.parametrize("dims_name", list(DIMS))
def test_pooled_weights(dims_name, ranks_name, dtype):
    """Weights stored at their own ranks, back to back (odd widths: every matrix aligned on its own; ranks all
    multiples of 16: the kernels are told B's row stride is one)."""
    row_slots = _zipf_rows(12, seed=6, base_fraction=0.25)
    plan = BatchPlan.build(row_slots, tokens_per_row=3, device=DEVICE)
    token_slot = [row_slots[i // 3] for i in range(plan.num_tokens)]
    ranks, r_max = RANKS[ranks_name]
    k, n = DIMS[dims_name]
    run_and_check_end_to_end(
        plan, token_slot, ranks, r_max, k, n, dtype, seed=31, what=f"pooled {dims_name}/{ranks_name}", pool=True
    )


@pytest.mark.parametrize("dtype", dtype_params())
def test_chunk64_tiles(dtype):
    """chunk ≥ 64 switches both kernels to 64-wide K / N tiles: K = 123 and N = 431 then need a loop with a tail."""
    row_slots = [0, 0, 0, 0, 1, 1, -1, 3]  # runs of 80 (64 + 16), 40 and 20 tokens
    plan = BatchPlan.build(row_slots, tokens_per_row=20, device=DEVICE, chunk_size=64)
    assert plan.seg_indptr.tolist() == [0, 64, 80, 120, 140]
    token_slot = [row_slots[i // 20] for i in range(plan.num_tokens)]
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in123-out431"]
    run_and_check_end_to_end(plan, token_slot, ranks, r_max, k, n, dtype, seed=35, what="chunk64")


@pytest.mark.parametrize("dtype", dtype_params())
def test_rank128_small(dtype):
    row_slots = [0, 2, 3, 1, -1, 0]  # slot 2 has rank 0
    plan = BatchPlan.build(row_slots, tokens_per_row=2, device=DEVICE)
    token_slot = [row_slots[i // 2] for i in range(plan.num_tokens)]
    ranks, r_max = RANKS["r128-3-0-64"]
    run_and_check_end_to_end(plan, token_slot, ranks, r_max, 33, 47, dtype, seed=40, what="rank128")


# ----------------------------------------------------------------------------------------------------------------------
# Rank 0, rank padding, base rows
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "row_slots",
    [pytest.param([1, 0, 1, 3, 1], id="mixed-with-rank0"), pytest.param([1, 1, 1], id="only-rank0")],
)
def test_rank0_slot_touches_nothing(row_slots, dtype):
    ranks, r_max = RANKS["r8-0-3-16"]  # slot 1 has rank 0
    k, n = DIMS["in33-out47"]
    plan = BatchPlan.build(row_slots, tokens_per_row=4, device=DEVICE)
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=50)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=51)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=52)
    rank0 = device_mask([row_slots[i // 4] == 1 for i in range(plan.num_tokens)])
    y[rank0, ::3] = -0.0  # re-storing y + 0 there would turn these into +0.0
    y0 = y.clone()
    t = full((plan.num_tokens, r_max), SENTINEL)

    shrink(x, a, ranks_t, plan, t=t)
    expand(t, b, ranks_t, scalings, plan, y)

    assert torch.equal(bits(t[rank0]), bits(torch.full_like(t[rank0], SENTINEL))), "t written for a rank-0 slot"
    assert torch.equal(bits(y[rank0]), bits(y0[rank0])), "y changed for a rank-0 slot"
    if (~rank0).any():
        assert not torch.equal(y[~rank0], y0[~rank0])
        assert (t[~rank0][:, 0] != SENTINEL).all()


@pytest.mark.parametrize("dtype", dtype_params())
def test_rank_padding_is_never_read(dtype):
    """Garbage (1e3) past each slot's rank in A, B and the input t: the kernels must only use the first r entries."""
    plan_name = "base-interleaved"
    plan, token_slot = make_plan(plan_name)
    ranks, r_max = RANKS["r8-1-3-8-pad16"]
    k, n = DIMS["in33-out47"]
    a_clean, b_clean, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=60, pad=0.0)
    a_dirty, b_dirty, _, _ = make_weights(ranks, r_max, k, n, dtype, seed=60, pad=1e3)
    assert not torch.equal(a_clean, a_dirty) and not torch.equal(b_clean, b_dirty)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=61)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=62)
    y0 = y.clone()
    t = full((plan.num_tokens, r_max), 1e3)

    shrink(x, a_dirty, ranks_t, plan, t=t)
    t_exp = oracle_shrink(x, a_clean, ranks, token_slot, torch.full_like(t, 1e3))
    written = written_mask(token_slot, ranks, r_max)
    check_close(t[written], t_exp[written.cpu()], dtype, what="shrink (dirty pad)")
    assert (t[~written] == 1e3).all(), "shrink wrote past a slot's rank"

    # t still holds 1e3 past each rank: expand must mask both t and B by rank.
    expand(t, b_dirty, ranks_t, scalings, plan, y)
    y_exp = oracle_expand(t_exp.float(), b_clean, ranks, scalings, token_slot, y0)
    check_close(y, y_exp, dtype, what="expand (dirty pad)")


@pytest.mark.parametrize("dtype", dtype_params())
def test_base_rows_bit_identical(dtype):
    """Base rows hold -0.0, NaN and inf: a kernel that so much as re-stores y + 0 there would flip -0.0 to +0.0."""
    plan, token_slot = make_plan("base-interleaved")
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=70)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=71)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=72)
    base = device_mask([s < 0 for s in token_slot])
    assert base.any() and (~base).any()
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1.5], dtype=dtype, device=DEVICE)
    y[base] = special.repeat(n // len(special) + 1)[:n]
    x[base] = float("nan")  # base tokens of x must not be read into anything that is compared
    t = full((plan.num_tokens, r_max), float("nan"))
    y0 = y.clone()

    shrink(x, a, ranks_t, plan, t=t)
    expand(t, b, ranks_t, scalings, plan, y)

    assert torch.equal(bits(y[base]), bits(y0[base])), "base rows of y are not bit-identical"
    assert torch.isnan(t[base]).all(), "shrink wrote t for base rows"
    assert torch.isfinite(y[~base]).all(), "NaN from base rows leaked into adapter rows"
    assert not torch.equal(y[~base], y0[~base])


def dora_tables(n: int, seed: int) -> dict:
    """``mag`` / ``bias`` for an expand with DoRA: a per-slot scale near 1, no base bias."""
    g = torch.Generator().manual_seed(seed)
    return dict(mag=(1 + 0.1 * torch.randn(NUM_SLOTS, n, generator=g)).to(DEVICE), bias=torch.zeros(n, device=DEVICE))


def with_dora(expected: torch.Tensor, tables: dict, token_slot, copied: torch.Tensor) -> torch.Tensor:
    """The oracle's expand rows scaled by DoRA's ``mag`` of their slot (the bias is zero); copied rows unchanged."""
    if not tables:
        return expected
    slot_of = torch.tensor([max(s, 0) for s in token_slot])
    return torch.where(copied.cpu()[:, None], expected, tables["mag"].cpu().double()[slot_of] * expected)


def static_plan(row_slots, tokens_per_row):
    """The plan compiled code runs (:class:`~peft_csgmv.executor.StaticPlan`): adapter segments, the base tokens in
    segments of slot -1, then empty segments; as the ``peft_csgmv::lora`` op reads it."""
    from peft_csgmv.mapping import StaticPlan
    from peft_csgmv.ops import _plan

    static = StaticPlan(len(row_slots), len(row_slots), tokens_per_row, DEVICE)
    static.fill(tuple(row_slots))
    return _plan(static.permutation, static.seg_indptr, static.seg_slot, static.chunk, runs=True)


def static_case():
    """A static plan of rows of slots ``[2, -1, 0, -1, 3, 1, -1, 2, 1]``, 2 tokens each, with ranks ``r8-0-3-16`` (slot
    1 has rank 0): ``(plan, slot of each token, ranks, max rank)``."""
    row_slots = [2, -1, 0, -1, 3, 1, -1, 2, 1]
    plan = static_plan(row_slots, 2)
    return plan, [row_slots[i // 2] for i in range(plan.num_tokens)], *RANKS["r8-0-3-16"]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("layout", ["dense", "row-stride-2", "transposed"])
def test_expand_out_of_place_over_base_segments(layout, dora, dtype):
    """``expand(..., out=)`` over a static plan: every token of ``out`` is written in one launch (adapter rows:
    ``y`` + LoRA; base rows and a rank-0 slot's rows: ``y`` bit for bit, -0.0 / NaN / inf included, DoRA or not),
    ``y`` is not touched, and nothing of ``out``'s parent outside the view is written."""
    plan, token_slot, ranks, r_max = static_case()
    assert -1 in plan.seg_slot.tolist()
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=75)
    t = randn(plan.num_tokens, r_max, dtype=torch.float32, seed=76)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=77)
    copied = device_mask([s < 0 or ranks[s] == 0 for s in token_slot])
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1.5], dtype=dtype, device=DEVICE)
    y[copied] = special.repeat(n // len(special) + 1)[:n]
    t[copied] = float("nan")  # not read for rows that only copy
    y0 = y.clone()
    tables = dora_tables(n, seed=78) if dora else {}
    if layout == "dense":
        out, parent, outside = torch.empty_like(y), None, None
    else:
        out, parent, outside = y_view(torch.zeros_like(y), layout)
    parent0 = parent.clone() if parent is not None else None

    got = expand(t, b, ranks_t, scalings, plan, y, out=out, **tables)

    assert got is out
    assert torch.equal(bits(y), bits(y0)), "an out-of-place expand wrote y"
    assert torch.equal(bits(out[copied]), bits(y0[copied])), "base / rank-0 rows are not copied bit for bit"
    expected = with_dora(oracle_expand(t, b, ranks, scalings, token_slot, y0), tables, token_slot, copied)
    check_close(out[~copied], expected[~copied.cpu()], dtype, what=f"out-of-place expand ({layout}, dora={dora})")
    if parent is not None:
        assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "expand wrote outside the out view"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "fused"])
@pytest.mark.parametrize("layout", ["dense", "row-stride-2", "transposed"])
def test_expand_lora_alone_over_base_segments(layout, fused, dtype):
    """``expand(..., y=None, out=fp32)`` (what compiled decode runs beside the base product): ``out`` gets the LoRA
    alone over a static plan, ``lora_bias`` included, zeros (+0.0) on base and rank-0 rows, through ``out``'s strides,
    nothing outside the view; ``(y + out)`` rounded to ``y``'s dtype is the out-of-place sum bit for bit."""
    plan, token_slot, ranks, r_max = static_case()
    k, n = DIMS["in33-out47"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=90)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=91)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=92)
    lora_bias = randn(NUM_SLOTS, n, dtype=torch.float32, seed=93)
    t = shrink(x, a, ranks_t, plan)
    if layout == "dense":
        out, parent, outside = full((plan.num_tokens, n), float("nan"), torch.float32), None, None
    else:
        out, parent, outside = y_view(full((plan.num_tokens, n), float("nan"), torch.float32), layout)
    parent0 = parent.clone() if parent is not None else None
    lora = dict(x=x, a=a) if fused else {}

    got = expand(None if fused else t, b, ranks_t, scalings, plan, None, lora_bias=lora_bias, out=out,
                 act_dtype=dtype, **lora)  # fmt: skip

    assert got is out
    copied = device_mask([s < 0 or ranks[s] == 0 for s in token_slot])
    assert torch.equal(bits(out[copied]), bits(torch.zeros_like(out[copied]))), "base / rank-0 rows are not +0.0"
    expected = oracle_expand(t.float(), b, ranks, scalings, token_slot, torch.zeros(plan.num_tokens, n))
    slot_of = torch.tensor([max(s, 0) for s in token_slot])
    expected += lora_bias.cpu().double()[slot_of] * scalings.cpu().double()[slot_of, None]
    check_close(out[~copied], expected[~copied.cpu()], dtype, what=f"the LoRA alone ({layout}, fused={fused})")
    if parent is not None:
        assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "expand wrote outside the out view"
    summed = expand(None if fused else t, b, ranks_t, scalings, plan, y, lora_bias=lora_bias,
                    out=torch.empty_like(y), **lora)  # fmt: skip
    assert torch.equal(bits((y + out).to(dtype)), bits(summed)), "y + the LoRA alone is not the out-of-place sum"


def test_expand_lora_alone_needs_out_and_no_dora():
    plan = static_plan([0, -1], 1)
    ranks, r_max = RANKS["r8-0-3-16"]
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, torch.float32, seed=94)
    t = randn(plan.num_tokens, r_max, dtype=torch.float32, seed=95)
    with pytest.raises(ValueError, match="needs out"):
        expand(t, b, ranks_t, scalings, plan, None)
    with pytest.raises(ValueError, match="not for DoRA"):
        expand(t, b, ranks_t, scalings, plan, None, out=torch.empty(plan.num_tokens, n), **dora_tables(n, seed=96))


# ----------------------------------------------------------------------------------------------------------------------
# In place, strides
# ----------------------------------------------------------------------------------------------------------------------


# ----------------------------------------------------------------------------------------------------------------------
# Fused: one launch computes both products (expand with x and A)
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("pool", [False, True], ids=["padded", "pooled"])
@pytest.mark.parametrize("plan_name", plan_params("distinct", "zipf", "base-interleaved", "docstring-chunk3"))
def test_fused_matches_oracle(plan_name, pool, dtype):
    """``expand(None, B, …, y, x=x, a=A)``: shrink and expand in one launch, ``t`` never in memory, against the float64
    oracle of both steps; rows outside the segments bit-identical; a K longer than one BLOCK_K step (257)."""
    plan, token_slot = make_plan(plan_name)
    ranks, r_max = RANKS["r8-0-3-16"]
    k, n = DIMS["in257-out33"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=21, pad=math.nan if pool else 0.0)
    a_k, b_k = a, b
    if pool:
        stack = pooled(a, b, ranks, scalings)
        a_k, b_k, ranks_t = stack.a, stack.b, stack.ranks
        a, b = a.nan_to_num(0.0), b.nan_to_num(0.0)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=22)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=23)
    y0 = y.clone()

    got = expand(None, b_k, ranks_t, scalings, plan, y, x=x, a=a_k)

    assert got is y
    t_exp = oracle_shrink(x, a, ranks, token_slot, torch.zeros(plan.num_tokens, r_max, dtype=torch.float64))
    check_close(y, oracle_expand(t_exp.float(), b, ranks, scalings, token_slot, y0), dtype, what=f"fused {plan_name}")
    touched = touched_rows(token_slot, ranks)
    assert torch.equal(bits(y[~touched]), bits(y0[~touched])), "fused: rows outside the segments changed"
    assert not torch.equal(y[touched], y0[touched]), "fused: changed nothing"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
@pytest.mark.parametrize("layout", ["dense", "strided"])
def test_fused_out_of_place_over_base_segments(layout, dora, dtype):
    """Fused over a static plan (base rows in segments of slot -1), out of place, ``x`` and ``out`` strided: adapter
    rows as the oracle (DoRA's scale applied as the expand applies it), base and rank-0 rows a bit-exact copy of
    ``y``, ``y`` untouched; the same as the two launches (shrink, then expand) to fp32 accumulation order."""
    plan, token_slot, ranks, r_max = static_case()
    k, n = DIMS["in123-out431"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=24)
    x_dense = randn(plan.num_tokens, k, dtype=dtype, seed=25)
    x = x_view(x_dense, "column-slice") if layout == "strided" else x_dense
    y = randn(plan.num_tokens, n, dtype=dtype, seed=26)
    y0 = y.clone()
    tables = dora_tables(n, seed=27) if dora else {}
    if layout == "strided":
        out, parent, outside = y_view(torch.zeros_like(y), "row-stride-2")
        parent0 = parent.clone()
    else:
        out = torch.empty_like(y)

    got = expand(None, b, ranks_t, scalings, plan, y, out=out, x=x, a=a, **tables)

    assert got is out and torch.equal(bits(y), bits(y0)), "a fused out-of-place launch wrote y"
    copied = device_mask([s < 0 or ranks[s] == 0 for s in token_slot])
    assert torch.equal(bits(out[copied]), bits(y0[copied])), "base / rank-0 rows are not copied bit for bit"
    t_exp = oracle_shrink(x_dense, a, ranks, token_slot, torch.zeros(plan.num_tokens, r_max, dtype=torch.float64))
    expected = with_dora(oracle_expand(t_exp.float(), b, ranks, scalings, token_slot, y0), tables, token_slot, copied)
    check_close(out[~copied], expected[~copied.cpu()], dtype, what=f"fused out of place ({layout}, dora={dora})")
    two_launches = expand(shrink(x, a, ranks_t, plan), b, ranks_t, scalings, plan, y, out=torch.empty_like(y), **tables)
    check_close(out, two_launches.double(), dtype, what="fused against shrink + expand")
    if layout == "strided":
        assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "fused wrote outside the out view"


def test_expand_is_in_place():
    plan, token_slot = make_plan("zipf")
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, torch.float32, seed=80)
    t = randn(plan.num_tokens, r_max, dtype=torch.float32, seed=81)
    y = randn(plan.num_tokens, n, dtype=torch.float32, seed=82)
    y0 = y.clone()
    ptr = y.data_ptr()

    out = expand(t, b, ranks_t, scalings, plan, y)

    assert out is y
    assert y.data_ptr() == ptr and out.data_ptr() == ptr
    assert not torch.equal(y, y0), "y was not updated in place"
    check_close(y, oracle_expand(t, b, ranks, scalings, token_slot, y0), torch.float32, what="in-place expand")


def x_view(x: torch.Tensor, layout: str) -> torch.Tensor:
    """A non-contiguous view holding the same values as ``x``."""
    if layout == "column-slice":  # columns 7 .. 7+K of a wider tensor: strides (K + 12, 1)
        wide = full((x.shape[0], x.shape[1] + 12), float("nan"), x.dtype)
        wide[:, 7 : 7 + x.shape[1]] = x
        return wide[:, 7 : 7 + x.shape[1]]
    if layout == "transposed":  # column-major: strides (1, T)
        return x.t().contiguous().t()
    raise ValueError(layout)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["column-slice", "transposed"])
def test_noncontiguous_x(layout, dtype):
    plan, token_slot = make_plan("base-interleaved")
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    a, _, ranks_t, _ = make_weights(ranks, r_max, k, n, dtype, seed=90)
    x_dense = randn(plan.num_tokens, k, dtype=dtype, seed=91)
    x = x_view(x_dense, layout)
    assert not x.is_contiguous() and torch.equal(x, x_dense)

    t = shrink(x, a, ranks_t, plan)

    assert t.shape == (plan.num_tokens, r_max) and t.dtype == torch.float32
    expected = oracle_shrink(x_dense, a, ranks, token_slot, torch.zeros(plan.num_tokens, r_max, dtype=torch.float64))
    written = written_mask(token_slot, ranks, r_max)
    check_close(t[written], expected[written.cpu()], dtype, what=f"shrink x {layout}")


def y_view(y: torch.Tensor, layout: str):
    """A strided view holding the same values as ``y``, its parent buffer, and a mask of the parent that is not in the
    view."""
    t, n = y.shape
    if layout == "column-slice":  # columns 5 .. 5+N of a wider buffer
        parent = full((t, n + 9), 3.25, y.dtype)
        view = parent[:, 5 : 5 + n]
    elif layout == "transposed":  # column-major, rows 1 .. 1+N of a taller buffer
        parent = full((n + 3, t), 3.25, y.dtype)
        view = parent[1 : 1 + n].t()
    elif layout == "row-stride-2":  # every other row
        parent = full((2 * t, n), 3.25, y.dtype)
        view = parent[::2]
    else:
        raise ValueError(layout)
    view.copy_(y)
    outside = torch.ones_like(parent, dtype=torch.bool)
    outside.as_strided(view.shape, view.stride(), view.storage_offset()).fill_(False)
    return view, parent, outside


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("layout", ["column-slice", "transposed", "row-stride-2"])
def test_strided_y(layout, dtype):
    plan, token_slot = make_plan("base-interleaved")
    ranks, r_max = RANKS["r1-3-8-16"]
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=100)
    t = randn(plan.num_tokens, r_max, dtype=torch.float32, seed=101)
    y_dense = randn(plan.num_tokens, n, dtype=dtype, seed=102)
    y, parent, outside = y_view(y_dense, layout)
    assert not y.is_contiguous() and torch.equal(y, y_dense) and outside.any()
    parent0 = parent.clone()
    ptr = y.data_ptr()

    out = expand(t, b, ranks_t, scalings, plan, y)

    assert out is y and out.data_ptr() == ptr
    expected = oracle_expand(t, b, ranks, scalings, token_slot, y_dense)
    check_close(y, expected, dtype, what=f"expand y {layout}")
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "expand wrote outside the y view"


# ----------------------------------------------------------------------------------------------------------------------
# Argument checks
# ----------------------------------------------------------------------------------------------------------------------


def test_shape_mismatch_raises():
    plan, _ = make_plan("distinct")
    ranks, r_max = RANKS["r1-3-8-16"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, 33, 47, torch.float32, seed=110)
    x = randn(plan.num_tokens, 33, dtype=torch.float32, seed=111)
    with pytest.raises(ValueError):
        shrink(x[:, :32], a, ranks_t, plan)  # K mismatch
    with pytest.raises(ValueError):
        shrink(x[:-1], a, ranks_t, plan)  # token count mismatch
    t = full((plan.num_tokens, r_max), 0.0)
    y = full((plan.num_tokens, 47), 0.0)
    with pytest.raises(ValueError):
        expand(t, b, ranks_t, scalings, plan, y[:, :46])  # N mismatch
    with pytest.raises(ValueError):
        expand(t[:, :8], b, ranks_t, scalings, plan, y)  # R mismatch
    with pytest.raises(ValueError):
        expand(t[:-1], b, ranks_t, scalings, plan, y[:-1])  # token count mismatch
    with pytest.raises(ValueError, match="fused x"):
        expand(None, b, ranks_t, scalings, plan, y, x=x[:, :32], a=a)  # fused: K mismatch
    with pytest.raises(ValueError, match="fused x"):
        expand(None, b, ranks_t, scalings, plan, y, x=x)  # fused without A


# ----------------------------------------------------------------------------------------------------------------------
# The torch reference against the same oracle
# ----------------------------------------------------------------------------------------------------------------------

REF_DTYPES = [pytest.param(torch.float64, id="fp64"), *dtype_params()]  # the reference handles bf16 on the CPU too


@pytest.mark.parametrize("dtype", REF_DTYPES)
@pytest.mark.parametrize("plan_name", plan_params())
def test_reference_matches_oracle(plan_name, dtype):
    plan, token_slot = make_plan(plan_name)
    ranks, r_max = RANKS["r8-0-3-16"]  # includes a rank-0 slot
    k, n = DIMS["in33-out47"]
    a, b, _, scalings = make_weights(ranks, r_max, k, n, dtype, seed=120)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=121)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=122)
    y0 = y.clone()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    t = full((plan.num_tokens, r_max), SENTINEL, acc)
    scal = scalings.tolist()

    out_t = shrink_reference(x, a, ranks, plan, t=t)
    assert out_t is t
    t_exp = oracle_shrink(x, a, ranks, token_slot, torch.full_like(t, SENTINEL))
    check_close(t, t_exp, dtype, what=f"shrink_reference[{plan_name}]")

    fresh = shrink_reference(x, a, ranks, plan)
    assert fresh.dtype == acc and fresh.shape == (plan.num_tokens, r_max)
    written = written_mask(token_slot, ranks, r_max)
    assert (fresh[~written] == 0).all()
    assert torch.equal(fresh[written], t[written])

    out_y = expand_reference(t, b, ranks, scal, plan, y)
    assert out_y is y
    y_exp = oracle_expand(t, b, ranks, scalings, token_slot, y0)
    check_close(y, y_exp, dtype, what=f"expand_reference[{plan_name}]")
    untouched = ~touched_rows(token_slot, ranks)
    assert torch.equal(bits(y[untouched]), bits(y0[untouched]))


# ----------------------------------------------------------------------------------------------------------------------
# Split-K: shrink writes partial products per K range into planes of t; expand sums them.
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split_k", [1, 2, 3, 5], ids=lambda s: f"split{s}")
@pytest.mark.parametrize("dtype", dtype_params())
def test_split_k_partials_sum_to_oracle(split_k, dtype):
    plan, token_slot = make_plan("base-interleaved")
    ranks, r_max, k, n = [8, 1, 3, 16], 16, 777, 47
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, dtype, seed=21)
    x = randn(plan.num_tokens, k, dtype=dtype, seed=22)
    y = randn(plan.num_tokens, n, dtype=dtype, seed=23)
    y0 = y.clone()
    t = shrink(x, a, ranks_t, plan, split_k=split_k)
    planes = t.shape[0] if t.dim() == 3 else 1
    # K splits are whole BLOCK_K tiles, so a request may round down (777 in 5 splits of 256 → 4), never up.
    assert min(split_k, 2) <= planes <= split_k, f"asked for {split_k} splits, got {planes} planes"
    t_exp = oracle_shrink(x, a, ranks, token_slot, torch.zeros(plan.num_tokens, r_max))
    t_sum = (t if t.dim() == 3 else t.unsqueeze(0)).sum(0)
    written = written_mask(token_slot, ranks, r_max)
    check_close(t_sum[written], t_exp.to(DEVICE)[written], dtype, what=f"split {split_k} shrink")
    expand(t, b, ranks_t, scalings, plan, y)
    y_exp = oracle_expand(t_exp.float(), b, ranks, scalings, token_slot, y0)
    check_close(y, y_exp, dtype, what=f"split {split_k} expand")
    untouched = ~touched_rows(token_slot, ranks)
    assert torch.equal(bits(y[untouched]), bits(y0[untouched]))


def test_split_k_chosen_for_few_segments():
    """With few segments and a wide input the default ``split_k="auto"`` splits K (the interpreter poses as a 4-SM
    GPU), ``shrink_splits`` says how many planes that makes, and the result still matches the oracle; a 2-D ``t``
    means one split."""
    from peft_csgmv.kernels import shrink_splits

    plan, token_slot = make_plan("distinct")  # 4 segments
    k, n = 1024, 33
    splits = shrink_splits(plan, k)
    if DEVICE.type == "cpu":
        assert splits == 4
    else:
        assert splits > 1
    assert shrink_splits(plan, 128) == 1  # each split keeps at least 128 K elements
    ranks, r_max = [8, 1, 3, 16], 16
    a, b, ranks_t, scalings = make_weights(ranks, r_max, k, n, torch.float32, seed=31)
    x = randn(plan.num_tokens, k, dtype=torch.float32, seed=32)
    y = randn(plan.num_tokens, n, dtype=torch.float32, seed=33)
    y0 = y.clone()
    t2 = torch.empty(plan.num_tokens, r_max, device=DEVICE)
    assert shrink(x, a, ranks_t, plan, t2) is t2
    workspace = torch.empty(splits, plan.num_tokens, r_max, device=DEVICE)
    assert shrink(x, a, ranks_t, plan, workspace) is workspace
    t = shrink(x, a, ranks_t, plan)
    assert t.shape == (splits, plan.num_tokens, r_max)
    expand(t, b, ranks_t, scalings, plan, y)
    t_exp = oracle_shrink(x, a, ranks, token_slot, torch.zeros(plan.num_tokens, r_max))
    check_close(y, oracle_expand(t_exp.float(), b, ranks, scalings, token_slot, y0), torch.float32, what="auto split")


def test_launcher_key_separates_what_triton_specializes_on():
    """The lean launch path reuses a compiled kernel only for arguments Triton would compile identically: same
    dtypes, same 16-byte alignment of every pointer, integers Triton classes the same, same constexprs."""
    from peft_csgmv.kernels.launch import Launcher

    launcher = Launcher(kernel=None, num_tensors=2)
    base = torch.empty(64, dtype=torch.float32)
    key = launcher._key((base[:16], base[16:32], 7, 16), {"BLOCK": 16})
    assert key == launcher._key((base[16:32], base[32:48], 7, 16), {"BLOCK": 16})  # other data, same alignment
    assert key != launcher._key((base[1:17], base[16:32], 7, 16), {"BLOCK": 16})  # misaligned pointer
    assert key != launcher._key((base[:16].half(), base[16:32], 7, 16), {"BLOCK": 16})  # dtype
    assert key != launcher._key((base[:16], base[16:32], 7, 24), {"BLOCK": 16})  # an integer's divisibility by 16
    assert key != launcher._key((base[:16], base[16:32], 1, 16), {"BLOCK": 16})  # an integer 1 (a constant to Triton)
    assert key != launcher._key((base[:16], base[16:32], 7, 16), {"BLOCK": 32})  # a constexpr
    # Integers Triton compiles the same share the key (a token count, a stride growing with it): no new slow launch.
    assert key == launcher._key((base[:16], base[16:32], 9, 48), {"BLOCK": 16})


def test_launcher_scalar_key_follows_tritons_specialization():
    """Two scalar arguments share a launch key exactly when Triton's own specialization of them is the same (type and
    specialization), over integers around every boundary Triton draws (1, multiples of 16, i32 / i64 / u64), floats
    and bools."""
    from peft_csgmv.kernels.launch import _scalar_key

    libtriton = pytest.importorskip("triton._C.libtriton")
    if not hasattr(libtriton, "native_specialize_impl"):
        pytest.skip("this Triton specializes in Python")
    from triton.backends.compiler import BaseBackend

    values = [0, 1, 2, 15, 16, 17, 32, 48, -1, -16, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, 2**40 + 3, 2**63 - 16,
              2**63, 2**64 - 16, -(2**63), -(2**31), -(2**31) - 16, 0.5, 1.0, 3.25, True, False]  # fmt: skip
    spec = {i: libtriton.native_specialize_impl(BaseBackend, v, False, True, True) for i, v in enumerate(values)}
    for i, v in enumerate(values):
        for j, w in enumerate(values):
            same_triton = spec[i] == spec[j] and type(v) is type(w)
            assert (_scalar_key(v) == _scalar_key(w)) == same_triton, (v, w, spec[i], spec[j])


def test_launches_under_recording_are_noted_not_run(monkeypatch):
    """Within ``launch.recording()`` a shrink launch is recorded, not compiled or run: its output buffer keeps what it
    held, and the record names the kernel (module and name, which the compile worker imports), the device, the grid,
    each tensor argument as its dtype and address (a view's own), the integers and the constexprs. Outside it, the
    same call writes its output. A record pickles (it travels to the worker)."""
    import pickle

    from peft_csgmv.kernels.launch import Pointer, recording

    shrink_module = importlib.import_module("peft_csgmv.kernels.shrink")

    monkeypatch.setattr(shrink_module._launch_shrink, "compiled", {})  # (this variant compiled by earlier tests)
    ranks = [4, 8, 2, 8]
    a, _, ranks_t, _ = make_weights(ranks, 8, 32, 16, torch.float32, seed=0)
    x = randn(12, 64, dtype=torch.float32, seed=1)[:, 1::2]  # (a strided view: its own address is recorded)
    plan = BatchPlan.build([0, 1, -1, 1], 3, device=DEVICE)
    t = torch.full((12, 8), SENTINEL, device=DEVICE)
    with recording() as records:
        shrink(x, a, ranks_t, plan, t=t)
    assert torch.equal(t, torch.full_like(t, SENTINEL)), "a recorded launch wrote its output"
    assert len(records) == 1, records
    module, name, device, grid, args, constexprs, options = pickle.loads(pickle.dumps(records[0]))
    assert getattr(importlib.import_module(module), name) is shrink_module._shrink_kernel
    assert device == x.get_device() and len(grid) == 3 and all(isinstance(g, int) and g >= 1 for g in grid)
    pointers = [p for p in args if isinstance(p, Pointer)]
    assert len(pointers) == shrink_module._launch_shrink.num_tensors
    assert (pointers[0].dtype, pointers[0].data_ptr()) == (x.dtype, x.data_ptr())
    assert all(isinstance(v, int) for v in args[len(pointers) :]) and constexprs
    shrink(x, a, ranks_t, plan, t=t)
    assert not torch.equal(t, torch.full_like(t, SENTINEL)), "the same launch outside recording wrote nothing"


def test_compile_worker_answers_each_job_with_its_errors():
    """The compile worker (a process of its own, started by the first job): each job's answer lists the records it
    could not compile, by kernel name (a kernel that does not exist; on a machine without CUDA, a real one too), and
    the worker stays up for the next job."""
    from peft_csgmv.kernels import ahead
    from peft_csgmv.kernels.launch import Pointer

    errors = ahead.compile_elsewhere([("peft_csgmv.kernels.shrink", "_no_such_kernel", 0, (1, 1, 1), (), {}, ())])
    assert len(errors) == 1 and "_no_such_kernel" in errors[0] and "AttributeError" in errors[0], errors
    worker = ahead._worker
    record = ("peft_csgmv.kernels.shrink", "_shrink_kernel", 0, (1, 1, 1), (Pointer(torch.float32, 1024),), {}, ())
    errors = ahead.compile_elsewhere([record, record])
    if not torch.cuda.is_available():
        assert len(errors) == 2 and all(e.startswith("_shrink_kernel: ") for e in errors), errors
    assert ahead._worker is worker and worker.alive(), "the worker did not stay up between jobs"


def test_a_compile_worker_that_does_not_answer_is_stopped(monkeypatch):
    """A worker that takes a job and never answers does not hold its caller: past the job's time limit the call
    raises (the compile-ahead job then gives up, and the variants compile at their first launch), the worker is
    killed, and the next job starts a new one; after a second failed worker none is started again in the process
    (a setup where workers cannot run costs each job nothing more)."""
    from peft_csgmv.kernels import ahead

    monkeypatch.setattr(ahead, "_worker", None)
    monkeypatch.setattr(ahead, "_failures", 0)
    monkeypatch.setattr(ahead, "JOB_TIMEOUT_S", 1.0)
    monkeypatch.setattr(ahead, "_BOOT", "import sys, time; sys.stdin.buffer.read(8); time.sleep(60)")
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        ahead.compile_elsewhere([("peft_csgmv.kernels.shrink", "_shrink_kernel", 0, (1, 1, 1), (), {}, ())])
    assert time.perf_counter() - t0 < 30
    hung = ahead._worker
    assert hung.proc.wait(timeout=10) is not None, "the worker that did not answer is still running"
    assert ahead._failures == 1
    with monkeypatch.context() as m:
        m.setattr(ahead, "_BOOT", "import sys; sys.exit(3)")  # (a second worker that dies at once)
        with pytest.raises((OSError, EOFError)):  # (its pipe broken, or closed)
            ahead.compile_elsewhere([("peft_csgmv.kernels.shrink", "_no_such_kernel", 0, (1, 1, 1), (), {}, ())])
    started = []
    monkeypatch.setattr(ahead, "Worker", lambda: started.append(1))
    with pytest.raises(RuntimeError, match="failed before"):
        ahead.compile_elsewhere([("peft_csgmv.kernels.shrink", "_no_such_kernel", 0, (1, 1, 1), (), {}, ())])
    assert not started, "a worker started after two had failed"
    monkeypatch.undo()
    monkeypatch.setattr(ahead, "_worker", hung)
    errors = ahead.compile_elsewhere([("peft_csgmv.kernels.shrink", "_no_such_kernel", 0, (1, 1, 1), (), {}, ())])
    assert ahead._worker is not hung and len(errors) == 1, errors


def _cuda_stack(num_slots, ranks, k, n, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r_max = max(ranks)
    a = torch.zeros(num_slots, r_max, k, dtype=torch.float64)
    b = torch.zeros(num_slots, n, r_max, dtype=torch.float64)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, k, generator=g, dtype=torch.float64) / k**0.5
        b[s, :, :r] = torch.randn(n, r, generator=g, dtype=torch.float64) / r**0.5
    scal = torch.linspace(0.5, 2.0, num_slots, dtype=torch.float32)
    return (
        a.to("cuda", dtype),
        b.to("cuda", dtype),
        torch.tensor(ranks, dtype=torch.int32, device="cuda"),
        scal.to("cuda"),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "k,n,ranks,row_slots,tpr,chunk",
    [
        (2048, 2048, [16] * 32, list(range(32)), 1, 16),  # decode, 32 distinct
        (2048, 8192, [8, 16, 64, 128], [0, 1, 2, 3, -1, 0, 2, 1], 1, 16),  # decode, mixed ranks, base rows
        (8192, 2048, [16, 64], [0, 1, 1, -1], 250, 128),  # prefill, chunk 128 with remainder
        (4096, 14336, [16] * 8, [0] * 16, 64, 128),  # prefill, one adapter
        (2048, 4096, [16, 64] * 8, list(range(16)), 64, 64),  # prefill, 16 runs of 64: 64-row tiles
        (4096, 2048, [16, 64] * 16, list(range(32)), 16, 16),  # prefill, 32 runs of 16: 16-row tiles
        (2049, 431, [1, 3, 0, 17], [0, 1, 2, 3, 0, -1], 33, 16),  # odd dims, rank 0 slot
    ],
    ids=["decode32", "mixed-ranks", "prefill-chunk", "prefill-one", "prefill-runs64", "prefill-runs16", "odd"],
)
def test_kernels_vs_float64(dtype, k, n, ranks, row_slots, tpr, chunk):
    torch.manual_seed(0)
    a, b, r, scal = _cuda_stack(len(ranks), ranks, k, n, dtype)
    plan = BatchPlan.build(row_slots, tpr, "cuda")
    assert plan.chunk_size == chunk
    x = torch.randn(plan.num_tokens, k, device="cuda").to(dtype)
    y = torch.randn(plan.num_tokens, n, device="cuda").to(dtype)
    y0 = y.clone()
    t = shrink(x, a, r, plan)
    expand(t, b, r, scal, plan, y)
    ranks_h, scal_h = r.tolist(), scal.tolist()
    t_ref = shrink_reference(x.double(), a.double(), ranks_h, plan)
    y_ref = expand_reference(t_ref, b.double(), ranks_h, scal_h, plan, y0.double())
    assert_close(y, y_ref, dtype, scale=4.0, what=f"y ({dtype})")
    base_rows = [i * tpr + j for i, s in enumerate(row_slots) for j in range(tpr) if s < 0 or ranks[s] == 0]
    if base_rows:
        assert torch.equal(y[base_rows], y0[base_rows])


def _chain(layers, plan, x, out_of_place):
    """``x`` through ``layers`` of base matmul + LoRA, each layer's input the previous layer's output: every kernel
    reads what the one before it wrote, and the shrinks of all layers share one workspace (``t``)."""
    t = None
    for w, a, b, r, scal in layers:
        y = x @ w
        if t is None:
            t = shrink(x, a, r, plan)
        else:
            shrink(x, a, r, plan, t=t)
        x = expand(t, b, r, scal, plan, y, out=torch.empty_like(y) if out_of_place else None)
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out-of-place"])
def test_pdl_launches_give_the_serial_launches_results(out_of_place, monkeypatch):
    """On Hopper the kernels launch with programmatic dependent launch (each may start while the one before it ends,
    and waits for it before touching activations): a chain of layers, each reading what the last wrote, gives
    bit for bit what launches that wait in full give, eagerly and replayed from a CUDA graph, 20 times over."""
    from peft_csgmv.kernels import launch

    if torch.cuda.get_device_capability()[0] < 9 or not launch._triton_has_pdl():
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with launch_pdl")
    torch.manual_seed(0)
    dt, k = torch.bfloat16, 2048
    layers = []
    for i in range(12):
        a, b, r, scal = _cuda_stack(32, [16] * 32, k, k, dt, seed=i)
        layers.append((torch.randn(k, k, device="cuda", dtype=dt) / k**0.5, a, b, r, scal))
    rows = list(range(32))
    if out_of_place:
        # Base rows too, in segments of slot -1 as a static plan has them (out of place, the plan covers every row).
        from peft_csgmv.mapping import StaticPlan
        from peft_csgmv.ops import _plan

        rows[::5] = [-1] * len(rows[::5])
        static = StaticPlan(32, 32, 1, torch.device("cuda"))
        static.fill(tuple(rows))
        plan = _plan(static.permutation, static.seg_indptr, static.seg_slot, static.chunk, runs=False)
    else:
        plan = BatchPlan.build(rows, 1, "cuda")
    x = torch.randn(32, k, device="cuda", dtype=dt)

    def results():
        eager = [_chain(layers, plan, x, out_of_place) for _ in range(20)]
        static_x = x.clone()
        _chain(layers, plan, static_x, out_of_place)  # warm up (compile) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(layers, plan, static_x, out_of_place)
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        return eager, replays

    launch.reset_pdl()
    assert launch.pdl(torch.device("cuda", torch.cuda.current_device()))
    with_pdl = results()
    monkeypatch.setenv("PEFT_CSGMV_PDL", "0")
    launch.reset_pdl()
    try:
        assert not launch.pdl(torch.device("cuda", torch.cuda.current_device()))
        eager, _ = results()
    finally:
        monkeypatch.delenv("PEFT_CSGMV_PDL")
        launch.reset_pdl()
    serial = eager[0]
    assert torch.isfinite(serial).all() and serial.abs().sum() > 0
    for got in with_pdl[0] + with_pdl[1]:
        assert torch.equal(got, serial)


def _packed_step(seed: int) -> list[int]:
    """The token slots of one packed continuous-batching step: requests of 1 to 9 tokens (decode tokens and prefill
    chunks) back to back, each with its adapter's slot (zipf-skewed) or a base request."""
    rng = random.Random(seed)
    slots = _zipf_rows(24, seed, base_fraction=0.2)
    return [slot for slot in slots for _ in range(rng.choice([1, 1, 1, 4, 9]))]


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("seed", [0, 1])
def test_packed_token_plan_end_to_end(dtype, seed):
    """A plan made from each token's slot (``BatchPlan.from_token_slots``: a packed step's tokens, requests of
    different lengths back to back) runs shrink and expand as the float64 oracle says, every untouched entry kept."""
    token_slot = _packed_step(seed)
    plan = BatchPlan.from_token_slots(token_slot, device=DEVICE)
    ranks, r_max = RANKS["r8-0-3-16"]
    run_and_check_end_to_end(plan, token_slot, ranks, r_max, 33, 47, dtype, seed=seed, what=f"packed seed {seed}")
