"""Strided, offset and transposed views through every kernel entry point, on both backends.

``shrink`` (``x``, ``t``), ``expand`` (``t``, ``y``, updated in place), ``embedding_shrink`` (``ids``, ``t``) and their
torch references take views of a larger buffer: every 2nd row (``buf[::2]``), the last columns of a wider tensor
(``buf[:, -C:]``, as ``seq[:, -1:]``), a view at a storage offset (``buf[3:3+T]``) and a transposed-then-sliced one.
Each result is compared with a float64 oracle computed from contiguous copies, and each test first checks that a
kernel that ignored the strides (read ``view.data_ptr()`` densely) would give a clearly different answer, so the
comparison can fail. Outputs passed as views are written through their strides: the rest of the underlying buffer
must stay bit-identical. Then the per-slot vectors and tables, :class:`~peft_csgmv.kernels.BoundLayer` (which must
refuse the strides and alignments it was not bound for), and a tiny Llama with LoRA on its embedding called on
``seq[:, -1:]``-style ids against each row's stock PEFT run.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
from helpers import (
    ALL_LINEAR,
    BASE,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    assert_close,
    close,
    make,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.kernels import (
    BoundLayer,
    embedding_shrink,
    embedding_shrink_reference,
    expand,
    expand_reference,
    shrink,
    shrink_reference,
    shrink_splits,
)
from peft_csgmv.mapping import PlanRun
from peft_csgmv.plan import BatchPlan

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

BACKENDS = ["triton", "torch"]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}  # the interpreter's tl.dot on bf16 is unreliable
if torch.cuda.is_available():  # compiled kernels: bf16 too
    DTYPES["bf16"] = torch.bfloat16

# Eight rows of two tokens, base rows interleaved, slot 3 of rank 0; chunks of 3 split slot 0's run in two segments.
ROW_SLOTS = [2, -1, 0, 1, 3, 0, -1, 2]
TOKENS_PER_ROW = 2
TOKEN_SLOT = [s for s in ROW_SLOTS for _ in range(TOKENS_PER_ROW)]
T = len(TOKEN_SLOT)
RANKS = [3, 8, 1, 0]
R = max(RANKS)
SCALINGS = [0.5, 2.0, 1.25, 0.75]
K, N, V = 33, 47, 61
SENTINEL = -77.0


def make_plan() -> BatchPlan:
    plan = BatchPlan.build(ROW_SLOTS, TOKENS_PER_ROW, device=DEVICE, chunk_size=3)
    assert plan.num_segments == 6 and plan.num_tokens == T
    return plan


def randn(*shape, dtype=torch.float32, seed=0, mean=0.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) + mean).to(DEVICE, dtype)


def weights(dtype, seed=0, k=K, n=N):
    """``A (S, R, K)``, ``B (S, N, R)`` (zero past each slot's rank), device ranks (int32) and scalings (fp32)."""
    a = randn(len(RANKS), R, k, seed=seed) / math.sqrt(k)
    b = randn(len(RANKS), n, R, seed=seed + 1) / math.sqrt(R)
    for s, r in enumerate(RANKS):
        a[s, r:] = 0.0
        b[s, :, r:] = 0.0
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    return a.to(dtype), b.to(dtype), ranks, torch.tensor(SCALINGS, device=DEVICE)


# ----------------------------------------------------------------------------------------------------------------------
# Views: each is a slice of a larger parent buffer whose other elements hold different values.
# ----------------------------------------------------------------------------------------------------------------------

LAYOUTS_2D = ["rows-step2", "last-columns", "offset", "transposed-sliced"]
LAYOUTS_1D = ["step2", "last-column", "offset", "transposed-row", "broadcast"]


def view_2d(parent_of, rows: int, cols: int, layout: str):
    """``(view, parent)``: a ``(rows, cols)`` view in ``layout`` of a parent made by ``parent_of(shape)``."""
    if layout == "rows-step2":  # strides (2·cols, 1)
        parent = parent_of((2 * rows, cols))
        view = parent[::2]
    elif layout == "last-columns":  # the last cols columns of a wider tensor: strides (cols + 9, 1), offset 9
        parent = parent_of((rows, cols + 9))
        view = parent[:, -cols:]
    elif layout == "offset":  # contiguous strides at a storage offset (3 rows in)
        parent = parent_of((rows + 5, cols))
        view = parent[3 : 3 + rows]
    elif layout == "transposed-sliced":  # column-major, sliced on both axes: strides (1, rows + 6)
        parent = parent_of((cols + 4, rows + 6))
        view = parent[2 : 2 + cols, 3 : 3 + rows].t()
    else:
        raise ValueError(layout)
    assert view.shape == (rows, cols) and (layout == "offset") == view.is_contiguous()
    return view, parent


def view_1d(parent_of, length: int, layout: str):
    """``(view, parent)``: a ``(length,)`` view in ``layout``."""
    if layout == "step2":
        parent = parent_of((2 * length,))
        view = parent[::2]
    elif layout == "last-column":  # what a patched embedding gets for input_ids=seq[:, -1:]: stride 5, offset 4
        parent = parent_of((length, 5))
        view = parent[:, -1:].reshape(-1)
    elif layout == "offset":
        parent = parent_of((length + 7,))
        view = parent[3 : 3 + length]
    elif layout == "transposed-row":  # a row of a transposed tensor, sliced: stride 4, offset 9
        parent = parent_of((length + 3, 4))
        view = parent.t()[1, 2 : 2 + length]
    elif layout == "broadcast":  # one id for every token: stride 0
        parent = parent_of((2 * length,))
        view = parent[5:6].expand(length)
    else:
        raise ValueError(layout)
    assert view.shape == (length,) and view.data_ptr() != 0
    assert view.untyped_storage().data_ptr() == parent.untyped_storage().data_ptr(), "not a view of the parent"
    return view, parent


def misread(view: torch.Tensor) -> torch.Tensor:
    """What a kernel that ignored ``view``'s strides would read: ``view.numel()`` elements from its address on."""
    return view.as_strided(view.shape, torch.empty(view.shape).stride(), view.storage_offset())


def outside_mask(parent: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``parent``-shaped bool: the elements that ``view`` does not cover."""
    outside = torch.ones(parent.shape, dtype=torch.bool, device=parent.device)
    offset = view.storage_offset() - parent.storage_offset()
    outside.as_strided(view.shape, view.stride(), offset).fill_(False)
    assert outside.any()
    return outside


def through_parent(parent: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view``'s elements read back from ``parent``'s storage (what was written through the view's strides)."""
    return parent.as_strided(view.shape, view.stride(), view.storage_offset())


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit pattern (so -0.0 ≠ +0.0 and NaN == NaN)."""
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def check(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str):
    """``actual`` against the float64 oracle with ``dtype``'s tolerance scaled by the result magnitude; finite."""
    actual, expected = actual.cpu(), expected.cpu()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), f"{what}: non-finite values"
    assert_close(actual, expected, dtype=dtype, scale=max(1.0, expected.abs().max().item()), what=what)


def assert_misread_differs(expected: torch.Tensor, wrong: torch.Tensor, what: str):
    """The oracle on a stride-ignoring read is clearly off, so comparing with the oracle can fail."""
    diff = (expected.double() - wrong.double()).abs().max().item()
    assert diff > 0.1, f"{what}: ignoring the strides would change the result by only {diff:.3g}: proves nothing"


# ----------------------------------------------------------------------------------------------------------------------
# Oracle: per-token loops over the Semantics in float64, from contiguous copies.
# ----------------------------------------------------------------------------------------------------------------------


def oracle_shrink(x, a, t_before):
    t = t_before.contiguous().cpu().double().clone()
    x64, a64 = x.contiguous().cpu().to(a.dtype).double(), a.cpu().double()
    for i, slot in enumerate(TOKEN_SLOT):
        if slot >= 0:
            t[i, : RANKS[slot]] = a64[slot, : RANKS[slot]] @ x64[i]
    return t


def oracle_embedding(ids, a, t_before):
    t = t_before.contiguous().cpu().double().clone()
    ids, a64 = ids.contiguous().cpu(), a.cpu().double()
    for i, slot in enumerate(TOKEN_SLOT):
        if slot >= 0:
            t[i, : RANKS[slot]] = a64[slot, : RANKS[slot], int(ids[i])]
    return t


def oracle_expand(t, b, y_before):
    """``t`` (T, R) or (P, T, R) planes (summed in fp32, as the kernels do); returns float64, not rounded to y."""
    t = t.contiguous().cpu().float()
    t = t.sum(0) if t.dim() == 3 else t
    y = y_before.contiguous().cpu().double().clone()
    b64 = b.cpu().double()
    for i, slot in enumerate(TOKEN_SLOT):
        r = RANKS[slot] if slot >= 0 else 0
        if r:
            y[i] += (b64[slot, :, :r] @ t[i, :r].to(b.dtype).double()) * SCALINGS[slot]
    return y


def touched_rows() -> torch.Tensor:
    return torch.tensor([s >= 0 and RANKS[s] > 0 for s in TOKEN_SLOT], device=DEVICE)


def written_mask(width: int = R) -> torch.Tensor:
    mask = torch.zeros(T, width, dtype=torch.bool, device=DEVICE)
    for i, slot in enumerate(TOKEN_SLOT):
        if slot >= 0:
            mask[i, : RANKS[slot]] = True
    return mask


def run_shrink(backend, x, a, ranks, plan, t=None):
    if backend == "triton":
        return shrink(x, a, ranks, plan, t)
    return shrink_reference(x, a, RANKS, plan, t)


def run_expand(backend, t, b, ranks, scalings, plan, y, **dora):
    if backend == "triton":
        return expand(t, b, ranks, scalings, plan, y, **dora)
    return expand_reference(t, b, RANKS, SCALINGS, plan, y, **dora)


def run_embedding(backend, ids, a, ranks, plan, t=None):
    if backend == "triton":
        return embedding_shrink(ids, a, ranks, plan, t)
    return embedding_shrink_reference(ids, a, RANKS, plan, t)


# ----------------------------------------------------------------------------------------------------------------------
# shrink: strided x, strided t
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS_2D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_strided_x(backend, layout, dtype):
    plan = make_plan()
    a, _, ranks, _ = weights(dtype, seed=1)
    x, parent = view_2d(lambda shape: randn(*shape, dtype=dtype, seed=2), T, K, layout)
    x0 = parent.clone()
    t = torch.full((T, R), SENTINEL, device=DEVICE)

    assert run_shrink(backend, x, a, ranks, plan, t) is t

    expected = oracle_shrink(x, a, torch.full((T, R), SENTINEL))
    if not x.is_contiguous():
        assert_misread_differs(expected, oracle_shrink(misread(x), a, torch.full((T, R), SENTINEL)), "shrink x")
    assert (t[written_mask()] != SENTINEL).all(), "shrink wrote nothing"
    check(t, expected, dtype, f"{backend} shrink x {layout}")
    assert torch.equal(bits(parent), bits(x0)), "shrink modified x"


@pytest.mark.parametrize("layout", LAYOUTS_2D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_shrink_into_strided_t(backend, layout):
    plan = make_plan()
    a, _, ranks, _ = weights(torch.float32, seed=3)
    x = randn(T, K, seed=4)
    t, parent = view_2d(lambda shape: torch.full(shape, SENTINEL, device=DEVICE), T, R, layout)
    outside = outside_mask(parent, t)
    parent0 = parent.clone()

    assert run_shrink(backend, x, a, ranks, plan, t) is t

    expected = oracle_shrink(x, a, torch.full((T, R), SENTINEL))
    written = through_parent(parent, t)
    assert (written[written_mask()] != SENTINEL).all(), "shrink wrote nothing"
    check(written, expected, torch.float32, f"{backend} shrink t {layout}")
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "shrink wrote outside the t view"


def planes_view(parent_of, planes: int, layout: str):
    """``(view, parent)``: a ``(planes, T, R)`` split-K workspace view."""
    if layout == "planes-sliced":  # planes 1.., every 2nd token row, columns 2..2+R
        parent = parent_of((planes + 1, 2 * T, R + 5))
        view = parent[1:, ::2, 2 : 2 + R]
    elif layout == "planes-permuted":  # stored (R, T, P + 1), plane 0 unused: strides (1, P + 1, T·(P + 1))
        parent = parent_of((R, T, planes + 1))
        view = parent[:, :, 1:].permute(2, 1, 0)
    else:
        raise ValueError(layout)
    assert view.shape == (planes, T, R) and not view.is_contiguous()
    return view, parent


@pytest.mark.parametrize("layout", ["planes-sliced", "planes-permuted"])
def test_shrink_into_strided_split_planes(layout):
    """Split-K partial products written into a strided 3-D workspace (the torch reference does not split K)."""
    plan = make_plan()
    k = 150  # two splits of 128
    a, _, ranks, _ = weights(torch.float32, seed=5, k=k)
    x = randn(T, k, seed=6)
    t, parent = planes_view(lambda shape: torch.full(shape, SENTINEL, device=DEVICE), 2, layout)
    outside = outside_mask(parent, t)
    parent0 = parent.clone()

    assert shrink(x, a, ranks, plan, t, split_k=2) is t

    written = written_mask()
    planes = through_parent(parent, t)
    assert (planes[:, ~written] == SENTINEL).all(), "shrink wrote past a rank or into base rows"
    expected = oracle_shrink(x, a, torch.zeros(T, R))
    assert planes[1][written].abs().max() > 0.1, "the second K split contributed nothing"
    check(planes[0][written] + planes[1][written], expected[written.cpu()], torch.float32, f"split planes {layout}")
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "shrink wrote outside the t view"


# ----------------------------------------------------------------------------------------------------------------------
# expand: strided y (in place), strided t
# ----------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("layout", LAYOUTS_2D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_into_strided_y(backend, layout, dtype):
    plan = make_plan()
    _, b, ranks, scalings = weights(dtype, seed=7)
    t = randn(T, R, seed=8)
    y, parent = view_2d(lambda shape: randn(*shape, dtype=dtype, seed=9, mean=3.0), T, N, layout)
    outside = outside_mask(parent, y)
    parent0, y0, ptr = parent.clone(), y.clone(), y.data_ptr()

    assert run_expand(backend, t, b, ranks, scalings, plan, y) is y
    assert y.data_ptr() == ptr

    expected = oracle_expand(t, b, y0)
    updated = through_parent(parent, y)
    touched = touched_rows()
    assert not torch.equal(updated[touched], y0[touched]), "expand changed nothing"
    check(updated, expected, dtype, f"{backend} expand y {layout}")
    assert torch.equal(bits(updated[~touched]), bits(y0[~touched])), "expand changed base / rank-0 rows"
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "expand wrote outside the y view"


@pytest.mark.parametrize("layout", LAYOUTS_2D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_strided_t(backend, layout):
    plan = make_plan()
    _, b, ranks, scalings = weights(torch.float32, seed=10)
    t, _ = view_2d(lambda shape: randn(*shape, seed=11), T, R, layout)
    y = randn(T, N, seed=12)
    y0 = y.clone()

    run_expand(backend, t, b, ranks, scalings, plan, y)

    expected = oracle_expand(t, b, y0)
    if not t.is_contiguous():
        assert_misread_differs(expected, oracle_expand(misread(t), b, y0), "expand t")
    check(y, expected, torch.float32, f"{backend} expand t {layout}")


@pytest.mark.parametrize("layout", ["planes-sliced", "planes-permuted"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_strided_split_planes(backend, layout):
    plan = make_plan()
    _, b, ranks, scalings = weights(torch.float32, seed=13)
    t, _ = planes_view(lambda shape: randn(*shape, seed=14), 2, layout)
    y = randn(T, N, seed=15)
    y0 = y.clone()

    run_expand(backend, t, b, ranks, scalings, plan, y)

    expected = oracle_expand(t, b, y0)
    assert_misread_differs(expected, oracle_expand(misread(t), b, y0), "expand planes")
    check(y, expected, torch.float32, f"{backend} expand planes {layout}")


# ----------------------------------------------------------------------------------------------------------------------
# embedding_shrink: strided ids, strided t
# ----------------------------------------------------------------------------------------------------------------------


def embedding_a(dtype=torch.float32):
    a = randn(len(RANKS), R, V, seed=16)
    for s, r in enumerate(RANKS):
        a[s, r:] = 1e3  # padding past a slot's rank must never be read
    return a.to(dtype)


@pytest.mark.parametrize("ids_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
@pytest.mark.parametrize("layout", LAYOUTS_1D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_shrink_strided_ids(backend, layout, ids_dtype):
    plan = make_plan()
    a = embedding_a()
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    g = torch.Generator().manual_seed(17)
    ids, parent = view_1d(lambda shape: torch.randint(0, V, shape, generator=g).to(DEVICE, ids_dtype), T, layout)
    parent0 = parent.clone()
    t = torch.full((T, R), SENTINEL, device=DEVICE)

    assert run_embedding(backend, ids, a, ranks, plan, t) is t

    expected = oracle_embedding(ids, a, torch.full((T, R), SENTINEL))
    if not ids.is_contiguous():
        assert_misread_differs(expected, oracle_embedding(misread(ids), a, torch.full((T, R), SENTINEL)), "ids")
    check(t, expected, torch.float32, f"{backend} embedding ids {layout}")
    assert torch.equal(parent, parent0), "embedding_shrink modified ids"


@pytest.mark.parametrize("layout", LAYOUTS_2D)
@pytest.mark.parametrize("backend", BACKENDS)
def test_embedding_shrink_into_strided_t(backend, layout):
    plan = make_plan()
    a = embedding_a(torch.float16)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(18)).to(DEVICE)
    t, parent = view_2d(lambda shape: torch.full(shape, SENTINEL, device=DEVICE), T, R, layout)
    outside = outside_mask(parent, t)
    parent0 = parent.clone()

    assert run_embedding(backend, ids, a, ranks, plan, t) is t

    written = through_parent(parent, t)
    assert (written[written_mask()] != SENTINEL).all(), "embedding_shrink wrote nothing"
    check(written, oracle_embedding(ids, a, torch.full((T, R), SENTINEL)), torch.float32, f"{backend} emb t {layout}")
    assert torch.equal(bits(parent[outside]), bits(parent0[outside])), "embedding_shrink wrote outside the t view"


def test_embedding_shrink_checks_t_shape():
    plan = make_plan()
    ids = torch.zeros(T, dtype=torch.int64, device=DEVICE)
    ranks = torch.tensor(RANKS, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError):
        embedding_shrink(ids, embedding_a(), ranks, plan, torch.empty(T - 1, R, device=DEVICE))
    with pytest.raises(ValueError):
        embedding_shrink(ids[::2], embedding_a(), ranks, plan)


# ----------------------------------------------------------------------------------------------------------------------
# Per-slot vectors and tables (read densely by the kernels: a strided view is copied first)
# ----------------------------------------------------------------------------------------------------------------------


def strided_copy(v: torch.Tensor) -> torch.Tensor:
    """``v``'s values in a view of every 2nd element of the last dim of a larger buffer (garbage in between)."""
    parent = torch.full((*v.shape[:-1], 2 * v.shape[-1]), 99, dtype=v.dtype, device=v.device)
    view = parent[..., ::2]
    view.copy_(v)
    assert not view.is_contiguous()
    return view


def test_strided_ranks_and_scalings_triton():
    plan = make_plan()
    a, b, ranks, scalings = weights(torch.float32, seed=19)
    ea = embedding_a()
    x, y, ids = randn(T, K, seed=20), randn(T, N, seed=21), torch.randint(0, V, (T,), device=DEVICE)
    dense = [
        shrink(x, a, ranks, plan, torch.zeros(T, R, device=DEVICE)),
        embedding_shrink(ids, ea, ranks, plan, torch.zeros(T, R, device=DEVICE)),
    ]
    dense.append(expand(dense[0], b, ranks, scalings, plan, y.clone()))
    assert not torch.equal(dense[2], y), "expand changed nothing"
    ranks_v, scalings_v = strided_copy(ranks), strided_copy(scalings)
    got = [
        shrink(x, a, ranks_v, plan, torch.zeros(T, R, device=DEVICE)),
        embedding_shrink(ids, ea, ranks_v, plan, torch.zeros(T, R, device=DEVICE)),
    ]
    got.append(expand(got[0], b, ranks_v, scalings_v, plan, y.clone()))
    for what, g, d in zip(("shrink", "embedding_shrink", "expand"), got, dense):
        assert torch.equal(g, d), f"{what}: strided ranks / scalings give another result"


@pytest.mark.parametrize("backend", BACKENDS)
def test_expand_strided_dora_and_lora_bias_tables(backend):
    plan = make_plan()
    _, b, ranks, scalings = weights(torch.float32, seed=22)
    t, y = randn(T, R, seed=23), randn(T, N, seed=24)
    tables = dict(
        mag=1 + 0.3 * randn(len(RANKS), N, seed=25), bias=randn(N, seed=26), lora_bias=randn(len(RANKS), N, seed=27)
    )
    expected = expand_reference(
        t.double(), b.double(), RANKS, SCALINGS, plan, y.double(), **{k: v.double() for k, v in tables.items()}
    )
    plain = oracle_expand(t, b, y)
    assert (expected.cpu() - plain).abs().max() > 0.1, "the tables change nothing: the test proves nothing"
    views = {k: strided_copy(v) for k, v in tables.items()}

    got = run_expand(backend, t, b, ranks, scalings, plan, y.clone(), **views)

    check(got, expected, torch.float32, f"{backend} expand with strided DoRA / lora_bias tables")


# ----------------------------------------------------------------------------------------------------------------------
# BoundLayer: refuses strides and alignments it was not bound for, passes an offset view's own address
# ----------------------------------------------------------------------------------------------------------------------


def _addresses(args) -> tuple:
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_bound_layer_strides_and_offsets(recorded):
    plan = make_plan()
    k, n = 40, 24  # rows of 160 / 96 bytes: a view 3 rows in keeps 16-byte alignment
    a, b, ranks, scalings = weights(torch.float32, seed=28, k=k, n=n)
    stack = types.SimpleNamespace(a=a, b=b, ranks=ranks, scalings=scalings, mag=None, bias=None, lora_bias=None)
    t = PlanRun(plan).workspace(R, shrink_splits(plan, k))
    x, y = randn(T, k, seed=29), randn(T, n, seed=30)
    shrink(x, a, ranks, plan, t)
    expand(t, b, ranks, scalings, plan, y)  # compiled ("triton" launches): the binding can take them
    bound = BoundLayer.bind(x, y, t, stack, plan)
    assert bound is not None and bound.fits(x, y, stack)

    def strided(rows, cols, layout, seed):
        return view_2d(lambda shape: randn(*shape, seed=seed), rows, cols, layout)[0]

    # Other strides: never fit (the checked launch path takes them, tested above).
    for layout in ("rows-step2", "last-columns", "transposed-sliced"):
        assert not bound.fits(strided(T, k, layout, 31), y, stack), f"x {layout}"
        assert not bound.fits(x, strided(T, n, layout, 32), stack), f"y {layout}"
    # Same strides at an offset that breaks the 16-byte alignment: the kernels would compile differently.
    x_mis, y_mis = randn(T * k + 1, seed=33)[1:].view(T, k), randn(T * n + 1, seed=34)[1:].view(T, n)
    assert x_mis.data_ptr() % 16 and y_mis.data_ptr() % 16
    assert not bound.fits(x_mis, y, stack) and not bound.fits(x, y_mis, stack)
    # Same strides at an aligned offset: fits, and launches with the views' own addresses, as the checked path does.
    x_off, y_off = strided(T, k, "offset", 35), strided(T, n, "offset", 36)
    assert x_off.storage_offset() and x_off.data_ptr() % 16 == 0 and y_off.data_ptr() % 16 == 0
    assert bound.fits(x_off, y_off, stack)
    recorded.clear()
    bound(x_off, y_off)
    via_bound = list(recorded)
    recorded.clear()
    shrink(x_off, a, ranks, plan, t)
    expand(t, b, ranks, scalings, plan, y_off)
    via_checked = list(recorded)
    assert [e[:2] for e in via_bound] == [e[:2] for e in via_checked] == [("shrink", "direct"), ("expand", "direct")]
    assert via_bound[0][3][0] == x_off.data_ptr() and via_bound[1][3][2] == y_off.data_ptr()
    for got, want in zip(via_bound, via_checked):
        assert _addresses(got[3]) == _addresses(want[3]), f"{got[0]}: bound and checked launches differ"
    # A stack whose per-slot vectors are strided views is not bound (shrink/expand launch a dense copy of them).
    strided_stack = types.SimpleNamespace(**{**vars(stack), "ranks": strided_copy(ranks)})
    assert BoundLayer.bind(x, y, t, strided_stack, plan) is None


# ----------------------------------------------------------------------------------------------------------------------
# A model with LoRA on its embedding, called on strided input_ids, against each row's stock PEFT run
# ----------------------------------------------------------------------------------------------------------------------

SEQ_ROWS, SEQ_LEN = 8, 5


def _ids_case(seq: torch.Tensor, case: str):
    """``(input_ids, adapter names)``: a strided slice of ``seq`` and one name per row (base rows included)."""
    if case == "last-column":  # (8, 1), strides (5, 1): the embedding's ids.reshape(-1) is a stride-5 view
        ids = seq[:, -1:]
    elif case == "offset-column":  # (5, 1) at storage offset 17 (not 16-byte aligned)
        ids = seq[3:, 2:3]
    elif case == "every-other-row":  # (4, 5), strides (10, 1)
        ids = seq[::2]
    elif case == "one-row-every-other-token":  # (1, 3), strides (5, 2): a stride-2 view after reshape
        ids = seq[1:2, ::2]
    else:
        raise ValueError(case)
    assert not ids.is_contiguous() or ids.storage_offset()
    cycle = ["a1", BASE, "a0", "a2"]
    return ids, [cycle[i % len(cycle)] for i in range(ids.shape[0])]


@pytest.mark.parametrize("case", ["last-column", "offset-column", "every-other-row", "one-row-every-other-token"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_model_strided_input_ids(backend, case):
    model, _ = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"]),
        "a1": dict(r=8, lora_alpha=4, target_modules=["embed_tokens", *ALL_LINEAR]),
        "a2": dict(r=2, lora_alpha=4, target_modules=ALL_LINEAR),  # no embedding LoRA: rank 0 there
    }
    model = add_adapters(model, specs).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, 97, (SEQ_ROWS, SEQ_LEN), generator=g).to(DEVICE)
    ids, names = _ids_case(seq, case)
    everyone = [*names, BASE, "a0", "a1", "a2"]  # every adapter runs, so each pair can be checked to differ
    outs = per_adapter(model, everyone, lambda: model(input_ids=ids).logits)
    assert_adapters_matter(outs)
    embed = per_adapter(model, [BASE, "a0"], lambda: model.get_input_embeddings()(ids))
    assert (embed["a0"] - embed[BASE]).abs().max() > 0.1, "the embedding LoRA changes nothing: the test proves nothing"
    enable_csgmv(model, backend=backend)
    try:
        with torch.no_grad():
            got = model(input_ids=ids, adapter_ids=[None if n == BASE else n for n in names]).logits
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), f"{backend} {case}: csgmv vs each row's stock PEFT run")


@pytest.mark.parametrize("layout", ["rows-step2", "last-columns", "offset", "transposed-sliced"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_linear_takes_strided_inputs(backend, layout):
    """``peft_csgmv::lora_linear`` on a view of ``x`` (every 2nd row, the last columns of a wider tensor, at a storage
    offset, transposed and sliced): the base product and the LoRA alone of the same values given contiguously, ``x``'s
    parent untouched; ``y + delta`` is the base product followed by the ``lora`` op, bit for bit."""
    from test_strides import view_2d

    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model = make()
    enable_csgmv(model, backend=backend)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    stack, base = layer._csgmv_record.stack, layer.base_layer
    static = StaticPlan(4, 4, 2, DEVICE)
    static.fill((1, -1, 0, 1))
    x, parent = view_2d(lambda shape: torch.randn(shape, device=DEVICE), 8, layer.in_features, layout)
    x_dense, parent0 = x.contiguous(), parent.clone()
    args = (static.permutation, static.seg_indptr, static.seg_slot, stack.handle, stack.version, static.chunk)
    triton = backend == "triton"
    with torch.no_grad():
        y, delta = ops.lora_linear(x, base.weight, base.bias, *args, triton)
        y_dense, delta_dense = ops.lora_linear(x_dense, base.weight, base.bias, *args, triton)
        want = ops.lora(x_dense, torch.nn.functional.linear(x_dense, base.weight, base.bias), *args[:3], None,
                        *args[3:], triton)  # fmt: skip
    assert torch.equal(parent, parent0), "lora_linear wrote x"
    close(y, y_dense, f"base product of a {layout} view")
    close(delta, delta_dense, f"the LoRA of a {layout} view")
    assert delta.abs().sum() > 0 and not delta[2:4].any(), "the LoRA is zero on the base row's tokens only"
    assert torch.equal((y_dense + delta_dense).to(y.dtype), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_take_a_layers_input_with_its_leading_dimensions(backend):
    """The ops take a layer's input and output as the layer sees them, ``(rows, tokens, features)`` (token ids
    ``(rows, tokens)`` for an embedding), strided views included (the last token of every 2nd row, ``[::2, -1:]``; a
    middle token at an offset, ``[:, 1:2]``), so a compiled graph holds no reshape around them: each output has the
    input's leading dimensions and, bit for bit, the values of the same op over the flattened contiguous tensors."""
    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model = make(embedding=True)
    enable_csgmv(model, backend=backend)
    inner = model.base_model.model.model
    q, k, v = (getattr(inner.layers[1].self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    embed = inner.embed_tokens
    static = StaticPlan(4, 4, 1, DEVICE)
    static.fill((1, -1, 0, 1))
    plan, triton = (static.permutation, static.seg_indptr, static.seg_slot), backend == "triton"
    stacks = [m._csgmv_record.stack for m in (q, k, v)]
    handles, versions = [s.handle for s in stacks], [s.version for s in stacks]
    weights, biases = [m.base_layer.weight for m in (q, k, v)], [m.base_layer.bias for m in (q, k, v)]
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(8, 3, q.in_features, generator=g).to(DEVICE)
    ids_wide = torch.randint(1, 90, (8, 3), generator=g).to(DEVICE)
    y_wide = torch.randn(8, 3, q.out_features, generator=g).to(DEVICE)
    e_wide = torch.randn(8, 3, embed.base_layer.embedding_dim, generator=g).to(DEVICE)

    def flat(t):
        return t.reshape(-1, t.shape[-1]).contiguous()

    def same(got, want, lead, what):
        assert got.shape == (*lead, want.shape[-1]), f"{what}: shape {tuple(got.shape)}"
        assert torch.equal(got.reshape(-1, want.shape[-1]), want), f"{what}: other values than over flat tensors"

    with torch.no_grad():
        for pick in (lambda t: t[::2, -1:], lambda t: t[:4, 1:2]):
            x, y, ids, e = pick(wide), pick(y_wide), pick(ids_wide), pick(e_wide)
            assert not x.is_contiguous() and not ids.is_contiguous()
            lead = x.shape[:-1]
            s = stacks[0]
            got = ops.lora(x, y, *plan, None, s.handle, s.version, static.chunk, triton)
            same(got, ops.lora(flat(x), flat(y), *plan, None, s.handle, s.version, static.chunk, triton), lead, "lora")
            es = embed._csgmv_record.stack
            got = ops.lora(ids, e, *plan, None, es.handle, es.version, static.chunk, triton)
            want = ops.lora(ids.reshape(-1).contiguous(), flat(e), *plan, None, es.handle, es.version, static.chunk,
                            triton)  # fmt: skip
            same(got, want, ids.shape, "lora over token ids")
            got = ops.lora_linear(x, weights[0], biases[0], *plan, s.handle, s.version, static.chunk, triton)
            want = ops.lora_linear(flat(x), weights[0], biases[0], *plan, s.handle, s.version, static.chunk, triton)
            for a, b, what in zip(got, want, ("lora_linear's base product", "lora_linear's delta")):
                same(a, b, lead, what)
            got = ops.lora_group(x, *plan, handles, versions, static.chunk, triton)
            want = ops.lora_group(flat(x), *plan, handles, versions, static.chunk, triton)
            assert len(got) == 3 and got[0].abs().sum() > 0
            for a, b in zip(got, want):
                same(a, b, lead, "lora_group")
            got = ops.lora_group_linear(x, weights, biases, *plan, handles, versions, static.chunk, triton)
            want = ops.lora_group_linear(flat(x), weights, biases, *plan, handles, versions, static.chunk, triton)
            assert len(got) == 6
            for a, b in zip(got, want):
                same(a, b, lead, "lora_group_linear")
