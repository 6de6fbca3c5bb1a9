"""``enable_csgmv`` / ``disable_csgmv``: patch a ``PeftModel`` in place so that mixed-adapter batches run through the
chunked-SGMV kernels.

What patching does, all of it undone by :func:`disable_csgmv`:

* every PEFT LoRA ``Linear`` layer (``nn.Linear`` or GPT-2 ``Conv1D`` base) and ``Embedding`` layer gets a
  :class:`~peft_csgmv.slots.LoraStack` and csgmv's ``forward``, through a subclass of its class of the same name
  (see :mod:`peft_csgmv.layers`);
* every other PEFT tuner layer and auxiliary wrapper (LoRA convolutions, embeddings with ``max_norm``,
  MultiheadAttention, ``target_parameters``, other quantized layers, ``modules_to_save`` and trainable-token wrappers)
  gets PEFT's own mixed-batch path during csgmv calls: PEFT's results there, and PEFT's errors where PEFT refuses;
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
import operator
import threading
import types
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from transformers import GenerationConfig

from ._compat import deferred_stop_check
from .executor import NO_COPIES, CallContext, Executor
from .layers import (
    BACKENDS,
    WeakMethod,
    is_patched,
    method_function,
    patch_layer,
    patch_peft_path,
    patched_class,
    restore_walks,
    spare_walks,
    unpatch_layer,
    unpatched_type,
    weights_lent,
)
from .slots import (
    LoraStack,
    SlotRegistry,
    layer_adapter,
    layer_adapters,
    module_param,
    set_peft_rows,
    vacate,
    weights_device,
)
from .static_cache import KeptStaticCache
from .tier import HostTier, copies_out, host_copies_done, move_adapter, no_gc_pauses, settle

BASE = "__base__"
BASE_NAMES = (None, BASE)


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


# PEFT's own message when a DoRA adapter is asked for in a layer whose mixed-batch path refuses DoRA.
PEFT_DORA_ERROR = "Cannot pass `{arg}` when DoRA is enabled."


def _kernel_reason(layer: nn.Module, name: str) -> str | None:
    """Why csgmv's kernels cannot serve adapter ``name`` in a kernel layer (``None`` when they can: plain LoRA,
    ``lora_bias``, and DoRA on Linear). Such an adapter's rows run through PEFT's mixed-batch forward of the layer."""
    variant = getattr(layer, "lora_variant", {}).get(name)
    if type(variant).__name__ == "ALoraLinearVariant":
        # aLoRA: plain LoRA from each row's invocation tokens on; the call's token mapping says which tokens.
        return "aLoRA together with DoRA" if layer.use_dora.get(name, False) else None
    if layer.use_dora.get(name, False):
        if _is_embedding(layer):
            return "DoRA on an Embedding layer"
        if getattr(layer.lora_B[name], "bias", None) is not None:
            return "DoRA together with `lora_bias=True`"
        return None
    if variant is not None:
        return f"the LoRA variant {type(variant).__name__}"
    return None


def _is_embedding(layer: nn.Module) -> bool:
    from peft.tuners.lora import Embedding as LoraEmbedding

    return isinstance(layer, LoraEmbedding)


def _kernel_layer_types() -> tuple[type, ...]:
    """The PEFT layer classes the kernels serve: ``lora.Linear`` (``nn.Linear`` and GPT-2 ``Conv1D`` bases), and
    bitsandbytes' 4-bit and 8-bit LoRA layers where bitsandbytes is installed (``y = base(x)`` from bitsandbytes, then
    the kernels)."""
    from peft.tuners.lora import Linear as LoraLinear

    types: tuple[type, ...] = (LoraLinear,)
    try:
        from peft.tuners.lora import bnb as lora_bnb
    except ImportError:
        return types
    return types + tuple(getattr(lora_bnb, n) for n in ("Linear8bitLt", "Linear4bit") if hasattr(lora_bnb, n))


def _kernel_layer(layer: nn.Module) -> bool:
    """A PEFT layer the kernels serve: one of :func:`_kernel_layer_types` (exactly: subclasses may change the
    math), or ``lora.Embedding`` without ``max_norm`` (which renormalises looked-up rows; PEFT's own path serves
    that)."""
    from peft.tuners.lora import Embedding as LoraEmbedding

    cls = unpatched_type(layer)
    if cls in _kernel_layer_types():
        return True
    return cls is LoraEmbedding and layer.get_base_layer().max_norm is None


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


# Entry points that make or move the state PEFT's weights view (stacks, host regions) and the buffers later calls write
# into (plans, workspaces) run outside torch.inference_mode, also when called inside it: an inference tensor cannot
# be updated in place, nor be a parameter that requires grad, outside inference mode (PEFT's set_adapter sets that).
_normal_tensors = torch.inference_mode(False)


class CsgmvState:
    """Everything ``enable_csgmv`` attached to one model: the slot registry, the patched layers and their stacks."""

    def __init__(
        self,
        backend: str,
        dtype: torch.dtype | None,
        max_resident: int | None = None,
        keep_static_cache: bool = True,
        defer_stop_check: bool | None = None,
    ) -> None:
        self.dtype = dtype
        # The static cache of the last generate call with ids, for the next one that fits it (None: transformers'
        # own, a new one per call).
        self.static_cache = KeptStaticCache() if keep_static_cache else None
        # enable_csgmv's defer_stop_check: None (calls that do not sample), True or False.
        self.defer_stop_check = defer_stop_check
        # The host tier: at most this many adapters have slots (on the layers' device); the others' kernel-layer
        # weights wait in (pinned) host memory and are brought into a slot when a call needs them, least recently
        # used out. None: every adapter has a slot.
        self.max_resident = max_resident
        self.tier = None if max_resident is None else HostTier()
        self.loading = 0  # PEFT's load_adapter under way (its add_adapter then waits for the load to sync)
        # Runs the layers' LoRA for each call; it restacks a layer through this state when PEFT rescales it.
        self.executor = Executor(backend, WeakMethod(CsgmvState._restack, self))  # (no cycle through the executor)
        self.registry = SlotRegistry()
        self.layers: dict[str, nn.Module] = {}  # module name -> lora.Linear / lora.Embedding on the kernels
        self.peft_path: dict[str, nn.Module] = {}  # module name -> module on PEFT's mixed-batch path
        self.peft_only: str | None = None  # why calls with ids go to PEFT whole (adapters that are not LoRA)
        self.known: frozenset[str] = frozenset()  # the adapter names PEFT accepts in `adapter_names`
        self.dora_refused: set[str] = set()  # DoRA adapters held by a layer whose PEFT path refuses DoRA
        self.reported: set[str] = set()  # modules already named in the PEFT-path warning
        # The adapters' names and config objects when last synced (see _unchanged; the objects kept alive here).
        self.fingerprint: tuple[list, tuple] | None = None
        # One adapter weight and its dtype when last synced: a cast of the model (model.to(dtype), .half()) gives every
        # weight a new dtype, and the next call restacks (a probe of one weight: read on every call).
        self.probe: tuple[torch.Tensor, torch.dtype] | None = None

    # -- adapters -------------------------------------------------------------------------------------------------

    def _unchanged(self, model) -> bool:
        """Whether PEFT holds the adapters of the last sync: the same names in order, each with the same config object
        (by identity: a config replaced by an equal one is a new adapter). Read on every call, and a model may hold
        thousands of adapters, so only C loops: ~40 µs for 1000 on this repository's CPU (a tuple of their ids took
        ~80 µs, a generator over them ~300)."""
        if self.fingerprint is None:
            return False
        configs = model.peft_config
        names, held = self.fingerprint
        return len(configs) == len(held) and list(configs) == names and all(map(operator.is_, configs.values(), held))

    def sync(self, model, force: bool = False) -> None:
        """Bring slots and stacks in line with the adapters PEFT holds now. Only what changed is (re)stacked: new
        LoRA layers are patched, new adapters get a slot, deleted ones free theirs, replaced ones are copied again.
        Every other PEFT tuner layer and auxiliary wrapper gets PEFT's mixed-batch path (the modules PEFT's own
        ``adapter_names`` hooks reach), so a module csgmv has no kernel for gives PEFT's result, or PEFT's error."""
        unchanged = self._unchanged(model)
        probe = self.probe
        if probe is not None and probe[0].dtype != probe[1]:
            force = True  # the model was cast: every stack follows its adapters' new dtype, and is shared again
        if unchanged and not force:
            return
        self.peft_only = _not_lora(model)
        found: dict[str, nn.Module] = {}
        peft_path: dict[str, nn.Module] = {}
        known: set[str] = set()
        self.dora_refused = set()
        regroup = False  # a layer got a new stack
        if self.peft_only is None:
            _, LoraLayer, _ = _peft_classes()
            Aux = _auxiliary_wrapper_class()
            names = list(model.peft_config)
            tier = self.tier
            for gone in [n for n in self.registry.index if n not in names]:
                self.registry.remove(gone)
                if tier is not None:
                    tier.lru.pop(gone, None)
            if tier is not None:
                for gone in {key[0] for key in tier.host.regions} - set(names):
                    tier.host.forget(gone)
            for name in names:
                if name not in self.registry.index and (
                    self.max_resident is None or len(self.registry.index) < self.max_resident
                ):
                    self.registry.add(name)
                    if tier is not None:
                        tier.lru[name] = None
            for mod_name, module in model.named_modules():
                if isinstance(module, LoraLayer):
                    # The names PEFT's own check accepts: those some LoRA layer holds.
                    known.update(module.lora_A.keys(), module.lora_embedding_A.keys())
                    if _kernel_layer(module):
                        found[mod_name] = module
                        continue
                    self.dora_refused.update(n for n in _held_adapters(module) if module.use_dora.get(n, False))
                    peft_path[mod_name] = module
                elif isinstance(module, Aux):
                    peft_path[mod_name] = module
            for module in peft_path.values():
                if not is_patched(module):
                    patch_peft_path(module, self.executor)
                module._csgmv_held = frozenset(_held_adapters(module))
            restack = set()
            for layer in found.values():
                if not is_patched(layer):
                    patch_layer(layer, self._new_stack(layer), self.executor)
                    regroup = True
                elif layer._csgmv_stack.dtype != self.stack_dtype(layer):
                    # An adapter of a wider dtype arrived: the stack takes that dtype, every slot copied again.
                    layer._csgmv_stack.release_shared()
                    layer._csgmv_stack = self._new_stack(layer)
                    restack.add(layer)
                    regroup = True
            if tier is not None:
                # Every adapter's place in its page; those without a slot wait in host memory, and residents whose
                # weights wait there (admitted now) come in from it.
                tier.lay_out(found.values(), names, self.registry, self.kernel_reason)
                if len(names) > self.max_resident:  # (while every adapter has a slot, none can leave: no host memory)
                    tier.reserve(names)
                hosted = [n for n in names if n not in self.registry.index]
                for name in hosted:
                    tier.park(name)
                for slot, name in enumerate(self.registry.names):
                    if name is not None and tier.hosted(name):
                        tier.bring_in(name, slot, _dora_scale, self.dora_refused)
                if hosted:
                    host_copies_done(found.values())
            for layer in found.values():
                self.stack_layer(layer, force or layer in restack)
        for old, new in ((self.layers, found), (self.peft_path, peft_path)):
            for mod_name, module in old.items():
                if new.get(mod_name) is not module:
                    unpatch_layer(module)
        self.layers, self.peft_path, self.known = found, peft_path, frozenset(known)
        if found or peft_path:
            spare_walks(model, [*found, *peft_path])
        self.fingerprint = (list(model.peft_config), tuple(model.peft_config.values()))
        if regroup and len(found) > 1:  # sibling groups name stacks by handle: learned again (Executor.observe)
            self.executor.forget_groups(found.values())
        weights = next((w for layer in found.values() for w in layer_adapters(layer).values()), None)
        self.probe = None if weights is None else (weights[0], weights[0].dtype)
        self.executor.clear_plans()
        self._report(model)

    def _report(self, model) -> None:
        """Warn once about what runs at PEFT's speed: a whole non-LoRA model, or modules on PEFT's path."""
        if self.peft_only is not None:
            if "" not in self.reported:
                self.reported.add("")
                warnings.warn(f"csgmv: {self.peft_only}; calls with ids run PEFT's own mixed-batch path", stacklevel=3)
            return
        slow = [n for n, m in self.peft_path.items() if n not in self.reported and _held_adapters(m)]
        slow += [n for n, layer in self.layers.items() if n not in self.reported and layer._csgmv_peft]
        if slow:
            self.reported.update(slow)
            shown = ", ".join(slow[:6]) + (f" and {len(slow) - 6} more" if len(slow) > 6 else "")
            warnings.warn(
                f"csgmv: {len(slow)} module(s) run (some of) their adapters through PEFT's own mixed-batch path, at "
                f"PEFT's speed: {shown}",
                stacklevel=3,
            )

    def kernel_reason(self, layer: nn.Module, name: str) -> str | None:
        """:func:`_kernel_reason`, and, where ``enable_csgmv`` was given no ``dtype``, an adapter whose weights are
        of a narrower (or another half-precision) dtype than the layer's base weight: PEFT rounds the layer's input to
        the adapter's dtype before its products, which the kernels do not, so its rows take PEFT's path (PEFT's
        numbers). Wider adapters (PEFT's fp32 default on a half-precision model) and same-dtype ones run the kernels."""
        reason = _kernel_reason(layer, name)
        if reason is not None or self.dtype is not None:
            return reason
        a = layer_adapter(layer, name)[0]
        weight = getattr(layer.get_base_layer(), "weight", None)
        if (
            weight is None
            or a.dtype == weight.dtype
            or not (a.dtype.is_floating_point and weight.dtype.is_floating_point)
        ):
            return None
        if torch.finfo(a.dtype).bits <= torch.finfo(weight.dtype).bits:
            return f"weights in {a.dtype} on a {weight.dtype} layer"
        return None

    @_normal_tensors
    def _restack(self, layer: nn.Module) -> None:
        """Copy one layer's adapters again (PEFT rescaled it)."""
        self.stack_layer(layer, force=True)

    def stack_layer(self, layer: nn.Module, force: bool = False) -> None:
        """Bring one kernel-path layer's stack in line with its adapters: copy new or replaced ones (all with
        ``force``), clear the rest. Adapters the kernels do not serve here get rank 0 in the stack and are named in
        the layer's ``_csgmv_peft``: their rows run through PEFT's forward of this layer. Also called when PEFT
        rescales the layer (``set_scale``, ``scale_layer``, ``unscale_layer``, or a new ``scaling`` dict as
        ``peft.helpers.rescale_adapter_scale`` sets). The host tier brings adapters into slots on its own
        (:meth:`~peft_csgmv.tier.HostTier.bring_in`)."""
        stack: LoraStack = layer._csgmv_stack
        names = self.registry.names
        peft_rows = set()
        for slot, name in enumerate(names):
            weights = None if name is None else layer_adapter(layer, name)  # a lookup: layers may hold thousands
            if weights is None:
                stack.clear_slot(slot)
                continue
            if self.kernel_reason(layer, name) is not None:
                peft_rows.add(name)
                if layer.use_dora.get(name, False):
                    self.dora_refused.add(name)
                stack.clear_slot(slot)
                continue
            a, b = weights
            held = stack.held.get(slot)
            if force or held is None or held.a is not a:
                dora = _dora_scale(layer, name) if layer.use_dora.get(name, False) else None
                lora_bias = None if stack.embedding else module_param(layer._modules["lora_B"][name], "bias")
                # PEFT's weights become views into the stack where dtype and device allow: one copy of each adapter.
                share = isinstance(a, nn.Parameter) and a.dtype == b.dtype == stack.dtype and a.device == stack.device
                stack.set_slot(slot, a, b, layer.scaling[name], dora=dora, lora_bias=lora_bias, share=share)
        stack.ensure_capacity(self.registry.capacity)
        for slot in range(len(names), stack.capacity):
            stack.clear_slot(slot)
        stack.scaling_src = layer.scaling
        if force:
            stack.compact()
        stack.refresh()
        set_peft_rows(layer, peft_rows)

    def stack_dtype(self, layer: nn.Module) -> torch.dtype:
        """The dtype of a layer's stack: ``enable_csgmv``'s ``dtype`` where given, else the adapters' own (PEFT's
        numerics: fp32 adapters on a bf16 model, PEFT's default, are computed in fp32), the widest where they differ."""
        if self.dtype is not None:
            return self.dtype
        dtypes = {a.dtype for a, _ in layer_adapters(layer).values() if a.dtype.is_floating_point}
        if not dtypes:  # no adapter yet: the base weight's dtype, or fp32 for a quantized one
            weight = getattr(layer.get_base_layer(), "weight", None)
            return weight.dtype if weight is not None and weight.dtype.is_floating_point else torch.float32
        return max(dtypes, key=lambda d: torch.finfo(d).bits)

    def _new_stack(self, layer: nn.Module) -> LoraStack:
        # Storage for exactly the adapters that get a slot here now (later ones: see slots.py).
        slotted = [
            a.shape[0]
            for n, (a, _) in layer_adapters(layer).items()
            if n in self.registry.index and self.kernel_reason(layer, n) is None
        ]
        device, dtype = weights_device(layer), self.stack_dtype(layer)
        if self.tier is not None and device.type == "cpu":  # the layer's first adapter may wait in host memory
            weight = getattr(layer.get_base_layer(), "weight", None)
            if weight is not None and weight.device.type not in ("cpu", "meta"):
                device = weight.device
        return LoraStack(
            in_features=layer.in_features,
            out_features=layer.out_features,
            capacity=max(self.registry.capacity, 1),
            dtype=dtype,
            device=device,
            embedding=_is_embedding(layer),
            reserve=sum(LoraStack.slot_elements(r, layer.in_features, layer.out_features) for r in slotted),
            pages=None if self.tier is None else self.tier.pages_for(device, dtype),
        )

    def release(self) -> None:
        if self.max_resident is not None:  # PEFT holds every adapter on the device again
            for layer in self.layers.values():
                for name in layer_adapters(layer):
                    move_adapter(layer, name, layer._csgmv_stack.device)
        for module in [*self.layers.values(), *self.peft_path.values()]:
            unpatch_layer(module)
        self.layers, self.peft_path = {}, {}
        self.executor.clear_plans()
        if self.static_cache is not None:
            self.static_cache.drop()

    # -- per call -------------------------------------------------------------------------------------------------

    # -- the host tier ----------------------------------------------------------------------------------------------

    def _check_residency(self, needed, what: str) -> None:
        if self.max_resident is not None and len(needed) > self.max_resident:
            raise ValueError(
                f"this call's `{what}` need {len(needed)} distinct adapters, more than the {self.max_resident} that "
                f"fit on the device (enable_csgmv(..., max_resident_adapters={self.max_resident})): split the batch "
                "or raise max_resident_adapters"
            )

    def make_resident(self, needed) -> list:
        """Give every adapter in ``needed`` a slot (host tier only): the least recently used residents that are not
        needed go back to host memory, the needed ones come in (one copy of each into its slot's page; PEFT's weights
        become views of it again). ``needed`` fits: :meth:`_check_residency` ran first. Returns the events of the
        copies out still in flight (:func:`~peft_csgmv.tier.copies_out`), which the caller settles before host code
        may read the weights that went out (as its call ends)."""
        tier = self.tier
        if tier is None:
            return []
        missing = [n for n in needed if n not in self.registry.index]
        out = []
        if missing:
            with no_gc_pauses():
                try:
                    out = self._bring_in(missing, needed)
                except BaseException:
                    self._abandon(missing)
                    raise
        for name in needed:
            tier.lru.move_to_end(name)
        return out

    def _bring_in(self, missing: list[str], needed) -> list:
        """:meth:`make_resident`'s moves: evict the least recently used residents that are not needed, then bring
        ``missing`` into their slots; the events of the copies out."""
        tier = self.tier
        victims = [n for n in tier.lru if n not in needed]
        # Slots whose adapter left, by the stacks that still describe it: a slot's next adapter writes the same
        # fields in the stacks it has a part in, so the slot is emptied only in the others (most often none).
        held: dict[int, list[LoraStack]] = {}
        try:
            for name in missing:
                if len(self.registry.index) >= self.max_resident:
                    victim = victims.pop(0)
                    slot = self.registry.index[victim]
                    held[slot] = self._evict(victim, empty=False)
                self.registry.add(name)
                tier.lru[name] = None
            out = copies_out(self.layers.values()) if held else []
            stacks = {layer._csgmv_stack for layer in self.layers.values()}
            for stack in stacks:
                stack.ensure_capacity(self.registry.capacity)
            for name in missing:
                slot = self.registry.index[name]
                if slot in held:
                    tier.refill(name, slot, held.pop(slot))
                tier.bring_in(name, slot, _dora_scale, self.dora_refused)
        finally:  # (slots left unfilled: emptied in full, as an eviction does)
            for slot, left in held.items():
                vacate(slot, left)
        for stack in stacks:
            stack.refresh()
        return out

    def _abandon(self, missing: list[str]) -> None:
        """Undo a bring-in that failed part way (out of memory, an interrupt): the adapters it was bringing in leave
        their slots and the registry again, and their weights go back to their host regions, so no slot claims
        weights it was not given and the next call brings them in afresh; the residents evicted for them stay in
        host memory."""
        tier = self.tier
        layers = list(self.layers.values())
        for name in missing:
            slot = self.registry.index.get(name)
            if slot is None:
                continue
            tier.park(name)  # from wherever each weight got to: its page, its host region, the device
            vacate(slot, [layer._csgmv_stack for layer in layers])
            for layer in layers:
                if name in layer._csgmv_peft:
                    set_peft_rows(layer, layer._csgmv_peft - {name})
            self.registry.remove(name)
            tier.lru.pop(name, None)
        for layer in layers:
            layer._csgmv_stack.refresh()
        host_copies_done(layers)
        tier.page_out.clear()

    def _evict(self, name: str, empty: bool = True) -> list[LoraStack]:
        # Its weights leave the slot as they are (edits included), copied out first: a copy that fails leaves the
        # adapter resident and shared as it was. (``empty``: see HostTier.evict.)
        stacks = self.tier.evict(name, self.registry.index[name], empty)
        self.registry.remove(name)
        self.tier.lru.pop(name)
        return stacks

    @property
    def resident(self) -> list[str]:
        """The adapters with a slot, least recently used first."""
        return list(self.tier.lru) if self.tier is not None else list(self.registry.index)

    def restack_rescaled(self) -> None:
        """Restack the layers whose ``scaling`` dict PEFT replaced (``peft.helpers.rescale_adapter_scale`` assigns a new
        one; ``set_scale`` and friends are caught as they happen)."""
        for layer in self.layers.values():
            if layer.scaling is not layer._csgmv_stack.scaling_src:
                self.stack_layer(layer, force=True)

    def validate(
        self, model, ids: Sequence[str | None], arg: str, args: tuple, kwargs: dict, generate: bool = False
    ) -> None:
        """Validate ``ids`` for a call with these inputs, after :meth:`sync`; raises before anything runs or moves. The
        checks and messages are PEFT's (``adapter_names`` reads as ``arg``). PEFT's spelling takes PEFT's length rule:
        one name per input row (``generate`` repeats them for beams, as PEFT does, and refuses returned sequences
        without beams, as PEFT's layers do); ``adapter_ids`` may also have a length that divides the batch, each id
        then covering that many consecutive rows."""
        _check_ids(ids, arg)
        batch_size = _check_inputs(args, kwargs, arg)
        if model.training:
            raise ValueError(f"Cannot pass `{arg}` when the model is in training mode.")
        unknown = {i for i in ids if i not in BASE_NAMES and i not in self.known}
        if unknown:
            raise ValueError(
                f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}. "
                f"Loaded adapters: {', '.join(sorted(self.known)) or '(none)'}; use None or '__base__' for base rows."
            )
        rows = batch_size
        if arg == "adapter_names" and generate and batch_size == len(ids):
            beams = _generation_setting(model, args, kwargs, "num_beams") or 1
            returned = _generation_setting(model, args, kwargs, "num_return_sequences") or 1
            if beams <= 1 and returned > 1:  # (PEFT repeats names for beams only; its layers then see more rows)
                rows = batch_size * returned
        if rows is not None and (rows % len(ids) != 0 or (arg == "adapter_names" and rows != len(ids))):
            raise ValueError(
                f"Length of `{arg}` should be the same as the number of inputs, but got {len(ids)} and {rows} "
                "respectively."
            )
        if any(getattr(m, "merged", False) for m in (*self.layers.values(), *self.peft_path.values())):
            raise ValueError(
                f"Cannot pass `{arg}` when there are merged adapters, please call `unmerge_adapter` first."
            )
        if not self.dora_refused.isdisjoint(ids):
            raise ValueError(PEFT_DORA_ERROR.format(arg=arg))
        self._check_residency(_adapters_in(ids), arg)

    def slots_for(self, ids: Sequence[str | None], copies_out: list | None = None) -> tuple[int, ...]:
        """The slot of each row of a validated call (``-1`` for base rows), its adapters made resident first.
        ``copies_out``: a call's list, which takes :meth:`make_resident`'s events for the call to settle as it ends;
        without it they are settled before this returns."""
        out = self.make_resident(_adapters_in(ids))
        if copies_out is None:
            settle(out)
        else:
            copies_out += out
        index = self.registry.index
        return tuple(-1 if i in BASE_NAMES else index[i] for i in ids)


