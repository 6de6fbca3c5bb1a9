"""BatchPlan unit tests: worked examples with exact tensors, plus structural properties on assorted slot lists."""

from __future__ import annotations

import random

import pytest
import torch

from peft_csgmv.plan import MIN_CHUNK_SIZE, BatchPlan, chunk_size_for


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def assert_plan(plan: BatchPlan, *, chunk_size, permutation, seg_indptr, seg_slot, runs):
    """Every field of ``plan`` equals the given values exactly (tensors: same dtype, same values)."""
    assert plan.chunk_size == chunk_size
    assert plan.num_segments == len(seg_slot)
    assert plan.num_tokens == len(permutation)
    for name, got, want in (
        ("permutation", plan.permutation, permutation),
        ("seg_indptr", plan.seg_indptr, seg_indptr),
        ("seg_slot", plan.seg_slot, seg_slot),
    ):
        assert got.dtype == torch.int32, f"{name} dtype {got.dtype}"
        assert got.device.type == "cpu"
        assert torch.equal(got, i32(want)), f"{name}: got {got.tolist()}, want {list(want)}"
    assert plan.runs == tuple(runs), f"runs: got {plan.runs}, want {tuple(runs)}"


# ----------------------------------------------------------------------------------------------------------------------
# Worked examples
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 16], ids=["chunk-default", "chunk16"])
def test_docstring_example(chunk_size):
    plan = BatchPlan.build([1, -1, 0, 1], tokens_per_row=2, chunk_size=chunk_size)
    assert (plan.rows, plan.tokens_per_row) == (4, 2)
    assert not plan.is_empty
    assert_plan(
        plan,
        chunk_size=16,
        permutation=[4, 5, 0, 1, 6, 7, 2, 3],
        seg_indptr=[0, 2, 6],
        seg_slot=[0, 1],
        runs=[(0, 0, 2), (1, 2, 6)],
    )


def test_docstring_example_chunk3():
    plan = BatchPlan.build([1, -1, 0, 1], tokens_per_row=2, chunk_size=3)
    assert_plan(
        plan,
        chunk_size=3,
        permutation=[4, 5, 0, 1, 6, 7, 2, 3],
        seg_indptr=[0, 2, 5, 6],
        seg_slot=[0, 1, 1],
        runs=[(0, 0, 2), (1, 2, 6)],
    )


@pytest.mark.parametrize("row_slots", [[-1], [-1, -1, -1]], ids=["one-base-row", "three-base-rows"])
def test_all_base_batch(row_slots):
    plan = BatchPlan.build(row_slots, tokens_per_row=4)
    assert plan.is_empty
    assert plan.num_segments == 0
    n = 4 * len(row_slots)
    assert_plan(plan, chunk_size=16, permutation=list(range(n)), seg_indptr=[0], seg_slot=[], runs=[])


def test_one_row():
    plan = BatchPlan.build([5], tokens_per_row=3)
    assert not plan.is_empty
    assert_plan(plan, chunk_size=16, permutation=[0, 1, 2], seg_indptr=[0, 3], seg_slot=[5], runs=[(5, 0, 3)])


def test_one_row_one_token():
    plan = BatchPlan.build([0], tokens_per_row=1)
    assert_plan(plan, chunk_size=16, permutation=[0], seg_indptr=[0, 1], seg_slot=[0], runs=[(0, 0, 1)])


def test_every_row_same_slot():
    plan = BatchPlan.build([2, 2, 2], tokens_per_row=4)
    assert_plan(plan, chunk_size=16, permutation=list(range(12)), seg_indptr=[0, 12], seg_slot=[2], runs=[(2, 0, 12)])


def test_every_row_same_slot_cut_into_chunks():
    plan = BatchPlan.build([2, 2, 2], tokens_per_row=4, chunk_size=5)
    assert_plan(
        plan,
        chunk_size=5,
        permutation=list(range(12)),
        seg_indptr=[0, 5, 10, 12],
        seg_slot=[2, 2, 2],
        runs=[(2, 0, 12)],
    )


