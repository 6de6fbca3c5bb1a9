"""Version floors, checked when ``peft_csgmv`` is imported, and the few spellings that differ between the transformers
versions it supports. Imported first, it also keeps a Ctrl-C during the ``peft-csgmv`` command's imports to one line.

The floors are the oldest releases the whole test suite passes on (``.ci/run`` runs it on them pinned exactly, after
the run on the newest releases); ``pyproject.toml`` declares the same numbers. Below them things break, mostly in ways
that do not name the cause: peft < 0.18 lacks ``has_active_enabled_adapter`` (every mixed call fails), peft < 0.19
lacks ``add_adapter(..., autocast_adapter_dtype=)`` (the benchmark) and does not import with transformers 5, and on
peft 0.19 the suite's drop-in tests cannot run (no GLoRA, one ``target_parameters`` adapter per model); triton < 3.4
computes some kernels wrongly under its interpreter and fails to compile others for sm_90.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import inspect
import os
import signal
import sys
import threading
from importlib import metadata

from packaging.version import Version

# Keep in step with pyproject.toml's dependencies (tests/test_compat.py checks that they agree).
FLOORS = {
    "peft": "0.20.0",
    "transformers": "4.56.0",
    "triton": "3.4.0",
    "accelerate": "1.0.0",
}


def _release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string, trailing zeros dropped: ``"5.25.0.dev0"`` -> ``(5, 25)``,
    ``"2.13.0+cpu"`` -> ``(2, 13)`` (a pre-release of a floor counts as the floor)."""
    parts = list(Version(version).release)
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def too_old(found: dict[str, str | None] | None = None) -> list[str]:
    """One message per installed package below its floor (packages not installed are not this check's business).
    ``found`` maps package to version, for tests; by default the installed versions are read."""
    problems = []
    for package, floor in FLOORS.items():
        if found is not None:
            version = found.get(package)
        else:
            try:
                version = metadata.version(package)
            except metadata.PackageNotFoundError:
                version = None
        if version is not None and _release(version) < _release(floor):
            problems.append(
                f"peft_csgmv needs {package}>={floor}, found {package} {version} (pip install -U '{package}>={floor}')"
            )
    return problems


def check_versions(found: dict[str, str | None] | None = None) -> None:
    """Raise ImportError with one line per package below its floor."""
    problems = too_old(found)
    if problems:
        raise ImportError("; ".join(problems))


def transformers_model(model):
    """The transformers model under ``model``: a PeftModel's base model, else ``model`` itself."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def cache_kwarg(model) -> str:
    """The name of a transformers model's KV-cache argument: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before. ``model`` may be a PeftModel."""
    base = transformers_model(model)
    try:
        params = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(output):
    """The KV cache of a model output: ``output.cache`` where the output class has that field, else
    ``output.past_key_values`` (reading the old name warns where the new one exists)."""
    if dataclasses.is_dataclass(output) and any(f.name == "cache" for f in dataclasses.fields(output)):
        return output.cache
    return output.past_key_values


_DEFER_STOP = contextvars.ContextVar("peft_csgmv_defer_stop_check", default=False)


def _defer_on_cuda(original):
    """transformers' ``DeferredStopCheck.is_supported`` that also says yes on CUDA inside :func:`deferred_stop_check`,
    with the conditions it sets for the devices it defers on (not for an assistant model; a cache that is returned to
    the caller must be croppable, so that the extra step can be taken back)."""
    signature = inspect.signature(original)

    def is_supported(*args, **kwargs):
        if _DEFER_STOP.get():
            bound = signature.bind(*args, **kwargs)
            device, cache = bound.arguments["device"], bound.arguments["cache"]
            if device.type == "cuda" and not bound.arguments["is_assistant"]:
                return cache is None or cache.is_croppable or not bound.arguments["cache_is_returned"]
        return original(*args, **kwargs)

    is_supported.__wrapped__ = original
    return is_supported


def _install_deferred_stop_check() -> bool:
    """Put :func:`_defer_on_cuda` in place of transformers' ``DeferredStopCheck.is_supported`` once per process (it
    answers as transformers does outside :func:`deferred_stop_check`); ``False`` where this transformers has no
    ``DeferredStopCheck`` of that signature."""
    try:
        from transformers.generation.utils import DeferredStopCheck
    except ImportError:
        return False
    current = inspect.getattr_static(DeferredStopCheck, "is_supported", None)
    if not isinstance(current, staticmethod):
        return False
    if hasattr(current.__func__, "__wrapped__"):
        return True
    names = set(inspect.signature(current.__func__).parameters)
    if not {"device", "cache", "cache_is_returned", "is_assistant"} <= names:
        return False
    DeferredStopCheck.is_supported = staticmethod(_defer_on_cuda(current.__func__))
    return True


@contextlib.contextmanager
def deferred_stop_check(enabled: bool = True):
    """Inside the block, transformers' decoding loop on CUDA reads its stop flag one step late (its
    ``DeferredStopCheck``, which it uses on Apple GPUs): the host queues the next step while the GPU runs this one,
    instead of waiting for the GPU at every step. Same sequences (a loop that stops on EOS takes back its extra step);
    a no-op where this transformers has no deferred check. ``enabled=False``: not deferred inside the block, whatever
    an enclosing block says."""
    token = _DEFER_STOP.set(bool(enabled) and _install_deferred_stop_check())
    try:
        yield
    finally:
        _DEFER_STOP.reset(token)


def _interrupted_while_importing(signum, frame) -> None:
    """Ctrl-C while the ``peft-csgmv`` command is still importing torch, transformers and peft (seconds): its one
    line and exit status 130, as ``cli.main`` gives once it runs, instead of a traceback from deep in an import."""
    hint = ": rerun the same command to resume" if sys.argv[1:2] == ["generate"] else ""
    sys.stderr.write(f"\ninterrupted{hint}\n")
    sys.stderr.flush()
    os._exit(130)


def quiet_interrupts_while_importing() -> None:
    """Install :func:`_interrupted_while_importing` when this process is the ``peft-csgmv`` command (its console
    script, or ``python -m peft_csgmv``) and Ctrl-C has Python's own handler; ``cli.main`` puts Python's handler back
    first thing."""
    argv0 = sys.argv[0] if sys.argv else ""
    orig = list(getattr(sys, "orig_argv", []))
    # python -m peft_csgmv: while the package imports, argv[0] is "-m" and orig_argv holds "-m", "peft_csgmv"
    as_module = argv0 == "-m" and any(a == "-m" and b == "peft_csgmv" for a, b in zip(orig, orig[1:]))
    if os.path.basename(argv0) != "peft-csgmv" and not as_module:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_while_importing)


def restore_interrupts() -> None:
    """Python's own Ctrl-C handler (KeyboardInterrupt) again, where :func:`quiet_interrupts_while_importing` had
    replaced it."""
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGINT) is _interrupted_while_importing:
            signal.signal(signal.SIGINT, signal.default_int_handler)


# On import (peft_csgmv/__init__.py imports this module first, before torch, transformers and peft).
quiet_interrupts_while_importing()
check_versions()
