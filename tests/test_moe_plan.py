"""MoePlan unit tests: the worked example with exact tensors, then structural properties on assorted routings."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from peft_csgmv import moe_plan
from peft_csgmv.kernels.moe_plan import MAX_PAIRS, fits
from peft_csgmv.moe_plan import MAX_CHUNK_SIZE, MoePlan, max_segments, moe_chunk_size, token_groups
from peft_csgmv.plan import MIN_CHUNK_SIZE

EXAMPLE = dict(token_slot=[1, -1, 0, 1], top_k_index=[[0, 2], [2, 1], [2, 0], [0, 1]], num_experts=3, num_slots=2)


def example(**kwargs) -> MoePlan:
    index = torch.tensor(EXAMPLE["top_k_index"])
    return MoePlan.build(EXAMPLE["token_slot"], index, EXAMPLE["num_experts"], EXAMPLE["num_slots"], **kwargs)


def assert_tensor(name, got, want):
    assert got.dtype == torch.int32, f"{name} dtype {got.dtype}"
    assert got.tolist() == list(want), f"{name}: got {got.tolist()}, want {list(want)}"


@pytest.mark.parametrize("chunk_size", [None, 16], ids=["chunk-default", "chunk16"])
def test_docstring_example(chunk_size):
    plan = example(chunk_size=chunk_size)
    assert (plan.num_tokens, plan.top_k, plan.num_pairs, plan.chunk_size, plan.num_segments) == (4, 2, 8, 16, 6)
    assert_tensor("permutation", plan.permutation, [5, 0, 6, 7, 3, 4, 1, 2])
    assert_tensor("expert_offsets", plan.expert_offsets, [3, 5, 8])
    assert_tensor("seg_start", plan.seg_start, [0, 1, 3, 5, 6, 0])
    assert_tensor("seg_end", plan.seg_end, [1, 3, 4, 6, 7, 0])
    assert_tensor("seg_slot", plan.seg_slot, [0, 1, 1, 0, 1, -1])
    assert_tensor("seg_expert", plan.seg_expert, [0, 0, 1, 2, 2, 0])
    assert plan.segments() == [(0, 0, 0, 1), (1, 0, 1, 3), (1, 1, 3, 4), (0, 2, 5, 6), (1, 2, 6, 7)]


def test_docstring_example_chunk1():
    plan = example(chunk_size=1)
    assert plan.num_segments == 14
    assert plan.segments() == [(0, 0, 0, 1), (1, 0, 1, 2), (1, 0, 2, 3), (1, 1, 3, 4), (0, 2, 5, 6), (1, 2, 6, 7)]


def test_token_slots_as_a_tensor_give_the_same_plan():
    a = example()
    b = MoePlan.build(
        torch.tensor(EXAMPLE["token_slot"], dtype=torch.int32), torch.tensor(EXAMPLE["top_k_index"]), 3, 2
    )
    # A tensor's slots are device data: the chunk is chosen for every slot in use.
    assert b.chunk_size == a.chunk_size == MIN_CHUNK_SIZE
    for name in ("permutation", "expert_offsets", "seg_start", "seg_end", "seg_slot", "seg_expert"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_chunk_size_choice():
    assert moe_chunk_size(8, 6) == MIN_CHUNK_SIZE
    assert moe_chunk_size(4096 * 8, 128 * 4) == MAX_CHUNK_SIZE  # 64 pairs per group
    assert moe_chunk_size(4096, 128) == 32
    assert moe_chunk_size(1000, 1) == MAX_CHUNK_SIZE
    assert max_segments(8, 3, 2, 16) == 6 and max_segments(8, 3, 2, 1) == 14


def test_bad_arguments_raise():
    index = torch.tensor(EXAMPLE["top_k_index"])
    with pytest.raises(ValueError, match="token_slot must hold"):
        MoePlan.build([1, -1, 0], index, 3, 2)
    with pytest.raises(ValueError, match="token_slot must hold"):
        MoePlan.build([1, -1, 0, 2], index, 3, 2)  # slot 2 of 2 slots
    with pytest.raises(ValueError, match="does not fit"):
        MoePlan.build(torch.zeros(3, dtype=torch.int64), index, 3, 2)
    with pytest.raises(ValueError, match="tokens, top_k"):
        MoePlan.build([0, 0, 0, 0, 0, 0, 0, 0], index.reshape(-1), 3, 2)
    with pytest.raises(ValueError, match="chunk_size"):
        MoePlan.build(EXAMPLE["token_slot"], index, 3, 2, chunk_size=0)


def test_no_tokens():
    plan = MoePlan.build([], torch.zeros(0, 4, dtype=torch.int64), 8, 2)
    assert plan.num_pairs == 0 and plan.num_segments == 0 and plan.segments() == []
    assert plan.expert_offsets.tolist() == [0] * 8


# ----------------------------------------------------------------------------------------------------------------------
# Structural properties
# ----------------------------------------------------------------------------------------------------------------------


def random_routing(seed, tokens, top_k, experts, slots, base_fraction=0.25, unrouted_fraction=0.0):
    rng = random.Random(seed)
    token_slot = [-1 if rng.random() < base_fraction else rng.randrange(slots) for _ in range(tokens)]
    weights = [1.0 / (e + 1) for e in range(experts)]  # skewed: expert 0 gets the most pairs
    index = []
    for _ in range(tokens):
        chosen: list[int] = []
        while len(chosen) < top_k:
            e = rng.choices(range(experts), weights)[0]
            if e not in chosen:
                chosen.append(e)
        index.append([rng.choice([-1, experts]) if rng.random() < unrouted_fraction else e for e in chosen])
    return token_slot, torch.tensor(index, dtype=torch.int64).reshape(tokens, top_k)


CASES = {
    # name: (seed, tokens, top_k, experts, slots, base fraction, unrouted fraction, chunk)
    "small": (0, 9, 2, 4, 3, 0.25, 0.0, None),
    "chunk3": (1, 40, 3, 5, 2, 0.2, 0.0, 3),
    "chunk1-all-adapters": (2, 17, 2, 3, 4, 0.0, 0.0, 1),
    "unrouted": (3, 25, 4, 6, 3, 0.3, 0.2, 4),
    "all-base": (4, 6, 2, 3, 2, 1.0, 0.0, None),
    "top1-many-experts": (5, 30, 1, 64, 2, 0.1, 0.0, None),
    "big": (6, 300, 8, 32, 5, 0.1, 0.0, None),
}


@pytest.fixture(params=["torch-ops", "one-launch"])
def build_path(request, monkeypatch):
    """Both ways a plan is built: torch ops, and the one Triton launch CUDA's eager steps take (here under the
    interpreter), which must give the same arrays."""
    monkeypatch.setattr(moe_plan, "FUSED_ON_CPU", request.param == "one-launch")
    return request.param


@pytest.mark.parametrize("case", list(CASES))
def test_plan_properties(case, build_path):
    seed, tokens, top_k, experts, slots, base, unrouted, chunk = CASES[case]
    token_slot, index = random_routing(seed, tokens, top_k, experts, slots, base, unrouted)
    plan = MoePlan.build(token_slot, index, experts, slots, chunk_size=chunk)
    chunk = plan.chunk_size
    pairs = tokens * top_k
    pair_slot = [token_slot[p // top_k] for p in range(pairs)]
    pair_expert = index.reshape(-1).tolist()
    routed = [0 <= e < experts for e in pair_expert]

    # The permutation sorts pairs by (expert, slot with base last), stably; unrouted pairs last.
    perm = plan.permutation.tolist()
    assert sorted(perm) == list(range(pairs))

    def key(p):
        return (pair_expert[p], pair_slot[p] if pair_slot[p] >= 0 else slots) if routed[p] else (experts, 0)

    assert perm == sorted(range(pairs), key=key)
    # Each expert's pairs end at its offset: the offs of a grouped product over the sorted order.
    per_expert = [sum(1 for e in pair_expert if e == x) for x in range(experts)]
    assert plan.expert_offsets.tolist() == [sum(per_expert[: x + 1]) for x in range(experts)]

    # The live segments partition exactly the routed adapter pairs, each one slot and one expert, at most a chunk.
    assert plan.num_segments == max_segments(pairs, experts, slots, chunk)
    assert plan.seg_start.shape == plan.seg_end.shape == plan.seg_slot.shape == (plan.num_segments,)
    covered = []
    for slot, expert, start, end in plan.segments():
        assert 0 < end - start <= chunk
        for q in range(start, end):
            p = perm[q]
            assert (pair_slot[p], pair_expert[p]) == (slot, expert)
            covered.append(p)
    want = [p for p in range(pairs) if routed[p] and pair_slot[p] >= 0]
    assert sorted(covered) == want
    # Each (slot, expert) run makes ceil(count / chunk) segments: no more than it needs.
    runs: dict = {}
    for p in want:
        runs[(pair_slot[p], pair_expert[p])] = runs.get((pair_slot[p], pair_expert[p]), 0) + 1
    assert len(plan.segments()) == sum(-(-c // chunk) for c in runs.values())
    # Live segments first; the rest are empty with slot -1.
    live = len(plan.segments())
    assert (plan.seg_start[live:] == plan.seg_end[live:]).all() and (plan.seg_slot[live:] == -1).all()
    if case == "all-base":
        assert live == 0


def _old_style_reference(token_slot, index, experts, slots, chunk):
    """The plan's arrays, from the host by the definition (sort by (expert, slot, base last), unrouted last; segments
    in group order, chunked, padded with empty segments (0, 0, slot -1, expert 0))."""
    top_k = index.shape[1]
    flat = index.reshape(-1).tolist()
    pairs = len(flat)

    def key(p):
        e, s = flat[p], token_slot[p // top_k]
        return (e, s if s >= 0 else slots) if 0 <= e < experts else (experts, 0)

    perm = sorted(range(pairs), key=key)
    offsets = [sum(1 for e in flat if 0 <= e <= x) for x in range(experts)]
    segs = []
    q = 0
    while q < pairs:
        k = key(perm[q])
        end = q
        while end < pairs and key(perm[end]) == k:
            end += 1
        if k[0] < experts and k[1] < slots:
            for start in range(q, end, chunk):
                segs.append((start, min(start + chunk, end), k[1], k[0]))
        q = end
    n = max_segments(pairs, experts, slots, chunk)
    segs += [(0, 0, -1, 0)] * (n - len(segs))
    return perm, offsets, segs


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("chunk", [1, 2, 5, None])
def test_plan_arrays_exactly_with_far_sentinels(index_dtype, chunk, build_path):
    """Every array of the plan, exactly, against a host reference: routings with expert-parallel sentinels far out of
    range (-7, E + 5, as well as -1 and E), int32 or int64 router indices, chunks of 1, 2, 5 and the default; the
    group slots made from a tensor (the layers' path, :meth:`MoePlan.from_groups`) give the same plan."""
    rng = random.Random(7)
    experts, slots, tokens, top_k = 5, 3, 23, 3
    token_slot = [rng.choice([-1, 0, 1, 2]) for _ in range(tokens)]
    index = torch.tensor(
        [[rng.choice([-7, -1, experts, experts + 5, *range(experts)]) for _ in range(top_k)] for _ in range(tokens)],
        dtype=index_dtype,
    )
    plan = MoePlan.build(token_slot, index, experts, slots, chunk_size=chunk)
    perm, offsets, segs = _old_style_reference(token_slot, index, experts, slots, plan.chunk_size)
    assert_tensor("permutation", plan.permutation, perm)
    assert_tensor("expert_offsets", plan.expert_offsets, offsets)
    assert_tensor("seg_start", plan.seg_start, [s[0] for s in segs])
    assert_tensor("seg_end", plan.seg_end, [s[1] for s in segs])
    assert_tensor("seg_slot", plan.seg_slot, [s[2] for s in segs])
    assert_tensor("seg_expert", plan.seg_expert, [s[3] for s in segs])
    groups = token_groups(torch.tensor(token_slot, dtype=torch.int32), slots)
    assert groups.dtype == torch.int64 and groups.tolist() == [slots if s < 0 else s for s in token_slot]
    again = MoePlan.from_groups(groups, index, experts, slots, chunk_size=plan.chunk_size)
    for name in ("permutation", "expert_offsets", "seg_start", "seg_end", "seg_slot", "seg_expert"):
        assert torch.equal(getattr(again, name), getattr(plan, name)), name


def _arrays(plan: MoePlan) -> list:
    return [t.tolist() for t in (plan.permutation, plan.expert_offsets, plan.seg_start, plan.seg_end, plan.seg_slot,
                                 plan.seg_expert)]  # fmt: skip


@pytest.mark.parametrize(
    "shape",
    [(32, 8, 128, 32), (64, 4, 32, 9), (7, 2, 5, 3), (1, 1, 1, 1), (MAX_PAIRS // 8, 8, 16, 4)],
    ids=["qwen3-decode", "gpt-oss-decode", "small", "one-pair", "most-pairs"],
)
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "every-other-row", "last-columns"])
def test_one_launch_equals_torch_ops(shape, layout, monkeypatch):
    """The one-launch plan (on CUDA, else under the Triton interpreter) equals the torch ops' entry for entry, on
    decode-sized routings (Qwen3-30B-A3B's and gpt-oss-20b's expert counts with 32 and 9 slots), the largest step it
    takes, base tokens and sentinels included, with the router's index read through any strides: a transposed copy,
    every other row of a taller one (``[::2]``), the last ``top_k`` columns of a wider one (``[:, -top_k:]``)."""
    tokens, top_k, experts, slots = shape
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(tokens * 31 + experts)
    token_slot = torch.randint(-1, slots, (tokens,), generator=g)
    index = torch.stack([torch.randperm(experts + 2, generator=g)[:top_k] - 1 for _ in range(tokens)])
    if layout == "transposed":
        index = index.t().contiguous().t()
    elif layout == "every-other-row":
        index = torch.stack([index, torch.full_like(index, 3)], 1).reshape(2 * tokens, top_k)[::2]
    elif layout == "last-columns":
        index = torch.cat([torch.full_like(index, -5), index], 1)[:, -top_k:]
    index = index.to(device)
    groups = token_groups(token_slot.to(device), slots)
    assert fits(tokens * top_k, experts, slots)
    monkeypatch.setattr(moe_plan, "FUSED_ON_CPU", True)
    for chunk in (None, 1):
        got = MoePlan.from_groups(groups, index, experts, slots, chunk_size=chunk)
        # (the torch ops: a plan given its constant tables takes them, as compiled code's does)
        tables = moe_plan.plan_tables(device, experts, slots, got.num_segments, got.chunk_size)
        want = MoePlan.from_groups(groups, index, experts, slots, chunk_size=chunk, tables=tables)
        assert _arrays(got) == _arrays(want), f"chunk {got.chunk_size}"
        assert all(t.dtype == torch.int32 for t in (got.permutation, got.seg_start, got.seg_slot))
    from peft_csgmv.kernels import moe_plan as one_launch

    launched, real = [], one_launch.moe_plan_arrays
    monkeypatch.setattr(one_launch, "moe_plan_arrays", lambda *a: launched.append(a) or real(*a))
    MoePlan.from_groups(groups, index, experts, slots)
    assert len(launched) == 1, "the layers' path (no tables) did not take the one launch"


def test_steps_past_one_launch_take_torch_ops(monkeypatch):
    """A step with more routed pairs than one program holds (a prefill), or more sort keys, is built by torch ops."""
    assert not fits(MAX_PAIRS + 1, 8, 2) and not fits(4, 128, 200) and fits(MAX_PAIRS, 8, 2)
    monkeypatch.setattr(moe_plan, "FUSED_ON_CPU", True)
    launched = []
    monkeypatch.setattr("peft_csgmv.kernels.moe_plan.moe_plan_arrays", lambda *a: launched.append(a))
    index = torch.randint(0, 8, (MAX_PAIRS // 2 + 1, 2))
    plan = MoePlan.from_groups(torch.zeros(index.shape[0], dtype=torch.int64), index, 8, 2)
    assert not launched and plan.permutation.shape == (index.numel(),)


def test_host_tile_helpers_are_tritons():
    """The plain-Python powers of two the launch paths size tiles with (Triton's own helpers cost microseconds per
    call on the host) are Triton's ``next_power_of_2``, and a plan's kernel arrays are its arrays, read densely."""
    import triton

    from peft_csgmv.kernels.common import block_size, pow2

    assert all(pow2(n) == triton.next_power_of_2(n) for n in range(1, 5000))
    assert [block_size(n) for n in (1, 16, 17, 64, 65)] == [16, 16, 32, 64, 128]
    plan = MoePlan.build([1, -1, 0, 1], torch.tensor([[0, 2], [2, 1], [2, 0], [0, 1]]), 3, 2, chunk_size=16)
    arrays = (plan.permutation, plan.seg_start, plan.seg_end, plan.seg_slot, plan.seg_expert)
    assert all(a is b for a, b in zip(plan.kernel_arrays, arrays))
    strided = torch.zeros(2 * plan.num_segments, dtype=torch.int32)[::2]
    strided.copy_(plan.seg_slot)
    other = dataclasses.replace(plan, seg_slot=strided)
    assert other.kernel_arrays[3].is_contiguous() and torch.equal(other.kernel_arrays[3], plan.seg_slot)
