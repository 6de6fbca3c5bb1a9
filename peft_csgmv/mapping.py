"""The mapping of a call: which adapter slot each token uses, and the plans the kernels read.

A call's :class:`Mapping` holds its rows' slots (``-1``: a base row) and, for aLoRA rows, how many of each row's last
tokens use the row's adapter (PEFT's offsets). Every layer input the call's layers see, ``rows × tokens_per_row``
tokens with ``rows`` a whole multiple of the ids, reads its plan from it (:meth:`Mapping.plan`), prepared by the driver
before the call's layers run (:meth:`Mapping.prepare`): a
:class:`~peft_csgmv.plan.BatchPlan` (tokens grouped by slot into segments, see :mod:`peft_csgmv.plan` for a worked
example) in a :class:`PlanRun` with its workspaces and bound launches, kept across calls with the same ids
(:class:`PlanCache`). Compiled code cannot run Python per layer, so its plans are :class:`StaticPlan` buffers at fixed
device addresses, one per compiled shape, rewritten from the mapping when a call opens (their grids sized for the most
segments the shape can have, :func:`max_segments`). Eager, compiled and the torch backend read the same segments.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import TYPE_CHECKING, Callable

import torch

from .plan import BatchPlan, aligned_parts, aligned_tail, chunk_size_for, upload, write_buffer

if TYPE_CHECKING:
    from .slots import LoraStack

PLAN_CACHE_SIZE = 64


def row_tokens(row_keep: tuple[int | None, ...] | None, rows: int, tokens_per_row: int) -> tuple[int, ...] | None:
    """For a layer input of ``rows × tokens_per_row`` tokens (``rows`` a whole multiple of the call's ids, each id's
    entry repeated for its rows): how many of each row's last tokens use the row's slot, as PEFT's aLoRA layers count
    them (``row_keep``: :attr:`Mapping.row_keep`; an offset longer than the row covers it whole); ``None`` when
    every token does."""
    if row_keep is None:
        return None
    repeat = rows // len(row_keep)
    per_row = tuple(tokens_per_row if k is None else min(k, tokens_per_row) for k in row_keep)
    return tuple(k for k in per_row for _ in range(repeat)) if repeat > 1 else per_row


@dataclasses.dataclass
class Mapping:
    """One call's LoRA work per token: each input row's slot, each aLoRA row's tokens, and from them the plan of every
    layer input shape the call's layers see. The driver (:func:`peft_csgmv.call.open_call`) makes it once per call
    from the validated ids and prepares the plans of the shapes the call's steps will have (:meth:`prepare`), before
    anything runs; the executor holds it for the call's thread from :meth:`~peft_csgmv.executor.Executor.begin` to
    :meth:`~peft_csgmv.executor.Executor.end`; layers only read it (:meth:`plan`)."""

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
    # Plans kept across calls (the model's, by ids and shape); the executor gives its own where none is given.
    cache: "PlanCache | None" = None
    # A step of packed tokens (continuous batching: every scheduled request's tokens back to back in one row): each
    # token's slot (-1: a base token), in place of ``row_slots``; a layer input of any ``rows × tokens_per_row`` with
    # at least that many tokens reads them in order, the tokens past them (padding) as base tokens.
    token_slots: tuple[int, ...] | None = None
    # A packed step that transformers runs as a CUDA graph (captured in it, or replayed: then no layer's Python runs).
    # Every layer then reads what varies from step to step from buffers at fixed addresses that the driver rewrites
    # before the step (:meth:`prepare`, :meth:`prepare_groups`), sized for any step of its token count: the plans of
    # :meth:`PlanCache.run_for_tokens` with ``graph_slots``, the MoE layers' token groups (:meth:`token_groups_for`);
    # and no layer skips its LoRA for a step without adapter tokens (a replay would skip it for every later step too).
    graphed: bool = False
    # A graphed step: how many slots its tokens may use (the host tier's resident ones, else the registry's), which
    # sizes its plans.
    graph_slots: int = 0

    # Until the model's sibling groups are learned: where each run of layers that read one tensor goes when it ends
    # (the executor's, set when the call opens); ``None`` once they are learned.
    learn: "Callable[[list], None] | None" = None

    def __post_init__(self) -> None:
        self.name_set = frozenset(self.names)
        self._seen: list = []  # the layers that read the tensor _seen_x, in order (while learning)
        self._seen_x = None
        self.runs: dict = {}  # (rows, tokens_per_row, device) -> PlanRun: this call's plans, by shape
        self.unforeseen = 0  # plans of shapes the driver did not prepare, made when a layer first read them
        self._token_slots: dict = {}  # (num_tokens, device[, slots]) -> token_slots_for's (token_groups_for's) answer

    @functools.cached_property
    def slot_set(self) -> frozenset:
        """The distinct slots of the call's rows (or of the step's tokens), -1 included where there are base ones: what
        an experts layer asks before each forward (``MoeStack.serves``), made once per call."""
        return frozenset(self.token_slots if self.token_slots is not None else self.row_slots)

    def prepare(self, rows: int, tokens_per_row: int, device: torch.device) -> "PlanRun":
        """Make the plan of a layer input of ``rows × tokens_per_row`` tokens on ``device`` (from the cache when an
        earlier call with the same ids made it): the driver's step, before the layers run. ``rows`` is a whole
        multiple of the ids (each id's entry repeated for its rows: beams, returned sequences, tokens flattened into
        rows)."""
        key = (rows, tokens_per_row, device)
        run = self.runs.get(key)
        if run is None and self.token_slots is not None:
            slots = self._packed(rows * tokens_per_row)
            graph_slots = self.graph_slots if self.graphed else None
            run = self.runs[key] = self.cache.run_for_tokens(slots, device, graph_slots)
        elif run is None:
            repeat = self.repeat(rows)
            keep = self.row_tokens(rows, tokens_per_row)
            run = self.runs[key] = self.cache.run_for(self.row_slots, repeat, tokens_per_row, device, keep)
        return run

    def plan(self, rows: int, tokens_per_row: int, device: torch.device) -> "PlanRun":
        """What a layer reads: the plan of its input's shape, which the driver prepared (:meth:`prepare`). A shape no
        driver foresaw (a model that reshapes its activations its own way) is prepared here, on first use, and
        counted in :attr:`unforeseen`."""
        run = self.runs.get((rows, tokens_per_row, device))
        if run is None:
            self.unforeseen += 1
            run = self.prepare(rows, tokens_per_row, device)
        return run

    def observe(self, layer, x: torch.Tensor) -> None:
        """An eager kernel layer of this call read ``x`` (while :attr:`learn` is set): layers that read the very same
        tensor one after another are siblings, and a run of them goes to :attr:`learn` as soon as it ends (the next
        layer reads another tensor). Held by the call, so another thread's call never sees it."""
        if x is self._seen_x:
            self._seen.append(layer)
            return
        run, self._seen, self._seen_x = self._seen, [layer], x
        self.learn(run)

    @property
    def observed(self) -> bool:
        """Whether a layer of this call was observed (:meth:`observe`)."""
        return self._seen_x is not None

    def last_run(self) -> list:
        """The run of siblings still open as the call ends (its layers), forgotten here."""
        run, self._seen, self._seen_x = self._seen, [], None
        return run

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

    def _packed(self, num_tokens: int) -> tuple[int, ...]:
        """The token slots of a packed step for a layer input of ``num_tokens`` tokens (padding: base tokens)."""
        slots = self.token_slots
        if num_tokens < len(slots):
            raise ValueError(
                f"a layer saw {num_tokens} tokens in a step of {len(slots)} packed tokens: csgmv cannot tell which "
                "request each of them belongs to"
            )
        return slots + (-1,) * (num_tokens - len(slots)) if num_tokens > len(slots) else slots

    def token_slots_for(self, num_tokens: int, device: torch.device | None = None):
        """The slot of each of a layer input's ``num_tokens`` tokens, flattened row by row (a MoE layer's experts see
        the step's ``rows × tokens`` hidden states as one ``(T, hidden)`` matrix): each id's slot over its
        ``num_tokens / len(ids)`` consecutive tokens (its rows, beams or returned sequences included, one after
        another), ``-1`` for base tokens; an aLoRA row's tokens before its last ``row_keep`` ones are base tokens
        (counted on rows of one id each: aLoRA refuses beams). A packed continuous-batching step: its
        :attr:`token_slots`, padded with ``-1``. ``device``: as an int32 tensor there, made once per call and size
        (every MoE layer of a step reads the same one); ``None``: a tuple."""
        key = (num_tokens, device)
        cached = self._token_slots.get(key)
        if cached is not None:
            return cached
        if self.token_slots is not None:
            slots = self._packed(num_tokens)
        else:
            n = len(self.row_slots)
            if num_tokens % n:
                raise ValueError(
                    f"Length of `{self.arg_name}` should be the same as the number of inputs, but got {n} and a "
                    f"layer input of {num_tokens} tokens (not a whole multiple of {n})"
                )
            per = num_tokens // n
            keep = self.row_tokens(n, per) or (per,) * n  # (each id's tokens that use its slot)
            slots = tuple(
                -1 if slot < 0 or j < per - k else slot for slot, k in zip(self.row_slots, keep) for j in range(per)
            )
        out = slots if device is None else upload(torch.tensor(slots, dtype=torch.int32), device)
        self._token_slots[key] = out
        return out

    def token_groups_for(self, num_tokens: int, device: torch.device, num_slots: int) -> torch.Tensor:
        """:meth:`token_slots_for` as a MoE plan's group slots (:func:`~peft_csgmv.moe_plan.token_groups`): ``(T,)``
        int64 on ``device``, each token's slot or ``num_slots`` for a base token; made once per call, size and slot
        count (every MoE layer of a step reads the same one)."""
        key = (num_tokens, device, num_slots)
        cached = self._token_slots.get(key)
        if cached is None and self.graphed:
            cached = self._token_slots[key] = self.cache.groups_for(key, self)
        elif cached is None:
            cached = self._token_slots[key] = upload(self.host_token_groups(num_tokens, num_slots), device)
        return cached

    def prepare_groups(self) -> None:
        """A graphed step (:attr:`graphed`): rewrite the MoE token groups of its size that earlier steps' layers asked
        for (:meth:`PlanCache.groups_for`, on any device: an experts layer's stacks may be where no kernel layer's
        are), before the step runs (a replay reads them without a layer's Python running)."""
        num_tokens = len(self.token_slots)
        for key, buf in self.cache.groups.items():
            if key[0] == num_tokens:
                write_buffer(buf, self.host_token_groups(num_tokens, key[2]))
                self._token_slots[key] = buf

    def host_token_groups(self, num_tokens: int, num_slots: int) -> torch.Tensor:
        """:meth:`token_groups_for`'s tensor in host memory (what a compiled layer's fixed buffer is rewritten from:
        :meth:`StaticMoePlan.fill`)."""
        return torch.tensor([num_slots if s < 0 else s for s in self.token_slots_for(num_tokens)], dtype=torch.int64)

    def names_for(self, rows: int) -> list[str]:
        """PEFT's ``adapter_names`` for a module input of ``rows`` rows (each name repeated for its rows); the call's
        names as they are when ``rows`` is no whole multiple of them, as PEFT's hooks pass them (PEFT's module then
        raises its own error)."""
        n = len(self.names)
        if self.token_slots is not None:  # (a packed step is served only where no module runs PEFT's path for it)
            return ["__base__"] * rows
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

    __slots__ = ("plan", "workspaces", "bound", "ahead", "_slots")

    def __init__(self, plan: BatchPlan) -> None:
        self.plan = plan
        self.workspaces: dict = {}
        self.bound: dict = {}
        self.ahead = False  # its kernel variants handed to :func:`~peft_csgmv.eager_ahead.compile_ahead_eager` already
        self._slots: tuple | None = None  # (plan, its slots) as :meth:`slots` last read them

    def slots(self) -> frozenset:
        """The slots the plan's segments use (what an offloaded layer's stack lends: :meth:`LoraStack.lend`), the same
        object for every layer of the plan (a packed step's plan changes each step: read again then)."""
        held = self._slots
        if held is None or held[0] is not self.plan:
            held = self._slots = (self.plan, frozenset(slot for slot, _, _ in self.plan.runs))
        return held[1]

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
    """The plan of one compiled shape at fixed device addresses: ``n`` ids, ``rows × tokens_per_row`` tokens (``n``
    0: a packed continuous-batching step of that many tokens, each token its own slot: :meth:`fill_tokens`).

    One int32 buffer ``[permutation (T) | seg_indptr (S + 1) | seg_slot (S)]`` with ``S`` = :func:`max_segments`;
    :meth:`fill` rewrites it for each call's ids (one host-to-device copy). The adapter segments come first, then the
    base tokens cut into segments of slot ``-1`` (the op's out-of-place expand copies them), then empty segments, whose
    programs exit at once (:func:`max_segments` counts the runs ``S`` must hold).
    The row tile follows the token count only (``chunk_size_for(T)``), so it does not change with the ids."""

    def __init__(self, n: int, rows: int, tokens_per_row: int, device: torch.device) -> None:
        self.n, self.rows, self.tokens_per_row, self.device = n, rows, tokens_per_row, device
        self.num_tokens = rows * tokens_per_row
        self.chunk = chunk_size_for(self.num_tokens)
        # (a packed step's tokens may take a run of slots each: at most one segment per token)
        self.max_segments = max_segments(rows, self.num_tokens, self.chunk) if n else self.num_tokens
        t, s = self.num_tokens, self.max_segments
        indptr_at, slot_at, length = aligned_parts(t, s)  # (fill lays its contents out the same: aligned_tail)
        self.buf = torch.zeros(length, dtype=torch.int32, device=device)
        torch._dynamo.mark_static_address(self.buf)  # a CUDA graph reads it in place: each call's fill is seen
        self.permutation = self.buf[:t]
        self.seg_indptr = self.buf[indptr_at : indptr_at + s + 1]
        self.seg_slot = self.buf[slot_at:]
        self.plan = (self.permutation, self.seg_indptr, self.seg_slot)  # (as the ops take them)

    def fill(self, row_slots: tuple[int, ...], row_keep: tuple[int | None, ...] | None = None) -> None:
        """Rewrite the buffer for a call's ``row_slots`` (and ``row_keep``: :attr:`Mapping.row_keep`)."""
        repeat = self.rows // self.n
        slots = [s for s in row_slots for _ in range(repeat)] if repeat > 1 else row_slots
        keep = row_tokens(row_keep, self.rows, self.tokens_per_row)
        self._write(BatchPlan.build(slots, self.tokens_per_row, "cpu", chunk_size=self.chunk, row_tokens=keep))

    def fill_tokens(self, token_slots: tuple[int, ...]) -> None:
        """Rewrite the buffer of a packed step (``n`` 0) for each token's slot (-1: a base token)."""
        self._write(BatchPlan.from_token_slots(token_slots, "cpu", chunk_size=self.chunk))

    def _write(self, plan: BatchPlan) -> None:
        # The base tokens (after the adapter tokens in the permutation) in segments of slot -1, so that the segments
        # cover every token and the op's expand writes its whole output out of place.
        bounds = plan.seg_indptr.tolist()
        base = range(bounds[-1], self.num_tokens, self.chunk)
        bounds += [min(p + self.chunk, self.num_tokens) for p in base]
        seg_slot = plan.seg_slot.tolist() + [-1] * len(base)
        pad = self.max_segments - len(seg_slot)  # segments past the live ones: empty, at the end of the tokens
        tail = aligned_tail(self.num_tokens, bounds + [self.num_tokens] * pad, seg_slot + [0] * pad)
        host = torch.tensor(plan.permutation.tolist() + tail, dtype=torch.int32)
        write_buffer(self.buf, host)