def test_slots_sorted_stable_base_last():
    # rows: 0→slot 3, 1→base, 2→slot 0, 3→slot 3, 4→base, 5→slot 0; tokens_per_row = 1
    plan = BatchPlan.build([3, -1, 0, 3, -1, 0], tokens_per_row=1)
    assert_plan(
        plan,
        chunk_size=16,
        permutation=[2, 5, 0, 3, 1, 4],
        seg_indptr=[0, 2, 4],
        seg_slot=[0, 3],
        runs=[(0, 0, 2), (3, 2, 4)],
    )


def test_distinct_slots_each_row_own_segment():
    plan = BatchPlan.build([2, 0, 1], tokens_per_row=3)
    assert_plan(
        plan,
        chunk_size=16,
        permutation=[3, 4, 5, 6, 7, 8, 0, 1, 2],
        seg_indptr=[0, 3, 6, 9],
        seg_slot=[0, 1, 2],
        runs=[(0, 0, 3), (1, 3, 6), (2, 6, 9)],
    )


# ----------------------------------------------------------------------------------------------------------------------
# Chunk boundaries: a run of exactly chunk, chunk + 1 and 2 * chunk tokens (default chunk sizes and an explicit one)
# ----------------------------------------------------------------------------------------------------------------------

CHUNK_BOUNDARY_CASES = [
    # (run length, tokens_per_row, chunk_size override, expected chunk, expected seg_indptr)
    pytest.param(16, 1, None, 16, [0, 16], id="len16-default16"),
    pytest.param(17, 1, None, 16, [0, 16, 17], id="len17-default16"),
    pytest.param(32, 1, None, 16, [0, 16, 32], id="len32-default16"),
    pytest.param(16, 8, None, 16, [0, 16], id="len16-2rows-of-8"),
    pytest.param(64, 1, None, 32, [0, 32, 64], id="len64-default32"),
    # 65 tokens in 32-row tiles would mask 31 of 96 rows: the chunk drops to 16 (15 of 80)
    pytest.param(65, 1, None, 16, [0, 16, 32, 48, 64, 65], id="len65-follows-run16"),
    pytest.param(96, 32, None, 32, [0, 32, 64, 96], id="len96-3rows-of-32"),
    pytest.param(256, 1, None, 128, [0, 128, 256], id="len256-default128"),
    # 257 tokens in 128-row tiles would mask 127 of 384 rows: 64 (63 of 320)
    pytest.param(257, 257, None, 64, [0, 64, 128, 192, 256, 257], id="len257-1row-follows-run64"),
    pytest.param(300, 300, None, 128, [0, 128, 256, 300], id="len300-1row-default128"),
    pytest.param(4, 2, 4, 4, [0, 4], id="len4-chunk4"),
    pytest.param(5, 1, 4, 4, [0, 4, 5], id="len5-chunk4"),
    pytest.param(8, 2, 4, 4, [0, 4, 8], id="len8-chunk4"),
    pytest.param(3, 1, 1, 1, [0, 1, 2, 3], id="len3-chunk1"),
]


@pytest.mark.parametrize("length, tokens_per_row, chunk_size, chunk, indptr", CHUNK_BOUNDARY_CASES)
def test_chunk_boundaries(length, tokens_per_row, chunk_size, chunk, indptr):
    rows = length // tokens_per_row
    assert rows * tokens_per_row == length
    plan = BatchPlan.build([7] * rows, tokens_per_row, chunk_size=chunk_size)
    assert_plan(
        plan,
        chunk_size=chunk,
        permutation=list(range(length)),
        seg_indptr=indptr,
        seg_slot=[7] * (len(indptr) - 1),
        runs=[(7, 0, length)],
    )


def test_chunk_boundaries_two_runs_with_base():
    # slot 1: 17 tokens (16 + 1), slot 0: 16 tokens (one full chunk), a base row in between that goes last.
    row_slots = [1] * 17 + [-1] * 3 + [0] * 16
    plan = BatchPlan.build(row_slots, tokens_per_row=1, chunk_size=16)
    assert_plan(
        plan,
        chunk_size=16,
        permutation=list(range(20, 36)) + list(range(0, 17)) + [17, 18, 19],
        seg_indptr=[0, 16, 32, 33],
        seg_slot=[0, 1, 1],
        runs=[(0, 0, 16), (1, 16, 33)],
    )


