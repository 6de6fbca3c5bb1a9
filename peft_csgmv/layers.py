"""The patched forwards of PEFT modules.

A patched ``lora.Linear`` (or bitsandbytes 4-bit / 8-bit LoRA layer) runs ``y = base(x)`` and then, when a csgmv call
is active, adds every row's own adapter in two kernel launches: ``t = shrink(x, A_stack, plan)``;
``expand(t, B_stack, plan, out=y)``. With no csgmv call active, under ``disable_adapter()``, or when PEFT's own
``adapter_names`` reaches the layer directly, it is PEFT's forward, unchanged. A patched ``lora.Embedding`` does the
same with the embedding-A gather kernel in place of the shrink. Adapters the kernels do not serve in a layer (LoRA
variants such as aLoRA) have rank 0 in its stack; when a call asks for one, ``y`` comes from PEFT's own mixed-batch
forward of the layer with those rows' names (the other rows as ``"__base__"``), and the kernels add the rest.

Every other PEFT tuner layer and auxiliary wrapper (the modules PEFT's own ``adapter_names`` hooks reach) gets the
*PEFT path*: during a csgmv call it receives PEFT's ``adapter_names`` for exactly the rows it sees, so PEFT applies
each row's adapter there, or raises what PEFT raises for that module. PEFT's results, at PEFT's speed, for those
modules only.
"""

from __future__ import annotations

import contextvars
import dataclasses
import types
from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from . import kernels
from .plan import BatchPlan
from .slots import weights_device

if TYPE_CHECKING:
    from .model import CsgmvState
    from .slots import LoraStack

BACKENDS = ("auto", "triton", "torch")
try:  # per-call arguments PEFT passes its LoRA layers besides adapter_names
    from peft.tuners.lora.layer import VARIANT_KWARG_KEYS as _VARIANT_KEYS
except ImportError:  # a PEFT without LoRA variants
    _VARIANT_KEYS = ()
VARIANT_KWARGS = frozenset(_VARIANT_KEYS)


@dataclasses.dataclass
class CallContext:
    """Per-call state, alive only inside one ``forward``/``generate`` call (see :data:`ACTIVE`)."""

    state: "CsgmvState"
    row_slots: tuple[int, ...]  # slot of each input row, -1 for base rows
    names: tuple[str, ...]  # adapter name of each input row in PEFT's spelling ("__base__" for base rows)
    arg_name: str  # "adapter_ids" or "adapter_names", for error messages
    alora_offsets: list | None = None  # PEFT's aLoRA offsets of the call's rows, for the layers' PEFT path
    plans: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._triton: dict = {}
        self.name_set = frozenset(self.names)

    def triton_on(self, device: torch.device) -> bool:
        """Whether layers on ``device`` use the Triton kernels in this call (the state's backend choice)."""
        use = self._triton.get(device)
        if use is None:
            use = self._triton[device] = use_triton(self.state.backend, device)
        return use

    def repeat(self, rows: int) -> int:
        """How many consecutive rows of a module input each id covers (``num_beams``, ``num_return_sequences``,
        or tokens flattened into rows)."""
        n = len(self.row_slots)
        if rows % n:
            raise ValueError(
                f"Length of `{self.arg_name}` should be the same as the number of inputs, but got {n} and "
                f"{rows} respectively (a layer saw {rows} rows, which is not a whole multiple of {n})."
            )
        return rows // n

    def names_for(self, rows: int) -> list[str]:
        """PEFT's ``adapter_names`` for a module input of ``rows`` rows (each name repeated for its rows); the call's
        names as they are when ``rows`` is no whole multiple of them, as PEFT's hooks pass them (PEFT's module then
        raises its own error)."""
        n = len(self.names)
        if rows % n:
            return list(self.names)
        k = rows // n
        return [name for name in self.names for _ in range(k)] if k > 1 else list(self.names)

    def variant_kwargs(self) -> dict:
        """The per-call arguments PEFT's hooks give every LoRA layer besides ``adapter_names``."""
        return {} if self.alora_offsets is None else {"alora_offsets": self.alora_offsets}

    def plan_for(self, rows: int, tokens_per_row: int, device: torch.device) -> BatchPlan:
        """The plan for a layer input of ``rows × tokens_per_row`` tokens on ``device``; built by the first layer
        that sees this shape, reused by all later ones (and by later calls with the same ids, via the state's
        cache)."""
        key = (rows, tokens_per_row, device)
        plan = self.plans.get(key)
        if plan is None:
            plan = self.state.cached_plan(self.row_slots, self.repeat(rows), tokens_per_row, device)
            self.plans[key] = plan
        return plan


# The active csgmv call, if any. Layers read it; the model wrapper sets it and resets it in ``finally``.
ACTIVE: contextvars.ContextVar[CallContext | None] = contextvars.ContextVar("peft_csgmv_call", default=None)


def use_triton(backend: str, device: torch.device) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    return device.type == "cuda"