def _adapters_in(ids) -> list[str]:
    """The distinct adapters of a call, in order of first use (base rows left out)."""
    return list(dict.fromkeys(i for i in ids if i not in BASE_NAMES))


def _check_ids(ids, arg: str) -> None:
    if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"Got {arg} of type {type(ids)}, expected a list of str.")
    bad = [i for i in ids if i is not None and not isinstance(i, str)]
    if bad:
        raise TypeError(f"`{arg}` must hold adapter names (str) or None for base rows; got {bad[0]!r}")
    if len(ids) == 0:
        raise ValueError(f"`{arg}` is empty; give one adapter name (or None / '__base__') per input row")


def _check_model(model) -> None:
    PeftModel, _, _ = _peft_classes()
    if not isinstance(model, PeftModel):
        raise TypeError(f"enable_csgmv expects a peft.PeftModel, got {type(model).__name__}")


def _not_lora(model) -> str | None:
    """Why the kernels cannot serve ``model`` at all (adapters of another PEFT method), or ``None``."""
    other = [
        f"'{name}': {getattr(cfg.peft_type, 'value', cfg.peft_type)}"
        for name, cfg in model.peft_config.items()
        if str(cfg.peft_type) not in ("LORA", "PeftType.LORA")
    ]
    return f"adapters that are not LoRA ({', '.join(other)})" if other else None


