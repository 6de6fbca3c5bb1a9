"""The per-model executor: what one csgmv call runs, and the state it owns.

Every patched layer of an enabled model holds the model's :class:`Executor`. The model wrapper opens a call with
:meth:`Executor.begin` (the ids already validated and resolved to slots) and closes it with :meth:`Executor.end` in a
``finally``; in between, each layer asks the executor for the LoRA of its rows. The executor runs the same plan in three
ways:

* **eager, Triton** (CUDA): a host-built :class:`~peft_csgmv.plan.BatchPlan` per ``(rows × tokens)`` shape, cached
  across calls with the same ids, its workspace and each layer's bound launches (:class:`PlanRun`), and the two kernel
  launches per layer;
* **eager, torch** (CPU): the same plan through the plain-torch reference;
* **compiled** (``torch.compile``, and transformers' ``cache_implementation="static"``, which compiles the decode
  step): no Python runs per layer at run time, so the plan lives in a :class:`StaticPlan` — device buffers whose
  addresses and shapes stay fixed and whose contents :meth:`Executor.begin` rewrites for each call's ids — and the
  layers call the kernels through the ``peft_csgmv::lora`` custom op (:mod:`peft_csgmv.ops`). The kernel grid is sized
  for the most segments the shape can have; programs past the live segments exit at once.

Launch-path choices (the direct launch path, see :mod:`peft_csgmv.kernels.launch`) are executor state, not module
globals.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from .options import Options
from .plan import BatchPlan, aligned_parts, aligned_tail, chunk_size_for
from .slots import bump_routes

if TYPE_CHECKING:
    from .slots import LoraStack

PLAN_CACHE_SIZE = 64


def use_triton(backend: str, device: torch.device) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    return device.type == "cuda"


def row_tokens(row_keep: tuple[int | None, ...] | None, rows: int, tokens_per_row: int) -> tuple[int, ...] | None:
    """For a layer input of ``rows × tokens_per_row`` tokens (``rows`` a whole multiple of the call's ids, each id's
    entry repeated for its rows): how many of each row's last tokens use the row's slot, as PEFT's aLoRA layers count
    them (``row_keep``: :attr:`CallContext.row_keep`; an offset longer than the row covers it whole); ``None`` when
    every token does."""
    if row_keep is None:
        return None
    repeat = rows // len(row_keep)
    per_row = tuple(tokens_per_row if k is None else min(k, tokens_per_row) for k in row_keep)
    return tuple(k for k in per_row for _ in range(repeat)) if repeat > 1 else per_row


@dataclasses.dataclass
class CallContext:
    """One call's ids, alive from :meth:`Executor.begin` to :meth:`Executor.end`."""

    row_slots: tuple[int, ...]  # slot of each input row, -1 for base rows
    names: tuple[str, ...]  # adapter name of each input row in PEFT's spelling ("__base__" for base rows)
    arg_name: str  # "adapter_ids" or "adapter_names", for error messages
    alora_offsets: list | None = None  # PEFT's aLoRA offsets of the call's rows, for the layers' PEFT path
    # Per row of the call: ``None`` where the row's adapter applies to every token, else how many of the row's last
    # tokens it applies to (an aLoRA row: PEFT's offset, 0 where the invocation was not found). ``None``: no such row.
    row_keep: tuple[int | None, ...] | None = None
    # Events of the host tier's copies to host memory that the call's moves queued (tier.copies_out): :meth:`Executor.
    # end` waits for them, so that the call returns only once the weights it moved out are there.
    copies_out: list = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.name_set = frozenset(self.names)
        self.runs: dict = {}  # (rows, tokens_per_row, device) -> PlanRun, filled by the first layer of each shape

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

    def row_tokens(self, rows: int, tokens_per_row: int) -> tuple[int, ...] | None:
        """:func:`row_tokens` of the call's rows."""
        return row_tokens(self.row_keep, rows, tokens_per_row)

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


