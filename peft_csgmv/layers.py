"""The patched forwards of PEFT modules.

A patched ``lora.Linear`` runs ``y = base(x)`` and then, when a csgmv call is active, adds every row's own adapter in
two kernel launches: ``t = shrink(x, A_stack, plan)``; ``expand(t, B_stack, plan, out=y)``. With no csgmv call
active, under ``disable_adapter()``, or when PEFT's own ``adapter_names`` reaches the layer directly, it is PEFT's
forward, unchanged. A patched ``lora.Embedding`` does the same with the embedding-A gather kernel in place of the
shrink.

Modules csgmv has no kernel for, but for which PEFT has a mixed-batch path (LoRA on convolutions and on embeddings
with ``max_norm``, ``modules_to_save`` and trainable-token wrappers), get the *PEFT path*: during a csgmv call they
receive PEFT's ``adapter_names`` for exactly the rows they see, so PEFT applies each row's adapter there. Correct by
construction, at PEFT's speed for those few modules.
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

if TYPE_CHECKING:
    from .model import CsgmvState
    from .slots import LoraStack

BACKENDS = ("auto", "triton", "torch")


@dataclasses.dataclass
class CallContext:
    """Per-call state, alive only inside one ``forward``/``generate`` call (see :data:`ACTIVE`)."""

    state: "CsgmvState"
    row_slots: tuple[int, ...]  # slot of each input row, -1 for base rows
    names: tuple[str, ...]  # adapter name of each input row in PEFT's spelling ("__base__" for base rows)
    arg_name: str  # "adapter_ids" or "adapter_names", for error messages
    plans: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        self._triton: dict = {}

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
        """PEFT's ``adapter_names`` for a module input of ``rows`` rows."""
        k = self.repeat(rows)
        return [name for name in self.names for _ in range(k)]

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


def apply_lora(x: torch.Tensor, y: torch.Tensor, stack: "LoraStack", plan: BatchPlan, triton_backend: bool) -> None:
    """``y[i] += scaling[s] * (x[i] @ A[s]ᵀ) @ B[s]ᵀ`` for every token ``i`` of slot ``s``, in place; ``x``: (T, in)
    activations, or (T,) token ids for an embedding stack (``A[s][:, x[i]]`` instead of ``x[i] @ A[s]ᵀ``); ``y``:
    (T, out)."""
    if triton_backend:
        device = x.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            # Triton launches on the current device; a model spread over GPUs (device_map) has layers elsewhere.
            with torch.cuda.device(device):
                apply_lora(x, y, stack, plan, triton_backend)
            return
        if stack.embedding:
            t = kernels.embedding_shrink(x, stack.a, stack.ranks, plan, plan.workspace(stack.r_max))
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
    """The forward of a patched ``lora.Linear`` (``x``: rows × ... × in) or ``lora.Embedding`` (``x``: rows × ...
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
    stack: LoraStack = state["_csgmv_stack"]
    embedding = stack.embedding
    if x.dim() < (1 if embedding else 2):
        raise ValueError(f"csgmv expects a batched input of shape (rows, ..., features), got {tuple(x.shape)}")
    if state["scaling"] is not stack.scaling_src:  # rescaled by assignment (peft.helpers.rescale_adapter_scale)
        ctx.state.stack_layer(self, force=True)
    rows = x.shape[0]
    base = self._modules["base_layer"]
    if base._forward_pre_hooks or base._forward_hooks or base._backward_hooks or _global_hooks():
        result = base(x, *args, **kwargs)
    else:  # nothing for Module.__call__ to run around forward: skip its few microseconds per layer
        result = base.forward(x, *args, **kwargs)
    x2 = x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1])
    device = x.device
    plan = ctx.plan_for(rows, x2.shape[0] // rows, device)
    if plan.is_empty:
        return result
    if stack.device != device:  # the model was moved after enabling: follow it
        stack.to(device)
        for cached in ctx.state.plans.values():  # bindings to the old tensors would keep them alive
            cached.bound.pop(stack, None)
    if not result.is_contiguous():
        result = result.contiguous()
    apply_lora(x2, result.view(-1, result.shape[-1]), stack, plan, ctx.triton_on(device))
    return result


def _peft_path_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A module csgmv has no kernel for: during a csgmv call, PEFT's own mixed-batch forward with the rows' names."""
    ctx = ACTIVE.get()
    if ctx is None or ctx.state is not self._csgmv_state_ref() or "adapter_names" in kwargs:
        return self._csgmv_orig_forward(x, *args, **kwargs)
    # Rows whose adapter this module does not hold run its base module, as they do in that adapter's own PEFT run
    # (PEFT's trainable-token and modules_to_save wrappers fail on names they do not hold).
    held = self._csgmv_held
    names = [name if name in held else "__base__" for name in ctx.names_for(x.shape[0])]
    return self._csgmv_orig_forward(x, *args, adapter_names=names, **kwargs)


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
        *_RESCALING_METHODS,
    ):
        layer.__dict__.pop(attr, None)


def is_patched(layer: nn.Module) -> bool:
    return "_csgmv_state_ref" in layer.__dict__