# plan.bound values besides a BoundLayer: used once (bind on the next use) / the launches cannot be bound here.
_SEEN, _UNBINDABLE = "seen", "unbindable"


def apply_lora(
    x: torch.Tensor, y: torch.Tensor, stack: "LoraStack", plan: BatchPlan, triton_backend: bool, embed_scale=None
) -> None:
    """``y[i] += scaling[s] * (x[i] @ A[s]ᵀ) @ B[s]ᵀ`` for every token ``i`` of slot ``s``, in place; ``x``: (T, in)
    activations, or (T,) token ids for an embedding stack (``A[s][:, x[i]]`` instead of ``x[i] @ A[s]ᵀ``, times
    ``embed_scale`` where given: a scaled embedding's factor, read per call as PEFT does); ``y``: (T, out)."""
    if triton_backend:
        device = x.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            # Triton launches on the current device; a model spread over GPUs (device_map) has layers elsewhere.
            with torch.cuda.device(device):
                apply_lora(x, y, stack, plan, triton_backend, embed_scale=embed_scale)
            return
        if stack.embedding:
            t = kernels.embedding_shrink(x, stack.a, stack.ranks, plan, plan.workspace(stack.r_max))
            if embed_scale is not None:
                t.mul_(embed_scale)
            kernels.expand(t, stack.b, stack.ranks, stack.scalings, plan, y, stack.mag, stack.bias, stack.lora_bias)
            return
        bound = plan.bound.get(stack)
        if bound.__class__ is kernels.BoundLayer:
            try:
                if bound.run_if_fits(x, y, stack):
                    return
            except TypeError:  # this Triton's compiled-kernel launcher takes other arguments: Triton's path
                kernels.disable_direct_launch()
        t = plan.workspace(stack.r_max, kernels.shrink_splits(plan, x.shape[1]))
        t = kernels.shrink(x, stack.a, stack.ranks, plan, t)
        kernels.expand(t, stack.b, stack.ranks, stack.scalings, plan, y, stack.mag, stack.bias, stack.lora_bias)
        # Bind on a plan's second use: a plan used once (ids that change every call) never pays for binding.
        if bound is None:
            plan.bound[stack] = _SEEN
        elif bound is not _UNBINDABLE:
            plan.bound[stack] = kernels.BoundLayer.bind(x, y, t, stack, plan) or _UNBINDABLE
    else:
        shrink = kernels.embedding_shrink_reference if stack.embedding else kernels.shrink_reference
        t = shrink(x, stack.a, stack.ranks_host, plan)
        if embed_scale is not None:
            t.mul_(embed_scale)
        kernels.expand_reference(
            t, stack.b, stack.ranks_host, stack.scalings_host, plan, y, stack.mag, stack.bias, stack.lora_bias
        )


_module_globals = nn.modules.module


def _global_hooks() -> bool:
    """Whether any global module hook is registered (``torch.nn.modules.module.register_module_forward_*_hook``)."""
    g = _module_globals
    return bool(
        g._global_forward_pre_hooks or g._global_forward_hooks or g._global_backward_hooks
        or g._global_backward_pre_hooks
    )  # fmt: skip