class StaticMoePlan:
    """What a compiled experts layer (MoE expert LoRA) reads to build its plan, at fixed device addresses: ``n`` ids,
    ``num_tokens`` tokens (the step's rows × tokens, flattened, as the experts see them), ``top_k`` experts per token,
    ``num_experts`` experts, ``num_slots`` slots.

    ``groups`` ``(T,)`` int64 holds each token's group slot (its slot, ``num_slots`` for a base token:
    :meth:`Mapping.token_groups_for`'s), rewritten for each call's ids by :meth:`fill` (one host-to-device copy, as
    :class:`StaticPlan`'s); ``tables`` are the plan's constant tensors (:func:`~peft_csgmv.moe_plan.plan_tables`). The
    layer builds its :class:`~peft_csgmv.moe_plan.MoePlan` from them and the router's ``top_k_index`` with tensor ops
    inside the graph (:meth:`~peft_csgmv.moe_plan.MoePlan.from_groups`): the router's choice is device data, so the
    plan is the graph's own work, and the ids reach it through ``groups`` alone (no recompile when they change)."""

    def __init__(
        self, n: int, num_tokens: int, top_k: int, num_experts: int, num_slots: int, device: torch.device
    ) -> None:
        from .moe_plan import max_segments as moe_max_segments
        from .moe_plan import moe_chunk_size, plan_tables

        self.n, self.num_tokens, self.num_slots, self.device = n, num_tokens, num_slots, device
        self.key = (n, num_tokens, top_k, num_experts, num_slots, device)
        num_pairs = num_tokens * top_k
        # (the chunk an eager layer's plan takes by default: MoePlan.from_groups without used_slots)
        self.chunk = moe_chunk_size(num_pairs, num_experts * num_slots)
        segments = moe_max_segments(num_pairs, num_experts, num_slots, self.chunk)
        self.groups = torch.full((num_tokens,), num_slots, dtype=torch.int64, device=device)
        self.tables = plan_tables(device, num_experts, num_slots, segments, self.chunk)
        for t in (self.groups, *self.tables):
            torch._dynamo.mark_static_address(t)  # a CUDA graph reads them in place: each call's fill is seen

    def fill(self, mapping: "Mapping") -> None:
        """Rewrite :attr:`groups` for ``mapping``'s call."""
        write_buffer(self.groups, mapping.host_token_groups(self.num_tokens, self.num_slots))


