"""The MoE kernels (``moe_shrink`` / ``moe_expand``) and their torch reference against an independent float64 oracle.

As in tests/test_kernels.py (whose comparison helpers and tolerance table this reuses): on a machine without CUDA the
kernels run under the Triton interpreter in fp32 and fp16 (bf16 joins on a GPU); kernel inputs live on ``DEVICE``, the
oracle runs on the CPU in float64. The oracle works from each pair's token slot and expert (``token_slot[p // top_k]``,
``top_k_index.reshape(-1)[p]``), not from the plan's segments; only the ``"sorted"`` row mode reads the plan's
permutation, whose order tests/test_moe_plan.py checks.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from test_kernels import DEVICE, DTYPES, SENTINEL, bits, check_close, full, randn, x_view, y_view

from peft_csgmv.kernels.moe import moe_expand, moe_shrink
from peft_csgmv.kernels.moe_reference import moe_expand_reference, moe_shrink_reference
from peft_csgmv.moe_plan import MoePlan

NUM_SLOTS = 4
SCALINGS = [0.5, 2.0, 1.25, 0.75]

# ----------------------------------------------------------------------------------------------------------------------
# Routings (kept apart from the oracle)
# ----------------------------------------------------------------------------------------------------------------------


def _route(seed, tokens, top_k, experts, base_fraction=0.25, skew=1.0, idle=(), unrouted=0.0):
    """Token slots (zipf-skewed over the slots, some base tokens) and ``top_k`` distinct experts per token (skewed
    towards expert 0), never the experts in ``idle``; a fraction ``unrouted`` of the entries is -1 or ``experts``."""
    rng = random.Random(seed)
    slot_weights = [1.0 / (s + 1) ** 1.5 for s in range(NUM_SLOTS)]
    token_slot = [-1 if rng.random() < base_fraction else rng.choices(range(NUM_SLOTS), slot_weights)[0]
                  for _ in range(tokens)]  # fmt: skip
    choices = [e for e in range(experts) if e not in idle]
    weights = [1.0 / (e + 1) ** skew for e in choices]
    index = []
    for _ in range(tokens):
        row: list[int] = []
        while len(row) < top_k:
            e = rng.choices(choices, weights)[0]
            if e not in row:
                row.append(e)
        index.append([rng.choice([-1, experts]) if rng.random() < unrouted else e for e in row])
    return token_slot, index


# name → (token_slot, top_k_index rows, experts, chunk_size override)
ROUTINGS = {
    "mixed-idle-expert": (*_route(5, 13, 2, 6, idle=(3, 5)), 6, None),
    "skewed-chunk4": (*_route(1, 20, 3, 5, skew=2.5), 5, 4),
    "unrouted": (*_route(2, 9, 2, 4, unrouted=0.3), 4, None),
    "top1": (*_route(3, 11, 1, 3), 3, None),
    "one-token-top4": ([2], [[3, 0, 2, 1]], 5, None),
    "docstring": ([1, -1, 0, 1], [[0, 2], [2, 1], [2, 0], [0, 1]], 3, None),
    "all-base": (*_route(4, 5, 2, 3, base_fraction=1.0), 3, None),
}

# name → (rank of each slot, padded max rank R of the stack)
RANKS = {
    "r1-7-16-64": ([1, 7, 16, 64], 64),
    "r8-0-3-33": ([8, 0, 3, 33], 48),
    "r2-5-1-4": ([2, 5, 1, 4], 8),
}
DIMS = {"in33-out47": (33, 47), "in123-out431": (123, 431)}


def dtype_params():
    return [pytest.param(dt, id=name) for name, dt in DTYPES.items()]


class Routing:
    """One routing case: the plan on ``DEVICE`` and, on the host, each pair's slot and expert."""

    def __init__(self, token_slot, index, experts, chunk_size=None, num_slots=NUM_SLOTS):
        self.token_slot = list(token_slot)
        self.index = torch.tensor(index, dtype=torch.int64)
        self.experts = experts
        self.top_k = self.index.shape[1]
        self.plan = MoePlan.build(token_slot, self.index.to(DEVICE), experts, num_slots, chunk_size=chunk_size)
        self.pairs = self.index.numel()
        self.pair_slot = [self.token_slot[p // self.top_k] for p in range(self.pairs)]
        self.pair_expert = self.index.reshape(-1).tolist()
        self.position = torch.empty(self.pairs, dtype=torch.int64)  # sorted position of each pair
        self.position[self.plan.permutation.cpu().long()] = torch.arange(self.pairs)

    @classmethod
    def named(cls, name):
        token_slot, index, experts, chunk = ROUTINGS[name]
        return cls(token_slot, index, experts, chunk)

    @property
    def tokens(self) -> int:
        return len(self.token_slot)

    def groups(self, ranks):
        """``(slot, expert, rank, pairs)`` of each (slot, expert) with routed pairs and a rank, straight from the
        routing."""
        found: dict = {}
        for p, (slot, expert) in enumerate(zip(self.pair_slot, self.pair_expert)):
            if slot >= 0 and 0 <= expert < self.experts and int(ranks[slot]) > 0:
                found.setdefault((slot, expert), []).append(p)
        for (slot, expert), pairs in sorted(found.items()):
            yield slot, expert, int(ranks[slot]), torch.tensor(pairs)

    def rows(self, mode, pairs):
        return {"token": pairs // self.top_k, "pair": pairs, "sorted": self.position[pairs]}[mode]

    def x_len(self, mode) -> int:
        return self.tokens if mode == "token" else self.pairs

    def written(self, ranks, width) -> torch.Tensor:
        """``(P, width)`` bool: the entries of ``t`` the shrink writes."""
        mask = torch.zeros(self.pairs, width, dtype=torch.bool)
        for _, _, r, pairs in self.groups(ranks):
            mask[pairs, :r] = True
        return mask.to(DEVICE)

    def touched(self, ranks, mode) -> torch.Tensor:
        """``(P,)`` bool: the rows of ``y`` (by ``mode``) the expand updates."""
        mask = torch.zeros(self.pairs, dtype=torch.bool)
        for _, _, _, pairs in self.groups(ranks):
            mask[self.rows(mode, pairs)] = True
        return mask.to(DEVICE)


# ----------------------------------------------------------------------------------------------------------------------
# Oracle: the Semantics of kernels/moe.py per (slot, expert) of the routing, in float64.
# ----------------------------------------------------------------------------------------------------------------------


def oracle_shrink(x, a, ranks, routing, x_rows, t_before):
    """``t[p, :r] = x[row(p)] (cast to A's dtype) @ A[slot, e, :r]ᵀ`` for each routed adapter pair ``p`` of a slot with
    rank ``r > 0``; every other entry keeps ``t_before``. float64."""
    t = t_before.cpu().double().clone()
    x64, a64 = x.cpu().to(a.dtype).double(), a.cpu().double()
    for slot, expert, r, pairs in routing.groups(ranks):
        t[pairs, :r] = x64[routing.rows(x_rows, pairs)] @ a64[slot, expert, :r].T
    return t


def oracle_expand(t, b, ranks, scalings, routing, y_rows, y_before):
    """``y[row(p)] += (t[p, :r] (cast to B's dtype) @ B[slot, e, :, :r]ᵀ) * scaling[slot]``; other rows keep
    ``y_before``. float64, no rounding to y's dtype."""
    y = y_before.cpu().double().clone()
    t, b64 = t.cpu(), b.cpu().double()
    for slot, expert, r, pairs in routing.groups(ranks):
        delta = t[pairs, :r].to(b.dtype).double() @ b64[slot, expert, :, :r].T
        y[routing.rows(y_rows, pairs)] += delta * float(scalings[slot])
    return y


def make_weights(ranks, r_max, experts, k, n, dtype, seed, pad=0.0):
    """``A (S, E, R, K)``, ``B (S, E, N, R)`` with ``pad`` past each slot's rank; ranks int32, scalings fp32."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(NUM_SLOTS, experts, r_max, k, generator=g) / math.sqrt(k)
    b = torch.randn(NUM_SLOTS, experts, n, r_max, generator=g) / math.sqrt(r_max)
    for s, r in enumerate(ranks):
        a[s, :, r:] = pad
        b[s, :, :, r:] = pad
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    scalings = torch.tensor(SCALINGS, dtype=torch.float32, device=DEVICE)
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype), ranks_t, scalings


def run_end_to_end(routing, ranks, r_max, k, n, dtype, x_rows, y_rows, seed=0, what="", own_rank=False):
    """shrink then expand on fresh data; each step against the oracle; untouched entries bit-identical. ``own_rank``:
    the kernels read the weights as :class:`~peft_csgmv.moe.MoeStack` keeps them (:func:`own_rank_stacks`)."""
    a, b, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed)
    a_in, b_in = own_rank_stacks(a, b, ranks, 1) if own_rank else (a, b)
    x = randn(routing.x_len(x_rows), k, dtype=dtype, seed=seed + 1)
    y = randn(routing.pairs, n, dtype=dtype, seed=seed + 2)
    y0 = y.clone()
    t = full((routing.pairs, r_max), SENTINEL)

    assert moe_shrink(x, a_in, ranks_t, routing.plan, t=t, x_rows=x_rows, own_rank=own_rank) is t
    t_exp = oracle_shrink(x, a, ranks, routing, x_rows, torch.full_like(t, SENTINEL))
    check_close(t, t_exp, dtype, what=f"{what} moe_shrink t")
    unwritten = ~routing.written(ranks, r_max)
    assert torch.equal(bits(t[unwritten]), bits(torch.full_like(t[unwritten], SENTINEL))), f"{what}: t written"

    assert moe_expand(t, b_in, ranks_t, scalings, routing.plan, y, y_rows=y_rows, own_rank=own_rank) is y
    y_exp = oracle_expand(t_exp.float(), b, ranks, scalings, routing, y_rows, y0)  # t is stored in fp32
    check_close(y, y_exp, dtype, what=f"{what} moe_expand y")
    touched = routing.touched(ranks, y_rows)
    assert torch.equal(bits(y[~touched]), bits(y0[~touched])), f"{what}: rows outside the segments changed"
    if touched.any():
        assert not torch.equal(y[touched], y0[touched]), f"{what}: expand changed nothing"


# ----------------------------------------------------------------------------------------------------------------------
# Over the routings
# ----------------------------------------------------------------------------------------------------------------------


def test_routings_cover_the_cases():
    mixed = Routing.named("mixed-idle-expert")
    assert set(mixed.pair_expert) == {0, 1, 2, 4}, "experts 3 and 5 get no pairs"
    assert -1 in mixed.token_slot and len({s for s in mixed.token_slot if s >= 0}) == NUM_SLOTS
    skewed = Routing.named("skewed-chunk4")
    assert any(end - start == 4 for *_, start, end in skewed.plan.segments()), "runs longer than a chunk are cut"
    unrouted = Routing.named("unrouted")
    assert {-1, 4} <= set(unrouted.pair_expert)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("x_rows", ["token", "pair", "sorted"])
@pytest.mark.parametrize("routing_name", list(ROUTINGS))
def test_shrink_matches_oracle(routing_name, x_rows, dtype):
    routing = Routing.named(routing_name)
    ranks, r_max = RANKS["r1-7-16-64"]
    k, n = DIMS["in33-out47"]
    a, _, ranks_t, _ = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=10)
    x = randn(routing.x_len(x_rows), k, dtype=dtype, seed=11)
    x0 = x.clone()
    t = full((routing.pairs, r_max), SENTINEL)

    out = moe_shrink(x, a, ranks_t, routing.plan, t=t, x_rows=x_rows)

    assert out is t
    expected = oracle_shrink(x, a, ranks, routing, x_rows, torch.full_like(t, SENTINEL))
    check_close(t, expected, dtype, what=f"moe_shrink[{routing_name}, {x_rows}]")
    unwritten = ~routing.written(ranks, r_max)
    assert torch.equal(bits(t[unwritten]), bits(torch.full_like(t[unwritten], SENTINEL)))
    assert torch.equal(bits(x), bits(x0)), "moe_shrink modified x"


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("y_rows", ["pair", "sorted"])
@pytest.mark.parametrize("routing_name", list(ROUTINGS))
def test_expand_matches_oracle(routing_name, y_rows, dtype):
    routing = Routing.named(routing_name)
    ranks, r_max = RANKS["r1-7-16-64"]
    k, n = DIMS["in33-out47"]
    _, b, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=20)
    t = randn(routing.pairs, r_max, dtype=torch.float32, seed=21)
    y = randn(routing.pairs, n, dtype=dtype, seed=22)
    y0, t0 = y.clone(), t.clone()

    out = moe_expand(t, b, ranks_t, scalings, routing.plan, y, y_rows=y_rows)

    assert out is y
    expected = oracle_expand(t0, b, ranks, scalings, routing, y_rows, y0)
    check_close(y, expected, dtype, what=f"moe_expand[{routing_name}, {y_rows}]")
    touched = routing.touched(ranks, y_rows)
    assert torch.equal(bits(y[~touched]), bits(y0[~touched])), "base / unrouted rows changed"
    assert torch.equal(bits(t), bits(t0)), "moe_expand modified t"
    assert touched.any() == (routing_name != "all-base")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("ranks_name", list(RANKS))
@pytest.mark.parametrize("dims_name", list(DIMS))
def test_dims_and_ranks_end_to_end(dims_name, ranks_name, dtype):
    """gate/up-shaped (x by token, y by pair) and down-shaped (x and y in sorted order) LoRA over a skewed routing
    with base tokens, an idle expert and runs cut into several segments."""
    token_slot, index = _route(7, 24, 3, 7, idle=(6,), skew=1.5)
    routing = Routing(token_slot, index, 7, chunk_size=4)
    ranks, r_max = RANKS[ranks_name]
    k, n = DIMS[dims_name]
    what = f"{dims_name}/{ranks_name}"
    run_end_to_end(routing, ranks, r_max, k, n, dtype, "token", "pair", seed=30, what=f"gate_up {what}")
    run_end_to_end(routing, ranks, r_max, n, k, dtype, "sorted", "sorted", seed=40, what=f"down {what}")
    # (and read as the stacks keep the weights: each slot at its own rank)
    run_end_to_end(routing, ranks, r_max, k, n, dtype, "token", "pair", seed=31, what=f"own-rank {what}", own_rank=True)


@pytest.mark.parametrize("dtype", dtype_params())
def test_default_chunk_many_tokens(dtype):
    """The default chunk over more pairs than one tile: 96 tokens × top-4 over 8 experts and 4 slots."""
    token_slot, index = _route(8, 96, 4, 8, base_fraction=0.1)
    routing = Routing(token_slot, index, 8)
    assert routing.plan.chunk_size == 16 and any(end - start == 16 for *_, start, end in routing.plan.segments())
    ranks, r_max = RANKS["r8-0-3-33"]
    run_end_to_end(routing, ranks, r_max, 40, 24, dtype, "token", "pair", seed=45, what="default chunk")


# ----------------------------------------------------------------------------------------------------------------------
# Strides, rank padding, base and unrouted pairs
# ----------------------------------------------------------------------------------------------------------------------


def t_view(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "dense":
        return t
    if layout == "row-stride-2":  # t[::2] of a buffer twice as tall, columns 3.. of a wider one
        parent = full((2 * t.shape[0], t.shape[1] + 5), SENTINEL)
        view = parent[::2, 3 : 3 + t.shape[1]]
    else:  # column-major
        view = full(t.shape[::-1], SENTINEL).t()
    view.copy_(t)
    return view


def x_strided(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "row-stride-2":  # x[::2] of a buffer twice as tall
        parent = full((2 * x.shape[0], x.shape[1]), float("nan"), x.dtype)
        parent[::2] = x
        return parent[::2]
    return x_view(x, layout)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize(
    "x_layout,t_layout,y_layout",
    [
        ("row-stride-2", "row-stride-2", "row-stride-2"),
        ("column-slice", "transposed", "column-slice"),
        ("transposed", "dense", "transposed"),
    ],
)
@pytest.mark.parametrize("x_rows,y_rows", [("token", "pair"), ("pair", "sorted")])
def test_strided_operands(x_rows, y_rows, x_layout, t_layout, y_layout, dtype):
    """x, t and y as views (``[::2]``, column slices, transposed), A and B as strided views of other layouts (B as
    PEFT's ``lora_B.weight`` of every slot, ``(S, N, R * E)`` seen through ``.view(S, N, R, E).permute(0, 3, 1, 2)``):
    the kernels read and write through the strides, nothing outside the views is written."""
    routing = Routing.named("mixed-idle-expert")
    ranks, r_max = RANKS["r1-7-16-64"]
    k, n = DIMS["in33-out47"]
    experts = routing.experts
    a_dense, b_dense, ranks_t, scalings = make_weights(ranks, r_max, experts, k, n, dtype, seed=50)
    a = a_dense.permute(1, 0, 3, 2).contiguous().permute(1, 0, 3, 2)  # stored (E, S, K, R)
    b_peft = b_dense.permute(0, 2, 3, 1).reshape(NUM_SLOTS, n, r_max * experts)  # column j * E + e
    b = b_peft.view(NUM_SLOTS, n, r_max, experts).permute(0, 3, 1, 2)
    assert torch.equal(a, a_dense) and torch.equal(b, b_dense)
    assert not a.is_contiguous() and not b.is_contiguous()
    x_dense = randn(routing.x_len(x_rows), k, dtype=dtype, seed=51)
    x = x_strided(x_dense, x_layout)
    t = t_view(full((routing.pairs, r_max), SENTINEL), t_layout)
    y_dense = randn(routing.pairs, n, dtype=dtype, seed=52)
    y, parent, outside = y_view(y_dense, y_layout)
    assert not x.is_contiguous() and not y.is_contiguous() and torch.equal(x, x_dense)
    parent0 = parent.clone()

    moe_shrink(x, a, ranks_t, routing.plan, t=t, x_rows=x_rows)
    moe_expand(t, b, ranks_t, scalings, routing.plan, y, y_rows=y_rows)

    t_exp = oracle_shrink(x_dense, a_dense, ranks, routing, x_rows, torch.full(t.shape, SENTINEL))
    check_close(t, t_exp, dtype, what=f"moe_shrink x {x_layout} t {t_layout}")
    y_exp = oracle_expand(t_exp.float(), b_dense, ranks, scalings, routing, y_rows, y_dense)
    check_close(y, y_exp, dtype, what=f"moe_expand y {y_layout}")
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "moe_expand wrote outside the y view"


@pytest.mark.parametrize("dtype", dtype_params())
def test_rank_padding_is_never_read(dtype):
    """Garbage (1e3) past each slot's rank in A, B and the input t: the kernels use the first r entries only."""
    routing = Routing.named("skewed-chunk4")
    ranks, r_max = RANKS["r8-0-3-33"]
    k, n = DIMS["in33-out47"]
    a_clean, b_clean, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=60)
    a_dirty, b_dirty, _, _ = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=60, pad=1e3)
    assert not torch.equal(a_clean, a_dirty) and not torch.equal(b_clean, b_dirty)
    x = randn(routing.tokens, k, dtype=dtype, seed=61)
    y = randn(routing.pairs, n, dtype=dtype, seed=62)
    y0 = y.clone()
    t = full((routing.pairs, r_max), 1e3)

    moe_shrink(x, a_dirty, ranks_t, routing.plan, t=t)
    t_exp = oracle_shrink(x, a_clean, ranks, routing, "token", torch.full_like(t, 1e3))
    check_close(t, t_exp, dtype, what="moe_shrink (dirty pad)")
    moe_expand(t, b_dirty, ranks_t, scalings, routing.plan, y)  # t holds 1e3 past each rank
    y_exp = oracle_expand(t_exp.float(), b_clean, ranks, scalings, routing, "pair", y0)
    check_close(y, y_exp, dtype, what="moe_expand (dirty pad)")


def own_rank_stacks(a_dense, b_dense, ranks, spread, fill=1e3):
    """``a_dense`` / ``b_dense`` (padded, zero past each rank) laid out as each slot's PEFT weights at its own rank
    (``lora_A.weight`` ``(r·E, K)``, ``lora_B.weight`` ``(N, r·E)``) at the start of the slot's block, ``fill`` in the
    rest; ``spread`` 2: the slots are every other block of a buffer, from its second block (slot stride and offset)."""
    num_slots, experts, r_max, k = a_dense.shape
    n = b_dense.shape[2]
    a_buf = torch.full((num_slots * spread + 1, experts, r_max, k), fill, dtype=a_dense.dtype, device=DEVICE)
    b_buf = torch.full((num_slots * spread + 1, n, r_max, experts), fill, dtype=b_dense.dtype, device=DEVICE)
    a, b_store = a_buf[1::spread][:num_slots], b_buf[1::spread][:num_slots]
    for s, r in enumerate(ranks):
        a[s].view(-1)[: experts * r * k] = a_dense[s, :, :r].reshape(-1)  # expert-major: row e·r + j
        b_store[s].view(-1)[: n * r * experts] = b_dense[s, :, :, :r].permute(1, 2, 0).reshape(-1)  # col j·E + e
    return a, b_store.permute(0, 3, 1, 2)


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("spread", [1, 2], ids=["dense-slots", "every-other-slot-offset"])
def test_own_rank_layout_reads_peft_weights_in_place(spread, dtype):
    """``own_rank``: each slot holds PEFT's own ``lora_A`` / ``lora_B`` weights at its own rank at the start of its
    block (what :class:`~peft_csgmv.moe.MoeStack` stores, so that PEFT's weights of any rank view it), slots ``[1::2]``
    of a wider buffer; garbage (1e3) in the rest of each block is never read. Kernels and the torch reference against
    the float64 oracle on the padded weights."""
    routing = Routing.named("mixed-idle-expert")
    ranks, r_max = RANKS["r8-0-3-33"]
    k, n = DIMS["in33-out47"]
    a_dense, b_dense, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=90)
    a, b = own_rank_stacks(a_dense, b_dense, ranks, spread)
    assert not torch.equal(a, a_dense) and a.storage_offset() > 0
    x = randn(routing.tokens, k, dtype=dtype, seed=91)
    y_dense = randn(routing.pairs, n, dtype=dtype, seed=92)
    t_exp = oracle_shrink(x, a_dense, ranks, routing, "token", torch.full((routing.pairs, r_max), SENTINEL))
    y_exp = oracle_expand(t_exp.float(), b_dense, ranks, scalings, routing, "sorted", y_dense)

    t = full((routing.pairs, r_max), SENTINEL)
    moe_shrink(x, a, ranks_t, routing.plan, t=t, own_rank=True)
    check_close(t, t_exp, dtype, what="moe_shrink own_rank")
    y = y_dense.clone()
    moe_expand(t, b, ranks_t, scalings, routing.plan, y, y_rows="sorted", own_rank=True)
    check_close(y, y_exp, dtype, what="moe_expand own_rank")

    t_ref = moe_shrink_reference(x, a, ranks, routing.plan, own_rank=True)
    check_close(t_ref[routing.written(ranks, r_max)], t_exp[routing.written(ranks, r_max).cpu()], dtype, "reference")
    y_ref = moe_expand_reference(t_ref, b, ranks, scalings.tolist(), routing.plan, y_dense.clone(), "sorted", True)
    check_close(y_ref, y_exp, dtype, what="moe_expand_reference own_rank")


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("y_rows", ["pair", "sorted"])
def test_base_unrouted_and_rank0_rows_bit_identical(y_rows, dtype):
    """Rows of base pairs, unrouted pairs and a rank-0 slot's pairs hold -0.0, NaN and inf, and their tokens' x is
    NaN: a kernel that so much as re-stored y + 0 there would flip -0.0 to +0.0, and NaN must not leak anywhere."""
    routing = Routing.named("unrouted")
    ranks, r_max = RANKS["r8-0-3-33"]  # slot 1 has rank 0
    k, n = DIMS["in33-out47"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=70)
    x = randn(routing.tokens, k, dtype=dtype, seed=71)
    y = randn(routing.pairs, n, dtype=dtype, seed=72)
    touched = routing.touched(ranks, y_rows)
    idle_tokens = torch.tensor([s < 0 or ranks[s] == 0 for s in routing.token_slot], device=DEVICE)
    assert (~touched).any() and touched.any() and idle_tokens.any()
    assert any(ranks[s] == 0 for s in routing.token_slot if s >= 0), "the routing has tokens of the rank-0 slot"
    special = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf"), 1.5], dtype=dtype, device=DEVICE)
    y[~touched] = special.repeat(n // len(special) + 1)[:n]
    x[idle_tokens] = float("nan")
    t = full((routing.pairs, r_max), float("nan"))
    y0 = y.clone()

    moe_shrink(x, a, ranks_t, routing.plan, t=t)
    moe_expand(t, b, ranks_t, scalings, routing.plan, y, y_rows=y_rows)

    assert torch.equal(bits(y[~touched]), bits(y0[~touched])), "untouched rows of y are not bit-identical"
    assert torch.isfinite(y[touched]).all(), "NaN leaked into adapter rows"
    assert not torch.equal(y[touched], y0[touched])


# ----------------------------------------------------------------------------------------------------------------------
# Reference, argument checks
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", dtype_params())
@pytest.mark.parametrize("routing_name", ["mixed-idle-expert", "unrouted", "all-base"])
def test_reference_matches_oracle(routing_name, dtype):
    """The torch reference (the CPU backend) in float64 and in the kernels' dtypes, both row modes of each side."""
    routing = Routing.named(routing_name)
    ranks, r_max = RANKS["r8-0-3-33"]
    k, n = DIMS["in33-out47"]
    a, b, _, scalings = make_weights(ranks, r_max, routing.experts, k, n, dtype, seed=80)
    for x_rows, y_rows in (("token", "pair"), ("sorted", "sorted")):
        x = randn(routing.x_len(x_rows), k, dtype=dtype, seed=81)
        y = randn(routing.pairs, n, dtype=dtype, seed=82)
        t_exp = oracle_shrink(x, a, ranks, routing, x_rows, torch.zeros(routing.pairs, r_max))
        t64 = moe_shrink_reference(x.to(a.dtype).double(), a.double(), ranks, routing.plan, x_rows=x_rows)
        check_close(t64, t_exp, torch.float64, what=f"reference shrink fp64 {x_rows}")
        y64 = moe_expand_reference(t64, b.double(), ranks, scalings.tolist(), routing.plan, y.double(), y_rows)
        y_exp64 = oracle_expand(t_exp, b.double(), ranks, scalings.tolist(), routing, y_rows, y)
        check_close(y64, y_exp64, torch.float64, what=f"reference expand fp64 {y_rows}")
        y_exp = oracle_expand(t_exp.float(), b, ranks, scalings.tolist(), routing, y_rows, y)
        t = moe_shrink_reference(x, a, ranks, routing.plan, x_rows=x_rows)
        assert t.dtype == torch.float32
        check_close(t, t_exp, dtype, what=f"reference shrink {x_rows}")
        moe_expand_reference(t, b, ranks, scalings.tolist(), routing.plan, y, y_rows)
        check_close(y, y_exp, dtype, what=f"reference expand {y_rows}")


def test_shape_mismatch_raises():
    routing = Routing.named("docstring")
    ranks, r_max = RANKS["r2-5-1-4"]
    a, b, ranks_t, scalings = make_weights(ranks, r_max, routing.experts, 33, 47, torch.float32, seed=90)
    x = randn(routing.tokens, 33, dtype=torch.float32, seed=91)
    plan = routing.plan
    with pytest.raises(ValueError, match="x has 4 rows"):
        moe_shrink(x, a, ranks_t, plan, x_rows="pair")
    with pytest.raises(ValueError, match="x_rows must be one of"):
        moe_shrink(x, a, ranks_t, plan, x_rows="tokens")
    with pytest.raises(ValueError, match="do not fit"):
        moe_shrink(x[:, :32], a, ranks_t, plan)
    with pytest.raises(ValueError, match="do not fit"):
        moe_shrink(x, a[:, :2], ranks_t, plan)
    with pytest.raises(ValueError, match="is not"):
        moe_shrink(x, a, ranks_t, plan, t=torch.empty(plan.num_pairs, r_max, dtype=torch.float16, device=DEVICE))
    t = moe_shrink(x, a, ranks_t, plan)
    y = randn(plan.num_pairs, 47, dtype=torch.float32, seed=92)
    with pytest.raises(ValueError, match="one row per pair"):
        moe_expand(t, b, ranks_t, scalings, plan, y, y_rows="token")
    with pytest.raises(ValueError, match="do not fit"):
        moe_expand(t, b, ranks_t, scalings, plan, y[:, :46])
    with pytest.raises(ValueError, match="y has 7 rows"):
        moe_expand(t, b, ranks_t, scalings, plan, y[:7])


# ----------------------------------------------------------------------------------------------------------------------
# GPU: real layer shapes in bf16
# ----------------------------------------------------------------------------------------------------------------------

# name → (hidden, expert intermediate, experts, top_k): Qwen3-30B-A3B, gpt-oss-20b, Mixtral-8x7B (a slice of its
# 14336-wide intermediate keeps the float64 oracle quick)
GPU_LAYOUTS = {"qwen3-30b-a3b": (2048, 768, 128, 8), "gpt-oss-20b": (2880, 2880, 32, 4), "mixtral": (4096, 2048, 8, 2)}


@pytest.mark.gpu
@pytest.mark.parametrize("own_rank", [False, True], ids=["padded", "own-rank"])
@pytest.mark.parametrize("tokens", [7, 300], ids=["decode-7", "prefill-300"])
@pytest.mark.parametrize("layout", list(GPU_LAYOUTS))
def test_gpu_real_shapes_bf16(layout, tokens, own_rank):
    """Both products of one MoE layer (gate/up: x by token → 2·I columns by pair; down: I → hidden, sorted order) in
    bf16 with the default chunk, four slots of ranks 8..64 and base tokens, against the float64 oracle; the weights
    padded to the largest rank, or each slot at its own rank as the stacks keep them."""
    hidden, inter, experts, top_k = GPU_LAYOUTS[layout]
    g = torch.Generator().manual_seed(tokens)
    index = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    token_slot, _ = _route(tokens, tokens, 1, 1, base_fraction=0.2)
    routing = Routing(token_slot, index.tolist(), experts)
    ranks, r_max = [16, 8, 64, 32], 64
    run_end_to_end(routing, ranks, r_max, hidden, 2 * inter, torch.bfloat16, "token", "pair", seed=100,
                   what=f"{layout} gate_up", own_rank=own_rank)  # fmt: skip
    run_end_to_end(routing, ranks, r_max, inter, hidden, torch.bfloat16, "sorted", "sorted", seed=110,
                   what=f"{layout} down", own_rank=own_rank)  # fmt: skip
