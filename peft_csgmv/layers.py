"""The patched forwards of PEFT modules. Every patched module holds the handle of its model's
:class:`~peft_csgmv.executor.Executor`, which says whether a csgmv call is in progress and runs the LoRA of its rows.

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

import itertools
import math
import threading
import weakref
from typing import TYPE_CHECKING

import torch
from torch import nn

from . import kernels, ops
from . import slots as _slots
from .executor import _LIVE, Executor, executor_of, static_moe_attr, static_plan_attr, use_triton
from .mapping import PlanRun
from .moe import experts_products, moe_lora_forward
from .moe_plan import MoePlan
from .slots import stack_by_handle

if TYPE_CHECKING:
    from .slots import LoraStack

BACKENDS = ("auto", "triton", "torch")
try:  # per-call arguments PEFT passes its LoRA layers besides adapter_names
    from peft.tuners.lora.layer import VARIANT_KWARG_KEYS as _VARIANT_KEYS
except ImportError:  # a PEFT without LoRA variants
    _VARIANT_KEYS = ()
VARIANT_KWARGS = frozenset(_VARIANT_KEYS)

# PlanRun.bound values besides a BoundLayer: used once (bind on the next use) / the launches cannot be bound here.
_SEEN, _UNBINDABLE = "seen", "unbindable"


def apply_lora(
    x: torch.Tensor,
    y: torch.Tensor,
    stack: "LoraStack",
    run: PlanRun,
    triton_backend: bool,
    *,
    embed_scale: torch.Tensor | None,
) -> None:
    """``y[i] += scaling[s] * (x[i] @ A[s]ᵀ) @ B[s]ᵀ`` for every token ``i`` of slot ``s``, in place; ``x``: (T, in)
    activations, or (T,) token ids for an embedding stack (``A[s][:, x[i]]`` instead of ``x[i] @ A[s]ᵀ``, times
    ``embed_scale`` where given: a scaled embedding's factor, read per call as PEFT does); ``y``: (T, out). Eager:
    ``run`` is the host-built plan in use, whose bound launches run where this Triton takes them
    (:attr:`kernels.BoundLayer.direct`)."""
    plan = run.plan
    if triton_backend:
        device = x.device
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            # Triton launches on the current device; a model spread over GPUs (device_map) has layers elsewhere.
            with torch.cuda.device(device):
                apply_lora(x, y, stack, run, triton_backend, embed_scale=embed_scale)
            return
        if stack.embedding:
            t = kernels.embedding_shrink(x, stack.a, stack.ranks, plan, run.workspace(stack.r_max))
            if embed_scale is not None:
                t.mul_(embed_scale)
            kernels.expand(t, stack.b, stack.ranks, stack.scalings, plan, y, stack.mag, stack.bias, stack.lora_bias)
            return
        # (a lent stack's tensors are this forward's copies: never bound)
        bound = run.bound.get(stack) if kernels.BoundLayer.direct and not stack.lent else _UNBINDABLE
        if bound.__class__ is kernels.BoundLayer:
            try:
                if bound.run_if_fits(x, y, stack):
                    return
            except TypeError:  # this Triton's compiled-kernel launcher takes other arguments: Triton's path
                kernels.BoundLayer.direct = False
                bound = _UNBINDABLE
        t = run.workspace(stack.r_max, kernels.shrink_splits(plan, x.shape[1]))
        t = kernels.shrink(x, stack.a, stack.ranks, plan, t)
        kernels.expand(t, stack.b, stack.ranks, stack.scalings, plan, y, stack.mag, stack.bias, stack.lora_bias)
        # Bind on a plan's second use: a plan used once (ids that change every call) never pays for binding.
        if bound is None:
            run.bound[stack] = _SEEN
        elif bound is not _UNBINDABLE:
            run.bound[stack] = kernels.BoundLayer.bind(x, y, t, stack, plan) or _UNBINDABLE
    else:
        shrink = kernels.embedding_shrink_reference if stack.embedding else kernels.shrink_reference
        t = shrink(x, stack.a, stack.ranks_host, plan)
        if embed_scale is not None:
            t.mul_(embed_scale)
        kernels.expand_reference(
            t, stack.b, stack.ranks_host, stack.scalings_host, plan, y, stack.mag, stack.bias, stack.lora_bias
        )


_module_globals = nn.modules.module
_get_ident = threading.get_ident


def _hooked(base: nn.Module) -> bool:
    """Whether a hook would run around ``base``'s forward: its own or a global module hook
    (``torch.nn.modules.module.register_module_forward_*_hook``). Then ``base`` is called as a module."""
    g = _module_globals
    return bool(
        base._forward_pre_hooks or base._forward_hooks or base._backward_hooks or g._global_forward_pre_hooks
        or g._global_forward_hooks or g._global_backward_hooks or g._global_backward_pre_hooks
    )  # fmt: skip


def _embed_scale(layer: nn.Module) -> torch.Tensor | None:
    """A scaled embedding's factor (Gemma), read per call as PEFT reads it, in fp32; ``None`` for a plain one."""
    scale = layer._get_embed_scale() if hasattr(layer, "_get_embed_scale") else None
    return None if scale is None else scale.to(torch.float32)


def _peft_forward(layer: nn.Module, mapping, x: torch.Tensor, args: tuple, kwargs: dict, only=None) -> torch.Tensor:
    """PEFT's own mixed-batch forward of kernel layer ``layer`` for the call's rows (as many as ``x`` has), with the
    call's variant arguments; ``only``: the adapters it serves, the other rows as base rows (the kernels add theirs)."""
    names = mapping.names_for(x.shape[0])
    if only is not None:
        names = [n if n in only else "__base__" for n in names]
    return layer._csgmv_orig_forward(x, *args, adapter_names=names, **mapping.variant_kwargs(), **kwargs)


def kernel_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward of a patched kernel layer (``x``: rows × ... × in) or ``lora.Embedding`` (``x``: rows × ...
    token ids)."""
    # This runs once per LoRA layer per forward: attribute lookups are kept to what is needed. PEFT's
    # ``disable_adapters`` property is read from the instance dict (where PEFT's layers keep it; False by default, as
    # the class says): compiled code then guards one dict entry per layer, not the property's lookup through the
    # class hierarchy (a quarter of a compiled step's guard check on a 16-layer model).
    state = self.__dict__
    ex: Executor = _LIVE[state["_csgmv_exec"]]()  # (executor_of, written out: dynamo traces each layer's every call)
    if not ex.active or state.get("_disable_adapters", False) or "adapter_names" in kwargs:
        return self._csgmv_orig_forward(x, *args, **kwargs)
    if kwargs:
        # PEFT's hooks may pass per-call variant arguments (aLoRA offsets computed for the *active* adapter when no
        # adapter_names reach PEFT): the call's own, computed from its ids, replace them.
        kwargs = {k: v for k, v in kwargs.items() if k not in VARIANT_KWARGS}
    compiling = torch.compiler.is_compiling()
    if not compiling and ex.owner != _get_ident():  # another thread's call is in progress: not this one's
        return self._csgmv_orig_forward(x, *args, **kwargs)
    if ex.masked and x.dim() and x.shape[0] != ex.num_ids:
        # aLoRA rows, and this layer sees other rows than the call's ids (returned sequences, tokens flattened into
        # rows): PEFT's own forward, which counts each row's tokens its way (its result, or its error).
        return _peft_forward(self, ex.mapping, x, args, kwargs)
    if compiling and not (args or kwargs):
        # Compiled code: the path :func:`compiled_route` chose for this layer when the graph was traced, written out
        # here (dynamo steps through every line of it for each layer of the model: each line, each call, costs the
        # trace ~0.1-0.2 ms). ``None``: the general path below. A delta (fp32) is added out of place and the sum
        # rounded once to the base product's dtype: ``y.add_(delta)``'s numbers, without an in-place write into the
        # base product, a view of its matmul in AOT autograd's trace, which functionalizing costs that trace 10-20 ms
        # per layer (on the CPU: benchmarks/trace_time.py, docs/benchmarks.md); the compiler fuses either form.
        route = compiled_route(state["_csgmv_key"], _slots.ROUTE_EPOCH, ex.num_ids, x.shape, x.device)
        if route is not None:
            kind, base = route[0], self._modules["base_layer"]
            if kind == "member":  # a sibling group's later member: its delta from the group's first
                taken = ex.stash.pop(route[1], None)
                if taken is not None and taken[0] is x and taken[1] == route[2]:
                    # (taken[3]: the base product, where the group's op computed it beside the LoRA)
                    y = base.forward(x) if taken[3] is None else taken[3]
                    return (y + taken[2]).to(y.dtype)
            elif kind == "lora":
                return ops.lora_overload(x, base.forward(x), *getattr(ex, route[1]).plan, None, *route[2:])
            elif kind == "beside":  # (the base product is the op's: the route saw a plain Linear, no hooks)
                y, delta = ops.lora_linear_overload(x, base.weight, base.bias, *getattr(ex, route[1]).plan, *route[2:])
                return (y + delta).to(y.dtype)
            else:  # a sibling group's first member: the group's op, the others' deltas left for them
                _, attr, handles, versions, chunk, triton, keys = route
                deltas = ops.lora_group(x, *getattr(ex, attr).plan, list(handles), list(versions), chunk, triton)
                for i in range(1, len(deltas)):
                    ex.stash[keys[i]] = (x, handles[i], deltas[i], None)
                y = base.forward(x)
                return (y + deltas[0]).to(y.dtype)
    base = self._modules["base_layer"]
    hooked = _hooked(base)
    record = state["_csgmv_record"]
    stack: LoraStack = record.stack
    embedding = stack.embedding
    if x.dim() < (1 if embedding else 2):
        raise ValueError(f"csgmv expects a batched input of shape (rows, ..., features), got {tuple(x.shape)}")
    rows = x.shape[0]
    device = x.device
    if not compiling and ex.mapping.learn is not None:  # (compiled code reads no flag: no guard)
        ex.mapping.observe(self, x)
    runs_on = stack.runs_on
    if runs_on is None:
        if stack.device != device:
            # The input is not where the stack is (the driver moves stacks with their layer's weights before each call:
            # CsgmvState.follow_weights): PEFT's own path decides (its result, or its error).
            return _peft_forward(self, ex.mapping, x, args, kwargs)
    elif runs_on != device or compiling:
        # An offloaded layer (its stack in host memory, lent to its execution device for each eager forward): the
        # input elsewhere, or compiled code, which reads stacks where they live: PEFT's own path.
        return _peft_forward(self, ex.mapping, x, args, kwargs)
    peft_rows = record.peft_rows
    if peft_rows and not peft_rows.isdisjoint(ex.mapping.name_set):
        # Adapters the kernels do not serve here: PEFT's mixed-batch forward for their rows (base output included).
        result = _peft_forward(self, ex.mapping, x, args, kwargs, only=peft_rows)
    else:
        if compiling and not (hooked or args or kwargs):
            if ex.groups_on:  # (off: the layer's dict is not read for groups, so no guard on it)
                grouped = _compiled_group(self, ex, stack, base, x, rows, device)
                if grouped is not None:
                    return grouped
            if ex.beside_on(device) and _beside(stack, base, x, ex.beside_min_bytes):
                return _compiled_beside(ex, stack, base, x, rows, device)
        if hooked:
            result = base(x, *args, **kwargs)
        else:  # nothing for Module.__call__ to run around forward: skip its few microseconds per layer
            result = base.forward(x, *args, **kwargs)
    embed_scale = _embed_scale(self) if embedding else None
    if compiling:
        return _compiled_lora(ex, stack, x, result, rows, device, embed_scale)
    x2 = x.reshape(-1) if embedding else x.reshape(-1, x.shape[-1])
    run = ex.mapping.plan(rows, x2.shape[0] // rows, device)  # (prepared by the driver: a lookup)
    if run.plan.is_empty:
        return result
    if not result.is_contiguous():
        result = result.contiguous()
    y = result.view(-1, result.shape[-1])
    if runs_on is not None:  # an offloaded layer: its stack comes to the layer's device for this forward only
        stack = stack.lend(device, run.slots())
    apply_lora(x2, y, stack, run, ex.triton_on(device), embed_scale=embed_scale)
    return result


# Every patched kernel layer by its ``_csgmv_key`` (weakly): how :func:`compiled_route`, which takes constants only,
# finds the layer it decides for.
KERNEL_LAYERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
layer_keys = itertools.count()


@torch._dynamo.assume_constant_result
def compiled_route(key: int, epoch: int, n: int, shape: torch.Size, device: torch.device) -> tuple | None:
    """How compiled code runs kernel layer ``key`` on an input of ``shape`` on ``device`` (``n`` ids in the call):
    decided when the graph is traced, outside it, from the layer's state; the answer is a constant of the graph, and
    ``epoch`` (:data:`~peft_csgmv.slots.ROUTE_EPOCH`, which the graph guards) changes whenever that state does: its
    stack (a new version), its sibling group, the executor's backend, the adapters PEFT's own path serves in it.
    ``None``: the general path (:func:`kernel_forward`'s own, which reads and guards each fact itself). Else:

    * ``("member", stash key, handle)``: a sibling group's later member, its delta left by the group's first;
    * ``(kind, static plan attribute, *op arguments)``: ``"lora"`` (the LoRA after the base product),
      ``"beside"`` (``peft_csgmv::lora_linear``), ``"group"`` (a group's first member: its handles, versions, chunk,
      triton and the members' stash keys).

    The same choices as the general path: :func:`_compiled_group` (groups after their base products), :func:`_beside`
    and :func:`_compiled_lora`, in that order. The base layer's hooks (and the global module hooks) are read here, as
    torch.compile reads a module's own: hooks present when the graph is traced run in it (the general path, which
    calls the base layer as a module); hooks added later are not seen by that graph, as torch.compile does not see
    them for any module (``torch._dynamo.config.skip_nnmodule_hook_guards``, on by default; off, the general path
    reads and guards them). Likewise a forward set on the base layer's instance (accelerate's hooks)."""
    layer = KERNEL_LAYERS.get(key)
    if layer is None or not torch._dynamo.config.skip_nnmodule_hook_guards:
        return None
    state, base = layer.__dict__, layer._modules.get("base_layer")
    record = state.get("_csgmv_record")
    if record is None:  # (unpatched since the key was given)
        return None
    stack, ex = record.stack, executor_of(state["_csgmv_exec"])
    if (
        stack is None
        or base is None
        or stack.embedding
        or stack.device != device
        or stack.runs_on is not None
        or len(shape) < 2
    ):
        return None
    if record.peft_rows or _hooked(base):
        return None
    width = shape[-1]
    num_tokens = math.prod(shape[:-1])
    if stack.in_features != width or num_tokens % shape[0]:
        return None
    plain, small = _plain_linear(base, stack), num_tokens <= BESIDE_MAX_TOKENS
    where = str(device)

    def op_args(s) -> tuple:
        attr, triton, fused = compiled_launch(ex.handle, epoch, n, shape[0], num_tokens // shape[0], where, s.handle)
        return attr, s.handle, s.version, getattr(ex, attr).chunk, triton, fused

    if ex.groups_on:
        groupable = plain and stack.lora_bias is None and small
        member, group = record.member, record.siblings
        if member is not None:
            return ("member", member, stack.handle) if groupable else None
        if group is not None:
            if ex.groups_beside or not groupable:
                return None
            group_key, handles, _ = group
            attr, handle, version, chunk, triton, _ = op_args(stack)
            versions = (version, *(stack_by_handle(h).version for h in handles))
            keys = tuple((group_key, i) for i in range(len(handles) + 1))
            return ("group", attr, (handle, *handles), versions, chunk, triton, keys)
    if ex.beside_on(device) and plain and small and base.weight.nbytes >= ex.beside_min_bytes:
        return ("beside", *op_args(stack))
    return ("lora", *op_args(stack))


# Compiled code runs a plain Linear layer's LoRA beside its base product (ops.lora_linear) for inputs of at most this
# many tokens (decode, short prefills): where both are short, latency-bound launches that leave the GPU room.
BESIDE_MAX_TOKENS = 512


def _plain_linear(base: nn.Module, stack: "LoraStack") -> bool:
    """What an op that computes the base product itself (``peft_csgmv::lora_linear``, a sibling group's op) needs of a
    layer: a plain ``nn.Linear`` base whose forward is the class's ``F.linear`` (no instance-level forward, as
    accelerate's ``device_map`` hooks install; the callers check module hooks) and an activation stack without DoRA.
    One check for :func:`compiled_route`, :func:`_beside` and :func:`_groupable`."""
    return type(base) is nn.Linear and "forward" not in base.__dict__ and stack.mag is None and not stack.embedding


def _beside(stack: "LoraStack", base: nn.Module, x: torch.Tensor, min_bytes: int) -> bool:
    """Whether compiled code, with the executor's ``beside`` switch on (:meth:`Executor.beside_on`, the caller checked),
    runs this layer's base product and LoRA in one ``peft_csgmv::lora_linear`` (the LoRA on a side stream beside the
    base product, on CUDA): a plain ``nn.Linear`` base whose forward is the class's ``F.linear`` (no instance-level
    forward, as accelerate's ``device_map`` hooks install; the caller checked that no module hook is registered on it),
    no DoRA, a decode-sized input; and a base weight of at least ``min_bytes`` (:attr:`Executor.beside_min_bytes`)."""
    return (
        _plain_linear(base, stack)
        and x.dim() >= 2
        and x.numel() <= BESIDE_MAX_TOKENS * x.shape[-1]
        and base.weight.nbytes >= min_bytes
    )


def _compiled_plan(ex: Executor, stack: "LoraStack", x: torch.Tensor, rows: int, device):
    """``(static plan, triton, fused)`` of a layer inside compiled code (``x``: its input, (rows, ..., in) activations
    or (rows, ...) token ids): the shape's :class:`StaticPlan` (no Python runs here when the graph runs; its buffers
    hold the call's ids) and the launch choice, both decided once when the graph is traced (:func:`compiled_launch`)."""
    num_tokens = x.numel() if stack.embedding else x.numel() // x.shape[-1]
    attr, triton, fused = compiled_launch(
        ex.handle, _slots.ROUTE_EPOCH, ex.num_ids, rows, num_tokens // rows, str(device), stack.handle
    )
    return getattr(ex, attr), triton, fused


@torch._dynamo.assume_constant_result
def compiled_launch(ex_handle: int, epoch: int, n: int, rows: int, tokens_per_row: int, device: str, stack: int):
    """How compiled code launches the LoRA of stack handle ``stack`` for ``rows`` × ``tokens_per_row`` tokens on
    ``device`` (``n`` ids in the call): ``(static plan attribute, triton, fused)``. The attribute holding the shape's
    :class:`~peft_csgmv.mapping.StaticPlan` (:func:`static_plan_attr`); whether the Triton kernels run (on CUDA
    always: the torch reference reads the plan on the host; on the CPU the backend's choice); whether in one fused
    launch (:attr:`Executor.fused_decode`, a shape that fits). Decided when the graph is traced, outside it: a
    constant of the graph, which guards its arguments (``epoch``, :data:`~peft_csgmv.slots.ROUTE_EPOCH`, advances on
    a backend switch) in place of the executor's attributes. One choice for :func:`_compiled_plan` (the general path)
    and :func:`compiled_route`."""
    ex, s, dev = executor_of(ex_handle), stack_by_handle(stack), torch.device(device)
    attr = static_plan_attr(ex_handle, n, rows, tokens_per_row, device)
    triton = dev.type == "cuda" or use_triton(ex.backend, dev)
    fused = triton and ex.fused_decode and not s.embedding and kernels.fused_fits(rows * tokens_per_row, s.in_features)
    return attr, triton, fused


def _compiled_lora(ex: Executor, stack: "LoraStack", x, result, rows: int, device, embed_scale) -> torch.Tensor:
    """The LoRA of a layer inside compiled code: the ``peft_csgmv::lora`` op over the shape's static plan, on the
    layer's input and base output as they are (the op flattens them). The stack goes by handle, and its version becomes
    a guard of the graph (see :mod:`peft_csgmv.ops`)."""
    static, triton, fused = _compiled_plan(ex, stack, x, rows, device)
    return ops.lora_overload(
        x, result, *static.plan, embed_scale, stack.handle, stack.version, static.chunk, triton, fused
    )


def _compiled_beside(ex: Executor, stack: "LoraStack", base: nn.Linear, x, rows: int, device) -> torch.Tensor:
    """A plain Linear layer inside compiled code: its base product and LoRA in one ``peft_csgmv::lora_linear`` (the
    LoRA beside the base product on CUDA), then ``y + delta``, computed in fp32 and rounded once to ``y``'s dtype
    (out of place: see :func:`kernel_forward`), which the compiler fuses into whatever reads the output: the numbers
    of :func:`_compiled_lora`'s out-of-place sum."""
    static, triton, fused = _compiled_plan(ex, stack, x, rows, device)
    y, delta = ops.lora_linear_overload(
        x, base.weight, base.bias, *static.plan, stack.handle, stack.version, static.chunk, triton, fused
    )
    return (y + delta).to(y.dtype)


def _groupable(base: nn.Module, stack: "LoraStack", x: torch.Tensor) -> bool:
    """Whether a sibling group's member runs in the group's op for this call (:func:`_compiled_group`): a plain
    ``nn.Linear`` base whose forward is the class's, without hooks (the caller checked the layer's own and that no
    variant arguments came), no DoRA or ``lora_bias``, a decode-sized input of the stack's width on its device."""
    return (
        _plain_linear(base, stack)
        and stack.lora_bias is None
        and stack.device == x.device
        and stack.in_features == x.shape[-1]
        and x.numel() <= BESIDE_MAX_TOKENS * x.shape[-1]
    )


def _compiled_group(layer: nn.Module, ex: Executor, stack: "LoraStack", base, x, rows: int, device):
    """A sibling group's member inside compiled code (groups: :meth:`Mapping.observe`), or ``None`` for the layer's
    own path. The group's first member runs the group's op, one shrink and one expand launch for every member's LoRA
    (found by stack handle), and leaves the others' parts in :attr:`Executor.stash`. A group whose members' base
    weights hold at least :attr:`Executor.beside_min_bytes` together, where the executor runs LoRA beside base products
    on this device, runs ``peft_csgmv::lora_group_linear``: the members' base products too, the LoRA beside them;
    otherwise ``peft_csgmv::lora_group``, each member computing its own base product. Each member then adds its delta
    to its base product, as :func:`_compiled_beside` does (the same numbers). A member takes its part only if it reads
    the same ``x``, its stack is the one the group named and its base weight and bias are the ones the group used;
    otherwise (another input, hooks, a switched-off layer: checked by the caller) it runs on its own."""
    state = layer.__dict__
    record = state["_csgmv_record"]
    member = record.member
    if member is not None:
        taken = ex.stash.pop(member, None)
        if taken is None or taken[0] is not x or taken[1] != stack.handle or not _groupable(base, stack, x):
            return None
        if stack.version < 0:  # never: a branch on it makes the graph guard this member's stack, which the op read
            return None
        _, _, delta, y = taken
    else:
        group = record.siblings
        if group is None or not _groupable(base, stack, x):
            return None
        key, handles, bases = group
        static, triton, _ = _compiled_plan(ex, stack, x, rows, device)
        plan = static.plan
        stacks, versions = [stack.handle, *handles], [stack.version, *[-1] * len(handles)]
        # (the members' weights are read only for a group that may run beside: otherwise the graph guards none)
        weights = [base.weight, *(w for w, _ in bases)] if ex.groups_beside and ex.beside_on(device) else None
        if (
            weights is not None
            and sum(w.nbytes for w in weights) >= ex.beside_min_bytes
            and all(w.device == device and w.shape[-1] == x.shape[-1] for w in weights)
        ):
            biases = [base.bias, *(b for _, b in bases)]
            outs = ops.lora_group_linear(x, weights, biases, *plan, stacks, versions, static.chunk, triton)
            ys, deltas = outs[: len(weights)], outs[len(weights) :]
        else:
            deltas = ops.lora_group(x, *plan, stacks, versions, static.chunk, triton)
            ys = [None] * len(deltas)
        for index, (handle, delta, y) in enumerate(zip(handles, deltas[1:], ys[1:]), start=1):
            ex.stash[(key, index)] = (x, handle, delta, y)
        delta, y = deltas[0], ys[0]
    # y + delta in fp32, rounded once to y's dtype (out of place: see kernel_forward; the compiler fuses it into the
    # output's reader)
    y = base.forward(x) if y is None else y
    return (y + delta).to(y.dtype)


def peft_path_forward(self: nn.Module, *args, **kwargs) -> torch.Tensor:
    """A module csgmv has no kernel for: during a csgmv call, PEFT's own mixed-batch forward with the rows' names
    (and, for LoRA layers, the call's other per-call arguments, as PEFT's hooks pass them)."""
    ex: Executor = executor_of(self.__dict__["_csgmv_exec"])
    if not ex.active or "adapter_names" in kwargs:
        return self._csgmv_orig_forward(*args, **kwargs)
    if not torch.compiler.is_compiling() and ex.owner != _get_ident():  # another thread's call: not this one's
        return self._csgmv_orig_forward(*args, **kwargs)
    mapping = ex.mapping
    x = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
    names = mapping.names_for(len(x)) if isinstance(x, torch.Tensor) and x.dim() else list(mapping.names)
    # Rows whose adapter this module does not hold run its base module, as they do in that adapter's own PEFT run
    # (PEFT's trainable-token and modules_to_save wrappers fail on names they do not hold).
    held = self.__dict__["_csgmv_record"].adapters
    names = [name if name in held else "__base__" for name in names]
    if hasattr(self, "lora_A"):  # a LoRA layer: the mapping's variant arguments, not those PEFT's hooks passed
        kwargs = {k: v for k, v in kwargs.items() if k not in VARIANT_KWARGS}
        kwargs.update(mapping.variant_kwargs())
    return self._csgmv_orig_forward(*args, adapter_names=names, **kwargs)


def experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *args,
    **kwargs,
) -> torch.Tensor:
    """The forward of a patched experts layer: the outer PEFT ``ParamWrapper`` of a MoE experts module (any
    transformers ``@use_experts_implementation`` class), called by its MoE block with ``hidden_states`` ``(T, hidden)``
    (the step's rows × tokens, flattened), ``top_k_index`` and ``top_k_weights`` ``(T, top_k)``. During a csgmv call
    each token takes its row's adapter (:meth:`~peft_csgmv.mapping.Mapping.token_slots_for`) in both expert products
    (:func:`~peft_csgmv.moe.moe_lora_forward` over the layer's stacks, on the experts module under the wrappers,
    without PEFT's delta weight). With no call active, another thread's call, under ``disable_adapter()`` or with
    PEFT's own ``adapter_names``, it is PEFT's forward; a call that asks for an adapter the layer cannot serve gets
    PEFT's mixed-batch forward (PEFT's error)."""
    state = self.__dict__
    ex: Executor = _LIVE[state["_csgmv_exec"]]()
    if not ex.active or state.get("_disable_adapters", False) or "adapter_names" in kwargs:
        return self._csgmv_orig_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    if torch.compiler.is_compiling():
        return _compiled_experts(self, ex, hidden_states, top_k_index, top_k_weights, args, kwargs)
    if ex.owner != _get_ident():  # another thread's call is in progress: not this one's
        return self._csgmv_orig_forward(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    mapping = ex.mapping
    if mapping.learn is not None:
        # (while the sibling groups are learned: this layer reads another tensor, so the run of kernel layers before
        # it, the block's attention projections, ends here and is grouped in this call, not as the call ends: a
        # static-cache generate's compiled decode then sees the groups from its first step on)
        mapping.observe(self, hidden_states)
    record = state["_csgmv_record"]
    num_tokens = hidden_states.shape[0]
    stacks = record.experts
    device = hidden_states.device
    if (
        (record.peft_rows and not record.peft_rows.isdisjoint(mapping.name_set))
        or args
        or kwargs
        or any(stack.a.device != device for stack in stacks.values())
    ):
        # Adapters the layer cannot serve, arguments csgmv does not know, or the input elsewhere than the stacks:
        # PEFT's own path (its result or error).
        names = mapping.names_for(num_tokens)
        return self._csgmv_orig_forward(hidden_states, top_k_index, top_k_weights, *args, adapter_names=names, **kwargs)
    experts = record.experts_module
    if not mapping.graphed and not any(stack.serves(mapping.slot_set) for stack in stacks.values()):
        return experts(hidden_states, top_k_index, top_k_weights)  # no adapter token here: the base experts
    num_slots = record.experts_slots
    groups = mapping.token_groups_for(num_tokens, device, num_slots)  # (one per call: every MoE layer reads it)
    plan = MoePlan.from_groups(groups, top_k_index, experts.num_experts, num_slots)
    backend = "triton" if ex.triton_on(device) else "torch"
    return moe_lora_forward(experts, hidden_states, top_k_index, top_k_weights, None, stacks, backend, plan=plan)


# Every patched experts layer by its ``_csgmv_key`` (weakly): how :func:`compiled_experts_route` finds it.
EXPERTS_LAYERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@torch._dynamo.assume_constant_result
def compiled_experts_route(key: int, epoch: int, n: int, num_tokens: int, top_k: int, device: torch.device):
    """How compiled code runs experts layer ``key`` on ``num_tokens`` tokens of ``top_k`` experts each on ``device``
    (``n`` ids in the call), decided when the graph is traced, outside it (a constant of the graph, as
    :func:`compiled_route` is for kernel layers; ``epoch``, :data:`~peft_csgmv.slots.ROUTE_EPOCH`, advances whenever
    the layer is restacked or the backend switched). ``None``: PEFT's path (the stacks are not on ``device``);
    ``()``: the experts module itself (no stack). Else ``(static MoE plan attribute, experts, slots, gate/up stack
    handle, down stack handle, triton)``, a handle ``-1`` for a parameter without a stack."""
    layer = EXPERTS_LAYERS.get(key)
    record = None if layer is None else layer.__dict__.get("_csgmv_record")
    if record is None:
        return None
    stacks = record.experts or {}
    if not stacks:
        return ()
    if any(stack.a.device != device for stack in stacks.values()):
        return None
    ex = executor_of(layer.__dict__["_csgmv_exec"])
    num_experts, num_slots = record.experts_module.num_experts, record.experts_slots
    attr = static_moe_attr(ex.handle, n, num_tokens, top_k, num_experts, num_slots, str(device))
    handles = tuple(stacks[p].handle if p in stacks else -1 for p in _EXPERT_PARAMS)
    # (on CUDA the kernels always, as compiled_launch decides: the torch reference reads the plan on the host)
    return (attr, num_experts, num_slots, *handles, device.type == "cuda" or ex.triton_on(device))


def _compiled_experts(layer: nn.Module, ex: Executor, hidden_states, top_k_index, top_k_weights, args, kwargs):
    """A patched experts layer inside compiled code (``torch.compile``, transformers' static-cache decode) during a
    call with ids. The layer's plan is built in the graph from the router's ``top_k_index`` and the call's token groups,
    which :class:`~peft_csgmv.mapping.StaticMoePlan` holds at a fixed address (rewritten for each call's ids before the
    graph runs: new ids do not recompile); the base products and each expert parameter's LoRA are the
    ``peft_csgmv::moe_linear`` / ``peft_csgmv::moe_lora`` ops (:mod:`peft_csgmv.ops`), whose stacks go by handle.
    Every token goes through the layer's own products, base tokens included (a call without adapter tokens too: the
    graph does not depend on the ids). As eager code: arguments csgmv does not know, stacks elsewhere than the input,
    and an adapter the layer cannot serve (PEFT's path: its result or its error; the last reads the call's names, a
    guard per call)."""
    state = layer.__dict__
    record = state["_csgmv_record"]
    route = None
    if not (args or kwargs):
        route = compiled_experts_route(
            state["_csgmv_key"], _slots.ROUTE_EPOCH, ex.num_ids, hidden_states.shape[0], top_k_index.shape[1],
            hidden_states.device,
        )  # fmt: skip
    peft_rows = record.peft_rows
    if route is None or (peft_rows and not peft_rows.isdisjoint(ex.mapping.name_set)):
        names = ex.mapping.names_for(hidden_states.shape[0])
        return layer._csgmv_orig_forward(hidden_states, top_k_index, top_k_weights, *args, adapter_names=names,
                                         **kwargs)  # fmt: skip
    experts = record.experts_module
    if not route:
        return experts(hidden_states, top_k_index, top_k_weights)
    attr, num_experts, num_slots, gate_up, down, triton = route
    static = getattr(ex, attr)
    plan = MoePlan.from_groups(
        static.groups, top_k_index, num_experts, num_slots, static.chunk, tables=static.tables
    )  # fmt: skip
    top_k = top_k_index.shape[1]
    handles = {"gate_up_proj": gate_up, "down_proj": down}

    def lora(param: str, x: torch.Tensor, y: torch.Tensor, x_rows: str) -> torch.Tensor:
        handle = handles[param]
        if handle < 0:
            return y
        return ops.moe_lora(
            x, y, plan.permutation, plan.expert_offsets, plan.seg_start, plan.seg_end, plan.seg_slot, plan.seg_expert,
            top_k, plan.chunk_size, handle, 0 if x_rows == "token" else 2, triton,
        )  # fmt: skip

    return experts_products(experts, hidden_states, top_k_index, top_k_weights, plan, ops.moe_linear, lora)
