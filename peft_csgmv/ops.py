"""The kernels as a torch custom op, for compiled code (``torch.compile``, transformers' static-cache decode).

``peft_csgmv::lora`` is one layer's LoRA over a plan given as tensors (a :class:`~peft_csgmv.mapping.StaticPlan`'s
buffers): ``out = y + LoRA(x)``, ``y`` itself untouched. dynamo and inductor see it as one opaque call with a fake
(shape-only) implementation, so a patched layer traces into a graph without a break, and a CUDA graph captures its
launches as they are. The grid is the plan's most segments; empty segments exit at once. Its graph inputs are the
activations and the plan only: the layer's stack is named by a handle and read when the op runs, and the graph guards
on the stack's version (see :mod:`peft_csgmv.slots`), so a compiled model passes a few tensors per call, not five per
LoRA layer. The plan's segments cover the base rows too (slot ``-1``), so the expand writes every row of the output out
of place: no clone of ``y`` first.

``peft_csgmv::lora_linear`` is a plain ``nn.Linear`` layer's base product and LoRA in one op, for decode-sized inputs:
``y = x @ Wᵀ + bias`` and ``delta`` = the LoRA alone in fp32 (zeros on base rows), which the caller adds to ``y``
(``(y + delta)`` rounded once to ``y``'s dtype: the same numbers as ``lora``'s out-of-place sum), so compiled code
fuses that add into whatever reads the layer's output. While a CUDA graph is captured, the LoRA's launches go on a side
stream that forks from the caller's stream before the base product and joins it after: at each replay the two branches
run side by side (run eagerly, all on the caller's stream). They launch without programmatic dependent launch, which
across the graph's fork and join idled the GPU more than it hid. Compiled layers on CUDA use it by default
(``PEFT_CSGMV_BESIDE=0`` turns it off; on the H200 it is faster on the 8B layout, a tie on the 1B one:
docs/benchmarks.md).

``peft_csgmv::lora_group`` is a sibling group's LoRA (up to three layers that read the same ``x``: a block's q/k/v,
gate/up) in one shrink and one expand launch, one fp32 delta per member; ``peft_csgmv::lora_group_linear`` is that
and the members' base products in one op, the group's LoRA on the side stream beside all of them (one fork and one
join for the group) while a CUDA graph is captured.

Each op takes the layer's input and output with their leading dimensions (rows, tokens) and flattens them itself, so a
compiled graph holds the op alone, no reshape around it: each traced tensor call costs dynamo's tracing of every LoRA
layer a few milliseconds.

Semantics (as :mod:`peft_csgmv.kernels`)::

    for each segment s with slot = seg_slot[s], rows = permutation[seg_indptr[s]:seg_indptr[s+1]]:
        out[rows] = y[rows] + (x[rows] @ A[slot]ᵀ) @ B[slot]ᵀ · scaling[slot]       (DoRA, lora_bias: as expand)
        (embedding: A[slot][:, x[rows]]ᵀ · embed_scale in place of x[rows] @ A[slot]ᵀ)
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
from typing import Optional

import torch

from . import kernels
from .kernels.ahead import compile_elsewhere
from .kernels.group import expand_group, group_splits, shrink_group
from .kernels.launch import recording, without_pdl
from .moe import expert_linear, expert_linear_shape, moe_stack_by_handle, stack_lora
from .moe_plan import MoePlan
from .options import env, interpreting
from .plan import BatchPlan
from .slots import stack_by_handle


def _plan(permutation: torch.Tensor, seg_indptr: torch.Tensor, seg_slot: torch.Tensor, chunk: int, runs: bool):
    """The plan the kernels take, from its tensors. ``runs``: also the host-side runs the torch reference walks (read
    from the tensors: CPU only, where reading them costs no device sync; base segments left out)."""
    walk: tuple = ()
    if runs:
        bounds, slots = seg_indptr.tolist(), seg_slot.tolist()
        walk = tuple(
            (slot, bounds[i], bounds[i + 1]) for i, slot in enumerate(slots) if slot >= 0 and bounds[i + 1] > bounds[i]
        )
    return BatchPlan(
        rows=permutation.shape[0],
        tokens_per_row=1,
        chunk_size=chunk,
        num_segments=seg_slot.shape[0],
        permutation=permutation,
        seg_indptr=seg_indptr,
        seg_slot=seg_slot,
        runs=walk,
    )


def _stack_at(handle: int, version: int):
    """The stack of ``handle``, at the ``version`` the compiled caller's graph was traced with (it guards on it: a
    mismatch is a bug, not a user error)."""
    s = stack_by_handle(handle)
    if s.version != version:
        raise RuntimeError(f"peft_csgmv: stack {handle} is at version {s.version} under a graph of version {version}")
    return s


def _lora(
    x: torch.Tensor,
    y: torch.Tensor,
    permutation: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slot: torch.Tensor,
    embed_scale: Optional[torch.Tensor],
    stack: int,
    version: int,
    chunk: int,
    triton: bool,
    fused: bool = False,
) -> torch.Tensor:
    """``x``: (..., in) activations or (...) token ids (an embedding stack) of T tokens; ``y``: (..., out), the same
    leading dimensions; ``permutation`` (T,), ``seg_indptr`` (M + 1,), ``seg_slot`` (M,) int32: the plan (a
    :class:`~peft_csgmv.mapping.StaticPlan`'s: base rows in segments of slot ``-1``, then empty segments);
    ``embed_scale``: a scaled embedding's factor (0-dim fp32); ``stack``: the layer's
    :class:`~peft_csgmv.slots.LoraStack` handle, whose tensors are read here (not graph inputs); ``version``: the
    stack's version the caller's graph was traced with; ``chunk``: the plan's row tile; ``triton``: the Triton kernels
    (else the torch reference, CPU); ``fused``: one launch for both products (the expand kernel computes the A product
    itself; not for embeddings). Returns ``y`` plus the LoRA (``y`` untouched), contiguous, of ``y``'s shape."""
    s = _stack_at(stack, version)
    a, b = s.a, s.b
    shape = y.shape
    x, y = _tokens(x, s.embedding), y.reshape(-1, shape[-1])
    plan = _plan(permutation, seg_indptr, seg_slot, chunk, runs=not triton)
    if triton:
        # Out of place over a plan whose segments cover every token: one launch writes all of the output.
        out = torch.empty(y.shape, dtype=y.dtype, device=y.device)
        with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
            if fused:
                kernels.expand(None, b, s.ranks, s.scalings, plan, y, s.mag, s.bias, s.lora_bias, out=out, x=x, a=a)
                return out.view(shape)
            t = kernels.embedding_shrink(x, a, s.ranks, plan) if s.embedding else kernels.shrink(x, a, s.ranks, plan)
            if embed_scale is not None:
                t.mul_(embed_scale)
            kernels.expand(t, b, s.ranks, s.scalings, plan, y, s.mag, s.bias, s.lora_bias, out=out)
            return out.view(shape)
    out = y.clone(memory_format=torch.contiguous_format)
    shrink = kernels.embedding_shrink_reference if s.embedding else kernels.shrink_reference
    t = shrink(x, a, s.ranks_host, plan)
    if embed_scale is not None:
        t.mul_(embed_scale)
    kernels.expand_reference(t, b, s.ranks_host, s.scalings_host, plan, out, s.mag, s.bias, s.lora_bias)
    return out.view(shape)


def _tokens(x: torch.Tensor, embedding: bool = False) -> torch.Tensor:
    """The ops' input as the kernels take it: ``(T, in)`` activations from ``(..., in)``, or ``(T,)`` token ids from any
    shape (an embedding stack); a view where the strides allow one. The ops take the layer's input and output with their
    leading dimensions, so a compiled graph holds no reshape around each op."""
    return x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1])