def _csgmv_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a patched kernel layer (``x``: rows × ... × in) or ``lora.Embedding`` (``x``: rows × ...
    token ids)."""
    # This runs once per LoRA layer per forward: attribute lookups are kept to what is needed.
    ctx = ACTIVE.get()
    state = self.__dict__
    if (
        ctx is None
        or ctx.state is not state["_csgmv_state_ref"]()
        or self.disable_adapters
        or "adapter_names" in kwargs
    ):
        return state["_csgmv_orig_forward"](x, *args, **kwargs)
    if kwargs:
        # PEFT's hooks may pass per-call variant arguments (aLoRA offsets computed for the *active* adapter when no
        # adapter_names reach PEFT): the call's own, computed from its ids, replace them.
        kwargs = {k: v for k, v in kwargs.items() if k not in VARIANT_KWARGS}
    stack: LoraStack = state["_csgmv_stack"]
    embedding = stack.embedding
    if x.dim() < (1 if embedding else 2):
        raise ValueError(f"csgmv expects a batched input of shape (rows, ..., features), got {tuple(x.shape)}")
    rows = x.shape[0]
    device = x.device
    if stack.device != device and not _follow_weights(self, stack, ctx.state, device):
        # The input is not where the layer's weights are: PEFT's own path decides (its result, or its error), and
        # the stack stays where the weights are.
        names = ctx.names_for(rows)
        return state["_csgmv_orig_forward"](x, *args, adapter_names=names, **ctx.variant_kwargs(), **kwargs)
    if state["scaling"] is not stack.scaling_src:  # rescaled by assignment (peft.helpers.rescale_adapter_scale)
        ctx.state.stack_layer(self, force=True)
    peft_rows = state["_csgmv_peft"]
    if peft_rows and not peft_rows.isdisjoint(ctx.name_set):
        # Adapters the kernels do not serve here: PEFT's mixed-batch forward for their rows (base output included).
        names = [n if n in peft_rows else "__base__" for n in ctx.names_for(rows)]
        result = state["_csgmv_orig_forward"](x, *args, adapter_names=names, **ctx.variant_kwargs(), **kwargs)
    else:
        base = self._modules["base_layer"]
        if base._forward_pre_hooks or base._forward_hooks or base._backward_hooks or _global_hooks():
            result = base(x, *args, **kwargs)
        else:  # nothing for Module.__call__ to run around forward: skip its few microseconds per layer
            result = base.forward(x, *args, **kwargs)
    x2 = x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1])
    plan = ctx.plan_for(rows, x2.shape[0] // rows, device)
    if plan.is_empty:
        return result
    if not result.is_contiguous():
        result = result.contiguous()
    embed_scale = None
    if embedding:
        embed_scale = self._get_embed_scale() if hasattr(self, "_get_embed_scale") else None
        if embed_scale is not None:
            embed_scale = embed_scale.to(torch.float32)
    apply_lora(x2, result.view(-1, result.shape[-1]), stack, plan, ctx.triton_on(device), embed_scale=embed_scale)
    return result


def _follow_weights(layer: nn.Module, stack: "LoraStack", state: "CsgmvState", device: torch.device) -> bool:
    """The stack is not on the input's ``device``: if the layer's weights are (the model was moved after enabling),
    move the stack there and drop bindings to its old tensors; ``False`` when the input is somewhere else."""
    if weights_device(layer) != device:
        return False
    stack.to(device)
    for cached in state.plans.values():  # bindings to the old tensors would keep them alive
        cached.bound.pop(stack, None)
    return True


def _peft_path_forward(self: nn.Module, *args, **kwargs) -> torch.Tensor:
    """A module csgmv has no kernel for: during a csgmv call, PEFT's own mixed-batch forward with the rows' names
    (and, for LoRA layers, the call's other per-call arguments, as PEFT's hooks pass them)."""
    ctx = ACTIVE.get()
    if ctx is None or ctx.state is not self._csgmv_state_ref() or "adapter_names" in kwargs:
        return self._csgmv_orig_forward(*args, **kwargs)
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    names = ctx.names_for(len(x)) if isinstance(x, torch.Tensor) and x.dim() else list(ctx.names)
    # Rows whose adapter this module does not hold run its base module, as they do in that adapter's own PEFT run
    # (PEFT's trainable-token and modules_to_save wrappers fail on names they do not hold).
    held = self._csgmv_held
    names = [name if name in held else "__base__" for name in names]
    if hasattr(self, "lora_A"):  # a LoRA layer: the call's variant arguments, not those PEFT's hooks passed
        kwargs = {k: v for k, v in kwargs.items() if k not in VARIANT_KWARGS}
        kwargs.update(ctx.variant_kwargs())
    return self._csgmv_orig_forward(*args, adapter_names=names, **kwargs)


def _patch(module: nn.Module, forward, state_ref: Callable[[], "CsgmvState"]) -> None:
    module._csgmv_state_ref = state_ref
    module._csgmv_orig_forward = module.forward
    module.forward = types.MethodType(forward, module)


# PEFT methods that change a layer's scaling in place: after each, the layer's stack is refreshed.
_RESCALING_METHODS = ("set_scale", "scale_layer", "unscale_layer")


def _restack_after(layer: nn.Module, method: str):
    original = getattr(layer, method)

    def wrapper(*args, **kwargs):
        result = original(*args, **kwargs)
        state = layer._csgmv_state_ref()
        if state is not None:
            state.stack_layer(layer, force=True)
        return result

    return wrapper


def patch_layer(layer: nn.Module, stack: "LoraStack", state_ref: Callable[[], "CsgmvState"]) -> None:
    """Swap a ``lora.Linear``'s or ``lora.Embedding``'s ``forward`` for the csgmv forward, and make its rescaling
    methods refresh the stack (instance attributes; :func:`unpatch_layer` undoes it)."""
    layer._csgmv_stack = stack
    _patch(layer, _csgmv_forward, state_ref)
    for method in _RESCALING_METHODS:
        if hasattr(layer, method):
            layer.__dict__[method] = _restack_after(layer, method)


def patch_peft_path(module: nn.Module, state_ref: Callable[[], "CsgmvState"]) -> None:
    """Give a module csgmv has no kernel for the PEFT path (see the module docstring)."""
    _patch(module, _peft_path_forward, state_ref)


def unpatch_layer(layer: nn.Module) -> None:
    for attr in (
        "forward",
        "_csgmv_orig_forward",
        "_csgmv_stack",
        "_csgmv_state_ref",
        "_csgmv_held",
        "_csgmv_peft",
        *_RESCALING_METHODS,
    ):
        layer.__dict__.pop(attr, None)


def is_patched(layer: nn.Module) -> bool:
    return "_csgmv_state_ref" in layer.__dict__
