"""Reversible patching of PEFT's modules: csgmv's forward through a subclass of each module's class (same name; or on
the instance, over a forward set there), PEFT's rescaling and merging methods wrapped on the instance, the parameter
walks torch.compile would make skipped; :func:`unpatch_layer` and :func:`restore_parameter_walks` undo each. Methods set
on an instance go through :class:`WeakMethod`, so patching leaves no reference cycle (a dropped model is freed at once).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import weakref
from typing import TYPE_CHECKING, Iterator

from torch import nn

from .executor import Executor, executor_of
from .layers import EXPERTS_LAYERS, KERNEL_LAYERS, experts_forward, kernel_forward, layer_keys, peft_path_forward
from .tier import adapter_params

if TYPE_CHECKING:
    import torch

    from .slots import LoraStack


class ModuleRecord:
    """What csgmv keeps on one patched module besides the two numbers compiled code reads at every step
    (``_csgmv_exec``, its executor's handle, and a kernel layer's ``_csgmv_key``: plain dict entries, each one C++
    guard, where a field read through this object costs a type guard more per layer). Read by eager code and by
    compiled code's general path, not by its routed path.

    Attributes:
        stack: a kernel layer's :class:`~peft_csgmv.slots.LoraStack`.
        peft_rows: the adapters PEFT's own forward serves in a kernel layer (:func:`~peft_csgmv.slots.set_peft_rows`).
        adapters: the adapter names a PEFT-path module holds (rows of others run its base module).
        siblings: a sibling group's first member: ``(key, the others' stack handles, their base weights)``.
        member: a sibling group's later member: ``(the group's key, its place)``.
        experts: an experts layer's stacks, ``{parameter name: MoeStack}`` (:mod:`peft_csgmv.moe`), of the slots'
            adapters; ``None`` for other modules.
        experts_scalings: the scalings an experts layer's stacks were built with, by parameter name.
        offload: where accelerate runs a kernel layer whose weights it offloads (:mod:`peft_csgmv.offload`: its
            adapters are read from accelerate's weights maps, its stack waits in host memory); ``None`` for others.
        experts_module: an experts layer's experts module (under PEFT's wrappers), ``experts_wrappers`` its PEFT
            ``ParamWrapper`` of each adapted parameter, and ``experts_slots`` the slots of its stacks (all set with
            ``experts``).
    """

    def __init__(self) -> None:
        self.stack: "LoraStack | None" = None
        self.peft_rows: frozenset = frozenset()
        self.adapters: frozenset = frozenset()
        self.siblings: tuple | None = None
        self.member: tuple | None = None
        self.experts: dict | None = None
        self.experts_scalings: dict = {}
        self.offload: "torch.device | None" = None
        self.experts_module: nn.Module | None = None
        self.experts_wrappers: dict = {}
        self.experts_slots: int = 0


def _patch(module: nn.Module, forward, executor: Executor) -> ModuleRecord:
    """Give ``module`` the csgmv ``forward`` (``module._csgmv_orig_forward`` is its own), its executor's handle and its
    :class:`ModuleRecord` (``_csgmv_record``).
    A module whose forward is its class's gets a subclass of that class with ``forward`` (made once per class, same
    name): compiled code then checks a patched module with one type guard, where an instance-level bound forward
    costs a Python guard per module (``module is module.forward.__self__``) at every step. A module with a forward of
    its own (accelerate's hooks) gets ``forward`` on the instance, over it."""
    module._csgmv_exec = executor.handle
    record = module.__dict__["_csgmv_record"] = ModuleRecord()
    if "forward" in module.__dict__:
        module._csgmv_orig_forward = module.forward
        module.forward = types.MethodType(forward, module)
    else:
        module.__class__ = patched_class(type(module), forward=forward)
    return record


_PATCHED_CLASSES: dict = {}


def patched_class(cls: type, **methods) -> type:
    """The subclass of ``cls`` with ``methods`` (one per class and methods; same name; ``_csgmv_base`` names
    ``cls``). Patching by class also leaves no reference cycle behind, where a bound method set on the instance would
    make one (see :class:`WeakMethod`)."""
    key = (cls, *sorted(methods.items()))
    sub = _PATCHED_CLASSES.get(key)
    if sub is None:
        namespace = {**methods, "_csgmv_orig_forward": cls.forward, "_csgmv_base": cls,
                     "__module__": cls.__module__, "__qualname__": cls.__qualname__}  # fmt: skip
        sub = _PATCHED_CLASSES[key] = type(cls.__name__, (cls,), namespace)
    return sub


def unpatched_type(module: nn.Module) -> type:
    """``type(module)`` as it was before csgmv patched it."""
    return type(module).__dict__.get("_csgmv_base", type(module))


class WeakMethod:
    """``function`` bound to ``owner`` as ``types.MethodType(function, owner)`` binds it, through a weak reference: for
    the methods csgmv sets on an instance (its ``__dict__``). A bound method there is a reference cycle (owner → its
    dict → the method → owner), and an object in a cycle is freed only when Python's cyclic collector next runs: a
    model dropped with ``del model`` would keep its weights (GPU memory) until then, where a stock one is freed at
    once. Called, introspected (``__func__``, ``__self__``, ``inspect.signature``: the bound method's) and named as
    the bound method would be."""

    def __init__(self, function, owner) -> None:
        self.__func__ = function
        self._owner = weakref.ref(owner)
        for attr in ("__module__", "__name__", "__qualname__", "__doc__"):
            if hasattr(function, attr):
                setattr(self, attr, getattr(function, attr))

    @property
    def __self__(self):
        return self._owner()

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(types.MethodType(self.__func__, self._owner()))

    def __call__(self, *args, **kwargs):
        return self.__func__(self._owner(), *args, **kwargs)

    def __repr__(self) -> str:
        return f"<csgmv method {getattr(self.__func__, '__qualname__', self.__func__)!r} of {self._owner()!r}>"


def method_function(owner: nn.Module, method: str):
    """What ``getattr(owner, method)`` calls, as a function of the owner (for :class:`WeakMethod`): an instance-level
    one set before csgmv's (kept as it is), else the class's."""
    own = owner.__dict__.get(method)
    if own is not None:
        return functools.wraps(own)(lambda _, *args, **kwargs: own(*args, **kwargs))
    return getattr(type(owner), method)


# PEFT methods that change a layer's scaling in place: after each, the layer's stack is refreshed.
_RESCALING_METHODS = ("set_scale", "scale_layer", "unscale_layer")


def _restack_after(layer: nn.Module, method: str) -> WeakMethod:
    original = method_function(layer, method)

    def wrapper(layer, *args, **kwargs):
        result = original(layer, *args, **kwargs)
        executor_of(layer._csgmv_exec).restack(layer)
        return result

    return WeakMethod(functools.wraps(original)(wrapper), layer)


# PEFT methods of a layer that compute with adapter weights outside a forward (merges and delta weights; a DoRA merge
# reads its magnitude too): with the host tier, the weights of an adapter that waits in host memory are lent to the
# layer's device for the call (device copies, PEFT's parameters re-pointed at them and back), since stock PEFT, which
# keeps every adapter on the device, computes there.
_WEIGHT_READERS = ("merge", "unmerge", "get_delta_weight")


def _adapters_read(layer: nn.Module, method: str, args: tuple, kwargs: dict) -> list:
    """The adapters a call of PEFT's ``method`` on ``layer`` reads: ``get_delta_weight(adapter)``'s, those
    ``unmerge()`` takes out, those ``merge(safe_merge, adapter_names)`` puts in (by default the active ones)."""
    if method == "get_delta_weight":
        return [args[0] if args else kwargs.get("adapter")]
    if method == "unmerge":
        return list(layer.merged_adapters)
    names = kwargs["adapter_names"] if "adapter_names" in kwargs else args[1] if len(args) > 1 else None
    return list(layer.active_adapters if names is None else names)


@contextlib.contextmanager
def weights_lent(pairs) -> Iterator[None]:
    """For the block, the weights of each ``(kernel layer, adapter)`` of ``pairs`` that wait off the layer's device
    (the host tier's) lent to it: PEFT's parameters re-pointed at device copies, and back after (what PEFT computes
    with them there, it computes as with weights that never left the device)."""
    lent = []
    try:
        for layer, name in pairs:
            device = layer._csgmv_record.stack.device
            for p in adapter_params(layer, name):
                if p.device != device and p.device.type != "meta":  # (meta: accelerate's to bring, not the tier's)
                    lent.append((p, p.data))
                    p.data = p.data.to(device)
        yield
    finally:
        for p, data in lent:
            p.data = data


def _lending(layer: nn.Module, method: str) -> WeakMethod:
    original = method_function(layer, method)

    def wrapper(layer, *args, **kwargs):
        with weights_lent([(layer, name) for name in _adapters_read(layer, method, args, kwargs)]):
            return original(layer, *args, **kwargs)

    return WeakMethod(functools.wraps(original)(wrapper), layer)


def patch_layer(layer: nn.Module, stack: "LoraStack", executor: Executor) -> None:
    """Give a kernel layer the csgmv forward (see :func:`_patch`), make its rescaling methods refresh the stack, and
    its merges lend host weights to the device (instance attributes; :func:`unpatch_layer` undoes them)."""
    layer._csgmv_key = key = next(layer_keys)
    KERNEL_LAYERS[key] = layer
    _patch(layer, kernel_forward, executor).stack = stack
    for method in _RESCALING_METHODS:
        if hasattr(layer, method):
            layer.__dict__[method] = _restack_after(layer, method)
    for method in _WEIGHT_READERS:
        if hasattr(layer, method):
            layer.__dict__[method] = _lending(layer, method)


def patch_peft_path(module: nn.Module, executor: Executor) -> None:
    """Give a module csgmv has no kernel for the PEFT path (see the module docstring)."""
    _patch(module, peft_path_forward, executor)


def patch_experts(wrapper: nn.Module, executor: Executor) -> None:
    """Give an experts layer (the outer PEFT ``ParamWrapper`` of a MoE experts module) csgmv's forward (see
    :func:`_patch`; :func:`unpatch_layer` undoes it). Its stacks go in its record's ``experts``. Each of its
    ``ParamWrapper`` s (the inner one too) gets its ``get_delta_weight`` (what PEFT's ``merge`` and ``unmerge`` read)
    with the adapter's weights lent to its parameter's device for the call (the host tier's, where they wait in host
    memory; a no-op where they are on the device)."""
    from .moe import param_wrappers

    wrapper._csgmv_key = key = next(layer_keys)
    EXPERTS_LAYERS[key] = wrapper
    _patch(wrapper, experts_forward, executor)
    for w in param_wrappers(wrapper)[1].values():
        if "get_delta_weight" not in w.__dict__:
            w.__dict__["get_delta_weight"] = _experts_lending(w)


def _experts_lending(w: nn.Module) -> WeakMethod:
    original = method_function(w, "get_delta_weight")

    def get_delta_weight(w, adapter_name, *args, **kwargs):
        device = w.get_param().device
        lent = []
        try:
            for p in (*w.lora_A[adapter_name].parameters(), *w.lora_B[adapter_name].parameters()):
                if p.device != device and p.device.type != "meta":
                    lent.append((p, p.data))
                    p.data = p.data.to(device)
            return original(w, adapter_name, *args, **kwargs)
        finally:
            for p, data in lent:
                p.data = data

    method = WeakMethod(functools.wraps(original)(get_delta_weight), w)
    method._csgmv_lending = True
    return method


def unpatch_layer(layer: nn.Module) -> None:
    state = layer.__dict__
    record = state.get("_csgmv_record")
    if record is not None and record.stack is not None:  # PEFT's weights own their memory again
        record.stack.release_shared()
    if record is not None and record.experts:  # (an experts layer's too)
        for stack in record.experts.values():
            stack.release_shared()
    if record is not None and record.stack is None:  # an experts layer's wrappers: their lending get_delta_weight
        from .moe import param_wrappers

        for w in param_wrappers(layer)[1].values():
            if getattr(w.__dict__.get("get_delta_weight"), "_csgmv_lending", False):
                del w.__dict__["get_delta_weight"]
    if "_csgmv_orig_forward" in state:  # patched on the instance: the instance's own forward again
        state["forward"] = state.pop("_csgmv_orig_forward")
    else:  # patched by class: its class again (a forward set on the instance since, as accelerate's hooks do, stays)
        layer.__class__ = unpatched_type(layer)
    for attr in ("_csgmv_record", "_csgmv_exec", "_csgmv_key", *_RESCALING_METHODS, *_WEIGHT_READERS):
        layer.__dict__.pop(attr, None)


def is_patched(layer: nn.Module) -> bool:
    return "_csgmv_exec" in layer.__dict__


# The parameter walks of torch.compile. dynamo, as it meets each module of a traced call (the model, each decoder
# layer, its attention and MLP blocks, each LoRA layer), walks every parameter and buffer under it twice (marking them
# static inputs, recording their names), unless the module's ``named_parameters`` / ``named_buffers`` are not
# ``nn.Module``'s own, which it takes as a module that defines its own. Under each LoRA layer PEFT keeps three modules
# and two parameters per adapter loaded, so with many adapters each walk covers many times the base model's tree,
# parameters the graph never reads. The modules above csgmv's layers (and those layers) get instance-level
# ``named_parameters`` / ``named_buffers`` that call their class's own: the same results for every caller, and no walk
# by dynamo. The tensors a graph does read are marked static as it wraps them (dynamo marks every ``nn.Parameter``
# and every tensor attribute of a module it meets), so compiled code is the same; its trace is shorter.


@functools.wraps(nn.Module.named_parameters)
def _named_parameters(self, *args, **kwargs):
    return type(self).named_parameters(self, *args, **kwargs)


@functools.wraps(nn.Module.named_buffers)
def _named_buffers(self, *args, **kwargs):
    return type(self).named_buffers(self, *args, **kwargs)


_WALKS = (("named_parameters", _named_parameters), ("named_buffers", _named_buffers))


def skip_parameter_walks(model: nn.Module, names) -> None:
    """Give ``model``'s modules named ``names`` and every module above them the class's own ``named_parameters`` and
    ``named_buffers`` as instance attributes (see above); a module with an instance-level one of its own keeps it."""
    wanted = {""}
    for name in names:
        parts = name.split(".")
        wanted.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in wanted:  # (by name, not over every module: PEFT keeps three per adapter under each LoRA layer)
        module = model.get_submodule(name)
        for attr, function in _WALKS:
            if attr not in module.__dict__:
                module.__dict__[attr] = WeakMethod(function, module)


def restore_parameter_walks(module: nn.Module) -> None:
    """Undo :func:`skip_parameter_walks` on ``module``."""
    state = module.__dict__
    for attr, function in _WALKS:
        if getattr(state.get(attr), "__func__", None) is function:
            del state[attr]