def _lora_fake(x, y, *args, **kwargs) -> torch.Tensor:
    return y.new_empty(y.shape)


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream :func:`lora_linear` runs the LoRA on beside the base product, one per CUDA device."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def _delta_reference(x: torch.Tensor, s, plan: BatchPlan) -> torch.Tensor:
    """The LoRA alone of stack ``s`` over ``plan``, fp32, zeros on base rows: the torch reference (CPU) of the
    ``delta`` that :func:`lora_linear` and :func:`lora_group` return."""
    t = kernels.shrink_reference(x, s.a, s.ranks_host, plan)
    delta = torch.zeros((x.shape[0], s.out_features), dtype=torch.float32, device=x.device)
    kernels.expand_reference(t, s.b, s.ranks_host, s.scalings_host, plan, delta, None, None, s.lora_bias)
    return delta


def _lora_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    permutation: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slot: torch.Tensor,
    stack: int,
    version: int,
    chunk: int,
    triton: bool,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x``: (..., in) activations; ``weight`` (out, in), ``bias`` (out,) or ``None``: the base ``nn.Linear``'s; the
    plan, ``stack``, ``version``, ``chunk``, ``triton`` and ``fused`` as :func:`lora` takes them (no DoRA, no
    embedding). Returns ``(y, delta)``: ``y = F.linear(x, weight, bias)`` (..., out) in ``x``'s dtype, ``delta``
    (..., out) fp32, the LoRA of every token (0 on base rows and rank-0 slots); the layer's output is ``(y + delta)``
    in ``y``'s dtype. While a CUDA graph is captured the LoRA runs on :func:`side_stream`, beside the base product (see
    the module docstring)."""
    s = _stack_at(stack, version)
    shape = (*x.shape[:-1], weight.shape[0])
    x = _tokens(x)
    plan = _plan(permutation, seg_indptr, seg_slot, chunk, runs=not triton)
    if not triton:
        return torch.nn.functional.linear(x, weight, bias).view(shape), _delta_reference(x, s, plan).view(shape)
    cuda = x.device.type == "cuda"
    with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
        # Everything the side stream writes is allocated here, on the caller's stream, before the fork (nothing is
        # allocated on the side stream, inside a CUDA graph's capture or out of it), and outlives the join below.
        delta, t = _linear_workspace(x, weight.shape[0], s, plan, fused)
        # The side stream only while a CUDA graph is captured, where the two branches then run side by side at every
        # replay; run eagerly (compiled code without CUDA graphs, a graph's warm-up), the fork and join would cost the
        # host two event waits per layer for an overlap the host-bound launches do not reach: one stream then.
        fork = cuda and torch.cuda.is_current_stream_capturing()
        main = torch.cuda.current_stream() if fork else None
        side = side_stream(x.device) if fork else None
        if fork:
            side.wait_stream(main)
        with torch.cuda.stream(side) if fork else contextlib.nullcontext():
            _linear_delta(x, s, plan, fused, delta, t)
        y = torch.nn.functional.linear(x, weight, bias)
        if fork:
            main.wait_stream(side)
    return y.view(shape), delta.view(shape)


def _linear_workspace(x: torch.Tensor, n: int, s, plan: BatchPlan, fused: bool):
    """:func:`_lora_linear`'s ``(delta, t)``: its fp32 output (T, n) and its shrink's workspace (``None`` when
    ``fused``)."""
    delta = torch.empty((x.shape[0], n), dtype=torch.float32, device=x.device)
    t = None if fused else torch.empty(
        (kernels.shrink_splits(plan, x.shape[1]), x.shape[0], s.b.shape[2]), dtype=torch.float32, device=x.device
    )  # fmt: skip
    return delta, t


def _linear_delta(x: torch.Tensor, s, plan: BatchPlan, fused: bool, delta: torch.Tensor, t) -> None:
    """:func:`_lora_linear`'s LoRA launches: ``delta`` (T, out) fp32 = the LoRA of every token (``t``: the shrink's
    workspace; ``None`` when ``fused``). Without PDL: on the side stream, its early start across the graph's fork and
    join idled the H200 longer than it hid (bench_beside.py, docs/benchmarks.md)."""
    with without_pdl():
        if fused:
            kernels.expand(None, s.b, s.ranks, s.scalings, plan, None, lora_bias=s.lora_bias, out=delta, x=x, a=s.a,
                           act_dtype=x.dtype)  # fmt: skip
        else:
            t = kernels.shrink(x, s.a, s.ranks, plan, t)
            kernels.expand(t, s.b, s.ranks, s.scalings, plan, None, lora_bias=s.lora_bias, out=delta,
                           act_dtype=x.dtype)  # fmt: skip


def _lora_linear_fake(x, weight, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*x.shape[:-1], weight.shape[0])
    return x.new_empty(shape), x.new_empty(shape, dtype=torch.float32)


def _group_run(x, weights, biases, permutation, seg_indptr, seg_slot, stacks, versions, chunk, triton):
    """:func:`_lora_group` (``weights`` ``None``: the deltas) and :func:`_lora_group_linear` (the base products, then
    the deltas, the LoRA beside the base products while a CUDA graph is captured)."""
    ss = [stack_by_handle(h) if v < 0 else _stack_at(h, v) for h, v in zip(stacks, versions)]
    lead = x.shape[:-1]
    x = _tokens(x)
    plan = _plan(permutation, seg_indptr, seg_slot, chunk, runs=not triton)
    num_tokens, linear = x.shape[0], weights is not None

    def products() -> list[torch.Tensor]:
        return [torch.nn.functional.linear(x, w, b).view(*lead, -1) for w, b in zip(weights, biases)] if linear else []

    if not triton:
        return products() + [_delta_reference(x, s, plan).view(*lead, -1) for s in ss]
    cuda = x.device.type == "cuda"
    with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
        # As in lora_linear: what the side stream writes is allocated before the fork, on the caller's stream.
        deltas = [torch.empty((num_tokens, s.out_features), dtype=torch.float32, device=x.device) for s in ss]
        r = max(s.a.shape[1] for s in ss)
        t = torch.empty((len(ss), group_splits(plan, x.shape[1]), num_tokens, r), dtype=torch.float32, device=x.device)
        fork = linear and cuda and torch.cuda.is_current_stream_capturing()
        main = torch.cuda.current_stream() if fork else None
        side = side_stream(x.device) if fork else None
        if fork:
            side.wait_stream(main)
        with torch.cuda.stream(side) if fork else contextlib.nullcontext():
            shrink_group(x, [s.a for s in ss], [s.ranks for s in ss], plan, t)
            expand_group(t, [s.b for s in ss], [s.ranks for s in ss], [s.scalings for s in ss], plan, deltas, x.dtype)
        ys = products()
        if fork:
            main.wait_stream(side)
    return ys + [delta.view(*lead, -1) for delta in deltas]


def _lora_group(x: torch.Tensor, *args) -> list[torch.Tensor]:
    """``(x, permutation, seg_indptr, seg_slot, stacks, versions, chunk, triton)``: the LoRA alone of a sibling group,
    up to three layers that read the same ``x`` ((..., in)), their stack handles in order, in one shrink and one expand
    launch (:mod:`peft_csgmv.kernels.group`). Returns one ``(..., N_g)`` fp32 delta per member, as :func:`lora_linear`
    returns its ``delta``: each member's output is ``(its base product + delta)`` in the base product's dtype.
    ``versions``: each stack's version the caller's graph was traced with, or ``-1`` where the caller's graph guards it
    elsewhere (each member's own call reads its stack's version, layers._compiled_group)."""
    return _group_run(x, None, None, *args)


def _lora_group_fake(x, permutation, seg_indptr, seg_slot, stacks, *args, **kwargs) -> list[torch.Tensor]:
    lead = x.shape[:-1]
    return [x.new_empty((*lead, stack_by_handle(h).out_features), dtype=torch.float32) for h in stacks]


def _lora_group_linear(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    biases: list[Optional[torch.Tensor]],
    permutation: torch.Tensor,
    seg_indptr: torch.Tensor,
    seg_slot: torch.Tensor,
    stacks: list[int],
    versions: list[int],
    chunk: int,
    triton: bool,
) -> list[torch.Tensor]:
    """A sibling group's base products and LoRA in one op, as :func:`lora_linear` is one layer's: ``weights[g]``
    ``(N_g, in)`` and ``biases[g]`` (or ``None``) are member ``g``'s plain ``nn.Linear``'s. Returns the members' base
    products ``y_g = F.linear(x, W_g, b_g)`` in ``x``'s dtype, then their deltas as :func:`lora_group` returns them
    (``2 G`` tensors): member ``g``'s output is ``(y_g + delta_g)`` in ``y_g``'s dtype. While a CUDA graph is captured
    the group's two launches run on :func:`side_stream`, beside all the members' base products (one fork and one join
    for the group)."""
    return _group_run(x, weights, biases, permutation, seg_indptr, seg_slot, stacks, versions, chunk, triton)


def _lora_group_linear_fake(x, weights, biases, permutation, seg_indptr, seg_slot, stacks, *args, **kwargs):
    lead = x.shape[:-1]
    ys = [x.new_empty((*lead, w.shape[0])) for w in weights]
    return ys + [x.new_empty((*lead, w.shape[0]), dtype=torch.float32) for w in weights]


def _moe_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    experts: Optional[torch.Tensor],
    offsets: torch.Tensor,
    transposed: bool,
) -> torch.Tensor:
    """An experts layer's base product in compiled code: :func:`~peft_csgmv.moe.expert_linear` (``x`` ``(P, in)`` rows
    sorted expert-major, ``weight`` ``(E, out, in)`` or ``(E, in, out)`` transposed, ``bias`` ``(E, out)`` or
    ``None``, ``experts`` ``(P,)`` each row's expert (for the bias), ``offsets`` ``(E,)`` where each expert's rows
    end). An op because its product per expert reads the offsets on the host where torch has no grouped product for
    the tensors (as eager code does; a CUDA graph's capture takes the gathered form instead, which reads nothing)."""
    return expert_linear(x, weight, bias, experts, offsets, transposed)


def _moe_linear_fake(x, weight, bias, experts, offsets, transposed) -> torch.Tensor:
    shape, dtype = expert_linear_shape(x, weight, transposed)
    return x.new_empty(shape, dtype=dtype)


_MOE_ROWS = ("token", "pair", "sorted")


def _moe_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    permutation: torch.Tensor,
    expert_offsets: torch.Tensor,
    seg_start: torch.Tensor,
    seg_end: torch.Tensor,
    seg_slot: torch.Tensor,
    seg_expert: torch.Tensor,
    top_k: int,
    chunk: int,
    stack: int,
    x_rows: int,
    triton: bool,
) -> torch.Tensor:
    """An experts layer's LoRA of one expert parameter in compiled code: ``y`` ``(P, N)`` (rows in the plan's sorted
    order) plus each pair's LoRA of the :class:`~peft_csgmv.moe.MoeStack` of handle ``stack`` on ``x`` (rows by
    ``x_rows``: 0 token ``(T, K)``, 2 sorted ``(P, K)``), out of place (``y`` untouched). The plan's tensors are a
    :class:`~peft_csgmv.moe_plan.MoePlan`'s, built in the graph (``top_k``, ``chunk``: its shapes); ``triton``: the
    kernels (else their torch reference, CPU). Semantics: :mod:`peft_csgmv.kernels.moe`."""
    s = moe_stack_by_handle(stack)
    num_slots, num_experts = s.a.shape[:2]
    plan = MoePlan(
        num_tokens=permutation.shape[0] // top_k,
        top_k=top_k,
        num_experts=num_experts,
        num_slots=num_slots,
        chunk_size=chunk,
        num_segments=seg_slot.shape[0],
        permutation=permutation,
        expert_offsets=expert_offsets,
        seg_start=seg_start,
        seg_end=seg_end,
        seg_slot=seg_slot,
        seg_expert=seg_expert,
    )
    out = y.clone(memory_format=torch.contiguous_format)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        stack_lora(s, x, out, plan, _MOE_ROWS[x_rows], triton)
    return out


