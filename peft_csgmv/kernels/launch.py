"""A lean launch path for the Triton kernels.

``kernel[grid](...)`` re-derives the argument specialization, hashes a cache key and builds launch metadata on every
call: tens of microseconds of host time, paid twice per LoRA layer per forward. In eager decode that host time *is*
the cost of LoRA. :class:`Launcher` keeps the compiled kernel that Triton's own launch returned, keyed by everything
Triton specializes on (argument dtypes, 16-byte alignment of each pointer, each scalar argument as Triton classes
it, the constexprs) and calls it directly on later launches with the same key.

The first launch for a key always goes through Triton (which compiles and launches). The direct path is used only
where it is known to behave identically: compiled (not interpreted) kernels, no launch hooks installed, and a Triton
whose compiled-kernel ``run`` accepts the full argument list (checked on first use; otherwise the launcher falls back
to ``kernel[grid]`` for good). ``PEFT_CSGMV_TRITON_LAUNCH=1`` forces Triton's own path (for comparison).
"""

from __future__ import annotations

import contextlib
import contextvars

from ..options import env, interpreting

try:
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
except ImportError:  # older Triton: no direct path
    _knobs = None
    _driver = None


# Recording (:func:`recording`): a launch that would compile a kernel variant only notes what it would have launched
# (:meth:`Launcher._record`) and returns; nothing compiles or runs. The compile-ahead jobs of compiled code run an op
# this way and hand the records to a worker process (:mod:`peft_csgmv.kernels.ahead`), which compiles them into
# Triton's on-disk cache, where this process's first real launch of each variant finds it.
_RECORD: contextvars.ContextVar = contextvars.ContextVar("peft_csgmv_record_launches", default=None)


class Pointer:
    """A tensor argument as Triton's specialization sees it: its dtype and address (a worker process that compiles
    the variant passes it in the tensor's place; Triton reads the alignment from the address)."""

    __slots__ = ("dtype", "address")

    def __init__(self, dtype, address: int) -> None:
        self.dtype, self.address = dtype, address

    def data_ptr(self) -> int:
        return self.address


@contextlib.contextmanager
def recording():
    """Within: launches of variants not compiled yet in this process are recorded into the list this yields instead of
    compiling and running (see above); launches of compiled variants are skipped."""
    records: list = []
    token = _RECORD.set(records)
    try:
        yield records
    finally:
        _RECORD.reset(token)