def _held_adapters(module: nn.Module) -> set[str]:
    """Names of the adapters a PEFT layer or auxiliary wrapper holds (``{"?"}`` when it cannot tell)."""
    try:
        return set(module._get_available_adapters())
    except (AttributeError, NotImplementedError):
        return {"?"}


_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "decoder_input_ids")


def _main_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, bool]:
    """The call's batched input and whether it holds tokens (ids or embeddings: dim 1 is the sequence)."""
    for key in _TOKEN_INPUTS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value, True
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
        return args[0], not args[0].dtype.is_floating_point
    return None, False


def _check_inputs(args: tuple, kwargs: dict, arg: str) -> int | None:
    """The batch size of the call (``None`` when it has no batched tensor input); refuses an empty batch or sequence
    before anything runs."""
    value, tokens = _main_input(args, kwargs)
    if value is None:
        return None
    if value.shape[0] == 0:
        raise ValueError(f"`{arg}` was given with an input of 0 rows; pass at least one row")
    if tokens and value.dim() >= 2 and value.shape[1] == 0:
        raise ValueError(f"`{arg}` was given with inputs of 0 tokens per row; pass at least one token per row")
    return value.shape[0]


def _pop_ids(kwargs: dict) -> tuple[Sequence[str | None] | None, str]:
    ids = kwargs.pop("adapter_ids", None)
    names = kwargs.pop("adapter_names", None)
    if ids is not None and names is not None:
        raise ValueError("Pass either `adapter_ids` or `adapter_names`, not both.")
    if names is not None:
        return names, "adapter_names"
    return ids, "adapter_ids"