def _moe_lora_fake(x, y, *args, **kwargs) -> torch.Tensor:
    return y.new_empty(y.shape)


# Registered straight with the dispatcher (a ``torch.library.Library`` schema, one implementation for every device,
# a fake one for tracing), as vLLM's ``direct_register_custom_op`` registers its kernels: ``torch.library.custom_op``
# wraps each call in Python layers of its own (an autograd wrapper, a dynamo-disabled wrapper, an aliasing check of the
# outputs), which cost more host time per call than the op's own Python on an H200's host (~60-90 µs against ~57:
# docs/results/capture_ops_1b.log); compiled code without CUDA graphs pays that at every LoRA layer of every step, and a
# CUDA graph's capture (which transformers' static cache repeats for every ``generate``) once per layer. These ops are
# for inference: they have no backward.
_LIB = torch.library.Library("peft_csgmv", "DEF")
_SCHEMAS = {
    "lora": (
        "(Tensor x, Tensor y, Tensor permutation, Tensor seg_indptr, Tensor seg_slot, Tensor? embed_scale, int stack, "
        "int version, int chunk, bool triton, bool fused=False) -> Tensor",
        _lora,
        _lora_fake,
    ),
    "lora_linear": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor permutation, Tensor seg_indptr, Tensor seg_slot, int stack, "
        "int version, int chunk, bool triton, bool fused=False) -> (Tensor, Tensor)",
        _lora_linear,
        _lora_linear_fake,
    ),
    "lora_group": (
        "(Tensor x, Tensor permutation, Tensor seg_indptr, Tensor seg_slot, int[] stacks, int[] versions, int chunk, "
        "bool triton) -> Tensor[]",
        _lora_group,
        _lora_group_fake,
    ),
    "lora_group_linear": (
        "(Tensor x, Tensor[] weights, Tensor?[] biases, Tensor permutation, Tensor seg_indptr, Tensor seg_slot, "
        "int[] stacks, int[] versions, int chunk, bool triton) -> Tensor[]",
        _lora_group_linear,
        _lora_group_linear_fake,
    ),
    "moe_linear": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor? experts, Tensor offsets, bool transposed) -> Tensor",
        _moe_linear,
        _moe_linear_fake,
    ),
    "moe_lora": (
        "(Tensor x, Tensor y, Tensor permutation, Tensor expert_offsets, Tensor seg_start, Tensor seg_end, "
        "Tensor seg_slot, Tensor seg_expert, int top_k, int chunk, int stack, int x_rows, bool triton) -> Tensor",
        _moe_lora,
        _moe_lora_fake,
    ),
}


