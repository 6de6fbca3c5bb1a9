"""``enable_csgmv`` / ``disable_csgmv``: patch a ``PeftModel`` in place so that mixed-adapter batches run through the
chunked-SGMV kernels.

What patching does, all of it undone by :func:`disable_csgmv`:

* every PEFT LoRA ``Linear`` layer (``nn.Linear`` or GPT-2 ``Conv1D`` base) and ``Embedding`` layer gets a
  :class:`~peft_csgmv.slots.LoraStack` and an instance-level ``forward`` (see :mod:`peft_csgmv.layers`);
* modules csgmv has no kernel for but PEFT can mix (LoRA convolutions, embeddings with ``max_norm``,
  ``modules_to_save`` and trainable-token wrappers) get PEFT's own mixed-batch path during csgmv calls;
* the ``PeftModel`` gets instance-level ``forward`` and ``generate`` that accept ``adapter_ids`` (and PEFT's own
  ``adapter_names``), validate them once per call, and publish the per-row slots to the layers through a context
  variable that is reset in ``finally``.

Nothing is registered as a module, parameter or buffer: ``state_dict``, ``save_pretrained`` and PEFT's adapter
bookkeeping are untouched.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .layers import (
    ACTIVE,
    BACKENDS,
    CallContext,
    is_patched,
    patch_layer,
    patch_peft_path,
    unpatch_layer,
)
from .plan import BatchPlan
from .slots import LoraStack, SlotRegistry, layer_adapters

BASE_NAMES = (None, "__base__")
_PLAN_CACHE_SIZE = 64


def _peft_classes():
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    return PeftModel, LoraLayer, LoraLinear


def _auxiliary_wrapper_class():
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # older PEFT
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper
    return AuxiliaryTrainingWrapper


def _dora_error(name: str, where: str) -> str:
    return (
        f"Cannot pass `{{arg}}` when DoRA is enabled. (adapter '{name}' uses DoRA {where}, which csgmv does not serve "
        "yet)"
    )


def _unsupported_reason(layer: nn.Module, name: str) -> str | None:
    """Why csgmv's kernels cannot serve adapter ``name`` in a ``lora.Linear`` or ``lora.Embedding`` layer (an error
    message; ``None`` when they can: plain LoRA, ``lora_bias``, and DoRA on Linear)."""
    variant = getattr(layer, "lora_variant", {}).get(name)
    if _is_embedding(layer):
        if layer.use_dora.get(name, False):
            return _dora_error(name, "on an Embedding layer")
    elif layer.use_dora.get(name, False):
        if getattr(layer.lora_B[name], "bias", None) is not None:
            return _dora_error(name, "together with `lora_bias=True`")
        return None
    if variant is not None:
        return f"adapter '{name}' uses the LoRA variant {type(variant).__name__}, which csgmv does not serve yet"
    return None


def _is_embedding(layer: nn.Module) -> bool:
    from peft.tuners.lora import Embedding as LoraEmbedding

    return isinstance(layer, LoraEmbedding)


def _kernel_layer(layer: nn.Module) -> bool:
    """A PEFT layer the kernels serve: ``lora.Linear``, or ``lora.Embedding`` without ``max_norm`` (which renormalises
    looked-up rows; PEFT's own path serves that)."""
    from peft.tuners.lora import Embedding as LoraEmbedding

    _, _, LoraLinear = _peft_classes()
    if type(layer) is LoraLinear:
        return True
    return type(layer) is LoraEmbedding and layer.get_base_layer().max_norm is None


def _embed_scale(layer: nn.Module) -> float:
    """A scaled embedding's ``embed_scale`` (Gemma), which PEFT applies to the LoRA output too; 1 otherwise."""
    scale = layer._get_embed_scale() if hasattr(layer, "_get_embed_scale") else None
    return 1.0 if scale is None else float(scale)


def _dora_scale(layer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """DoRA at inference: ``(magnitude / ‖W + scaling·B·A‖ per output feature, base bias)``, computed once in fp32 as
    PEFT's DoRA layer does per forward."""
    from peft.utils.integrations import dequantize_module_weight

    base = layer.get_base_layer()
    dora = layer.lora_magnitude_vector[name]
    with torch.no_grad():
        weight = dequantize_module_weight(base).float()
        lora_weight = layer.lora_B[name].weight.float() @ layer.lora_A[name].weight.float()
        norm = dora.get_weight_norm(weight, lora_weight, layer.scaling[name]).float()
        return dora.weight.float() / norm, getattr(base, "bias", None)


class CsgmvState:
    """Everything ``enable_csgmv`` attached to one model: the slot registry, the patched layers and their stacks."""

    def __init__(self, backend: str, dtype: torch.dtype | None) -> None:
        self.backend = backend
        self.dtype = dtype
        self.registry = SlotRegistry()
        self.layers: dict[str, nn.Module] = {}  # module name -> lora.Linear / lora.Embedding on the kernels
        self.peft_path: dict[str, nn.Module] = {}  # module name -> module on PEFT's mixed-batch path
        self.unsupported: dict[str, str] = {}  # adapter name -> why csgmv cannot serve it
        self.fingerprint: tuple = ()
        self.configs: list = []  # keeps the fingerprinted config objects alive, so their ids stay unique
        self.plans: collections.OrderedDict = collections.OrderedDict()

    # -- adapters -------------------------------------------------------------------------------------------------

    def _fingerprint(self, model) -> tuple:
        return tuple((name, id(cfg)) for name, cfg in model.peft_config.items())

    def sync(self, model, force: bool = False) -> None:
        """Bring slots and stacks in line with the adapters PEFT holds now. Only what changed is (re)stacked: new
        LoRA layers are patched, new adapters get a slot, deleted ones free theirs, replaced ones are copied again."""
        fingerprint = self._fingerprint(model)
        if fingerprint == self.fingerprint and not force:
            return
        # An adapter added since enable_csgmv may have brought a module that csgmv cannot serve (MultiheadAttention,
        # `modules_to_save` around a norm, ...). Left alone, such a module would run PEFT's stock forward inside a
        # mixed batch and apply the *active* adapter to every row (or none at all), i.e. silently wrong output:
        # refuse, as enable_csgmv does, before anything runs. The fingerprint is not updated, so every call refuses
        # until the adapter is deleted again.
        peft_path = _check_modules(model)
        _, LoraLayer, _ = _peft_classes()
        names = list(model.peft_config)
        for gone in [n for n in self.registry.index if n not in names]:
            self.registry.remove(gone)
        for name in names:
            self.registry.add(name)

        self.unsupported = {}
        for mod_name, module in peft_path.items():
            if isinstance(module, LoraLayer):
                for name in _held_adapters(module):
                    if module.use_dora.get(name, False):
                        self.unsupported.setdefault(name, _dora_error(name, f"on a {type(module).__name__} layer"))
            if not is_patched(module):
                patch_peft_path(module, weakref.ref(self))
            module._csgmv_held = frozenset(_held_adapters(module))
        found: dict[str, nn.Module] = {}
        for mod_name, layer in model.named_modules():
            if not isinstance(layer, LoraLayer) or not _kernel_layer(layer):
                continue  # on PEFT's path, or rejected by _check_modules
            found[mod_name] = layer
            if not is_patched(layer):
                patch_layer(layer, self._new_stack(layer), weakref.ref(self))
            self.stack_layer(layer, force)
        for old, new in ((self.layers, found), (self.peft_path, peft_path)):
            for mod_name, module in old.items():
                if new.get(mod_name) is not module:
                    unpatch_layer(module)
        self.layers, self.peft_path = found, peft_path
        self.fingerprint = fingerprint
        self.configs = list(model.peft_config.values())
        self.plans.clear()

    def stack_layer(self, layer: nn.Module, force: bool = False) -> None:
        """Bring one kernel-path layer's stack in line with its adapters: copy new or replaced ones (all with
        ``force``), clear the rest. Also called when PEFT rescales the layer (``set_scale``, ``scale_layer``,
        ``unscale_layer``, or a new ``scaling`` dict as ``peft.helpers.rescale_adapter_scale`` sets)."""
        stack: LoraStack = layer._csgmv_stack
        if force:
            stack.sources.clear()
        adapters = layer_adapters(layer)
        for slot, name in enumerate(self.registry.names):
            if name is None or name not in adapters:
                stack.clear_slot(slot)
                continue
            reason = _unsupported_reason(layer, name)
            if reason is not None:
                self.unsupported.setdefault(name, reason)
                stack.clear_slot(slot)
                continue
            a, b = adapters[name]
            if stack.sources.get(slot) is not a:
                dora = _dora_scale(layer, name) if layer.use_dora.get(name, False) else None
                scaling = layer.scaling[name] * (_embed_scale(layer) if stack.embedding else 1.0)
                lora_bias = None if stack.embedding else getattr(layer.lora_B[name], "bias", None)
                stack.set_slot(slot, a, b, scaling, source=a, dora=dora, lora_bias=lora_bias)
        stack.ensure_capacity(self.registry.capacity)
        for slot in range(len(self.registry.names), stack.capacity):
            stack.clear_slot(slot)
        stack.scaling_src = layer.scaling

    def _new_stack(self, layer: nn.Module) -> LoraStack:
        base = layer.get_base_layer()
        weight = getattr(base, "weight", None)
        if self.dtype is not None:
            dtype = self.dtype
        elif weight is not None and weight.dtype.is_floating_point:
            dtype = weight.dtype
        else:
            dtype = torch.float32
        ranks = [layer.r[n] for n in layer_adapters(layer)] or [1]
        device = weight.device if weight is not None else next(layer.parameters()).device
        return LoraStack(
            in_features=layer.in_features,
            out_features=layer.out_features,
            capacity=max(self.registry.capacity, 1),
            r_max=max(ranks),
            dtype=dtype,
            device=device,
            embedding=_is_embedding(layer),
        )

    def release(self) -> None:
        for module in [*self.layers.values(), *self.peft_path.values()]:
            unpatch_layer(module)
        self.layers, self.peft_path = {}, {}
        self.plans.clear()

    # -- per call -------------------------------------------------------------------------------------------------

    def cached_plan(self, row_slots: tuple[int, ...], repeat: int, tokens_per_row: int, device) -> BatchPlan:
        key = (row_slots, repeat, tokens_per_row, device)
        plan = self.plans.get(key)
        if plan is None:
            slots = [s for s in row_slots for _ in range(repeat)] if repeat > 1 else row_slots
            plan = BatchPlan.build(slots, tokens_per_row, device)
            self.plans[key] = plan
            if len(self.plans) > _PLAN_CACHE_SIZE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return plan

    def resolve(self, model, ids: Sequence[str | None], arg: str, batch_size: int | None) -> tuple[int, ...]:
        """Validate ``ids`` for this call and map them to slots (``-1`` for base rows). Raises before anything runs."""
        if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
            raise TypeError(f"Got {arg} of type {type(ids)}, expected a list of str.")
        bad = [i for i in ids if i is not None and not isinstance(i, str)]
        if bad:
            raise TypeError(f"`{arg}` must hold adapter names (str) or None for base rows; got {bad[0]!r}")
        if len(ids) == 0:
            raise ValueError(f"`{arg}` is empty; give one adapter name (or None / '__base__') per input row")
        if model.training:
            raise ValueError(f"Cannot pass `{arg}` when the model is in training mode.")
        self.sync(model)
        known = set(self.registry.index) | set(self.unsupported)
        unknown = {i for i in ids if i not in BASE_NAMES and i not in known}
        if unknown:
            raise ValueError(
                f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}. "
                f"Loaded adapters: {', '.join(sorted(known)) or '(none)'}; use None or '__base__' for base rows."
            )
        if batch_size is not None and (batch_size % len(ids) != 0):
            raise ValueError(
                f"Length of `{arg}` should be the same as the number of inputs, but got {len(ids)} and {batch_size} "
                "respectively."
            )
        if any(layer.merged for layer in self.layers.values()):
            raise ValueError(
                f"Cannot pass `{arg}` when there are merged adapters, please call `unmerge_adapter` first."
            )
        for name in dict.fromkeys(ids):
            if name in self.unsupported:
                raise ValueError(self.unsupported[name].replace("{arg}", arg))
        index = self.registry.index
        return tuple(-1 if i in BASE_NAMES else index[i] for i in ids)


def _check_model(model) -> None:
    PeftModel, _, _ = _peft_classes()
    if not isinstance(model, PeftModel):
        raise TypeError(f"enable_csgmv expects a peft.PeftModel, got {type(model).__name__}")
    bad_types = {
        n: cfg.peft_type for n, cfg in model.peft_config.items() if str(cfg.peft_type) not in ("LORA", "PeftType.LORA")
    }
    if bad_types:
        raise ValueError(
            "csgmv serves LoRA adapters only; these are not LoRA: "
            + ", ".join(f"'{n}' ({t})" for n, t in bad_types.items())
        )
    _check_modules(model)


def _held_adapters(module: nn.Module) -> set[str]:
    """Names of the adapters a PEFT layer or auxiliary wrapper holds (``{"?"}`` when it cannot tell)."""
    try:
        return set(module._get_available_adapters())
    except (AttributeError, NotImplementedError):
        return {"?"}


_PEFT_MIXED_BATCH_BASES = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _check_modules(model) -> dict[str, nn.Module]:
    """The modules that take PEFT's mixed-batch path (name → module): LoRA on convolutions and on embeddings with
    ``max_norm``, and
    `modules_to_save` / trainable-token wrappers around the module types PEFT can mix. Raises
    ``NotImplementedError`` naming the first module that holds an adapter neither csgmv nor PEFT's mixed batches can
    serve (MultiheadAttention, ``target_parameters``, quantized or other untested layer types). Modules left empty
    by ``delete_adapter`` are fine: their forward is the base module's."""
    from peft.tuners.lora import Embedding as LoraEmbedding
    from peft.tuners.lora.layer import _ConvNd

    _, LoraLayer, _ = _peft_classes()
    Aux = _auxiliary_wrapper_class()
    peft_path: dict[str, nn.Module] = {}
    for mod_name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not _kernel_layer(module):
            if isinstance(module, (LoraEmbedding, _ConvNd)):
                peft_path[mod_name] = module
            elif _held_adapters(module):
                raise NotImplementedError(
                    f"csgmv does not handle the PEFT layer type {type(module).__module__}.{type(module).__name__} "
                    f"(module '{mod_name}') in mixed batches; it handles lora.Linear layers (nn.Linear and "
                    "transformers Conv1D bases) and embeddings, and LoRA convolutions through PEFT's own path."
                )
        elif isinstance(module, Aux):
            if isinstance(getattr(module, "original_module", None), _PEFT_MIXED_BATCH_BASES):
                peft_path[mod_name] = module
            elif _held_adapters(module):
                raise NotImplementedError(
                    f"csgmv cannot mix adapters in {type(module).__name__} (module '{mod_name}') around a "
                    f"{type(getattr(module, 'original_module', None)).__name__}: PEFT's mixed batches support "
                    f"{', '.join(t.__name__ for t in _PEFT_MIXED_BATCH_BASES)} there."
                )
    return peft_path


def _batch_size(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds", "decoder_input_ids"):
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value.shape[0]
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
        return args[0].shape[0]
    return None


def _pop_ids(kwargs: dict) -> tuple[Sequence[str | None] | None, str]:
    ids = kwargs.pop("adapter_ids", None)
    names = kwargs.pop("adapter_names", None)
    if ids is not None and names is not None:
        raise ValueError("Pass either `adapter_ids` or `adapter_names`, not both.")
    if names is not None:
        return names, "adapter_names"
    return ids, "adapter_ids"


@contextlib.contextmanager
def _csgmv_call(model, args: tuple, kwargs: dict) -> Iterator[None]:
    """Validate the ids of one call, publish them to the layers, and clear them again whatever happens."""
    state: CsgmvState = model._csgmv
    ids, arg = _pop_ids(kwargs)
    if ids is None or not model.has_active_enabled_adapter:
        # No ids, or under ``disable_adapter()``: PEFT ignores adapter_names there, and so do we.
        yield
        return
    row_slots = state.resolve(model, ids, arg, _batch_size(args, kwargs))
    names = tuple("__base__" if i in BASE_NAMES else i for i in ids)
    token = ACTIVE.set(CallContext(state=state, row_slots=row_slots, names=names, arg_name=arg))
    try:
        with torch.no_grad():
            yield
    finally:
        ACTIVE.reset(token)


def _forward(self, *args: Any, **kwargs: Any):
    with _csgmv_call(self, args, kwargs):
        return type(self).forward(self, *args, **kwargs)


def _generate(self, *args: Any, **kwargs: Any):
    with _csgmv_call(self, args, kwargs):
        return type(self).generate(self, *args, **kwargs)


def enable_csgmv(model, backend: str = "auto", dtype: torch.dtype | None = None):
    """Patch ``model`` (a ``peft.PeftModel`` with LoRA adapters) in place for fast mixed-adapter batches.

    Afterwards ``model(..., adapter_ids=[...])`` and ``model.generate(..., adapter_ids=[...])`` apply one adapter per
    input row (``None`` or ``"__base__"`` for the base model); PEFT's ``adapter_names=[...]`` spelling takes the
    same fast path. Without ids the model behaves exactly as before.

    Args:
        model: the ``PeftModel``. Returned for chaining; patched in place.
        backend: ``"auto"`` (Triton kernels on CUDA, the torch reference on CPU), ``"triton"`` or ``"torch"``.
        dtype: dtype of the stacked adapter weights; default the base layer's weight dtype (see
            :mod:`peft_csgmv.slots`).

    Calling it again on an enabled model restacks every adapter (use it after editing adapter weights in place).
    Adding, loading and deleting adapters through PEFT is picked up on the next call without it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    _check_model(model)
    state = model.__dict__.get("_csgmv")
    if state is not None:
        if dtype == state.dtype:
            state.backend = backend
            state.sync(model, force=True)
            return model
        # A restack copies into the existing stacks, which keep their dtype: build them afresh for the new one.
        disable_csgmv(model)
    state = CsgmvState(backend, dtype)
    try:
        state.sync(model, force=True)
    except BaseException:
        state.release()
        raise
    model.__dict__["_csgmv"] = state
    model.__dict__["forward"] = _forward.__get__(model)
    model.__dict__["generate"] = _generate.__get__(model)
    return model


def disable_csgmv(model):
    """Undo :func:`enable_csgmv`: every layer and the model get PEFT's own forward back. Returns ``model``."""
    state = model.__dict__.pop("_csgmv", None)
    if state is None:
        return model
    state.release()
    # Layers that PEFT replaced or dropped since (merge_and_unload, delete_adapter) may still carry a patch.
    for module in model.modules():
        if is_patched(module):
            unpatch_layer(module)
    model.__dict__.pop("forward", None)
    model.__dict__.pop("generate", None)
    return model


def is_csgmv_enabled(model) -> bool:
    return "_csgmv" in model.__dict__