class PackedPlan:
    """The plan of a packed step of ``num_tokens`` tokens (continuous batching) at fixed device addresses, rewritten
    for each step of that many tokens (:meth:`fill`): its launches bind once and stay bound while the step's
    composition changes as requests join and finish, where a plan made per step would launch through Triton's
    checked path every step. One int32 buffer ``[permutation (T) | seg_indptr (S + 1) | seg_slot (S)]`` laid out as
    :class:`~peft_csgmv.plan.BatchPlan`'s, ``S`` the most segments ``runs`` runs of slots can have (each cut into
    segments of the row tile: at most ``runs + T // chunk``); the segments past a step's own are empty (their programs
    exit at once), and base tokens are in none. Steps run one after another (synchronous batching): a step's rewrite
    never meets the previous step's kernels."""

    def __init__(self, num_tokens: int, runs: int, device: torch.device) -> None:
        self.num_tokens, self.device = num_tokens, device
        self.chunk = chunk_size_for(num_tokens)
        self.max_segments = min(num_tokens, runs + num_tokens // self.chunk)
        t, s = num_tokens, self.max_segments
        indptr_at, slot_at, length = aligned_parts(t, s)
        with torch.inference_mode(False):  # rewritten in place by every step, inside inference mode or not
            self.buf = torch.zeros(length, dtype=torch.int32, device=device)
        self.views = (self.buf[:t], self.buf[indptr_at : indptr_at + s + 1], self.buf[slot_at:])
        self.run = PlanRun(None)  # (its plan: the step's, each step; its workspaces and bound launches: kept)

    def fill(self, token_slots: tuple[int, ...]) -> "PlanRun":
        """This step's plan (``token_slots``: each token's slot, -1 for base tokens), written into the buffer."""
        plan = BatchPlan.from_token_slots(token_slots, "cpu", chunk_size=self.chunk)
        bounds, seg_slot = plan.seg_indptr.tolist(), plan.seg_slot.tolist()
        pad = self.max_segments - len(seg_slot)  # (empty segments: zero tokens each, after the step's own)
        tail = aligned_tail(self.num_tokens, bounds + [bounds[-1]] * pad, seg_slot + [0] * pad)
        host = torch.cat([plan.permutation, torch.tensor(tail, dtype=torch.int32)])
        write_buffer(self.buf, host)
        permutation, seg_indptr, seg_slot_view = self.views
        self.run.plan = dataclasses.replace(
            plan,
            num_segments=self.max_segments,
            permutation=permutation,
            seg_indptr=seg_indptr,
            seg_slot=seg_slot_view,
        )
        return self.run


def packed_runs(token_slots: tuple[int, ...]) -> int:
    """The runs a :class:`PackedPlan` for these slots is sized for: the step's distinct adapter slots, rounded up to a
    power of two (a few sizes, each bound once)."""
    distinct = len(set(token_slots) - {-1})
    return 1 << max(distinct - 1, 0).bit_length()


class PlanCache(collections.OrderedDict):
    """A model's plans kept for later calls, least recently used first, at most :data:`PLAN_CACHE_SIZE`: ``(row slots,
    repeat, tokens per row, device, row tokens)`` -> :class:`PlanRun`. A plan's bound launches live with it (a call
    whose ids came before reuses them)."""

    def __init__(self) -> None:
        super().__init__()
        self.packed: dict = {}  # the packed steps' plans at fixed addresses (PackedPlan), by tokens, device, runs
        # Graphed packed steps' MoE token groups at fixed addresses, by (tokens, device, slots): Mapping.graphed
        self.groups: dict = {}
        self.generation = 0  # advances at each clear (CUDA graphs that read the packed buffers are then stale)

    def run_for(self, row_slots: tuple[int, ...], repeat: int, tokens_per_row: int, device, keep=None) -> "PlanRun":
        key = (row_slots, repeat, tokens_per_row, device, keep)
        run = self.get(key)
        if run is None:
            slots = [s for s in row_slots for _ in range(repeat)] if repeat > 1 else row_slots
            with torch.inference_mode(False):  # kept for later calls, inside inference mode or not
                run = self[key] = PlanRun(BatchPlan.build(slots, tokens_per_row, device, row_tokens=keep))
            if len(self) > PLAN_CACHE_SIZE:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return run

    def run_for_tokens(self, token_slots: tuple[int, ...], device, graph_slots: int | None = None) -> "PlanRun":
        """The plan of one row of packed tokens: a :class:`PackedPlan` of its size (kept in :attr:`packed`, by token
        count, device and runs), rewritten for these slots; a step without adapter tokens gets an empty plan. A
        graphed step (:attr:`Mapping.graphed`, its tokens in at most ``graph_slots`` slots): one plan per token count,
        device and slot count, sized for any step of that many tokens, an all-base step's too."""
        if graph_slots is not None:
            runs = max(1, min(len(token_slots), graph_slots))
            key = (len(token_slots), device, "graphed", runs)
        elif all(slot < 0 for slot in token_slots):
            return PlanRun(BatchPlan.from_token_slots(token_slots, "cpu"))  # (empty: the layers skip the kernels)
        else:
            key = (len(token_slots), device, packed_runs(token_slots))
            runs = key[2]
        packed = self.packed.get(key)
        if packed is None:
            packed = self.packed[key] = PackedPlan(len(token_slots), runs, torch.device(device))
        return packed.fill(token_slots)

    def groups_for(self, key: tuple, mapping: "Mapping") -> torch.Tensor:
        """A graphed step's MoE token groups of ``key`` ``(tokens, device, slots)`` at a fixed address (kept in
        :attr:`groups`): as the driver wrote them before the step (:meth:`Mapping.prepare_groups`), or made now and
        written for ``mapping``, a step that is not being captured (transformers runs a step once before capturing
        it: a write inside a capture would be replayed from its old host copy)."""
        buf = self.groups.get(key)
        if buf is None:
            num_tokens, device, num_slots = key
            device = torch.device(device)
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"csgmv: a CUDA graph is being captured for a step of {num_tokens} tokens whose MoE token groups "
                    "were never written before it"
                )
            with torch.inference_mode(False):  # rewritten in place by every step, inside inference mode or not
                buf = self.groups[key] = torch.empty(num_tokens, dtype=torch.int64, device=device)
            write_buffer(buf, mapping.host_token_groups(num_tokens, num_slots))
        return buf

    def clear(self) -> None:
        super().clear()
        self.packed.clear()
        self.groups.clear()
        self.generation += 1

    def drop_bindings(self, stack: "LoraStack") -> None:
        """Bindings to ``stack``'s old tensors would keep them alive and launch on them: drop them."""
        for run in [*self.values(), *(packed.run for packed in self.packed.values())]:
            run.bound.pop(stack, None)
