"""``enable_csgmv`` / ``disable_csgmv``: patch a ``PeftModel`` in place so that mixed-adapter batches run through the
chunked-SGMV kernels.

What patching does, all of it undone by :func:`disable_csgmv`:

* every PEFT LoRA ``Linear`` layer (``nn.Linear`` or GPT-2 ``Conv1D`` base) and ``Embedding`` layer gets a
  :class:`~peft_csgmv.slots.LoraStack` and csgmv's ``forward``, through a subclass of its class of the same name
  (see :mod:`peft_csgmv.layers`);
* the outer PEFT ``ParamWrapper`` of each MoE experts module (``target_parameters`` on transformers' 3D experts) gets
  csgmv's experts forward and a :class:`~peft_csgmv.moe.MoeStack` per adapted parameter (eagerly only);
* every other PEFT tuner layer and auxiliary wrapper (LoRA convolutions, embeddings with ``max_norm``,
  MultiheadAttention, other ``target_parameters``, other quantized layers, ``modules_to_save`` and trainable-token
  wrappers) gets PEFT's own mixed-batch path during csgmv calls: PEFT's results there, and PEFT's errors where PEFT
  refuses;
* adapters the kernels do not serve in a kernel layer (LoRA variants such as aLoRA) run through PEFT's mixed-batch
  forward of that layer, for their rows only;
* a model whose adapters are not LoRA (RoAd, GLoRA, ...) has no kernels to run: its calls with ids go to PEFT's own
  ``adapter_names`` path whole;
* the ``PeftModel`` gets instance-level ``forward`` and ``generate`` that accept ``adapter_ids`` (and PEFT's own
  ``adapter_names``), validate them once per call, and publish the per-row slots to the layers through a context
  variable that is reset in ``finally``.

Nothing is registered as a module, parameter or buffer: ``state_dict``, ``save_pretrained`` and PEFT's adapter
bookkeeping are untouched.
"""

from __future__ import annotations

import contextlib
import functools
import types
import warnings
from typing import Any

import torch
from torch import nn

from . import continuous
from .call import adapter_ids_scope, run
from .executor import NO_COPIES
from .layers import BACKENDS
from .patching import (
    WeakMethod,
    is_patched,
    method_function,
    patched_class,
    restore_parameter_walks,
    unpatch_layer,
    unpatched_type,
    weights_lent,
)
from .static_cache import KeptStaticCache
from .sync import CsgmvState, outside_inference_mode, peft_classes

__all__ = ["enable_csgmv", "disable_csgmv", "csgmv_stats", "is_csgmv_enabled", "adapter_ids_scope"]


def _check_model(model) -> None:
    PeftModel, _, _ = peft_classes()
    if not isinstance(model, PeftModel):
        raise TypeError(f"enable_csgmv expects a peft.PeftModel, got {type(model).__name__}")


# The wrappers run eagerly under torch.compile (validation and the ids are host work, in the disabled helpers above);
# the model's own forward inside them is compiled, its LoRA layers included.
@torch.compiler.disable(recursive=False)
def _forward(self, *args: Any, **kwargs: Any):
    return run(self, _own_method(self, "forward"), args, kwargs, generate=False)


@torch.compiler.disable(recursive=False)
def _generate(self, *args: Any, **kwargs: Any):
    return run(self, _own_method(self, "generate"), args, kwargs, generate=True)


def _generate_batch(self, *args: Any, **kwargs: Any):
    """transformers' continuous batching on the base model; ``adapter_ids=``: an adapter per input (see
    :mod:`peft_csgmv.continuous`)."""
    return continuous.generate_batch(self, *args, **kwargs)


def _call_lock(state: CsgmvState | None):
    """The model's call lock (``state``: its csgmv state, ``None`` once disabled: no lock), for the adapter loads that
    hold it: a call from another thread waits for the load, and the load for the call."""
    return state.executor.lock if state is not None else contextlib.nullcontext()


def _load_adapter(self, *args: Any, **kwargs: Any):
    """PEFT's ``load_adapter``, under the model's call lock; with the host tier, the adapters beyond
    ``max_resident_adapters`` then go to host memory at once (:func:`_to_host_after_load`), so that loading many
    adapters never holds more than N + 1 on the device."""
    state = self.__dict__.get("_csgmv")
    with _call_lock(state):
        if state is None or state.tier is None:
            return _own_method(self, "load_adapter")(self, *args, **kwargs)
        state.loading += 1  # (PEFT's load_adapter calls add_adapter, whose weights are not loaded yet: no sync there)
        try:
            out = _own_method(self, "load_adapter")(self, *args, **kwargs)
        finally:
            state.loading -= 1
        _to_host_after_load(self, state)
        return out


