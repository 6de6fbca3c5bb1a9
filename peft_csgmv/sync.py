"""Adapter sync: PEFT's adapters brought into csgmv's stacks, and the state ``enable_csgmv`` attaches to a model.

:class:`CsgmvState` holds a model's slot registry, its patched layers and their stacks, the host tier and the executor.
:meth:`CsgmvState.sync` runs at the start of every call (a few C-level comparisons when nothing changed) and brings
slots and stacks in line with what PEFT holds: new LoRA layers are patched, new adapters get a slot, deleted ones free
theirs, replaced ones are copied again; every other PEFT tuner layer and auxiliary wrapper gets PEFT's mixed-batch
path. Which adapters the kernels serve in a layer is :meth:`CsgmvState.kernel_reason`'s answer. With the host tier,
:meth:`CsgmvState.make_resident` gives a call's adapters slots (least recently used out).
"""

from __future__ import annotations

import operator
import warnings
from typing import Sequence

import torch
from torch import nn

from .executor import Executor
from .offload import adapter_weights, execution_device, offloaded_param, on_meta
from .options import Options
from .patching import (
    WeakMethod,
    is_patched,
    patch_experts,
    patch_layer,
    patch_peft_path,
    skip_parameter_walks,
    unpatch_layer,
    unpatched_type,
)
from .slots import (
    LoraStack,
    SlotRegistry,
    bump_routes,
    layer_adapter,
    layer_adapters,
    module_param,
    set_peft_rows,
    weights_device,
)
from .static_cache import KeptStaticCache
from .tier import HostTier, host_copies_done, move_adapter, wait_for_copies

BASE = "__base__"
BASE_NAMES = (None, BASE)


def peft_classes():
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


EXPERT_PARAMETERS = frozenset({"gate_up_proj", "down_proj"})


def _experts_parts(wrapper: nn.Module) -> tuple[nn.Module, dict]:
    from .moe import param_wrappers

    return param_wrappers(wrapper)


def _experts_wrappers(module: nn.Module) -> dict | None:
    """``{parameter name: ParamWrapper}`` where ``module`` is the outer PEFT ``ParamWrapper`` of a MoE experts module
    csgmv serves (a transformers ``@use_experts_implementation`` class with a gate and no post-expert norm, whose 3-D
    ``gate_up_proj`` / ``down_proj`` carry the wrappers), else ``None`` (PEFT's path)."""
    from peft.tuners.lora.layer import ParamWrapper

    if not isinstance(module, ParamWrapper):
        return None
    experts, wrappers = _experts_parts(module)
    if (
        not wrappers
        or not set(wrappers) <= EXPERT_PARAMETERS
        or not callable(getattr(experts, "_apply_gate", None))
        or not getattr(experts, "has_gate", True)
        or getattr(experts, "has_post_expert_norm", False)
        or not isinstance(getattr(experts, "num_experts", None), int)
        or any(getattr(experts, p, None) is None or getattr(experts, p).dim() != 3 for p in EXPERT_PARAMETERS)
    ):
        return None
    return wrappers


def _experts_device(wrapper: nn.Module) -> torch.device:
    """Where the host tier keeps an experts parameter's stack: with its base parameter (its adapters' weights may
    wait in host memory)."""
    return wrapper.get_param().device