# ----------------------------------------------------------------------------------------------------------------------
# chunk_size_for thresholds
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_tokens, chunk",
    [(1, 16), (63, 16), (64, 32), (255, 32), (256, 128), (100_000, 128)],
    ids=lambda v: str(v),
)
def test_chunk_size_for(num_tokens, chunk):
    assert chunk_size_for(num_tokens) == chunk


def test_min_chunk_size_is_small_batch_chunk():
    assert chunk_size_for(1) == MIN_CHUNK_SIZE == 16


@pytest.mark.parametrize("num_tokens, chunk", [(63, 16), (64, 32), (255, 32), (256, 128)], ids=lambda v: str(v))
def test_build_uses_chunk_size_for_total_tokens(num_tokens, chunk):
    # The batch-size chunk follows the total token count, base tokens included; one run as long as the batch
    # leaves it there.
    plan = BatchPlan.build([0], tokens_per_row=num_tokens)
    assert plan.chunk_size == chunk
    assert plan.runs == ((0, 0, num_tokens),)


@pytest.mark.parametrize(
    "run_lengths, num_tokens, chunk",
    [
        ([8192], 8192, 128),  # one long run: the batch-size chunk
        ([256] * 32, 8192, 128),  # 32 prompts of 256: whole tiles
        ([64] * 128, 8192, 64),  # 128 runs of 64: a 128-row tile would be half masked
        ([16] * 32, 512, 16),  # 32 runs of 16
        ([100] * 3, 300, 128),  # 28 masked rows of 128: under a quarter
        ([40] * 4, 160, 16),  # 32 → 24 masked of 64 (37%); 16 → 8 of 48
        ([1], 256, 16),  # one adapter token among base tokens
        ([], 256, 128),  # no runs (all base): nothing to follow
        ([1] * 32, 32, 16),  # decode: the smallest chunk already
    ],
    ids=lambda v: str(v)[:20],
)
def test_chunk_follows_run_lengths(run_lengths, num_tokens, chunk):
    assert chunk_size_for(num_tokens, run_lengths) == chunk


