"""Eager calls' kernel variants compiled ahead, side by side on worker threads (compiled code's are compiled in a
worker process: :mod:`peft_csgmv.kernels.ahead`)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import dataclasses
import os
from typing import TYPE_CHECKING

import torch

from . import kernels, ops
from . import slots as _slots
from .options import env, interpreting
from .plan import BatchPlan, aligned_parts

if TYPE_CHECKING:
    from .slots import LoraStack


# Eager calls compile each Triton kernel variant at its first launch, layer after layer on the main thread (~0.3-0.6 s
# each on an H200's host with empty caches; a 1B layout's first prefill needs 3). The driver hands a new plan's
# variants to worker threads at once instead (:func:`peft_csgmv.call.prepare_plans`), which compile them side by
# side (Triton's compiles partly leave the interpreter lock) while the main thread waits: each job runs a kernel once
# over a plan of the same shape whose segments are all empty (every program exits at once) and scratch tensors like
# the layers' own. CUDA only (ops.AHEAD_DEVICES); ``PEFT_CSGMV_COMPILE_AHEAD=0`` turns it off; never while a CUDA
# graph is being captured.
_EAGER_SEEN: set = set()
_eager_pool: "concurrent.futures.ThreadPoolExecutor | None" = None
EAGER_AHEAD_THREADS = 4


def kernel_stacks(ex, layers, device: torch.device) -> list:
    """One activation stack of ``layers`` (a model's kernel layers, run by executor ``ex``) on ``device`` per kind of
    launch (dtype, launch shape, widths, extras), found again whenever the routes' epoch moved (any stack changed)."""
    held = ex.ahead_stacks.get(device)
    if held is None or held[0] != _slots.ROUTE_EPOCH:
        kinds = {}
        for layer in layers:
            stack = layer._csgmv_record.stack
            if stack is not None and not stack.embedding and stack.device == device:
                kind = (stack.dtype, stack.launch_shape, stack.in_features, stack.out_features, stack.mag is None,
                        stack.lora_bias is None)  # fmt: skip
                kinds.setdefault(kind, stack)
        held = ex.ahead_stacks[device] = (_slots.ROUTE_EPOCH, list(kinds.values()))
    return held[1]


def compile_ahead_eager(stacks: list, plan: BatchPlan, dtype: torch.dtype, device: torch.device) -> None:
    """Compile the kernel variants plan ``plan`` launches with activations of ``dtype`` over ``stacks`` (one
    activation stack per kind of launch on ``device``), side by side on worker threads, and wait for them (see
    above). Jobs are told apart by what picks a variant (the plan's row tile and segment count; the input width and
    launch shape for the shrink; the split count, launch shape and extras for the expand), each description once per
    process."""
    global _eager_pool
    if (
        device.type not in ops.AHEAD_DEVICES
        or env("PEFT_CSGMV_COMPILE_AHEAD") == "0"
        or device.type == "cuda"
        and torch.cuda.is_current_stream_capturing()
    ):
        return
    shape = (plan.chunk_size, plan.num_segments, plan.num_tokens % 16, dtype, device)
    jobs, empty = [], None
    for stack in stacks:
        a, b = stack.a, stack.b  # (the stack's launch views, brought up to date here, on the main thread)
        splits = kernels.shrink_splits(plan, stack.in_features)
        extras = (stack.mag is not None, stack.lora_bias is not None, stack.out_features % 16)
        for key in (
            ("shrink", shape, stack.dtype, stack.launch_shape, stack.in_features),
            ("expand", shape, stack.dtype, stack.launch_shape, splits, extras),
        ):
            if key not in _EAGER_SEEN:
                _EAGER_SEEN.add(key)
                empty = empty or _empty_plan(plan)
                jobs.append((key[0], stack, a, b, splits))
    if not jobs:
        return
    if _eager_pool is None:
        # (Triton's CPU interpreter keeps its state in globals: one thread there)
        workers = 1 if interpreting() else EAGER_AHEAD_THREADS
        _eager_pool = concurrent.futures.ThreadPoolExecutor(workers, "peft_csgmv_eager_ahead")
    futures = [
        _eager_pool.submit(
            contextvars.copy_context().run, _run_eager_job, kind, stack, a, b, splits, empty, dtype, device
        )
        for kind, stack, a, b, splits in jobs
    ]
    for future in futures:
        future.result()


def _forget_eager_pool() -> None:
    """In a forked child: the parent's worker threads do not exist there."""
    global _eager_pool
    _eager_pool = None


os.register_at_fork(after_in_child=_forget_eager_pool)


def _run_eager_job(*args) -> None:
    """On a worker thread: :func:`_eager_job`, whose failure only means the layer's own launch compiles the variant."""
    try:
        _eager_job(*args)
    except Exception:
        pass


def _eager_job(
    kind: str, stack: "LoraStack", a, b, splits: int, plan: BatchPlan, dtype: torch.dtype, device: torch.device
) -> None:
    """One kernel (``kind``: ``"shrink"`` or ``"expand"``) of ``stack`` launched once over ``plan`` (every segment
    empty) and scratch tensors laid out as the layer's own (rows of activations of ``dtype``; the shrink's fp32
    output in ``splits`` planes)."""
    num_tokens = plan.num_tokens
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext(), torch.no_grad():
        if kind == "shrink":
            xs = torch.empty((1, stack.in_features), dtype=dtype, device=device).expand(num_tokens, -1)
            kernels.shrink(xs, a, stack.ranks, plan)
            return
        r = stack.r_max
        t = torch.empty((num_tokens, r) if splits == 1 else (splits, num_tokens, r), dtype=torch.float32, device=device)
        y = torch.empty((1, stack.out_features), dtype=dtype, device=device).expand(num_tokens, -1)
        kernels.expand(t, b, stack.ranks, stack.scalings, plan, y, stack.mag, stack.bias, stack.lora_bias)


def _empty_plan(plan: BatchPlan) -> BatchPlan:
    """A plan of ``plan``'s shape (tokens, row tile, segment count, index layout) whose segments are all empty."""
    indptr_at, slot_at, length = aligned_parts(plan.num_tokens, plan.num_segments)
    buf = torch.zeros(length, dtype=torch.int32, device=plan.permutation.device)
    return dataclasses.replace(
        plan,
        permutation=buf[: plan.num_tokens],
        seg_indptr=buf[indptr_at : indptr_at + plan.num_segments + 1],
        seg_slot=buf[slot_at:],
        runs=(),
    )