def _alora_offsets(model, names: tuple[str, ...], args: tuple, kwargs: dict, generate: bool):
    """The aLoRA offsets PEFT computes for this call (``PeftModelForCausalLM`` does, when an aLoRA adapter is in the
    batch), or the ones the caller passed; ``None`` when there are none. PEFT's own helpers, so the offsets are
    PEFT's."""
    offsets = kwargs.pop("alora_offsets", None)
    if offsets is not None:
        return offsets
    from peft import PeftModelForCausalLM

    if not isinstance(model, PeftModelForCausalLM):
        return None
    try:
        from peft.tuners.lora.variants import get_alora_offsets_for_forward, get_alora_offsets_for_generate
    except ImportError:  # a PEFT without aLoRA
        return None
    kw = dict(kwargs, adapter_names=list(names))
    if generate:
        kw = get_alora_offsets_for_generate(model, *args, **kw)
    else:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        kw.pop("input_ids", None)
        inputs_embeds = kw.pop("inputs_embeds", None)
        kw = get_alora_offsets_for_forward(model, input_ids, inputs_embeds, **kw)
    offsets = kw.get("alora_offsets")
    if offsets is not None and generate and isinstance(kwargs.get("num_beams"), int) and kwargs["num_beams"] > 1:
        raise ValueError("Beam search not yet supported for aLoRA.")
    return offsets