def test_build_chunk_follows_runs():
    # 128 rows of 64 tokens, two rows per adapter (64 runs of 128) and then one row per adapter (64 runs of 64).
    assert BatchPlan.build([i // 2 for i in range(128)], tokens_per_row=64).chunk_size == 128
    plan = BatchPlan.build(list(range(128)), tokens_per_row=64)
    assert plan.chunk_size == 64
    assert plan.num_segments == 128
    assert plan.seg_indptr.tolist() == list(range(0, 8193, 64))


# ----------------------------------------------------------------------------------------------------------------------
# Structural properties over assorted slot lists
# ----------------------------------------------------------------------------------------------------------------------


def _zipf_rows(n, num_slots, seed, base_fraction=0.0):
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** 1.3 for k in range(num_slots)]
    return [-1 if rng.random() < base_fraction else rng.choices(range(num_slots), weights)[0] for _ in range(n)]


PROPERTY_CASES = [
    pytest.param([1, -1, 0, 1], 2, None, id="docstring"),
    pytest.param([1, -1, 0, 1], 2, 3, id="docstring-chunk3"),
    pytest.param([-1, -1], 3, None, id="all-base"),
    pytest.param([4], 1, None, id="one-token"),
    pytest.param([0, 1, 2, 3, 4, 5], 3, None, id="distinct"),
    pytest.param([5, 4, 3, 2, 1, 0], 3, 2, id="distinct-reversed-chunk2"),
    pytest.param([3] * 9, 5, None, id="identical"),
    pytest.param([2, -1, 0, -1, 2, -1, 1], 4, None, id="base-interleaved"),
    pytest.param(_zipf_rows(40, 6, seed=0), 3, None, id="zipf-40x3"),
    pytest.param(_zipf_rows(30, 5, seed=1, base_fraction=0.3), 7, None, id="zipf-base-30x7"),
    pytest.param(_zipf_rows(300, 8, seed=2, base_fraction=0.2), 1, None, id="zipf-base-300x1"),
    pytest.param(_zipf_rows(50, 3, seed=3), 2, 5, id="zipf-chunk5"),
]


@pytest.mark.parametrize("row_slots, tokens_per_row, chunk_size", PROPERTY_CASES)
def test_plan_properties(row_slots, tokens_per_row, chunk_size):
    plan = BatchPlan.build(row_slots, tokens_per_row, chunk_size=chunk_size)
    num_tokens = len(row_slots) * tokens_per_row
    token_slot = [row_slots[i // tokens_per_row] for i in range(num_tokens)]
    perm = plan.permutation.tolist()
    indptr = plan.seg_indptr.tolist()
    seg_slot = plan.seg_slot.tolist()
    num_adapter = sum(1 for s in token_slot if s >= 0)

    # shapes, dtypes, chunk
    assert plan.num_tokens == num_tokens
    run_lengths = [end - start for _, start, end in plan.runs]
    assert plan.chunk_size == (chunk_size if chunk_size is not None else chunk_size_for(num_tokens, run_lengths))
    assert plan.permutation.shape == (num_tokens,)
    assert plan.seg_indptr.shape == (plan.num_segments + 1,)
    assert plan.seg_slot.shape == (plan.num_segments,)
    for tensor in (plan.permutation, plan.seg_indptr, plan.seg_slot):
        assert tensor.dtype == torch.int32
    assert plan.is_empty == (num_adapter == 0)

    # permutation: a permutation of range(num_tokens); adapter tokens sorted by slot, base last; stable within a slot
    assert sorted(perm) == list(range(num_tokens))
    keys = [(token_slot[i] < 0, token_slot[i], i) for i in perm]
    assert keys == sorted(keys), "permuted order is not (slot ascending, base last, original order within a slot)"
    assert all(token_slot[i] < 0 for i in perm[num_adapter:])
    assert all(token_slot[i] >= 0 for i in perm[:num_adapter])

    # segments: cover exactly the adapter tokens [0, num_adapter), each non-empty, at most chunk_size, one slot each
    assert indptr[0] == 0 and indptr[-1] == num_adapter
    assert all(s >= 0 for s in seg_slot), f"seg_slot holds a base slot: {seg_slot}"
    for s in range(plan.num_segments):
        start, end = indptr[s], indptr[s + 1]
        assert 0 < end - start <= plan.chunk_size
        assert {token_slot[i] for i in perm[start:end]} == {seg_slot[s]}

    # runs: maximal, contiguous, in order, and each one is exactly the union of consecutive segments of its slot
    pos = 0
    prev_slot = None
    boundaries = set(indptr)
    for slot, start, end in plan.runs:
        assert start == pos and end > start
        assert slot != prev_slot and slot >= 0
        assert start in boundaries and end in boundaries
        assert {token_slot[i] for i in perm[start:end]} == {slot}
        segs = [s for s in range(plan.num_segments) if start <= indptr[s] < end]
        assert all(seg_slot[s] == slot for s in segs)
        assert indptr[segs[0]] == start and indptr[segs[-1] + 1] == end
        # within a run only the last segment may be short
        assert all(indptr[s + 1] - indptr[s] == plan.chunk_size for s in segs[:-1])
        prev_slot, pos = slot, end
    assert pos == num_adapter
    assert plan.num_segments == sum(-(-(end - start) // plan.chunk_size) for _, start, end in plan.runs)


def test_permutation_rows_stay_whole():
    # Sorting rows (not tokens) keeps each row's tokens together and in order.
    plan = BatchPlan.build([1, 0, 1, 0], tokens_per_row=3)
    assert plan.permutation.tolist() == [3, 4, 5, 9, 10, 11, 0, 1, 2, 6, 7, 8]


def test_plan_tensors_do_not_alias_the_input_list():
    row_slots = [1, 0, -1]
    plan = BatchPlan.build(row_slots, tokens_per_row=2)
    row_slots[0] = -1  # mutating the caller's list afterwards must not change the plan
    assert plan.seg_slot.tolist() == [0, 1]
    assert plan.permutation.tolist() == [2, 3, 0, 1, 4, 5]


@pytest.mark.parametrize("rows", [1, 3, 5, 32])
@pytest.mark.parametrize("tokens_per_row", [1, 3])
def test_plan_parts_start_on_16_bytes(rows, tokens_per_row):
    """Every plan tensor, of a host-built plan and of a compiled shape's static plan, starts on a 16-byte boundary
    of its buffer: Triton compiles a kernel per pointer alignment, and a CUDA graph's copies of the plan are aligned,
    so unaligned parts made the decode kernels compile twice (once for the graph's warm-up, once for its recording)."""
    from peft_csgmv.mapping import StaticPlan

    slots = [i % 3 - 1 for i in range(rows)]
    static = StaticPlan(rows, rows, tokens_per_row, torch.device("cpu"))
    static.fill(tuple(slots))
    plan = BatchPlan.build(slots, tokens_per_row=tokens_per_row, chunk_size=static.chunk)
    for which, p in (("host-built", plan), ("static", static)):
        for name in ("permutation", "seg_indptr", "seg_slot"):
            tensor = getattr(p, name)
            assert tensor.storage_offset() * tensor.element_size() % 16 == 0, f"{which} plan's {name} unaligned"
    # The static plan holds the same plan (with the same row tile; its extra segments are the base rows' and empty
    # ones).
    n = plan.num_segments
    assert static.permutation.tolist() == plan.permutation.tolist()
    assert static.seg_indptr[: n + 1].tolist() == plan.seg_indptr.tolist()
    assert static.seg_slot[:n].tolist() == plan.seg_slot.tolist()


# ----------------------------------------------------------------------------------------------------------------------
# Errors
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row_slots, tokens_per_row, chunk_size",
    [
        pytest.param([], 4, None, id="zero-rows"),
        pytest.param([0, 1], 0, None, id="zero-tokens-per-row"),
        pytest.param([0, 1], -2, None, id="negative-tokens-per-row"),
        pytest.param([0], 4, 0, id="chunk-zero"),
        pytest.param([0], 4, -16, id="chunk-negative"),
    ],
)
def test_build_rejects(row_slots, tokens_per_row, chunk_size):
    with pytest.raises(ValueError):
        BatchPlan.build(row_slots, tokens_per_row, chunk_size=chunk_size)


@pytest.mark.parametrize("row_slots, tokens_per_row, chunk_size", PROPERTY_CASES)
def test_token_slots_plan_is_the_row_plan(row_slots, tokens_per_row, chunk_size):
    """A plan made from each token's slot equals the plan of the same tokens made from their rows: the same stable
    order by slot (base tokens last), segments, chunk and runs."""
    token_slots = [slot for slot in row_slots for _ in range(tokens_per_row)]
    by_rows = BatchPlan.build(row_slots, tokens_per_row, chunk_size=chunk_size)
    by_tokens = BatchPlan.from_token_slots(token_slots, chunk_size=chunk_size)
    assert by_tokens.num_tokens == by_rows.num_tokens and by_tokens.runs == by_rows.runs
    assert by_tokens.chunk_size == by_rows.chunk_size
    for part in ("permutation", "seg_indptr", "seg_slot"):
        assert getattr(by_tokens, part).tolist() == getattr(by_rows, part).tolist(), part


def test_token_slots_docstring_example():
    plan = BatchPlan.from_token_slots([2, 2, -1, 0, 0, 0, 2])
    assert_plan(plan, chunk_size=16, permutation=[3, 4, 5, 0, 1, 6, 2], seg_indptr=[0, 3, 6], seg_slot=[0, 2],
                runs=((0, 0, 3), (2, 3, 6)))  # fmt: skip
    with pytest.raises(ValueError, match="at least one token"):
        BatchPlan.from_token_slots([])