class PlanRun:
    """A plan in use: the plan (plain data), its shrink workspaces, and each layer's launches bound to it (a
    :class:`~peft_csgmv.kernels.BoundLayer`, or a marker: used once / cannot bind)."""

    __slots__ = ("plan", "workspaces", "bound", "ahead")

    def __init__(self, plan: BatchPlan) -> None:
        self.plan = plan
        self.workspaces: dict = {}
        self.bound: dict = {}
        self.ahead = False  # its kernel variants handed to :func:`~peft_csgmv.layers.compile_ahead_eager` already

    def workspace(self, width: int, planes: int = 1) -> torch.Tensor:
        """A ``(num_tokens, width)`` fp32 buffer for the shrink output (``(planes, num_tokens, width)`` for split-K
        partial products), allocated once per plan and shape and shared by every layer: layers run one after
        another, and each layer's expand consumes it before the next layer's shrink."""
        buf = self.workspaces.get((width, planes))
        if buf is None:
            n = self.plan.num_tokens
            shape = (n, width) if planes == 1 else (planes, n, width)
            with torch.inference_mode(False):  # written in place by later calls, inside inference mode or not
                buf = self.workspaces[(width, planes)] = torch.empty(
                    shape, dtype=torch.float32, device=self.plan.permutation.device
                )
        return buf


