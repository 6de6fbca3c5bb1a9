"""The per-model executor: the call in progress, and the state compiled code reads.

Every patched layer of an enabled model holds its model's :class:`Executor` by handle. The driver
(:func:`peft_csgmv.call.open_call`) makes a call's :class:`~peft_csgmv.mapping.Mapping` and opens the call with
:meth:`Executor.begin`, which rewrites the static plans of compiled shapes from it; :meth:`Executor.end` closes it
in a ``finally``. In between, layers read the mapping (:attr:`Executor.mapping`) and the launch-path choices: eager
layers take their shape's plan from the mapping; compiled layers read the :class:`~peft_csgmv.mapping.StaticPlan` of
their shape through the ``peft_csgmv::lora`` custom ops (:mod:`peft_csgmv.ops`), chosen once when the graph is
traced. A call belongs to its thread (:attr:`Executor.lock`, :attr:`Executor.owner`). The executor also learns
sibling groups (layers reading the same input) from the first eager call, which compiled code then runs as one op per
group.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import TYPE_CHECKING, Callable

import torch

from .mapping import Mapping, PlanCache, StaticMoePlan, StaticPlan
from .options import Options
from .slots import bump_routes

if TYPE_CHECKING:
    from .slots import LoraStack


def use_triton(backend: str, device: torch.device) -> bool:
    if backend == "triton":
        return True
    if backend == "torch":
        return False
    return device.type == "cuda"


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


@torch._dynamo.assume_constant_result
def static_moe_attr(executor: int, n: int, num_tokens: int, top_k: int, experts: int, slots: int, device: str) -> str:
    """The executor attribute holding the :class:`StaticMoePlan` of a compiled experts layer's shape (made, and filled
    for the call in progress, on first use): as :func:`static_plan_attr`, a constant of the graph."""
    return executor_of(executor).register_static_moe(n, num_tokens, top_k, experts, slots, torch.device(device))


class Executor:
    """Runs the LoRA of every patched layer of one model for the call in progress (see the module docstring)."""

    def __init__(
        self, backend: str, restack: Callable[[torch.nn.Module], None], options: Options | None = None
    ) -> None:
        self.backend = backend
        self.restack = restack  # re-copies one layer's adapters (the model state's, passed down)
        self.mapping: Mapping | None = None  # the mapping of the call in progress
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
        # ``(stream, event)``: the work an asynchronous continuous-batching step left queued on its stream when its host
        # part ended (the next step is prepared while it runs). Work that is not ordered after it on that stream (a
        # call on another stream, stacks restacked or freed) waits for it first: :meth:`settle`.
        self.in_flight: tuple | None = None
        self.ahead_stacks: dict = {}  # device -> (route epoch, a stack per kind of launch): eager_ahead.kernel_stacks
        # The launch-path choices (see Options), as attributes compiled code reads (each a guard with a fixed value).
        self.options = options = options if options is not None else Options.from_env()
        self.fused_decode = options.fused_decode
        self.beside = options.beside
        self.beside_min_bytes = options.beside_min_bytes
        # Sibling groups (kernels.group): layers that read the same input tensor one after another, learned from the
        # first eager call with ids (Mapping.observe), then run by compiled code as one op per group.
        self.groups_on = options.groups != "off"
        self.groups_beside = options.groups == "beside"
        self.groups_learned = not self.groups_on
        self._groups: list[list] = []  # the groups given to layers, each its layers in call order
        self.unforeseen = 0  # plans made on a layer's first read, over every call (Mapping.unforeseen)
        # A group's members' outputs, computed by its first member in compiled code, for the others: (group leader's
        # id, member index) -> (input, output). Emptied as they are taken, and at the end of every call.
        self.stash: dict = {}
        self.plans = PlanCache()  # the plans of earlier calls, for later calls with the same ids
        self.statics: list[StaticPlan] = []
        self.moe_statics: list[StaticMoePlan] = []
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

    def leave_in_flight(self, stream) -> None:
        """The work queued on ``stream`` so far (an asynchronous step's, whose host part has ended) may still run:
        :meth:`settle` waits for it where it must (no stream: nothing to wait for)."""
        if stream is not None:
            self.in_flight = (stream, stream.record_event())

    def settle(self, stream=None) -> None:
        """Wait for the work an asynchronous step left in flight (:attr:`in_flight`), unless ``stream`` is the stream
        it runs on (work queued there is ordered after it)."""
        in_flight = self.in_flight
        if in_flight is None or (stream is not None and stream == in_flight[0]):
            return
        in_flight[1].synchronize()
        self.in_flight = None

    def begin(self, mapping: Mapping) -> None:
        """Open ``call``: the layers see it until :meth:`end`. Static plans of this many ids are rewritten for it."""
        if self.in_flight is not None:
            self.settle(torch.cuda.current_stream(self.in_flight[0].device))
        if self.mapping is not None:
            self._outer.append(self.mapping)
        if mapping.cache is None:
            mapping.cache = self.plans
        self._open(mapping)

    def end(self, failed: bool = False) -> None:
        """Close the call in progress; an interrupted outer call is in progress again. A call that ``failed`` learns
        no groups: the runs it marked are dropped, and the next eager call learns them again."""
        mapping = self.mapping
        if mapping is not None:
            for event in mapping.copies_out:
                event.synchronize()
            self.unforeseen += mapping.unforeseen
        self.stash.clear()
        if failed and not self.groups_learned:
            self.forget_groups(())
        elif mapping is not None and mapping.learn is not None and mapping.observed:
            # The first eager call that observed its layers: its last run is grouped too, and the groups are learned
            # for good.
            self._group(mapping.last_run())
            self.groups_learned = True
        if self._outer:
            self._open(self._outer.pop())
        else:
            self.mapping, self.active, self.num_ids, self.owner, self.masked = None, False, 0, None, False

    # -- sibling groups ---------------------------------------------------------------------------------------------

    def _run_ended(self, run: list) -> None:
        """A run of layers that read one tensor, from the call in progress (:meth:`Mapping.observe`): grouped at once,
        so a static-cache ``generate`` has its groups from its eager prefill on, before its decode step is
        compiled."""
        if not self.groups_learned:
            self._group(run)

    def _group(self, run: list) -> None:
        """``run``'s layers (siblings, in call order) as groups of up to three layers with a stack and a base weight
        (unless ``PEFT_CSGMV_GROUPS=beside``, leaving out layers that compiled code runs beside their base product):
        each group's first member holds its key, the other members' stack handles and (``PEFT_CSGMV_GROUPS=beside``)
        their base layers' ``(weight, bias)`` (their records' ``siblings``; a group that runs beside computes its
        members' base products too), and the other members hold the key and their place (``member``). No module holds
        another: compiled code would guard each such reference in Python at every step (a replaced base parameter:
        :meth:`check_groups`)."""
        from .kernels.group import MAX_MEMBERS

        def joins(layer) -> bool:
            record = layer._csgmv_record
            stack, base = record.stack, layer._modules.get("base_layer")
            weight = getattr(base, "weight", None)
            # (an offloaded layer's weights are accelerate's to bring, for each forward: never read by a group's op)
            if stack is None or not isinstance(weight, torch.Tensor) or record.offload is not None:
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
                handles = tuple(m._csgmv_record.stack.handle for m in chunk[1:])
                # (only groups that may run beside their base products read the members' weights)
                bases = (
                    tuple((m.base_layer.weight, getattr(m.base_layer, "bias", None)) for m in chunk[1:])
                    if self.groups_beside
                    else ()
                )
                self._groups.append(chunk)
                chunk[0]._csgmv_record.siblings = (key, handles, bases)
                for index, member in enumerate(chunk[1:], start=1):
                    member._csgmv_record.member = (key, index)
                bump_routes()

    def forget_groups(self, layers) -> None:
        """A layer got a new stack (another handle), or a call failed while learning: the groups (of ``layers`` and
        those given so far) are learned again from the next eager call."""
        for layer in itertools.chain(layers, *self._groups):
            record = layer.__dict__.get("_csgmv_record")
            if record is not None:
                record.siblings = record.member = None
        self._groups = []
        self.groups_learned = not self.groups_on
        bump_routes()

    def check_groups(self) -> None:
        """Before a call (``PEFT_CSGMV_GROUPS=beside``, where leaders hold their members' base tensors): a member
        whose base layer's weight or bias is another tensor than its group's leader holds (a parameter replaced since
        the groups were learned) makes the groups be learned again (compiled code then traces again: it guards the
        layers' group entries). The weights' values may change in place (merging, loading a state dict): the leader
        reads the same tensors."""
        for chunk in self._groups:
            for member, (weight, bias) in zip(chunk[1:], chunk[0]._csgmv_record.siblings[2]):
                base = member._modules.get("base_layer")
                if getattr(base, "weight", None) is not weight or getattr(base, "bias", None) is not bias:
                    self.forget_groups(())
                    return

    def _open(self, mapping: Mapping) -> None:
        """The mapping's call is in progress: the static plans of its number of ids (a packed step: of its token
        count) hold it, and layers read it."""
        packed = mapping.token_slots

        def holds(static) -> bool:  # a packed step's: the plans of its token count (n 0); a call's: of its ids
            if packed is not None:
                return static.n == 0 and static.num_tokens == len(packed)
            return static.n == len(mapping.row_slots)

        for static in self.statics:
            if not holds(static):
                continue
            if packed is None:
                static.fill(mapping.row_slots, mapping.row_keep)
            else:
                static.fill_tokens(packed)
        for moe_static in self.moe_statics:
            if holds(moe_static):
                moe_static.fill(mapping)
        self.mapping, self.active, self.num_ids = mapping, True, len(mapping.row_slots)
        # Until the groups are learned, the call's eager layers tell its mapping what they read (Mapping.observe),
        # which hands each run of siblings here as it ends.
        mapping.learn = None if self.groups_learned else self._run_ended
        self.owner, self.masked = threading.get_ident(), mapping.row_keep is not None

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

    def clear_plans(self) -> None:
        """Forget every cached plan and binding (after the stacks changed shape or moved)."""
        self.plans.clear()

    def drop_bindings(self, stack: "LoraStack") -> None:
        """Bindings to ``stack``'s old tensors would keep them alive and launch on them: drop them."""
        self.plans.drop_bindings(stack)

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
        if self.mapping is not None and self.mapping.token_slots is not None:
            # A packed continuous-batching step (n 0) of rows × tokens_per_row tokens, padding as base tokens.
            static.fill_tokens(self.mapping._packed(rows * tokens_per_row))
        elif self.mapping is not None:
            self.mapping.repeat(rows)  # the rows must be a whole multiple of the ids
            static.fill(self.mapping.row_slots, self.mapping.row_keep)
        self.statics.append(static)
        name = f"_static_{len(self.statics) - 1}"
        setattr(self, name, static)
        return name

    def register_static_moe(
        self, n: int, num_tokens: int, top_k: int, experts: int, slots: int, device: torch.device
    ) -> str:
        """The attribute of the :class:`StaticMoePlan` of this shape (see :func:`static_moe_attr`)."""
        key = (n, num_tokens, top_k, experts, slots, device)
        for i, static in enumerate(self.moe_statics):
            if static.key == key:
                return f"_static_moe_{i}"
        with torch.inference_mode(False):  # every later call rewrites its buffer in place
            static = StaticMoePlan(n, num_tokens, top_k, experts, slots, device)
        if self.mapping is not None:
            static.fill(self.mapping)  # (raises where the tokens are no whole multiple of the ids)
        self.moe_statics.append(static)
        name = f"_static_moe_{len(self.moe_statics) - 1}"
        setattr(self, name, static)
        return name