def _row_keep(model, names: tuple[str, ...], offsets, arg: str) -> tuple[int | None, ...] | None:
    """Per row of a call: ``None`` where its adapter applies to every token, else how many of its last tokens it
    applies to: an aLoRA adapter's rows, from PEFT's offsets (0 where PEFT found no invocation, or computed none: PEFT
    then runs those rows as base rows). ``None`` when the call has no aLoRA row."""
    configs = model.peft_config
    alora = [name != BASE and getattr(configs.get(name), "alora_invocation_tokens", None) is not None for name in names]
    if not any(alora):
        return None
    if offsets is not None and len(offsets) != len(names):
        raise ValueError(f"`alora_offsets` holds {len(offsets)} entries for the {len(names)} entries of `{arg}`")
    return tuple(
        (0 if offsets is None or offsets[i] is None else int(offsets[i])) if is_alora else None
        for i, is_alora in enumerate(alora)
    )


@torch.compiler.disable
@_normal_tensors
def _open_call(model, args: tuple, kwargs: dict, generate: bool) -> Executor | None:
    """Validate the ids of one call (popped from ``kwargs``) and open it on the model's executor, which the caller
    closes with :func:`_close_call` whatever happens; ``None`` when the call has no ids for the kernels (no ids, under
    ``disable_adapter()``, or a model PEFT's path serves whole: then ``kwargs`` carries PEFT's ``adapter_names``).
    Host work: never traced by torch.compile."""
    state: CsgmvState = model._csgmv
    ids, arg = _pop_ids(kwargs)
    if ids is None or not model.has_active_enabled_adapter:
        # No ids, or under ``disable_adapter()``: PEFT ignores adapter_names there, and so do we. With the host tier,
        # PEFT's own forward needs the active adapters' weights on the device.
        if state.max_resident is not None and model.has_active_enabled_adapter:
            state.sync(model)
            active = [n for n in model.active_adapters if n in model.peft_config]
            state._check_residency(active, "active adapters")
            settle(state.make_resident(active))
        return None
    state.sync(model)
    if state.peft_only is not None:
        # Nothing for the kernels: PEFT's own path, whole (its results, its errors).
        kwargs["adapter_names"] = (
            [BASE if i is None else i for i in ids] if isinstance(ids, (list, tuple)) and arg == "adapter_ids" else ids
        )
        return None
    state.validate(model, ids, arg, args, kwargs, generate)
    names = tuple(BASE if i in BASE_NAMES else i for i in ids)
    offsets = _alora_offsets(model, names, args, kwargs, generate)  # may raise PEFT's own error: before any move
    keep = _row_keep(model, names, offsets, arg)
    out: list = []
    row_slots = state.slots_for(ids, out)
    try:
        state.restack_rescaled()
        executor = state.executor
        executor.check_groups()
        executor.begin(
            CallContext(
                row_slots=row_slots, names=names, arg_name=arg, alora_offsets=offsets, row_keep=keep, copies_out=out
            )
        )
    except BaseException:
        settle(out)
        raise
    return executor