def _lora_linear_ahead(x, weight, bias, permutation, seg_indptr, seg_slot, stack, version, chunk, triton, fused=False):
    """:func:`_lora_linear` compiled ahead: its LoRA launches alone (``weight`` and ``bias`` by shape only: no base
    product, no scratch copy of the base weight)."""
    if not triton:
        return
    s = _stack_at(stack, version)
    x = _tokens(x)
    plan = _plan(permutation, seg_indptr, seg_slot, chunk, runs=False)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        delta, t = _linear_workspace(x, weight.shape[0], s, plan, fused)
        _linear_delta(x, s, plan, fused, delta, t)


def _lora_group_linear_ahead(x, weights, biases, *args) -> None:
    """:func:`_lora_group_linear` compiled ahead: the group's LoRA launches alone, as :func:`_lora_group` runs them
    (the base weights by shape only)."""
    _group_run(x, None, None, *args)


# Compiled ahead: a compiled graph's first run compiles each Triton kernel variant its ops launch, one after another on
# the host's main thread (~0.3 s each on an H200's host with empty caches, 6 variants for a 1B layout's decode step).
# Tracing knows them long before: each op's fake implementation, which dynamo and AOT autograd run as they trace, hands
# its arguments' shapes, strides and dtypes to a worker thread, which runs the op once over scratch tensors of that
# description (a plan of empty segments) with its launches recorded, not run, and hands them to a worker process
# (:mod:`peft_csgmv.kernels.ahead`: a compile holds the interpreter lock, which the tracing needs) that compiles each
# into Triton's on-disk cache while the tracing and inductor go on; the op's first real call waits for any job still
# running (so none runs beside a CUDA graph's capture) and loads its variants from that cache. CUDA only;
# ``PEFT_CSGMV_COMPILE_AHEAD=0`` turns it off (read per trace), ``=N`` compiles on N threads of this process instead,
# each job running the op with its launches (read when the first job starts).
AHEAD_DEVICES = ("cuda",)
# What a job runs for an op with a base product, and which of its arguments it takes by shape only (meta tensors).
_AHEAD_RUNS = {_lora_linear: (_lora_linear_ahead, (1, 2)), _lora_group_linear: (_lora_group_linear_ahead, (1, 2))}
_ahead_seen: set = set()
_ahead_jobs: list = []
_ahead_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _describe(value, meta: bool = False):
    """A hashable description of an op argument: a tensor's ``(shape, stride, dtype, device)`` (``meta``: its shape and
    dtype only), lists item by item, anything else as is. ``TypeError`` for a symbolic size (a dynamic-shape trace:
    nothing is compiled ahead)."""
    if isinstance(value, torch.Tensor):
        shape, stride = tuple(value.shape), tuple(value.stride())
        if not all(type(d) is int for d in shape + stride):
            raise TypeError
        return ("meta", shape, value.dtype) if meta else ("tensor", shape, stride, value.dtype, value.device)
    if isinstance(value, (list, tuple)):
        return ("list", tuple(_describe(v, meta) for v in value))
    return ("value", value)


