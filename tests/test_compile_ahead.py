"""Compiling the kernels ahead: an eager call's first plan hands its kernel variants to worker threads; while the
decode step is traced each op variant goes once to a worker (a thread, or by default the compile worker process) before
the graph's first real op call; on CUDA (``gpu``) the static path's decode kernels then compile off the main thread.
The suite turns compiling ahead off (conftest.py): these tests turn it on. The tokens are eager csgmv's."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    ID_LISTS,
    close,
    make,
    make_batch,
    per_adapter,
    static_and_eager,
    stitch,
)

from peft_csgmv import enable_csgmv

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def test_eager_first_call_compiles_its_kernel_variants_ahead(monkeypatch):
    """An eager call's driver hands the kernel variants each new plan launches to worker threads before any of its
    layers launches (one shrink per input width, one expand per split count and output
    kind): each job runs its kernel, without error and off the main thread, over a plan of the real one's shape
    (tokens, segment count) whose segments are all empty; each description goes once per process (a second call of
    the same shape hands none out); the logits are stock PEFT's."""
    from peft_csgmv import eager_ahead, ops

    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(eager_ahead, "_EAGER_SEEN", set())
    monkeypatch.setattr(eager_ahead, "_eager_pool", None)
    jobs, errors = [], []
    job = eager_ahead._eager_job

    def recorded(kind, stack, a, b, splits, plan, dtype, device):
        empty = int(plan.seg_indptr.count_nonzero()) == 0 and plan.num_segments > 0
        jobs.append((kind, stack.in_features, plan.num_segments, empty, threading.current_thread()))
        try:
            job(kind, stack, a, b, splits, plan, dtype, device)
        except Exception as e:  # (the library's runner swallows errors: the test records them)
            errors.append(e)
            raise

    monkeypatch.setattr(eager_ahead, "_eager_job", recorded)
    model = make(embedding=True)
    input_ids, mask = make_batch(3, 5)
    names, ids = ["a0", BASE, "a1"], ["a0", None, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="triton")
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=ids).logits
    close(got, stitch(outs, names), "eager, its kernels compiled ahead")
    assert not errors, errors
    widths = {
        m._csgmv_record.stack.in_features
        for m in model.modules()
        if getattr(m.__dict__.get("_csgmv_record"), "stack", None) is not None and not m._csgmv_record.stack.embedding
    }
    shrinks = [j for j in jobs if j[0] == "shrink"]
    assert sorted(j[1] for j in shrinks) == sorted(widths), jobs
    assert any(j[0] == "expand" for j in jobs), jobs
    assert all(j[3] for j in jobs), "a job ran over a plan with tokens in its segments"
    assert all(j[4] is not threading.main_thread() for j in jobs), "a job ran on the main thread"
    assert len({j[2] for j in jobs}) == 1, "one plan, one segment count"
    handed = len(jobs)
    with torch.no_grad():
        again = model(input_ids, attention_mask=mask, adapter_ids=ids).logits
    assert len(jobs) == handed, "the same shape handed its variants out again"
    assert torch.equal(again, got)