@torch.compiler.disable
def _close_call(executor: Executor, failed: bool = False) -> None:
    executor.end(failed)


@contextlib.contextmanager
def _closing(executor: Executor) -> Iterator[None]:
    """Close the call opened on ``executor`` when the block ends (as failed, where the block raised)."""
    try:
        yield
    except BaseException:
        _close_call(executor, failed=True)
        raise
    _close_call(executor)


def _defers_stop_check(model, args: tuple, kwargs: dict) -> bool:
    """Whether this ``generate`` call with ids reads transformers' stop flag one step late (``enable_csgmv``'s
    ``defer_stop_check``: by default for calls that do not sample, whose results and random state stay exactly
    transformers'; ``True`` for sampling calls too). Whether it samples: its ``do_sample``, else that of the
    generation config it passes (by keyword or by position), else the model's."""
    policy = model._csgmv.defer_stop_check
    if policy is not None:
        return policy
    return not _generation_setting(model, args, kwargs, "do_sample")


def _generation_setting(model, args: tuple, kwargs: dict, name: str):
    """A ``generate`` call's setting ``name``: its keyword, else that of the generation config it passes (by keyword
    or by position), else the model's (``None`` where none says)."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config")
    if config is None:
        config = next((a for a in args if isinstance(a, GenerationConfig)), None)
    if config is None:
        config = getattr(model.get_base_model(), "generation_config", None)
    return getattr(config, name, None)


@torch.compiler.disable
def _acquire(model) -> threading.RLock:
    """Take the model's call lock (see :attr:`~peft_csgmv.executor.Executor.lock`): a call from another thread waits
    here until the call in progress has ended. Re-entrant: a model called again inside a call, on its thread."""
    lock = model._csgmv.executor.lock
    lock.acquire()
    return lock


@torch.compiler.disable
def _release(lock: threading.RLock) -> None:
    lock.release()


def _run(model, method, args: tuple, kwargs: dict, generate: bool):
    # Every call, with ids or not, holds the model's lock to its end: the layers read the call in progress from the
    # model's state, so calls from several threads run one at a time, each with its own ids.
    lock = _acquire(model)
    try:
        executor = _open_call(model, args, kwargs, generate)
        if executor is None:
            return method(model, *args, **kwargs)
        kept = model._csgmv.static_cache if generate else None
        defer = generate and _defers_stop_check(model, args, kwargs)
        with _closing(executor):
            with torch.no_grad(), kept.lend(model.get_base_model()) if kept is not None else contextlib.nullcontext():
                with deferred_stop_check(defer):
                    out = method(model, *args, **kwargs)
            if kept is not None:
                kept.returned(out)
        return out
    finally:
        _release(lock)


@contextlib.contextmanager
def adapter_ids_scope(model, adapter_ids: Sequence[str | None]) -> Iterator[None]:
    """Apply ``adapter_ids`` to every patched layer called inside the block, as a call of the model with those ids
    does (validated the same way; for calling layers directly: benchmarks, tests, a compiled layer). The block holds
    the model's call lock: another thread's call waits until it ends."""
    with model._csgmv.executor.lock:
        executor = _open_call(model, (), {"adapter_ids": adapter_ids}, generate=False)
        with _closing(executor) if executor is not None else contextlib.nullcontext():
            yield


# The wrappers run eagerly under torch.compile (validation and the ids are host work, in the disabled helpers above);
# the model's own forward inside them is compiled, its LoRA layers included.
@torch.compiler.disable(recursive=False)
def _forward(self, *args: Any, **kwargs: Any):
    return _run(self, _own_method(self, "forward"), args, kwargs, generate=False)


@torch.compiler.disable(recursive=False)
def _generate(self, *args: Any, **kwargs: Any):
    return _run(self, _own_method(self, "generate"), args, kwargs, generate=True)


def _load_adapter(self, *args: Any, **kwargs: Any):
    """PEFT's ``load_adapter``; with the host tier, the adapters beyond ``max_resident_adapters`` then go to host
    memory at once (:func:`_park_loaded`), so that loading many adapters never holds more than N + 1 on the device.
    It holds the model's call lock: a call from another thread waits for the load, and the load for the call."""
    state = self.__dict__.get("_csgmv")
    with state.executor.lock if state is not None else contextlib.nullcontext():
        return _load_adapter_locked(self, state, args, kwargs)


