"""Mixed-adapter expert LoRA: the layer math that experts layers run (:func:`peft_csgmv.layers.experts_forward`; see
docs/moe-design.md).

PEFT adapts a MoE layer's 3-D expert parameters through ``LoraConfig(target_parameters=[...])``: a ``ParamWrapper``
per parameter (nested when a module has two), which folds ``scaling · B_e A_e`` of one adapter into every expert's
weight on each forward, and refuses mixed batches. :func:`moe_lora_forward` runs the experts of a transformers MoE
layer (any ``@use_experts_implementation`` class: Qwen3-MoE, Mixtral, gpt-oss with its interleaved gate/up, biases
and clamped activation) with each token's own adapter, inside the experts' computation and without a delta weight:

1. the routed pairs are sorted by (expert, slot) (:class:`~peft_csgmv.moe_plan.MoePlan`);
2. the gate/up product of every pair runs over the sorted order (one product per pair's expert), and
   ``moe_shrink`` / ``moe_expand`` add each pair's gate/up LoRA to it (x by token, output rows in sorted order);
3. the experts' own gate (``_apply_gate``: SiLU·up, or gpt-oss's clamp and ``(up + 1) · glu``) runs on the sum;
4. the down product, and its LoRA (x and output in sorted order), then the routing weights and the sum over each
   token's experts, as transformers' batched and grouped implementations do it.

:func:`stack_from_peft` builds the slot stacks the kernels read from PEFT's own weights.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Callable, Iterable, Sequence

import torch

from .kernels.moe import moe_expand, moe_shrink
from .kernels.moe_reference import moe_expand_reference, moe_shrink_reference
from .moe_plan import MoePlan
from .plan import write_buffer


@dataclasses.dataclass(eq=False)
class MoeStack:
    """The adapters of one expert parameter, one slot each.

    Attributes:
        a: ``(S, E, R, K)`` contiguous storage of A, a block of ``E·R·K`` per slot (``R``: the largest rank); slot
            ``s`` holds its adapter at its own rank ``r``, as PEFT's ``lora_A.weight`` ``(r·E, K)`` (expert ``e`` at
            rows ``e·r .. e·r + r``), at the block's start (:meth:`slot_a`; the kernels' ``own_rank`` layout), the
            rest of the block unread.
        b: ``(S, E, N, R)`` B likewise, a strided view of storage laid out ``(S, N, R, E)``: slot ``s``'s block
            starts with PEFT's rank-major ``lora_B.weight`` ``(N, r·E)`` (column ``j·E + e``) at its own rank
            (:meth:`slot_b`).
        ranks: ``(S,)`` int32 (0: the slot's adapter does not adapt this parameter).
        scalings: ``(S,)`` fp32.
        ranks_host, scalings_host: the same, on the host (the torch reference walks them; the host tier writes them
            and uploads both vectors once per call that moves adapters, :meth:`upload`).
        slot_shared: slot -> PEFT's ``lora_A`` / ``lora_B`` weight parameters of its adapter where they are views into
            ``a`` / ``b`` (adapters of any rank, of the stack's dtype: stored once); :attr:`shared` lists them all,
            :meth:`release_shared` gives them their own memory.
        handle: how compiled code's ``peft_csgmv::moe_lora`` op finds the stack (:func:`moe_stack_by_handle`): its
            tensors are read when the op runs, not graph inputs. A stack's tensors are never replaced (a restack makes
            a new stack, with a new handle, and advances :data:`~peft_csgmv.slots.ROUTE_EPOCH`, so compiled graphs
            trace again); the host tier's moves write its slots in place, which the op reads at its next run.
    """

    a: torch.Tensor
    b: torch.Tensor
    ranks: torch.Tensor
    scalings: torch.Tensor
    ranks_host: tuple[int, ...]
    scalings_host: tuple[float, ...] = ()
    slot_shared: dict = dataclasses.field(default_factory=dict)
    handle: int = dataclasses.field(default_factory=lambda: next(_handles), compare=False)

    def __post_init__(self) -> None:
        _STACKS[self.handle] = self

    @property
    def num_slots(self) -> int:
        return self.a.shape[0]

    @property
    def rank(self) -> int:
        """``R``: the largest rank a slot holds."""
        return self.a.shape[2]

    def slot_a(self, slot: int, r: int | None = None) -> torch.Tensor:
        """Slot ``slot``'s A as PEFT lays it out, ``(r·E, K)`` (a view; ``r``: the slot's rank unless given)."""
        num_experts, _, k = self.a.shape[1:]
        r = self.ranks_host[slot] if r is None else r
        return self.a[slot].view(-1)[: r * num_experts * k].view(r * num_experts, k)

    def slot_b(self, slot: int, r: int | None = None) -> torch.Tensor:
        """Slot ``slot``'s B as PEFT lays it out, ``(N, r·E)`` (a view; ``r``: the slot's rank unless given)."""
        num_experts, n = self.b.shape[1:3]
        r = self.ranks_host[slot] if r is None else r
        store = self.b.permute(0, 2, 3, 1)[slot]  # (N, R, E): the storage's own layout, contiguous
        return store.view(-1)[: n * r * num_experts].view(n, r * num_experts)

    @property
    def shared(self) -> tuple:
        return tuple(p for pair in self.slot_shared.values() for p in pair)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.a, self.b, self.ranks, self.scalings))

    @property
    def shared_bytes(self) -> int:
        """Bytes of PEFT's weights that are views into this stack (not held twice)."""
        return sum(p.nbytes for p in self.shared if _views(p, self))

    def release_shared(self, keep=frozenset()) -> None:
        """Every shared parameter (but those whose ``id`` is in ``keep``: a newer stack's views) owns its memory
        again, a copy of its values (``disable_csgmv``, the layer unpatched or restacked)."""
        for p in self.shared:
            if id(p) not in keep and _views(p, self):
                p.data = p.data.clone()

    def serves(self, slots: Iterable[int]) -> bool:
        """Whether one of ``slots`` (a call's distinct slots, :attr:`~peft_csgmv.mapping.Mapping.slot_set`) adapts
        this parameter."""
        ranks = self.ranks_host
        return any(0 <= s < len(ranks) and ranks[s] for s in slots)

    # -- the host tier's moves (peft_csgmv.tier): one slot at a time, host bookkeeping, then one upload -------------

    def set_slot(self, slot: int, wa: torch.Tensor, wb: torch.Tensor, scaling: float) -> None:
        """Slot ``slot`` holds the adapter whose PEFT weights are ``wa`` (``lora_A.weight`` ``(r·E, K)``) and ``wb``
        (``lora_B.weight`` ``(N, r·E)``), wherever they are (host memory: copied in, asynchronously from pinned
        memory). PEFT's weights become views of the slot where they are parameters of the stack's dtype (stored
        once, as :func:`stack_from_peft` shares them); the others get device copies of their own. The device vectors
        wait for :meth:`upload`."""
        r = wa.shape[0] // self.a.shape[1]
        dst_a, dst_b = self.slot_a(slot, r), self.slot_b(slot, r)
        dst_a.copy_(wa.detach(), non_blocking=True)
        dst_b.copy_(wb.detach(), non_blocking=True)
        if all(isinstance(w, torch.nn.Parameter) and w.dtype == self.a.dtype for w in (wa, wb)):
            wa.data, wb.data = dst_a, dst_b
            self.slot_shared[slot] = (wa, wb)
        else:
            self.slot_shared.pop(slot, None)
            for w in (wa, wb):
                if w.device != self.a.device:
                    w.data = w.data.to(self.a.device, copy=True, non_blocking=True)
        self._host(slot, r, float(scaling))

    def clear_slot(self, slot: int) -> None:
        """Slot ``slot`` holds nothing (rank 0; its weights stay as they are, unread). PEFT's weights that viewed it
        have been re-pointed elsewhere by the caller."""
        self.slot_shared.pop(slot, None)
        if slot < len(self.ranks_host) and self.ranks_host[slot]:
            self._host(slot, 0, 0.0)

    def _host(self, slot: int, rank: int, scaling: float) -> None:
        ranks, scalings = list(self.ranks_host), list(self.scalings_host)
        ranks[slot], scalings[slot] = rank, scaling
        self.ranks_host, self.scalings_host = tuple(ranks), tuple(scalings)

    def upload(self) -> None:
        """The device ranks and scalings from their host copies (one copy each, in stream order: no host sync)."""
        for vector, host, dtype in ((self.ranks, self.ranks_host, torch.int32),
                                    (self.scalings, self.scalings_host, torch.float32)):  # fmt: skip
            write_buffer(vector, torch.tensor(host, dtype=dtype))