@pytest.mark.parametrize("layout", ["default", "beside"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_compiled_ahead_while_tracing(backend, layout, monkeypatch):
    """While the decode step is traced, each op variant the trace meets (its arguments' description) goes once to a
    worker thread, which runs the op over scratch arguments of that description without error (the Triton variants
    then compiled before the graph runs; switched on for the test's device, the CPU included); the ops with a base
    product (``beside``: every layer and group beside its base products) run their LoRA launches alone there, the base
    weights taken by shape; the graph's first real op call waits for the workers; the tokens are eager's."""
    from peft_csgmv import ops

    if layout == "beside":
        monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
        monkeypatch.setenv("PEFT_CSGMV_GROUPS", "beside")
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    events, errors = [], []
    run_ahead, stack_at = ops._run_ahead, ops._stack_at

    def slow_run_ahead(impl, descriptions, names, elsewhere=False):
        def checked(*args, **kwargs):
            try:
                return impl(*args, **kwargs)
            except Exception as e:  # (the library's runner swallows errors: the test records them)
                errors.append(e)
                raise

        time.sleep(1.0)  # (a job still running when the graph first runs, unless its op call waits)
        run_ahead(checked, descriptions, names, elsewhere)
        events.append(("ahead", impl.__name__))

    def main_stack_at(handle, version):
        if threading.current_thread() is threading.main_thread():
            events.append(("real",))
        return stack_at(handle, version)

    monkeypatch.setattr(ops, "_run_ahead", slow_run_ahead)
    monkeypatch.setattr(ops, "_stack_at", main_stack_at)
    model = make(embedding=True)
    enable_csgmv(model, backend=backend)
    input_ids, mask = make_batch(3, 5)
    static, eager = static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    assert not errors, errors
    ahead = [i for i, e in enumerate(events) if e[0] == "ahead"]
    real = [i for i, e in enumerate(events) if e[0] == "real"]
    assert len(ahead) == len(ops._ahead_seen) >= 2, events
    assert real and min(real) > max(ahead), f"an op ran before the kernels compiled ahead were done: {events}"
    ran = {events[i][1] for i in ahead}
    if layout == "beside":
        assert {"_lora_linear_ahead", "_lora_group_linear_ahead"} <= ran, ran
    assert not ops._ahead_jobs
    ops._ahead_pool.shutdown()
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "0")
    torch._dynamo.reset()
    ops._ahead_seen.clear()
    static_and_eager(model, input_ids, mask, ID_LISTS[1])
    assert not ops._ahead_seen, "PEFT_CSGMV_COMPILE_AHEAD=0 still compiled ahead"


def test_compiled_ahead_in_the_worker_process_by_default(monkeypatch):
    """With ``PEFT_CSGMV_COMPILE_AHEAD`` unset (the default), each compile-ahead job runs its op with the launches
    recorded, not run, and hands the records to the compile worker (``kernels.ahead.compile_elsewhere``, here a
    stand-in) from its thread, before the graph's first real op call; each record names a kernel the worker can import
    and carries the op's pointers as dtypes and addresses; the tokens are eager's."""
    import importlib
    import pkgutil

    import peft_csgmv.kernels as kernel_package
    from peft_csgmv import ops
    from peft_csgmv.kernels.launch import Launcher, Pointer

    for info in pkgutil.iter_modules(kernel_package.__path__):  # (variants earlier tests compiled are not recorded)
        for value in vars(importlib.import_module(f"{kernel_package.__name__}.{info.name}")).values():
            if isinstance(value, Launcher):
                monkeypatch.setattr(value, "compiled", {})
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(ops, "interpreting", lambda: False)  # (on the CPU the kernels run in Triton's interpreter)
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    events = []

    def handed(records):
        events.append(("handed", threading.current_thread() is threading.main_thread(), list(records)))
        return []

    def main_stack_at(handle, version):
        if threading.current_thread() is threading.main_thread():
            events.append(("real",))
        return stack_at(handle, version)

    stack_at = ops._stack_at
    monkeypatch.setattr(ops, "compile_elsewhere", handed)
    monkeypatch.setattr(ops, "_stack_at", main_stack_at)
    model = make(embedding=True)
    enable_csgmv(model, backend="triton")
    input_ids, mask = make_batch(3, 5)
    static, eager = static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    handed_at = [i for i, e in enumerate(events) if e[0] == "handed"]
    real = [i for i, e in enumerate(events) if e[0] == "real"]
    assert handed_at and real and min(real) > max(handed_at), [e[:2] for e in events]
    assert not any(events[i][1] for i in handed_at), "records handed to the worker from the main thread"
    records = [r for i in handed_at for r in events[i][2]]
    names = set()
    for module, name, _, grid, args, _, _ in records:
        assert hasattr(importlib.import_module(module), name), (module, name)
        assert isinstance(args[0], Pointer) and isinstance(args[0].dtype, torch.dtype) and len(grid) == 3
        names.add(name)
    assert {"_shrink_kernel", "_expand_kernel"} <= names or {"_shrink_group_kernel", "_expand_group_kernel"} <= names


_WORKER_SCRIPT = """
import json, os, sys, threading
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
import torch, triton.compiler.compiler as cc
from helpers import ID_LISTS, make, make_batch, static_and_eager
from peft_csgmv import enable_csgmv, ops

made, handed, errors = [], [], []
make_ir, compile_elsewhere = cc.ASTSource.make_ir, ops.compile_elsewhere

def counted(self, *args, **kwargs):  # (after the first hand-off: the eager prefill's own compiles come before)
    made.append((self.fn.__name__, threading.current_thread() is threading.main_thread(), bool(handed)))
    return make_ir(self, *args, **kwargs)

def noted(records):
    handed.extend(r[1] for r in records)
    errors.extend(compile_elsewhere(records))
    return []

cc.ASTSource.make_ir, ops.compile_elsewhere = counted, noted
model = make(embedding=True).to("cuda")
enable_csgmv(model)
input_ids, mask = (t.to("cuda") for t in make_batch(3, 5))
static, eager = static_and_eager(model, input_ids, mask, ID_LISTS[0])
print(json.dumps(dict(same=torch.equal(static, eager), made=made, handed=handed, errors=errors)))
"""


@pytest.mark.gpu
def test_static_decode_kernels_compile_in_the_worker_process_on_cuda(tmp_path):
    """On CUDA by default, in a process of its own with an empty Triton cache: the static path's decode kernels
    compile in the compile worker (each record it is handed compiles there without error), and the main process
    generates Triton code for none of them itself (``ASTSource.make_ir``, which runs only where a compile misses the
    on-disk cache, does not run on its main thread for a kernel handed to the worker, once the hand-offs began: the
    eager prefill's own compiles come before); the tokens are eager csgmv's (fp32)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_WORKER_SCRIPT)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PEFT_CSGMV_COMPILE_AHEAD="")
    run = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["same"], "the compiled decode generated other tokens"
    assert got["handed"], "no kernel handed to the compile worker"
    assert not got["errors"], got["errors"]
    again = [name for name, main, after in got["made"] if main and after and name in got["handed"]]
    assert not again, f"handed to the worker, then compiled in the main process: {again} ({got})"


@pytest.mark.gpu
def test_static_decode_kernels_compile_ahead_on_cuda(monkeypatch):
    """On CUDA, where compiling ahead is on by default: the static path's decode kernels compile on the ops' worker
    thread while the step is traced, and the main thread compiles none of those again (Triton's in-process caches of
    the library's kernels and their launchers' emptied first); the tokens are eager csgmv's (fp32)."""
    import importlib
    import pkgutil

    import triton.runtime.jit as jit

    import peft_csgmv.kernels as kernel_package
    from peft_csgmv import ops
    from peft_csgmv.kernels.launch import Launcher

    for info in pkgutil.iter_modules(kernel_package.__path__):
        module = importlib.import_module(f"{kernel_package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, jit.JITFunction):
                value.device_caches.clear()
            elif isinstance(value, Launcher):  # (its compiled kernels by exact arguments, from earlier tests)
                value.compiled.clear()
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    compiled = []
    do_compile = jit.JITFunction._do_compile

    def recorded(self, key, *args, **kwargs):
        compiled.append((self.fn.__name__, str(key), threading.current_thread() is threading.main_thread()))
        return do_compile(self, key, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", recorded)
    model = make(embedding=True).to("cuda")
    enable_csgmv(model)
    input_ids, mask = (t.to("cuda") for t in make_batch(3, 5))
    static, eager = static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    ahead = {(name, key) for name, key, main in compiled if not main}
    again = [(name, key) for name, key, main in compiled if main and (name, key) in ahead]
    assert ahead, f"no kernel compiled ahead: {compiled}"
    assert not again, f"compiled ahead, then again on the main thread: {again}"