def _scratch(description):
    """An argument like the described one: integer tensors of zeros (a plan of empty segments; token 0), floating
    ones uninitialised."""
    kind, *rest = description
    if kind == "list":
        return [_scratch(d) for d in rest[0]]
    if kind == "value":
        return rest[0]
    if kind == "meta":
        return torch.empty(rest[0], dtype=rest[1], device="meta")
    shape, stride, dtype, device = rest
    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    return t.zero_() if not dtype.is_floating_point else t


def _run_ahead(impl, descriptions, names, elsewhere: bool = False) -> None:
    """On a worker thread: ``impl`` once over scratch arguments (positional, then ``names``' keyword ones).
    ``elsewhere``: its launches only recorded, and the variants compiled in the worker process
    (:mod:`peft_csgmv.kernels.ahead`), this thread waiting for it without the interpreter lock."""
    try:
        args = [_scratch(d) for d in descriptions]
        kwargs = dict(zip(names, args[len(args) - len(names) :]))
        with torch.no_grad(), recording() if elsewhere else contextlib.nullcontext() as records:
            impl(*args[: len(args) - len(names)], **kwargs)
        if records:
            compile_elsewhere(records)
    except Exception:  # compiling ahead only saves time: the op's first real call compiles whatever did not here
        pass


def _compile_ahead(impl, args, kwargs) -> None:
    """From an op's fake implementation: run ``impl`` (or its stand-in, :data:`_AHEAD_RUNS`) once over scratch
    arguments like ``args`` on a worker thread, the first time this description is seen (see above)."""
    global _ahead_pool
    x = args[0] if args else next(iter(kwargs.values()))
    threads = env("PEFT_CSGMV_COMPILE_AHEAD")
    if x.device.type not in AHEAD_DEVICES or threads == "0":
        return
    run, by_shape = _AHEAD_RUNS.get(impl, (impl, ()))
    try:
        names = tuple(kwargs)
        descriptions = tuple(_describe(a, i in by_shape) for i, a in enumerate((*args, *kwargs.values())))
    except TypeError:
        return
    key = (impl, descriptions, names)
    if key in _ahead_seen:
        return
    _ahead_seen.add(key)
    if _ahead_pool is None:
        # One thread by default: ops of different shapes often launch the same kernel variant (Triton keys a variant by
        # its arguments' types, alignments and constants, not their sizes), which jobs running side by side would each
        # compile (1B, H200: 16 compiles of 9 variants on 8 threads, 6 of 6 on one, done well inside the tracing).
        # Triton's CPU interpreter keeps its state in globals: one thread there whatever is asked.
        workers = int(threads) if threads.isdigit() and not interpreting() else 1
        _ahead_pool = concurrent.futures.ThreadPoolExecutor(workers, "peft_csgmv_ahead")
    elsewhere = not threads.isdigit() and not interpreting()  # (a worker process by default; =N: N threads here)
    _ahead_jobs.append(_ahead_pool.submit(_run_ahead, run, descriptions, names, elsewhere))