_handles = itertools.count()
_STACKS: "weakref.WeakValueDictionary[int, MoeStack]" = weakref.WeakValueDictionary()


def moe_stack_by_handle(handle: int) -> MoeStack:
    """The live :class:`MoeStack` with this :attr:`MoeStack.handle`."""
    return _STACKS[handle]


def _views(p: torch.Tensor, stack: MoeStack) -> bool:
    """Whether ``p`` still views ``stack``'s memory (a model moved or cast since gave it memory of its own)."""
    storage = p.untyped_storage().data_ptr()
    return storage in (stack.a.untyped_storage().data_ptr(), stack.b.untyped_storage().data_ptr())


def param_wrappers(module: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The experts module under PEFT's (nested) ``ParamWrapper`` s of ``module`` and ``{parameter name: wrapper}``."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers = {}
    while isinstance(module, ParamWrapper):
        wrappers[module.parameter_name] = module
        module = module.base_layer
    return module, wrappers


def stack_from_peft(
    wrapper: torch.nn.Module,
    adapters: Sequence[str | None],
    dtype: torch.dtype | None = None,
    share: bool = False,
    rank: int | None = None,
    device: torch.device | None = None,
):
    """A :class:`MoeStack` of ``adapters`` (slot ``i`` holds ``adapters[i]``; ``None`` or an adapter this parameter
    lacks: rank 0) from a PEFT ``ParamWrapper`` of a 3-D expert parameter.

    PEFT stores an adapter of rank ``r`` over ``E`` experts as ``lora_A.weight`` ``(r·E, in)``, expert-major (expert
    ``e``'s A is rows ``e·r .. e·r + r``), and ``lora_B.weight`` ``(out, r·E)``, rank-major (expert ``e``'s B is columns
    ``e, e + E, …``), whichever way the parameter itself is laid out (``in``/``out`` are the features of the product,
    the parameter's ``(E, out, in)`` or transposed ``(E, in, out)``). The delta of expert ``e`` on an input row ``x`` is
    ``scaling · (x @ A_eᵀ) @ B_eᵀ``. Each slot keeps both layouts at its adapter's own rank (see :class:`MoeStack`),
    so with ``share`` the weights of every adapter of the stack's dtype and device become views into it (stored once;
    PEFT's forward, saves and in-place edits then work on the memory the kernels read); others are copied.

    ``rank``: the stack's ``R`` (at least the adapters' largest rank; the host tier gives the largest of every adapter
    the parameter holds, so that any of them can come into a slot). ``device``: where the stack goes (default: the
    first adapter's device); given, PEFT's weights of the stack's dtype on another device (the host tier's
    host memory) become views into it too.
    """
    num_experts, k, n = wrapper.num_experts, wrapper.in_features, wrapper.out_features
    present = [name for name in adapters if name is not None and name in wrapper.lora_A]
    r_max = max([wrapper.r[name] for name in present] + ([rank] if rank else []), default=1)
    like = wrapper.lora_A[present[0]].weight if present else wrapper.get_param()
    dtype = dtype or like.dtype
    where = like.device if device is None else torch.device(device)
    a = torch.zeros(len(adapters), num_experts, r_max, k, dtype=dtype, device=where)
    b_store = torch.zeros(len(adapters), n, r_max, num_experts, dtype=dtype, device=where)
    ranks = [wrapper.r[name] if name is not None and name in wrapper.lora_A else 0 for name in adapters]
    scalings = [float(wrapper.scaling[name]) if r else 0.0 for name, r in zip(adapters, ranks)]
    stack = MoeStack(
        a=a,
        b=b_store.permute(0, 3, 1, 2),
        ranks=torch.tensor(ranks, dtype=torch.int32, device=where),
        scalings=torch.tensor(scalings, dtype=torch.float32, device=where),
        ranks_host=tuple(ranks),
        scalings_host=tuple(scalings),
    )
    for slot, (name, r) in enumerate(zip(adapters, ranks)):
        if not r:
            continue
        wa, wb = wrapper.lora_A[name].weight, wrapper.lora_B[name].weight
        dst_a, dst_b = stack.slot_a(slot), stack.slot_b(slot)
        dst_a.copy_(wa.detach())
        dst_b.copy_(wb.detach())
        if share and all(
            isinstance(w, torch.nn.Parameter) and w.dtype == dtype and (device is not None or w.device == where)
            for w in (wa, wb)
        ):
            wa.data, wb.data = dst_a, dst_b
            stack.slot_shared[slot] = (wa, wb)
    return stack


# benchmarks/count_moe_ops.py counts the CUDA path's host work on the CPU: there the base products take torch's grouped
# product too (torch runs it on the CPU), not the product per expert (whose offsets the CPU reads on the host).
GROUPED_ON_CPU = False
_SM80: dict = {}  # device -> whether its capability is 8.0 or above (torch's grouped product needs it)


def _sm80(device: torch.device) -> bool:
    ok = _SM80.get(device)
    if ok is None:
        ok = _SM80[device] = torch.cuda.get_device_capability(device) >= (8, 0)
    return ok


def grouped_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`expert_linear` takes torch's grouped product for these tensors (CUDA, 16-bit weights, capability
    8.0 or above; the CPU too where :data:`GROUPED_ON_CPU` says)."""
    if _GROUPED is None:
        return False
    if x.is_cuda:
        return weight.dtype in (torch.bfloat16, torch.float16) and _sm80(x.device)
    return GROUPED_ON_CPU


_GROUPED = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias,
    experts: torch.Tensor | None,
    offsets: torch.Tensor,
    is_transposed: bool,
) -> torch.Tensor:
    """Each row's product with its expert's weight (``(E, out, in)``, or ``(E, in, out)`` transposed) plus bias, the
    rows sorted expert-major (``offsets``: :attr:`MoePlan.expert_offsets`, where each expert's rows end; ``experts``:
    each row's expert, read for the bias only). One grouped product where torch has one for these tensors
    (:func:`grouped_fits`; no host sync), else a product per expert with rows (its offsets read on the host, as
    transformers' eager experts loop does); while a CUDA graph is captured (where nothing may read the device on the
    host), each row's product with its expert's weight gathered, as transformers' ``batched_mm`` does for decode.
    Outside a capture never each row's weight gathered: that is rows × the weight's bytes. Compiled code runs it
    inside the ``peft_csgmv::moe_linear`` op (:mod:`peft_csgmv.ops`), eager code as it is."""
    w = weight if is_transposed else weight.transpose(-1, -2)  # (E, in, out)
    if grouped_fits(x, w):
        out = _GROUPED(x.to(w.dtype), w, offs=offsets)
    else:
        dtype = torch.promote_types(x.dtype, w.dtype)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            out = gathered_linear(x.to(dtype), w.to(dtype), offsets)
        else:
            out = x.new_empty((x.shape[0], w.shape[-1]), dtype=dtype)
            start = 0
            for e, end in enumerate(offsets.tolist()):
                if end > start:
                    torch.matmul(x[start:end].to(out.dtype), w[e].to(out.dtype), out=out[start:end])
                start = end
            out[start:] = 0  # (rows routed to no expert of this module: none without expert parallelism)
    if bias is not None:
        out = out + bias[experts]
    return out


def gathered_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each row of ``x`` ``(P, in)`` (sorted expert-major, ``offsets`` where each expert's rows end) times its
    expert's ``w`` ``(E, in, out)``, the weight gathered per row (no host read: a CUDA graph's capture); rows past the
    last expert's (routed to no expert of this module) are zeros."""
    rows = torch.arange(x.shape[0], dtype=offsets.dtype, device=x.device)
    row_expert = torch.searchsorted(offsets, rows, right=True).clamp_(max=w.shape[0] - 1)
    out = torch.bmm(x.unsqueeze(1), w[row_expert]).squeeze(1)
    return torch.where((rows < offsets[-1]).unsqueeze(1), out, 0)


def expert_linear_shape(x: torch.Tensor, weight: torch.Tensor, is_transposed: bool) -> tuple[tuple, torch.dtype]:
    """The shape and dtype of :func:`expert_linear`'s output (the op's fake implementation)."""
    w = weight if is_transposed else weight.transpose(-1, -2)
    dtype = w.dtype if grouped_fits(x, w) else torch.promote_types(x.dtype, w.dtype)
    return (x.shape[0], w.shape[-1]), dtype


def _lora(x, stack: MoeStack | None, plan: MoePlan, y: torch.Tensor, x_rows: str, backend: str, t=None):
    """``y`` (rows in sorted order) += each pair's LoRA of ``stack`` on ``x`` (rows by ``x_rows``). ``t``: a shrink
    output buffer ``(P, R)`` fp32 to reuse (the Triton backend; one of another rank is not used). Returns the buffer
    the shrink wrote (``t`` or a new one; ``None`` without a stack or on the torch backend)."""
    if stack is None:
        return t
    if backend == "triton":
        if t is not None and t.shape[1] != stack.a.shape[2]:
            t = None
        t = moe_shrink(x, stack.a, stack.ranks, plan, t, x_rows=x_rows, own_rank=True)
        moe_expand(t, stack.b, stack.ranks, stack.scalings, plan, y, y_rows="sorted", own_rank=True)
        return t
    t = moe_shrink_reference(x, stack.a, stack.ranks_host, plan, x_rows=x_rows, own_rank=True)
    moe_expand_reference(t, stack.b, stack.ranks_host, stack.scalings_host, plan, y, y_rows="sorted", own_rank=True)
    return None


def stack_lora(stack: MoeStack, x: torch.Tensor, y: torch.Tensor, plan: MoePlan, x_rows: str, triton: bool) -> None:
    """``y`` (rows in sorted order) += each pair's LoRA of ``stack`` on ``x`` (rows by ``x_rows``), in place: the
    kernels (``triton``) or their torch reference. Compiled code's ``peft_csgmv::moe_lora`` op runs it on a copy."""
    _lora(x, stack, plan, y, x_rows, "triton" if triton else "torch")


def experts_products(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    plan: MoePlan,
    linear: Callable,
    lora: Callable,
) -> torch.Tensor:
    """The experts' output over ``plan``'s sorted pairs (the steps of :func:`moe_lora_forward`), with the base products
    and the LoRA given: ``linear(x, weight, bias, experts, offsets, is_transposed)`` as :func:`expert_linear`;
    ``lora(parameter name, x, y, x_rows)`` returns ``y`` (sorted rows) plus the parameter's LoRA on ``x`` (in place or
    not). Eager code passes :func:`expert_linear` and the kernels in place; compiled code the custom ops
    (:func:`peft_csgmv.layers.experts_forward`). Every step is a tensor op: no host sync, shapes fixed by the plan's."""
    num_tokens, top_k = top_k_index.shape
    perm = plan.permutation  # (P,) int32, each sorted position's pair (torch indexes with it as it is)
    transposed = getattr(experts, "is_transposed", False)
    if getattr(experts, "has_bias", False):
        expert_ids = top_k_index.reshape(-1)[perm]  # (P,) each sorted pair's expert (for its bias)
        gate_up_bias, down_bias = experts.gate_up_proj_bias, experts.down_proj_bias
    else:
        expert_ids = gate_up_bias = down_bias = None
    offsets = plan.expert_offsets
    gate_up = linear(hidden_states[perm // top_k], experts.gate_up_proj, gate_up_bias, expert_ids, offsets, transposed)
    gate_up = lora("gate_up_proj", hidden_states, gate_up, "token")  # (P, 2·I), sorted order
    act = experts._apply_gate(gate_up)  # (P, I)
    out = linear(act, experts.down_proj, down_bias, expert_ids, offsets, transposed)  # (P, hidden)
    out = lora("down_proj", act, out, "sorted")
    # Back to pair order, each pair weighted by its routing weight, summed over each token's experts.
    by_pair = torch.empty_like(out)
    by_pair[perm] = out
    weighted = by_pair.view(num_tokens, top_k, -1) * top_k_weights.to(out.dtype).unsqueeze(-1)
    return weighted.sum(dim=1).to(hidden_states.dtype)


def moe_lora_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    token_slot: Sequence[int] | torch.Tensor | None,
    stacks: dict[str, MoeStack],
    backend: str = "triton",
    chunk_size: int | None = None,
    plan: MoePlan | None = None,
) -> torch.Tensor:
    """The experts' output with each token's own adapter: for every token, what PEFT's forward with that token's
    adapter alone returns (the base experts' output for a base token, slot ``-1``).

    Args:
        experts: a transformers experts module (``@use_experts_implementation``: ``gate_up_proj``, ``down_proj``,
            their optional biases, ``is_transposed``, ``_apply_gate``), not PEFT's wrapper around it.
        hidden_states: ``(T, hidden)``, the experts' input.
        top_k_index, top_k_weights: ``(T, top_k)``, the router's experts and weights of each token.
        token_slot: ``(T,)`` slot of each token, ``-1`` for a base token (not read when ``plan`` is given).
        stacks: ``{"gate_up_proj": MoeStack, "down_proj": MoeStack}`` (either may be missing: that parameter is not
            adapted), of the same slots.
        backend: ``"triton"`` (the kernels) or ``"torch"`` (their reference).
        chunk_size: override the plan's segment length.
        plan: the layer's :class:`MoePlan` of ``top_k_index``, already built (an experts layer builds it from the
            call's :meth:`~peft_csgmv.mapping.Mapping.token_groups_for`); built from ``token_slot`` when ``None``.

    Returns:
        ``(T, hidden)`` in ``hidden_states``' dtype.
    """
    if not getattr(experts, "has_gate", True) or getattr(experts, "has_post_expert_norm", False):
        raise NotImplementedError("the prototype covers gated experts without a post-expert norm")
    if plan is None:
        num_slots = next(iter(stacks.values())).num_slots if stacks else 1
        plan = MoePlan.build(token_slot, top_k_index, experts.num_experts, num_slots, chunk_size=chunk_size)
    buffer = [None]  # (one shrink output buffer for both products: the down shrink runs after the gate/up expand)

    def lora(param: str, x: torch.Tensor, y: torch.Tensor, x_rows: str) -> torch.Tensor:
        buffer[0] = _lora(x, stacks.get(param), plan, y, x_rows, backend, buffer[0])
        return y

    return experts_products(experts, hidden_states, top_k_index, top_k_weights, plan, expert_linear, lora)