def _add_adapter(self, *args: Any, **kwargs: Any):
    """PEFT's ``add_adapter``, under the model's call lock; with the host tier, as :func:`_load_adapter` (not for
    ``low_cpu_mem_usage=True``, whose weights are empty, on the meta device, until a state dict is loaded into them)."""
    state = self.__dict__.get("_csgmv")
    with _call_lock(state):
        out = _own_method(self, "add_adapter")(self, *args, **kwargs)
        empty = kwargs.get("low_cpu_mem_usage", args[2] if len(args) > 2 else False)
        if state is not None and state.tier is not None and not state.loading and not empty:
            _to_host_after_load(self, state)
    return out


@outside_inference_mode
def _to_host_after_load(model, state: "CsgmvState") -> None:
    """Bring the slots and the host tier in line with the adapters PEFT now holds (a call would do it first): new
    adapters beyond ``max_resident_adapters`` leave the device for host memory now. Where that fails, PEFT's load
    stands and the next call tries again (and raises what it meets)."""
    try:
        state.sync(model)
    except Exception as exc:  # noqa: BLE001 (the load itself succeeded, as stock PEFT's would)
        warnings.warn(
            f"csgmv: the adapters loaded stay on the device until the next call ({type(exc).__name__}: {exc})",
            stacklevel=3,
        )


def _reduce_ex(self, protocol):
    # pickle and copy.deepcopy of an enabled model: its modules name the executor by handle (a copy would run its
    # calls through the original's state), and its classes are csgmv's (not importable by name): refused, loudly.
    raise TypeError(NO_COPIES)


def _copy(self):
    """``copy.copy``: a shallow copy, as for the class csgmv patched (the same modules, state and adapters)."""
    clone = type(self).__new__(type(self))
    clone.__dict__.update(self.__dict__)
    return clone


_MODEL_METHODS = {
    "forward": _forward,
    "generate": _generate,
    "load_adapter": _load_adapter,
    "add_adapter": _add_adapter,
    "generate_batch": _generate_batch,
}
_MODEL_CLASS_METHODS = {**_MODEL_METHODS, "__reduce_ex__": _reduce_ex, "__copy__": _copy}  # (read from the class)


def _own_method(model, name: str):
    """The model's ``forward`` / ``generate`` as it was before :func:`_patch_model`, as a function of the model."""
    own = model.__dict__.get("_csgmv_own")
    if own is not None and name in own:
        method = own[name]
        return lambda _, *args, **kwargs: method(*args, **kwargs)
    return getattr(unpatched_type(model), name)


def _patch_model(model) -> None:
    """csgmv's ``forward`` and ``generate`` for ``model``: by class (a subclass of its class, same name, as the
    layers get: no reference cycle, so a dropped model is freed at once; it also refuses pickling and
    ``copy.deepcopy`` with a message that says what to do), or, where the model has an instance-level
    ``forward`` / ``generate`` of its own (accelerate's ``prepare`` sets one), on the instance over them, which they
    then call."""
    own = {name: model.__dict__[name] for name in _MODEL_METHODS if name in model.__dict__}
    if own:
        model.__dict__["_csgmv_own"] = own
        for name, function in _MODEL_METHODS.items():
            model.__dict__[name] = types.MethodType(function, model)
    else:
        model.__class__ = patched_class(type(model), **_MODEL_CLASS_METHODS)


def _unpatch_model(model) -> None:
    """Undo :func:`_patch_model`."""
    own = model.__dict__.pop("_csgmv_own", None)
    if own is not None:
        for name in _MODEL_METHODS:
            model.__dict__.pop(name, None)
        model.__dict__.update(own)
    model.__class__ = unpatched_type(model)


def _add_weighted_adapter_lending(tuner: nn.Module, state: CsgmvState):
    """``tuner.add_weighted_adapter`` (PEFT's LoRA model's) with the weights it combines lent to their kernel layers'
    devices for the call (:func:`~peft_csgmv.patching.weights_lent`; ``state``'s layers, where the host tier keeps
    adapters): with the host tier, those of adapters waiting in host memory would meet device weights there."""
    original = method_function(tuner, "add_weighted_adapter")

    @functools.wraps(original)
    def add_weighted_adapter(tuner, *args, **kwargs):
        names = args[0] if args else kwargs.get("adapters")
        names = list(names) if isinstance(names, (list, tuple)) else []
        with weights_lent([(layer, name) for layer in state.layers.values() for name in names]):
            return original(tuner, *args, **kwargs)

    method = WeakMethod(add_weighted_adapter, tuner)
    method._csgmv_lending = True
    return method