def _hooks_installed() -> bool:
    """Whether a launch hook (a profiler, proton) is installed; then every launch takes Triton's own path. Recent
    Triton keeps the hooks as (usually empty) ``HookChain`` objects, older ones as ``None`` or a callable."""
    for hook in (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _triton_has_pdl() -> bool:
    """Whether this Triton launches with PDL (``launch_pdl``) and compiles ``gdc_wait`` / ``gdc_launch_dependents``
    (Triton 3.4 has both names, but its ``gdc`` functions take the builder argument its compiler no longer passes)."""
    try:
        import inspect

        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    fns = (gdc.gdc_wait, gdc.gdc_launch_dependents)
    return all("_semantic" in inspect.signature(getattr(f, "__wrapped__", f)).parameters for f in fns)


_PDL: dict = {}


def pdl(device) -> bool:
    """Whether the kernels on ``device`` launch with programmatic dependent launch (Hopper and later): a kernel may
    start while the one before it in the stream finishes, reads only what that kernel does not write (its plan, its
    weights) and waits for it (``gdc_wait``) before touching activations or writing anything. The shrink lets the
    expand start at once, so the expand's launch and its ``B`` loads overlap the shrink, in eager streams and in
    captured CUDA graphs alike. ``PEFT_CSGMV_PDL=0`` turns it off (for comparison); the choice is made once per
    device (:func:`reset_pdl` forgets it)."""
    on = _PDL.get(device)
    if on is None:
        on = _PDL[device] = (
            getattr(device, "type", None) == "cuda"
            and not interpreting()
            and env("PEFT_CSGMV_PDL", "1") != "0"
            and _triton_has_pdl()
            and _capability(device) >= 9
        )
    return on


def reset_pdl() -> None:
    """Forget :func:`pdl`'s choices (after ``PEFT_CSGMV_PDL`` changed: benchmarks comparing both)."""
    _PDL.clear()


def _capability(device) -> int:
    import torch

    return torch.cuda.get_device_capability(device)[0]


# Set while launches go on a side stream that forks from and joins another inside a CUDA graph (ops.lora_linear): there
# PDL's early start across the graph's fork and join edges left the H200 idle longer than it hides (bench_beside.py).
_NO_PDL: contextvars.ContextVar[bool] = contextvars.ContextVar("peft_csgmv_no_pdl", default=False)


@contextlib.contextmanager
def without_pdl():
    """Launches inside this block wait for their predecessors in full (no PDL), whatever :func:`pdl` says."""
    token = _NO_PDL.set(True)
    try:
        yield
    finally:
        _NO_PDL.reset(token)


def with_pdl(device, options: tuple) -> tuple[bool, tuple]:
    """``(USE_GDC, launch options)`` of a kernel launch on ``device``: the launch options with Triton's
    ``launch_pdl`` added where :func:`pdl` holds (and no :func:`without_pdl` block is open), and whether the kernel is
    compiled to wait for its predecessor."""
    if pdl(device) and not _NO_PDL.get():
        return True, (*options, ("launch_pdl", True))
    return False, options


def _scalar_key(v):
    """A runtime scalar argument as Triton's specialization sees it, so that one compiled kernel serves every value
    Triton would compile the same: an int by whether it is 1 (a constant to Triton), whether it is divisible by 16
    and the integer type it needs (i32, i64, u64); a float or a bool by its type alone (never specialized). A token
    count, or a stride that grows with it, then reuses the compiled kernel from step to step under continuous
    batching, where the exact value in the key sent every new count through Triton's own launch path. Anything else
    keys by its value."""
    kind = type(v)
    if kind is int:
        if v == 1:
            return 1
        return v % 16 == 0, "i32" if -(2**31) <= v < 2**31 else "u64" if 2**63 <= v < 2**64 else "i64"
    if kind is float or kind is bool:
        return kind
    return kind, v


class Launcher:
    """Launch one ``@triton.jit`` kernel; see the module docstring."""

    def __init__(self, kernel, num_tensors: int) -> None:
        """``num_tensors``: how many leading runtime arguments are tensors (the rest are ints)."""
        self.kernel = kernel
        self.num_tensors = num_tensors
        self.compiled: dict = {}
        self.direct = _knobs is not None and not interpreting() and env("PEFT_CSGMV_TRITON_LAUNCH", "0") != "1"

    def _key(self, args: tuple, constexprs: dict) -> tuple:
        n = self.num_tensors
        tensors = tuple([(a.dtype, a.data_ptr() & 15 == 0) for a in args[:n]])
        return args[0].get_device(), tensors, tuple([_scalar_key(v) for v in args[n:]]), tuple(constexprs.values())

    def _record(self, grid, args: tuple, constexprs: dict, options: tuple) -> tuple:
        """What this launch would compile: ``(module, kernel name, device index, grid, args, constexprs, options)``,
        each tensor argument as a :class:`Pointer`."""
        n, fn = self.num_tensors, self.kernel.fn
        pointers = tuple([Pointer(a.dtype, a.data_ptr()) for a in args[:n]])
        return (fn.__module__, fn.__name__, args[0].get_device(), tuple(grid), pointers + tuple(args[n:]),
                dict(constexprs), tuple(options))  # fmt: skip

    def compiled_for(self, args: tuple, constexprs: dict, options: tuple = ()):
        """The compiled kernel a direct launch with these arguments would use, or ``None`` (not launched yet, or the
        direct path is off)."""
        if not self.direct or _hooks_installed():
            return None
        return self.compiled.get(self._key(args, constexprs) + options)

    def __call__(self, grid: tuple[int, int, int], args: tuple, constexprs: dict, options: tuple = ()) -> None:
        """``args``: the kernel's runtime arguments in signature order; ``constexprs``: its constexpr arguments, which
        follow them in the signature; ``options``: Triton launch options as ``(name, value)`` pairs (``num_warps``,
        ``num_stages``), part of the compiled kernel's key but not of its arguments."""
        direct = self.direct and not _hooks_installed()
        key = compiled = None
        if direct:
            key = self._key(args, constexprs) + options
            compiled = self.compiled.get(key)
        if compiled is None:  # Triton's own path (its first launch of this key compiles it), or recorded
            records = _RECORD.get()
            if records is not None:
                records.append(self._record(grid, args, constexprs, options))
                return
            launched = self.kernel[grid](*args, **constexprs, **dict(options))
            if direct:
                self.compiled[key] = launched
            return
        stream = _driver.active.get_current_stream(key[0])
        try:
            compiled.run(
                grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                *args, *constexprs.values(),
            )  # fmt: skip
        except TypeError:
            # This Triton's launcher takes a different argument list: use its own path from now on.
            self.direct = False
            self.kernel[grid](*args, **constexprs, **dict(options))