def _experts_reason(wrapper: nn.Module, name: str) -> str | None:
    """Why an experts layer cannot serve adapter ``name`` of one of its wrappers (``None``: it can)."""
    if wrapper.use_dora.get(name, False):
        return "DoRA"
    if getattr(wrapper.lora_B[name], "bias", None) is not None:
        return "lora_bias"
    if getattr(wrapper, "lora_variant", {}).get(name) is not None:
        return "a LoRA variant"
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
outside_inference_mode = torch.inference_mode(False)


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
        self.registry = SlotRegistry()
        self.tier = None if max_resident is None else HostTier(max_resident, self.registry)
        self.loading = 0  # PEFT's load_adapter under way (its add_adapter then waits for the load to sync)
        # With the host tier: some offloaded layer's stack may not hold its slots' adapters (a restack failed part way)
        self.offload_stale = False
        # Runs the layers' LoRA for each call; it restacks a layer through this state when PEFT rescales it.
        # (its restack through a weak method: no cycle through the executor)
        self.executor = Executor(backend, WeakMethod(CsgmvState._restack, self), Options.from_env())
        self.layers: dict[str, nn.Module] = {}  # module name -> lora.Linear / lora.Embedding on the kernels
        # Of them (as of the last sync): those the host tier holds, and those accelerate offloads (:meth:`_tiered`)
        self.tiered: list[nn.Module] = []
        self.offloaded: list[nn.Module] = []
        self.peft_path: dict[str, nn.Module] = {}  # module name -> module on PEFT's mixed-batch path
        # module name -> experts layer: the outer PEFT ParamWrapper of a MoE experts module, its stacks in its record
        self.experts: dict[str, nn.Module] = {}
        self.peft_only: str | None = None  # why calls with ids go to PEFT whole (adapters that are not LoRA)
        self.known: frozenset[str] = frozenset()  # the adapter names PEFT accepts in `adapter_names`
        self.alora: frozenset[str] = frozenset()  # the aLoRA adapters (their configs' alora_invocation_tokens)
        self.dora_refused: set[str] = set()  # DoRA adapters held by a layer whose PEFT path refuses DoRA
        self.reported: set[str] = set()  # modules already named in the PEFT-path warning
        # The adapters' names and config objects when last synced (see _unchanged; the objects kept alive here).
        self.fingerprint: tuple[list, tuple] | None = None
        # One adapter weight and its dtype when last synced: a cast of the model (model.to(dtype), .half()) gives every
        # weight a new dtype, and the next call restacks (a probe of one weight: read on every call).
        self.probe: tuple[torch.Tensor, torch.dtype] | None = None
        # One base weight of a kernel layer and where it was when the stacks last followed their layers
        # (follow_weights), and the devices the kernel layers' stacks are on (those a call's plans are prepared for).
        self.place: tuple[torch.Tensor, torch.device] | None = None
        self.devices: tuple[torch.device, ...] = ()
        # generate_batch's adapter ids by thread, for the manager's add_requests it makes (peft_csgmv.continuous)
        self.batch_ids: dict[int, list] = {}
        # Why an adapter cannot be given per request under continuous batching (None: it can), by name, since the
        # last sync that changed something (peft_csgmv.continuous.refusal: read at every step)
        self.refusals: dict[str, str | None] = {}

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
        # (stacks may be freed, reallocated or rewritten below: an asynchronous step still running reads them)
        self.executor.settle()
        self.refusals = {}  # (what a request may be given is decided again: peft_csgmv.continuous.refusal)
        self.peft_only = _not_lora(model)
        found: dict[str, nn.Module] = {}
        peft_path: dict[str, nn.Module] = {}
        experts: dict[str, nn.Module] = {}
        inner: set[int] = set()  # the inner ParamWrappers of experts layers (part of their layer)
        known: set[str] = set()
        self.dora_refused = set()
        regroup = False  # a layer got a new stack
        if self.peft_only is None:
            _, LoraLayer, _ = peft_classes()
            Aux = _auxiliary_wrapper_class()
            names = list(model.peft_config)
            tier = self.tier
            for gone in [n for n in self.registry.index if n not in names]:
                if tier is not None:
                    tier.settle([gone])  # (a copy in still on its way lands before its slot is given again)
                    tier.lru.pop(gone, None)
                self.registry.remove(gone)
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
                    if id(module) in inner:
                        continue
                    wrappers = _experts_wrappers(module)
                    if wrappers is not None:
                        experts[mod_name] = module
                        inner.update(id(w) for w in wrappers.values() if w is not module)
                        continue
                    self.dora_refused.update(n for n in _held_adapters(module) if module.use_dora.get(n, False))
                    peft_path[mod_name] = module
                elif isinstance(module, Aux):
                    peft_path[mod_name] = module
            for module in peft_path.values():
                if not is_patched(module):
                    patch_peft_path(module, self.executor)
                module._csgmv_record.adapters = frozenset(_held_adapters(module))
            for module in experts.values():
                if not is_patched(module):
                    patch_experts(module, self.executor)
                self.stack_experts(module)
                module._csgmv_record.adapters = frozenset(_held_adapters(module))
            restack = set()
            for layer in found.values():
                where = execution_device(layer)  # (None: accelerate offloads nothing of it)
                if not is_patched(layer):
                    patch_layer(layer, self._new_stack(layer, where), self.executor)
                    regroup = True
                elif layer._csgmv_record.stack.dtype != self.stack_dtype(layer) or layer._csgmv_record.offload != where:
                    # An adapter of a wider dtype arrived (the stack takes that dtype), or accelerate placed the layer
                    # anew: a new stack, every slot copied again.
                    layer._csgmv_record.stack.release_shared()
                    layer._csgmv_record.stack = self._new_stack(layer, where)
                    restack.add(layer)
                    regroup = True
                layer._csgmv_record.offload = where
            if tier is not None:
                # Every adapter's place in its page; those without a slot wait in host memory, and residents whose
                # weights wait there (admitted now) come in from it.
                tier.lay_out(self._tiered(found.values()), names, self.registry, self.kernel_reason, experts.values())
                if len(names) > self.max_resident:  # (while every adapter has a slot, none can leave: no host memory)
                    tier.reserve(names)
                hosted = [n for n in names if n not in self.registry.index]
                for name in hosted:
                    tier.to_host(name)
                for slot, name in enumerate(self.registry.names):
                    if name is not None and tier.hosted(name):
                        tier.bring_in(name, slot, _dora_scale, self.dora_refused)
                if hosted:
                    host_copies_done([*self._tiered(found.values()), *experts.values()])
            for layer in found.values():
                self.stack_layer(layer, force or layer in restack)
        for old, new in ((self.layers, found), (self.peft_path, peft_path), (self.experts, experts)):
            for mod_name, module in old.items():
                if new.get(mod_name) is not module and is_patched(module):
                    unpatch_layer(module)
        self.layers, self.peft_path, self.experts, self.known = found, peft_path, experts, frozenset(known)
        self.tiered = self._tiered(found.values())
        self.offloaded = [layer for layer in found.values() if layer._csgmv_record.offload is not None]
        if found or peft_path or experts:
            skip_parameter_walks(model, [*found, *peft_path, *experts])
        self.fingerprint = (list(model.peft_config), tuple(model.peft_config.values()))
        self.alora = frozenset(
            name
            for name, config in model.peft_config.items()
            if getattr(config, "alora_invocation_tokens", None) is not None
        )
        if regroup and len(found) > 1:  # sibling groups name stacks by handle: learned again (Mapping.observe)
            self.executor.forget_groups(found.values())
        weights = next((w for layer in found.values() for w in layer_adapters(layer).values()), None)
        self.probe = None if weights is None else (weights[0], weights[0].dtype)
        self._find_devices()
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
        slow += [n for n, layer in self.layers.items() if n not in self.reported and layer._csgmv_record.peft_rows]
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
        if reason is None and layer.use_dora.get(name, False) and execution_device(layer) is not None:
            # (its norm needs the base weight, which accelerate brings for each forward only)
            reason = "DoRA on a layer accelerate offloads"
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

    @outside_inference_mode
    def _restack(self, layer: nn.Module) -> None:
        """Copy one layer's adapters again (PEFT rescaled it)."""
        self.stack_layer(layer, force=True)

    def stack_layer(self, layer: nn.Module, force: bool = False) -> None:
        """Bring one kernel-path layer's stack in line with its adapters: copy new or replaced ones (all with
        ``force``), clear the rest. Adapters the kernels do not serve here get rank 0 in the stack and are named in
        the layer's record (``peft_rows``): their rows run through PEFT's forward of this layer. Also called when PEFT
        rescales the layer (``set_scale``, ``scale_layer``, ``unscale_layer``, or a new ``scaling`` dict as
        ``peft.helpers.rescale_adapter_scale`` sets). The host tier brings adapters into slots on its own
        (:meth:`~peft_csgmv.tier.HostTier.bring_in`)."""
        stack: LoraStack = layer._csgmv_record.stack
        names = self.registry.names
        peft_rows = set()
        # An offloaded layer's adapters come from accelerate's weights maps (PEFT's parameters are on meta).
        offloaded = layer._csgmv_record.offload is not None
        adapter = adapter_weights if offloaded else layer_adapter
        for slot, name in enumerate(names):
            weights = None if name is None else adapter(layer, name)  # a lookup: layers may hold thousands
            if weights is None:
                stack.clear_slot(slot)
                continue
            if self.kernel_reason(layer, name) is not None or (offloaded and on_meta(*weights)):
                peft_rows.add(name)
                if layer.use_dora.get(name, False):
                    self.dora_refused.add(name)
                stack.clear_slot(slot)
                continue
            a, b = weights
            held = stack.records.get(slot)
            if force or held is None or held.a is not a:
                dora = _dora_scale(layer, name) if layer.use_dora.get(name, False) else None
                lora_b = None if stack.embedding else layer._modules["lora_B"][name]
                lora_bias = None if lora_b is None else (offloaded_param if offloaded else module_param)(lora_b, "bias")
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

    def stack_experts(self, wrapper: nn.Module) -> None:
        """Build an experts layer's stacks (one per adapted parameter, a slot per slot of the registry) from PEFT's
        weights (:func:`~peft_csgmv.moe.stack_from_peft`: PEFT's weights of adapters of each stack's largest rank
        become views into it, stored once and edited in place together; the others are copies, so those weights
        edited in place need ``enable_csgmv`` again). Adapters the layer cannot serve (DoRA, ``lora_bias``, a LoRA
        variant: PEFT refuses them here too) are named in its record's ``peft_rows``: a call that asks for one gets
        PEFT's path (PEFT's error)."""
        from .moe import stack_from_peft

        experts, wrappers = _experts_parts(wrapper)
        names = self.registry.names
        record = wrapper._csgmv_record
        refused = {n for w in wrappers.values() for n in w.lora_A if _experts_reason(w, n) is not None}
        slotted = [None if n in refused else n for n in names]
        tier = self.tier is not None
        if tier:
            # The host tier: a slot for each adapter that can be resident (no more: the stacks are on the device),
            # and every stack sized for every adapter (rank, dtype), so that any of them can come into any slot.
            held = {n for w in wrappers.values() for n in w.lora_A}
            slotted += [None] * (min(self.max_resident, len(held)) - len(slotted))
        stacks = {}
        for param, w in wrappers.items():
            chosen = [n for n in (w.lora_A if tier else slotted) if n in w.lora_A and n not in refused]
            dtypes = {w.lora_A[n].weight.dtype for n in chosen}
            dtype = self.dtype or (max(dtypes, key=lambda d: torch.finfo(d).bits) if dtypes else None)
            rank = max((w.r[n] for n in chosen), default=None) if tier else None
            device = _experts_device(w) if tier else None
            with torch.no_grad():  # (PEFT's weights of the stack's rank become views into it: stored once)
                stacks[param] = stack_from_peft(w, slotted, dtype, share=True, rank=rank, device=device)
            if tier:  # a resident's weights that are copies go where the stack is (from host memory, if there)
                for n in slotted:
                    if n is not None and n in w.lora_A:
                        for p in (w.lora_A[n].weight, w.lora_B[n].weight):
                            if p.device != stacks[param].a.device:
                                p.data = p.data.to(stacks[param].a.device, copy=True)
        # Weights the old stacks shared and the new ones do not (a wider adapter came) own their memory again.
        keep = {id(p) for stack in stacks.values() for p in stack.shared}
        for stack in (record.experts or {}).values():
            stack.release_shared(keep)
        record.experts = stacks
        record.experts_module = experts
        record.experts_wrappers = wrappers
        record.experts_slots = len(slotted)
        record.experts_scalings = {param: dict(w.scaling) for param, w in wrappers.items()}
        record.peft_rows = frozenset(refused)
        bump_routes()  # (compiled code found the old stacks by handle: its graphs trace again)

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

    def _new_stack(self, layer: nn.Module, where: torch.device | None = None) -> LoraStack:
        """A new stack for kernel layer ``layer``; ``where``: the execution device of a layer accelerate offloads
        (:func:`~peft_csgmv.offload.execution_device`), whose stack waits in host memory (out of the host tier's
        pages) and is lent to ``where`` for each forward where that is another device."""
        # Storage for exactly the adapters that get a slot here now (later ones: see slots.py).
        slotted = [
            a.shape[0]
            for n, (a, _) in layer_adapters(layer).items()
            if n in self.registry.index and self.kernel_reason(layer, n) is None
        ]
        dtype = self.stack_dtype(layer)
        if where is not None:
            device = torch.device("cpu")
            placed = dict(runs_on=None if where == device else where)
        else:
            device = weights_device(layer)
            if self.tier is not None and device.type == "cpu":  # the layer's first adapter may wait in host memory
                weight = getattr(layer.get_base_layer(), "weight", None)
                if weight is not None and weight.device.type not in ("cpu", "meta"):
                    device = weight.device
            placed = dict(pages=None if self.tier is None else self.tier.pages_for(device, dtype))
        return LoraStack(
            in_features=layer.in_features,
            out_features=layer.out_features,
            capacity=max(self.registry.capacity, 1),
            dtype=dtype,
            device=device,
            embedding=_is_embedding(layer),
            reserve=sum(LoraStack.slot_elements(r, layer.in_features, layer.out_features) for r in slotted),
            **placed,
        )

    def release(self) -> None:
        self.executor.settle()  # (an asynchronous step still running reads the stacks)
        if self.max_resident is not None:  # PEFT holds every adapter on the device again
            self.tier.settle(list(self.tier.ahead))  # (copies in still on their way land before the pages go)
            for layer in self.tiered:
                for name in layer_adapters(layer):
                    move_adapter(layer, name, layer._csgmv_record.stack.device)
            for wrapper in self.experts.values():  # (expert weights in host memory: memory of their own there)
                for w in _experts_parts(wrapper)[1].values():
                    device = _experts_device(w)
                    for name in w.lora_A:
                        for p in (*w.lora_A[name].parameters(), *w.lora_B[name].parameters()):
                            if p.device != device or self.tier.host.holds(p):
                                p.data = p.data.to(device, copy=True)
        for module in [*self.layers.values(), *self.peft_path.values(), *self.experts.values()]:
            unpatch_layer(module)
        self.layers, self.peft_path, self.experts = {}, {}, {}
        self.tiered, self.offloaded = [], []
        self.executor.clear_plans()
        if self.static_cache is not None:
            self.static_cache.drop()

    # -- the host tier (its own bookkeeping: tier.HostTier) -----------------------------------------------------------

    def _check_residency(self, needed, what: str) -> None:
        if self.tier is not None:
            self.tier.check_fits(needed, what)

    @staticmethod
    def _tiered(layers) -> list[nn.Module]:
        """The kernel layers of ``layers`` that the host tier holds: all but those accelerate offloads, whose stacks
        wait in host memory whatever their adapters (:mod:`peft_csgmv.offload`)."""
        return [layer for layer in layers if layer._csgmv_record.offload is None]

    def make_resident(self, needed) -> list:
        """Give every adapter in ``needed`` a slot (host tier only; :meth:`~peft_csgmv.tier.HostTier.make_resident`);
        the events of the copies out still in flight. The stacks of offloaded layers (out of the tier) then hold the
        adapters of the slots as they are now."""
        if self.tier is None:
            return []
        before = list(self.registry.names)
        out = self.tier.make_resident(needed, self.tiered, _dora_scale, self.dora_refused)
        self._restack_offloaded(before)
        return out

    def bring_in_ahead(self, names, keep) -> list[str]:
        """Bring adapters ``names`` into slots ahead of the step that needs them, beside the running steps, keeping
        ``keep`` (host tier only; :meth:`~peft_csgmv.tier.HostTier.bring_in_ahead`); the names brought in."""
        if self.tier is None:
            return []
        before = list(self.registry.names)
        brought = self.tier.bring_in_ahead(names, keep, self.tiered, _dora_scale, self.dora_refused)
        self._restack_offloaded(before)
        return brought

    def _restack_offloaded(self, before: list) -> None:
        """After adapters moved: the stacks of offloaded layers (out of the tier) hold the adapters of the slots as
        they are now."""
        if self.offloaded and (self.registry.names != before or self.offload_stale):
            self.offload_stale = True  # (until every offloaded stack holds its slots' adapters: a failure retries)
            for layer in self.offloaded:
                self.stack_layer(layer)
            self.offload_stale = False

    @property
    def resident(self) -> list[str]:
        """The adapters with a slot, least recently used first."""
        return list(self.tier.lru) if self.tier is not None else list(self.registry.index)

    def restack_rescaled(self) -> None:
        """Restack the layers whose ``scaling`` dict PEFT replaced (``peft.helpers.rescale_adapter_scale`` assigns a new
        one; ``set_scale`` and friends are caught as they happen)."""
        for layer in self.layers.values():
            if layer.scaling is not layer._csgmv_record.stack.scaling_src:
                self.stack_layer(layer, force=True)
        for wrapper in self.experts.values():  # (their scalings are copies: any change of a scaling restacks)
            record = wrapper._csgmv_record
            held = record.experts_scalings
            if any(held.get(param) != w.scaling for param, w in record.experts_wrappers.items()):
                self.stack_experts(wrapper)

    def follow_weights(self) -> None:
        """Before a call: where the model was moved since the last one (``model.to(device)``: a base weight of a
        kernel layer is elsewhere), every kernel layer's stack moves to its base layer's weight (not to its adapter
        weights: the host tier keeps those of adapters without a slot in host memory), and bindings to its old
        tensors are dropped. One read per call; a layer whose stack is not where its input is runs PEFT's own
        forward."""
        for wrapper in self.experts.values():  # (a few experts layers: read on every call)
            record = wrapper._csgmv_record
            stacks, wrappers = record.experts, record.experts_wrappers
            if any(stacks[p].a.device != w.get_param().device for p, w in wrappers.items() if p in stacks):
                self.stack_experts(wrapper)
        place = self.place
        if place is None or place[0].device == place[1]:
            return
        for layer in self.tiered:  # (offloaded layers: accelerate places their weights)
            stack, weight = layer._csgmv_record.stack, getattr(layer.get_base_layer(), "weight", None)
            if stack is not None and isinstance(weight, torch.Tensor) and weight.device.type != "meta":
                if stack.device != weight.device:
                    stack.to(weight.device)
                    self.executor.drop_bindings(stack)
        self._find_devices()

    def _find_devices(self) -> None:
        """The devices of the kernel layers' stacks, and the place :meth:`follow_weights` reads."""
        stacks = [(layer, layer._csgmv_record.stack) for layer in self.layers.values()]
        # (an offloaded layer's plans go where it runs, to which its stack is lent)
        self.devices = tuple(dict.fromkeys(stack.runs_on or stack.device for _, stack in stacks if stack is not None))
        weights = (getattr(layer.get_base_layer(), "weight", None) for layer, _ in stacks)
        weight = next((w for w in weights if isinstance(w, torch.Tensor)), None)
        self.place = None if weight is None else (weight, weight.device)

    def slots_for(self, ids: Sequence[str | None], copies_out: list | None = None) -> tuple[int, ...]:
        """The slot of each row of a validated call (``-1`` for base rows), its adapters made resident first.
        ``copies_out``: a call's list, which takes :meth:`make_resident`'s events for the call to wait for as it ends;
        without it they are waited for before this returns."""
        out = self.make_resident(adapters_in(ids))
        if copies_out is None:
            wait_for_copies(out)
        else:
            copies_out += out
        index = self.registry.index
        return tuple(-1 if i in BASE_NAMES else index[i] for i in ids)


def adapters_in(ids) -> list[str]:
    """The distinct adapters of a call, in order of first use (base rows left out)."""
    return list(dict.fromkeys(i for i in ids if i not in BASE_NAMES))


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