def max_segments(rows: int, num_tokens: int, chunk: int) -> int:
    """The most segments a plan of ``rows`` rows and ``num_tokens`` tokens can have with row tile ``chunk``: each run
    of one slot is cut into ``⌈len / chunk⌉`` segments, so at most ``runs + num_tokens // chunk``, and never more than
    one per token. Runs: one per slot in use, the base tokens' included, so at most one per row, and one more where
    rows have more than one token (a row whose slot covers its last tokens only has base tokens too: aLoRA)."""
    return min(num_tokens, rows + (num_tokens > rows) + num_tokens // chunk)


class StaticPlan:
    """The plan of one compiled shape at fixed device addresses: ``n`` ids, ``rows × tokens_per_row`` tokens.

    One int32 buffer ``[permutation (T) | seg_indptr (S + 1) | seg_slot (S)]`` with ``S`` = :func:`max_segments`;
    :meth:`fill` rewrites it for each call's ids (one host-to-device copy). The adapter segments come first, then the
    base tokens cut into segments of slot ``-1`` (the op's out-of-place expand copies them), then empty segments, whose
    programs exit at once. Every run of one slot, the base run included, is at most one per row, so ``S`` holds them.
    The row tile follows the token count only (``chunk_size_for(T)``), so it does not change with the ids."""

    def __init__(self, n: int, rows: int, tokens_per_row: int, device: torch.device) -> None:
        self.n, self.rows, self.tokens_per_row, self.device = n, rows, tokens_per_row, device
        self.num_tokens = rows * tokens_per_row
        self.chunk = chunk_size_for(self.num_tokens)
        self.max_segments = max_segments(rows, self.num_tokens, self.chunk)
        t, s = self.num_tokens, self.max_segments
        indptr_at, slot_at, length = aligned_parts(t, s)  # (fill lays its contents out the same: aligned_tail)
        self.buf = torch.zeros(length, dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(self.buf)  # a CUDA graph reads it in place: each call's fill is seen
        self.permutation = self.buf[:t]
        self.seg_indptr = self.buf[indptr_at : indptr_at + s + 1]
        self.seg_slot = self.buf[slot_at:]
        self.plan = (self.permutation, self.seg_indptr, self.seg_slot)  # (as the ops take them)

    def fill(self, row_slots: tuple[int, ...], row_keep: tuple[int | None, ...] | None = None) -> None:
        """Rewrite the buffer for a call's ``row_slots`` (and ``row_keep``: :attr:`CallContext.row_keep`)."""
        repeat = self.rows // self.n
        slots = [s for s in row_slots for _ in range(repeat)] if repeat > 1 else row_slots
        keep = row_tokens(row_keep, self.rows, self.tokens_per_row)
        plan = BatchPlan.build(slots, self.tokens_per_row, "cpu", chunk_size=self.chunk, row_tokens=keep)
        # The base tokens (after the adapter tokens in the permutation) in segments of slot -1, so that the segments
        # cover every token and the op's expand writes its whole output out of place.
        bounds = plan.seg_indptr.tolist()
        base = range(bounds[-1], self.num_tokens, self.chunk)
        bounds += [min(p + self.chunk, self.num_tokens) for p in base]
        seg_slot = plan.seg_slot.tolist() + [-1] * len(base)
        pad = self.max_segments - len(seg_slot)  # segments past the live ones: empty, at the end of the tokens
        tail = aligned_tail(self.num_tokens, bounds + [self.num_tokens] * pad, seg_slot + [0] * pad)
        host = torch.tensor(plan.permutation.tolist() + tail, dtype=torch.int32)
        if self.device.type == "cuda":
            self.buf.copy_(host.pin_memory(), non_blocking=True)
        else:
            self.buf.copy_(host)


# Every live executor by handle, weakly (a plain dict of weak references, which dynamo traces; an entry leaves with its
# executor). Patched modules hold their executor's handle, not the executor: compiled code then reaches the one
# executor through one source, ``_LIVE[handle]()``, which dynamo guards once, where the same object held by every layer
# would cost one Python aliasing guard per layer at every step (see :func:`executor_of`).
_LIVE: "dict[int, weakref.ref[Executor]]" = {}

NO_COPIES = (
    "copy.deepcopy of a model with csgmv enabled, and pickling it (torch.save(model)), are not supported: copy or "
    "pickle it before enable_csgmv, or disable_csgmv(model) first and enable it again afterwards (a copy that was "
    "not enabled would take adapter_ids as stock PEFT does); model.save_pretrained works while enabled"
)
_ids = itertools.count()


def executor_of(handle: int) -> "Executor":
    """The executor of ``handle`` (:attr:`Executor.handle`, which patched modules hold)."""
    return _LIVE[handle]()


def active_calls() -> int:
    """How many csgmv calls are in progress, over all enabled models (0 between calls; a read-out for tests)."""
    return sum(1 for ref in list(_LIVE.values()) if (ex := ref()) is not None and ex.active)


@torch._dynamo.assume_constant_result
def static_plan_attr(executor: int, n: int, rows: int, tokens_per_row: int, device: str) -> str:
    """The executor attribute holding the :class:`StaticPlan` of a compiled shape, made (and filled for the call in
    progress) on first use. It runs when a graph is traced, outside the graph, and its answer is a constant of it: the
    plan's buffers are graph inputs whose contents each call rewrites."""
    return executor_of(executor).register_static(n, rows, tokens_per_row, torch.device(device))


class Executor:
    """Runs the LoRA of every patched layer of one model for the call in progress (see the module docstring)."""

    def __init__(
        self, backend: str, restack: Callable[[torch.nn.Module], None], options: Options | None = None
    ) -> None:
        self.backend = backend
        self.restack = restack  # re-copies one layer's adapters (the model state's, passed down)
        self.call: CallContext | None = None
        self.active = False  # a csgmv call is in progress (compiled code reads this: a guard with two values)
        # A call belongs to its thread. The model's forward / generate (stock calls too) hold ``lock`` from before the
        # ids are validated until the call ends, so calls from several threads run one at a time, each with its own
        # ids; ``owner`` is the thread of the call in progress, and a layer called from another thread meanwhile
        # (directly, not through the model) runs PEFT's own forward.
        self.lock = threading.RLock()
        self.owner: int | None = None
        # Some row of the call in progress uses its adapter for its last tokens only (aLoRA; compiled code reads this:
        # a guard with two values). Such a call's layers that see other rows than its ids (beams, returned
        # sequences, tokens flattened into rows) run PEFT's forward, PEFT's result or PEFT's error.
        self.masked = False
        self.num_ids = 0  # ids of the call in progress (compiled code reads this: a guard per batch shape)
        self.direct_launch = True  # the kernels' lean launch path; off for good once a Triton rejects it
        self.ahead_stacks: dict = {}  # device -> (route epoch, a stack per kind of launch): layers._kernel_stacks
        # The launch-path choices (see Options), as attributes compiled code reads (each a guard with a fixed value).
        self.options = options = options if options is not None else Options.from_env()
        self.fused_decode = options.fused_decode
        self.beside = options.beside
        self.beside_min_bytes = options.beside_min_bytes
        # Sibling groups (kernels.group): layers that read the same input tensor one after another, learned from the
        # first eager call with ids (observe), then run by compiled code as one op per group.
        self.groups_on = options.groups != "off"
        self.groups_beside = options.groups == "beside"
        self.groups_learned = not self.groups_on
        self._seen: list = []  # this call's layers that read the tensor _seen_x, in order
        self._seen_x = None
        self._groups: list[list] = []  # the groups given to layers, each its layers in call order
        # A group's members' outputs, computed by its first member in compiled code, for the others: (group leader's
        # id, member index) -> (input, output). Emptied as they are taken, and at the end of every call.
        self.stash: dict = {}
        self.plans: collections.OrderedDict = collections.OrderedDict()  # LRU: (slots, repeat, tpr, device) -> PlanRun
        self.statics: list[StaticPlan] = []
        self._triton: dict = {}
        self._outer: list = []  # the calls a nested call interrupted (a model called again inside a call)
        self.handle = handle = next(_ids)
        _LIVE[handle] = weakref.ref(self, lambda _: _LIVE.pop(handle, None))

    def __deepcopy__(self, memo):
        # Patched modules name their executor by handle, so a copy of an enabled model would run its calls through
        # the original's executor and stacks: refused, loudly.
        raise TypeError(NO_COPIES)

    def beside_on(self, device: torch.device) -> bool:
        """Whether compiled code on ``device`` runs a layer's LoRA beside its base product (see :attr:`beside`)."""
        return self.beside == "always" or (self.beside == "cuda" and device.type == "cuda")

    # -- a call -----------------------------------------------------------------------------------------------------

    def begin(self, call: CallContext) -> None:
        """Open ``call``: the layers see it until :meth:`end`. Static plans of this many ids are rewritten for it."""
        if self.call is not None:
            self._outer.append(self.call)
        self._open(call)

    def end(self, failed: bool = False) -> None:
        """Close the call in progress; an interrupted outer call is in progress again. A call that ``failed`` learns
        no groups: the runs it marked are dropped, and the next eager call learns them again."""
        for event in self.call.copies_out if self.call is not None else ():
            event.synchronize()
        self.stash.clear()
        if failed and not self.groups_learned:
            self.forget_groups(())
        elif self._seen_x is not None:
            self._learn()
        if self._outer:
            self._open(self._outer.pop())
        else:
            self.call, self.active, self.num_ids, self.owner, self.masked = None, False, 0, None, False

    # -- sibling groups ---------------------------------------------------------------------------------------------

    def observe(self, layer: torch.nn.Module, x: torch.Tensor) -> None:
        """An eager kernel layer of the call in progress read ``x`` (until the groups are learned): layers that read
        the very same tensor one after another are siblings. A run of them becomes a group as soon as it ends (the
        next layer reads another tensor), so a static-cache ``generate`` has its groups from its eager prefill on,
        before its decode step is compiled."""
        if x is self._seen_x:
            self._seen.append(layer)
            return
        self._group(self._seen)
        self._seen, self._seen_x = [layer], x

    def _group(self, run: list) -> None:
        """``run``'s layers (siblings, in call order) as groups of up to three layers with a stack and a base weight
        (unless ``PEFT_CSGMV_GROUPS=beside``, leaving out layers that compiled code runs beside their base product):
        each group's first member holds its key, the other members' stack handles and (``PEFT_CSGMV_GROUPS=beside``)
        their base layers' ``(weight, bias)`` (``_csgmv_siblings``; a group that runs beside computes its members' base
        products too), and the other members hold the key and their place (``_csgmv_member``). No module holds
        another: compiled code would guard each such reference in Python at every step (a replaced base parameter:
        :meth:`check_groups`)."""
        from .kernels.group import MAX_MEMBERS

        def joins(layer) -> bool:
            stack, base = layer.__dict__.get("_csgmv_stack"), layer._modules.get("base_layer")
            weight = getattr(base, "weight", None)
            if stack is None or not isinstance(weight, torch.Tensor):
                return False
            if self.groups_beside:
                return True
            return not (self.beside_on(stack.device) and weight.nbytes >= self.beside_min_bytes)

        parts, part = [], []
        for layer in run:
            if joins(layer):
                part.append(layer)
            else:
                parts.append(part)
                part = []
        parts.append(part)
        for part in parts:
            for i in range(0, len(part) - 1, MAX_MEMBERS):
                chunk = part[i : i + MAX_MEMBERS]
                if len(chunk) < 2:
                    continue
                key = id(chunk[0])
                handles = tuple(m.__dict__["_csgmv_stack"].handle for m in chunk[1:])
                # (only groups that may run beside their base products read the members' weights)
                bases = (
                    tuple((m.base_layer.weight, getattr(m.base_layer, "bias", None)) for m in chunk[1:])
                    if self.groups_beside
                    else ()
                )
                self._groups.append(chunk)
                chunk[0].__dict__["_csgmv_siblings"] = (key, handles, bases)
                for index, member in enumerate(chunk[1:], start=1):
                    member.__dict__["_csgmv_member"] = (key, index)
                bump_routes()

    def forget_groups(self, layers) -> None:
        """A layer got a new stack (another handle), or a call failed while learning: the groups (of ``layers`` and
        those given so far) are learned again from the next eager call."""
        for layer in itertools.chain(layers, *self._groups):
            layer.__dict__.pop("_csgmv_siblings", None)
            layer.__dict__.pop("_csgmv_member", None)
        self._seen, self._seen_x, self._groups = [], None, []
        self.groups_learned = not self.groups_on
        bump_routes()

    def check_groups(self) -> None:
        """Before a call (``PEFT_CSGMV_GROUPS=beside``, where leaders hold their members' base tensors): a member
        whose base layer's weight or bias is another tensor than its group's leader holds (a parameter replaced since
        the groups were learned) makes the groups be learned again (compiled code then traces again: it guards the
        layers' group entries). The weights' values may change in place (merging, loading a state dict): the leader
        reads the same tensors."""
        for chunk in self._groups:
            for member, (weight, bias) in zip(chunk[1:], chunk[0].__dict__["_csgmv_siblings"][2]):
                base = member._modules.get("base_layer")
                if getattr(base, "weight", None) is not weight or getattr(base, "bias", None) is not bias:
                    self.forget_groups(())
                    return

    def _learn(self) -> None:
        """The end of the first eager call that observed its layers: its last run is grouped too, and the groups
        are learned for good."""
        self._group(self._seen)
        self._seen, self._seen_x = [], None
        self.groups_learned = True

    def _open(self, call: CallContext) -> None:
        for static in self.statics:
            if static.n == len(call.row_slots):
                static.fill(call.row_slots, call.row_keep)
        self.call, self.active, self.num_ids, self.owner = call, True, len(call.row_slots), threading.get_ident()
        self.masked = call.row_keep is not None

    def triton_on(self, device: torch.device) -> bool:
        """Whether layers on ``device`` use the Triton kernels (the backend choice)."""
        use = self._triton.get(device)
        if use is None:
            use = self._triton[device] = use_triton(self.backend, device)
        return use

    def set_backend(self, backend: str) -> None:
        self.backend = backend
        self._triton.clear()
        self.clear_plans()
        bump_routes()

    # -- eager plans ------------------------------------------------------------------------------------------------

    def plan_run(self, rows: int, tokens_per_row: int, device: torch.device) -> PlanRun:
        """The plan for a layer input of ``rows × tokens_per_row`` tokens on ``device`` in the call in progress; built
        by the first layer that sees this shape, reused by all later ones, and by later calls with the same ids."""
        call = self.call
        key = (rows, tokens_per_row, device)
        run = call.runs.get(key)
        if run is None:
            repeat = call.repeat(rows)
            keep = call.row_tokens(rows, tokens_per_row)
            run = call.runs[key] = self._cached_run(call.row_slots, repeat, tokens_per_row, device, keep)
        return run

    def _cached_run(
        self, row_slots: tuple[int, ...], repeat: int, tokens_per_row: int, device, keep: tuple | None = None
    ) -> PlanRun:
        key = (row_slots, repeat, tokens_per_row, device, keep)
        run = self.plans.get(key)
        if run is None:
            slots = [s for s in row_slots for _ in range(repeat)] if repeat > 1 else row_slots
            with torch.inference_mode(False):  # kept for later calls, inside inference mode or not
                run = self.plans[key] = PlanRun(BatchPlan.build(slots, tokens_per_row, device, row_tokens=keep))
            if len(self.plans) > PLAN_CACHE_SIZE:
                self.plans.popitem(last=False)
        else:
            self.plans.move_to_end(key)
        return run

    def clear_plans(self) -> None:
        """Forget every cached plan and binding (after the stacks changed shape or moved)."""
        self.plans.clear()

    def drop_bindings(self, stack: "LoraStack") -> None:
        """Bindings to ``stack``'s old tensors would keep them alive and launch on them: drop them."""
        for run in self.plans.values():
            run.bound.pop(stack, None)

    @property
    def num_plans(self) -> int:
        """How many plans are cached (a public read-out for benchmarks and tests)."""
        return len(self.plans)

    # -- compiled plans ---------------------------------------------------------------------------------------------

    def register_static(self, n: int, rows: int, tokens_per_row: int, device: torch.device) -> str:
        for i, static in enumerate(self.statics):
            if (static.n, static.rows, static.tokens_per_row, static.device) == (n, rows, tokens_per_row, device):
                return f"_static_{i}"
        with torch.inference_mode(False):  # every later call rewrites its buffer in place
            static = StaticPlan(n, rows, tokens_per_row, device)
        if self.call is not None:
            self.call.repeat(rows)  # the rows must be a whole multiple of the ids
            static.fill(self.call.row_slots, self.call.row_keep)
        self.statics.append(static)
        name = f"_static_{len(self.statics) - 1}"
        setattr(self, name, static)
        return name