def _load_adapter_locked(self, state, args: tuple, kwargs: dict):
    if state is None or state.tier is None:
        return _own_method(self, "load_adapter")(self, *args, **kwargs)
    state.loading += 1  # (PEFT's load_adapter calls add_adapter, whose weights are not loaded yet: no sync there)
    try:
        out = _own_method(self, "load_adapter")(self, *args, **kwargs)
    finally:
        state.loading -= 1
    _park_loaded(self, state)
    return out


def _add_adapter(self, *args: Any, **kwargs: Any):
    """PEFT's ``add_adapter``; with the host tier, as :func:`_load_adapter` (not for ``low_cpu_mem_usage=True``, whose
    weights are empty, on the meta device, until a state dict is loaded into them)."""
    state = self.__dict__.get("_csgmv")
    with state.executor.lock if state is not None else contextlib.nullcontext():
        out = _own_method(self, "add_adapter")(self, *args, **kwargs)
        empty = kwargs.get("low_cpu_mem_usage", args[2] if len(args) > 2 else False)
        if state is not None and state.tier is not None and not state.loading and not empty:
            _park_loaded(self, state)
    return out


@_normal_tensors
def _park_loaded(model, state: "CsgmvState") -> None:
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
    devices for the call (:func:`~peft_csgmv.layers.weights_lent`; ``state``'s layers, where the host tier parks
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


@_normal_tensors
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
    tuner = model.base_model
    if max_resident_adapters is not None and hasattr(tuner, "add_weighted_adapter"):
        tuner.__dict__["add_weighted_adapter"] = _add_weighted_adapter_lending(tuner, state)
    return model


@_normal_tensors
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
        restore_walks(module)
    if getattr(model.base_model.__dict__.get("add_weighted_adapter"), "_csgmv_lending", False):
        del model.base_model.__dict__["add_weighted_adapter"]
    _unpatch_model(model)
    return model


def csgmv_stats(model) -> dict:
    """What ``enable_csgmv`` holds for ``model`` (read-outs for benchmarks and monitoring):

    * ``kernel_layers``, ``peft_path_modules``: counts of the layers on the kernels and the modules on PEFT's path;
    * ``peft_row_layers``: kernel layers where some adapter's rows run PEFT's own forward (adapters the kernels do not
      serve there);
    * ``stack_bytes``: device memory of every stack; ``shared_bytes``: of that, PEFT's own adapter weights, which are
      views into the stacks (stored once);
    * ``plans_cached``: host-built plans kept for later calls with the same ids; ``static_plans``: plans of compiled
      shapes;
    * ``resident``: the adapters with a slot on the device, least recently used first with ``max_resident_adapters``;
      ``max_resident_adapters``: the option (None without the host tier); ``host_bytes``: host memory held for the
      host tier's adapters;
    * ``static_cache_bytes``: the static KV cache kept for the next ``generate`` (see ``keep_static_cache``)."""
    state: CsgmvState = model.__dict__["_csgmv"]
    return dict(
        kernel_layers=len(state.layers),
        peft_path_modules=len(state.peft_path),
        peft_row_layers=sum(1 for layer in state.layers.values() if layer._csgmv_peft),
        stack_bytes=sum(layer._csgmv_stack.nbytes for layer in state.layers.values())
        + (0 if state.tier is None else sum(pages.nbytes for pages in state.tier.pages.values())),
        shared_bytes=sum(layer._csgmv_stack.shared_bytes for layer in state.layers.values()),
        plans_cached=state.executor.num_plans,
        static_plans=len(state.executor.statics),
        resident=state.resident,
        max_resident_adapters=state.max_resident,
        host_bytes=0 if state.tier is None else state.tier.host.nbytes,
        static_cache_bytes=0 if state.static_cache is None else state.static_cache.nbytes,
    )


def is_csgmv_enabled(model) -> bool:
    return "_csgmv" in model.__dict__