def _forget_ahead() -> None:
    """In a forked child: the parent's worker threads do not exist there (a job left to them would never end)."""
    global _ahead_pool
    _ahead_pool = None
    _ahead_jobs.clear()
    _ahead_seen.clear()


os.register_at_fork(after_in_child=_forget_ahead)


def wait_ahead() -> None:
    """Wait for the kernels being compiled ahead (an op's real call does, before it launches anything)."""
    while True:
        try:
            job = _ahead_jobs.pop()
        except IndexError:  # (none left, or another thread took the last)
            return
        job.result()


def _with_ahead(impl, fake):
    """The op's implementation (which first waits for the kernels compiled ahead) and its fake (which hands them
    out)."""

    def traced(*args, **kwargs):
        _compile_ahead(impl, args, kwargs)
        return fake(*args, **kwargs)

    def run(*args, **kwargs):
        if _ahead_jobs:
            wait_ahead()
        return impl(*args, **kwargs)

    return run, traced


# Ops that launch no Triton kernel: nothing to compile ahead (a scratch run would allocate an experts' weight).
_NOT_AHEAD = frozenset(("moe_linear",))


def _register() -> None:
    for name, (schema, impl, fake) in _SCHEMAS.items():
        run, traced = (impl, fake) if name in _NOT_AHEAD else _with_ahead(impl, fake)
        _LIB.define(name + schema)
        _LIB.impl(name, run, "CompositeExplicitAutograd")
        torch.library.register_fake(f"peft_csgmv::{name}", traced, lib=_LIB)


_register()

# The ops' overloads, which compiled layers call (dynamo takes an overload as one graph call) and which run eagerly as
# any torch op does.
lora = lora_overload = torch.ops.peft_csgmv.lora.default
lora_linear = lora_linear_overload = torch.ops.peft_csgmv.lora_linear.default
lora_group = torch.ops.peft_csgmv.lora_group.default
lora_group_linear = torch.ops.peft_csgmv.lora_group_linear.default
moe_linear = torch.ops.peft_csgmv.moe_linear.default
moe_lora = torch.ops.peft_csgmv.moe_lora.default