@outside_inference_mode
def enable_csgmv(
    model,
    backend: str = "auto",
    dtype: torch.dtype | None = None,
    max_resident_adapters: int | None = None,
    keep_static_cache: bool = True,
    defer_stop_check: bool | None = None,
):
    """Patch ``model`` (a ``peft.PeftModel``) in place for fast mixed-adapter batches.

    Afterwards ``model(..., adapter_ids=[...])`` and ``model.generate(..., adapter_ids=[...])`` apply one adapter per
    input row (``None`` or ``"__base__"`` for the base model); PEFT's ``adapter_names=[...]`` spelling takes the
    same fast path. Without ids the model behaves exactly as before.

    LoRA layers on ``nn.Linear``, GPT-2 ``Conv1D``, bitsandbytes 4-bit / 8-bit and ``nn.Embedding`` bases run in the
    kernels; every other module PEFT's ``adapter_names`` reaches runs PEFT's own mixed-batch path (PEFT's results
    and errors there), and a model whose adapters are not LoRA runs PEFT's path whole. A warning names what runs at
    PEFT's speed.

    Args:
        model: the ``PeftModel``. Returned for chaining; patched in place.
        backend: ``"auto"`` (Triton kernels on CUDA, the torch reference on CPU), ``"triton"`` or ``"torch"``.
        dtype: dtype of the stacked adapter weights; default the adapters' own (see :mod:`peft_csgmv.slots`).
        max_resident_adapters: keep at most this many adapters' kernel-layer weights on the device; the others wait
            in (pinned) host memory and are copied into a free slot when a call needs them, least recently used out.
            A call that needs more distinct adapters fails before anything runs. Default: all on the device.
        keep_static_cache: ``generate(..., adapter_ids=..., cache_implementation="static")`` keeps its static KV cache
            for the next such call of the same size (reset, as transformers' releases before ``_prepare_static_cache``
            did), so the compiled decode step replays its CUDA graph instead of recording it again per call; the last
            call's cache stays allocated until then (``csgmv_stats(model)["static_cache_bytes"]``). ``False``:
            transformers' own, a new cache per call. See :mod:`peft_csgmv.static_cache`.
        defer_stop_check: ``generate`` calls with ids on CUDA read transformers' stop flag one step late (its
            ``DeferredStopCheck``, which it uses on Apple GPUs), so the host queues each decode step while the GPU
            runs the one before instead of waiting for it: the same sequences, the GPU no longer idle while the host
            prepares a step (the static cache's compiled steps gain most). A call that stops on EOS runs one more
            step, which transformers takes back. ``None`` (default): for calls that do not sample (greedy, beams),
            whose random state is then exactly transformers'; ``True``: sampling calls too (the same samples, but a
            call that stops on EOS draws one more step's samples from the random generator); ``False``: never. A no-op
            on transformers releases without ``DeferredStopCheck``. See :func:`peft_csgmv._compat.deferred_stop_check`.

    Calling it again on an enabled model restacks every adapter (use it after editing adapter weights in place).
    Adding, loading and deleting adapters through PEFT is picked up on the next call without it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if max_resident_adapters is not None and (
        not isinstance(max_resident_adapters, int)
        or isinstance(max_resident_adapters, bool)
        or max_resident_adapters < 1
    ):
        raise ValueError(f"max_resident_adapters must be a positive int or None; got {max_resident_adapters!r}")
    if not isinstance(keep_static_cache, bool):
        raise ValueError(f"keep_static_cache must be True or False; got {keep_static_cache!r}")
    if defer_stop_check is not None and not isinstance(defer_stop_check, bool):
        raise ValueError(f"defer_stop_check must be None, True or False; got {defer_stop_check!r}")
    _check_model(model)
    state = model.__dict__.get("_csgmv")
    if state is not None:
        if dtype == state.dtype and max_resident_adapters == state.max_resident:
            state.executor.set_backend(backend)
            if keep_static_cache != (state.static_cache is not None):
                state.static_cache = KeptStaticCache() if keep_static_cache else None
            state.defer_stop_check = defer_stop_check
            state.sync(model, force=True)
            return model
        # A restack copies into the existing stacks, which keep their dtype and size: build them afresh.
        disable_csgmv(model)
    state = CsgmvState(backend, dtype, max_resident_adapters, keep_static_cache, defer_stop_check)
    try:
        state.sync(model, force=True)
    except BaseException:
        state.release()
        raise
    model.__dict__["_csgmv"] = state
    _patch_model(model)
    continuous.patch_base_model(model)
    tuner = model.base_model
    if max_resident_adapters is not None and hasattr(tuner, "add_weighted_adapter"):
        tuner.__dict__["add_weighted_adapter"] = _add_weighted_adapter_lending(tuner, state)
    return model


@outside_inference_mode
def disable_csgmv(model):
    """Undo :func:`enable_csgmv`: every layer and the model get PEFT's own forward back. Returns ``model``. Waits for
    the call in progress on another thread (or a continuous-batching step) to end first."""
    state = model.__dict__.get("_csgmv")
    if state is None:
        return model
    with state.executor.lock:
        if model.__dict__.pop("_csgmv", None) is None:  # (disabled by another thread meanwhile)
            return model
        _disable(model, state)
    return model


def _disable(model, state: CsgmvState) -> None:
    state.release()
    # Layers that PEFT replaced or dropped since (merge_and_unload, delete_adapter) may still carry a patch.
    for module in model.modules():
        if is_patched(module):
            unpatch_layer(module)
        restore_parameter_walks(module)
    if getattr(model.base_model.__dict__.get("add_weighted_adapter"), "_csgmv_lending", False):
        del model.base_model.__dict__["add_weighted_adapter"]
    continuous.unpatch_base_model(model)
    _unpatch_model(model)


def csgmv_stats(model) -> dict:
    """What ``enable_csgmv`` holds for ``model`` (read-outs for benchmarks and monitoring):

    * ``kernel_layers``, ``peft_path_modules``: counts of the layers on the kernels and the modules on PEFT's path;
    * ``expert_layers``: MoE experts modules whose expert LoRA (``target_parameters``) runs csgmv's expert path;
      ``expert_stack_bytes``: device memory of their stacks (counted in ``stack_bytes`` too; PEFT's weights of every
      adapter of the stacks' dtype view them, counted in ``shared_bytes``);
    * ``peft_row_layers``: kernel layers where some adapter's rows run PEFT's own forward (adapters the kernels do not
      serve there);
    * ``stack_bytes``: device memory of every stack; ``shared_bytes``: of that, PEFT's own adapter weights, which are
      views into the stacks (stored once);
    * ``offloaded_layers``: kernel layers whose weights accelerate offloads (their adapters read from accelerate's
      weights maps, their stacks in host memory, lent to the execution device for each forward: peft_csgmv/offload.py);
      ``offloaded_stack_bytes``: host memory of their stacks (not counted in ``stack_bytes``);
    * ``plans_cached``: host-built plans kept for later calls with the same ids; ``static_plans``: plans of compiled
      shapes; ``unforeseen_plans``: plans a layer read that its call's driver had not prepared (shapes the call's
      arguments do not tell: made on the layer's first read), over every call so far;
    * ``resident``: the adapters with a slot on the device, least recently used first with ``max_resident_adapters``;
      ``max_resident_adapters``: the option (None without the host tier); ``host_bytes``: host memory held for the
      host tier's adapters;
    * ``static_cache_bytes``: the static KV cache kept for the next ``generate`` (see ``keep_static_cache``)."""
    state: CsgmvState = model.__dict__["_csgmv"]
    return dict(
        kernel_layers=len(state.layers),
        expert_layers=len(state.experts),
        expert_stack_bytes=_expert_stack_bytes(state),
        peft_path_modules=len(state.peft_path),
        peft_row_layers=sum(1 for layer in state.layers.values() if layer._csgmv_record.peft_rows),
        offloaded_layers=len(state.offloaded),
        offloaded_stack_bytes=sum(layer._csgmv_record.stack.nbytes for layer in state.offloaded),
        stack_bytes=sum(layer._csgmv_record.stack.nbytes for layer in state.tiered)
        + (0 if state.tier is None else sum(pages.nbytes for pages in state.tier.pages.values()))
        + _expert_stack_bytes(state),
        shared_bytes=sum(layer._csgmv_record.stack.shared_bytes for layer in state.layers.values())
        + _expert_stacks(state, "shared_bytes"),
        plans_cached=state.executor.num_plans,
        static_plans=len(state.executor.statics),
        unforeseen_plans=state.executor.unforeseen,
        resident=state.resident,
        max_resident_adapters=state.max_resident,
        host_bytes=0 if state.tier is None else state.tier.host.nbytes,
        static_cache_bytes=0 if state.static_cache is None else state.static_cache.nbytes,
    )


def _expert_stacks(state: CsgmvState, what: str) -> int:
    return sum(getattr(s, what) for wrapper in state.experts.values() for s in wrapper._csgmv_record.experts.values())


def _expert_stack_bytes(state: CsgmvState) -> int:
    return _expert_stacks(state, "nbytes")


def is_csgmv_enabled(model) -> bool:
    return "_csgmv" in model.__dict__
