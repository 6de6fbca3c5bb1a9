"""Kernel variants compiled in a worker process, for compiled code's compile-ahead (:mod:`peft_csgmv.ops`).

A Triton compile holds the interpreter lock for most of its ~0.3 s (Python code generation, MLIR passes called
without releasing it). On a thread beside dynamo's tracing it and the tracing took turns: on a 1B layout's decode step
(H200 host, empty caches) the 9 variants took 7 s there and the tracing ~2.2× the base model's, against 2.3 s for the
9 one after another on the main thread. A process has its own lock: the worker here compiles each launch recorded by
:func:`~peft_csgmv.kernels.launch.recording` with Triton's ``warmup`` (compile, no launch: the pointers are their
dtypes and addresses, which is all Triton specializes them on) and builds its launcher, both into Triton's on-disk
cache, where this process's first real launch of that variant finds them (milliseconds). It starts at the first job;
it imports torch, Triton and this package's kernel modules only (not the package itself: no transformers, no PEFT) and
leaves after :data:`IDLE_S` seconds without a job or when this process goes. Best effort: a variant it did not compile
(an error, a different key) is compiled by its first launch here, as without it.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
import time

IDLE_S = 120.0
JOB_TIMEOUT_S = 120.0  # a job not answered by then: the worker is stopped, the caller's launches compile the variants
_HEADER = struct.Struct("<Q")

# The worker's start: this package's directory as a package whose ``__init__`` does not run, then :func:`serve`.
_BOOT = (
    "import sys, types; pkg = types.ModuleType('peft_csgmv'); pkg.__path__ = [sys.argv[1]]; "
    "sys.modules['peft_csgmv'] = pkg; from peft_csgmv.kernels.ahead import serve; serve()"
)


class Worker:
    """This process's end of a worker: :meth:`compile` sends it a list of launch records and waits for its answer."""

    def __init__(self) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _BOOT, root], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, close_fds=True,
        )  # fmt: skip
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def compile(self, records: list) -> list[str]:
        """Compile ``records`` in the worker, into this process's Triton cache folder as it is now; its errors, one
        line each (raises where the worker is gone)."""
        data = pickle.dumps((_cache_dir(), records))
        with self.lock:
            try:
                self.proc.stdin.write(_HEADER.pack(len(data)) + data)
                self.proc.stdin.flush()
                deadline = time.monotonic() + JOB_TIMEOUT_S
                size = _HEADER.unpack(_read(self.proc.stdout.fileno(), _HEADER.size, deadline))[0]
                return pickle.loads(_read(self.proc.stdout.fileno(), size, deadline))
            except BaseException:
                self.proc.kill()  # (a worker that failed a job, or hangs, is not asked again: the next job starts one)
                raise


_worker: Worker | None = None
_worker_lock = threading.Lock()
_failures = 0  # workers that died or did not answer, this process
MAX_FAILURES = 2  # then no more are started: every variant compiles at its first launch (a broken setup costs little)


def compile_elsewhere(records: list) -> list[str]:
    """Compile the recorded launches in the worker process (started, or started again, here); its errors. Raises
    where the worker fails, and at once after :data:`MAX_FAILURES` failed workers."""
    global _worker, _failures
    with _worker_lock:
        if _failures >= MAX_FAILURES:
            raise RuntimeError("the kernel compile worker failed before: compiling at first launch")
    try:
        with _worker_lock:
            if _worker is None or not _worker.alive():
                _worker = Worker()
            worker = _worker
        return worker.compile(records)
    except BaseException:  # (a worker that could not start, died or did not answer)
        with _worker_lock:
            _failures += 1
        raise


def _forget() -> None:
    """In a forked child: the parent's worker is the parent's."""
    global _worker, _failures
    _worker, _failures = None, 0


os.register_at_fork(after_in_child=_forget)


def _cache_dir() -> str | None:
    """Where Triton caches compiled kernels in this process (its knob, or ``TRITON_CACHE_DIR``, or its default)."""
    try:
        from triton import knobs

        return knobs.cache.dir
    except Exception:  # (an older Triton: the worker's inherited environment decides)
        return None


def _read(fd: int, size: int, deadline: float | None = None) -> bytes:
    chunks, left = [], size
    while left:
        if deadline is not None and not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
            raise TimeoutError("the kernel compile worker did not answer in time")
        chunk = os.read(fd, left)
        if not chunk:
            raise EOFError("the kernel compile worker closed its pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def compile_record(record) -> None:
    """One recorded launch compiled (``warmup``) and its launcher built, into Triton's caches."""
    import importlib

    import torch
    import triton

    module, name, device, grid, args, constexprs, options = record
    kernel = getattr(importlib.import_module(module), name)
    if device != torch.cuda.current_device():
        torch.cuda.set_device(device)
    compiled = kernel.warmup(*args, grid=grid, **constexprs, **dict(options))
    launcher = getattr(triton.runtime.driver.active, "launcher_cls", None)
    if launcher is not None and compiled is not None:
        launcher(compiled.src, compiled.metadata)  # (the launcher's C module, built once per signature, cached)


def serve() -> None:
    """The worker's loop: jobs from stdin (a length, then the pickled caller's Triton cache folder and list of
    records), an answer each on the original stdout (its errors); anything printed goes to stderr. Returns at end of
    input or after :data:`IDLE_S` idle."""
    out = os.dup(1)
    os.dup2(2, 1)
    while True:
        ready, _, _ = select.select([0], [], [], IDLE_S)
        if not ready:
            return
        try:
            size = _HEADER.unpack(_read(0, _HEADER.size))[0]
            cache_dir, records = pickle.loads(_read(0, size))
        except EOFError:
            return
        if cache_dir is not None:  # (the caller's folder: its first launches look there)
            os.environ["TRITON_CACHE_DIR"] = cache_dir
        errors = []
        for record in records:
            try:
                compile_record(record)
            except Exception as e:  # (reported; this variant then compiles at its first launch in the caller)
                errors.append(f"{record[1]}: {type(e).__name__}: {e}")
        data = pickle.dumps(errors)
        reply = memoryview(_HEADER.pack(len(data)) + data)
        while reply:
            reply = reply[os.write(out, reply) :]
