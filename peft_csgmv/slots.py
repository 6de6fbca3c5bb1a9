"""Adapter slots: one model-wide name → slot index registry, and per-layer LoRA weights stored at their own ranks.

Every adapter gets one slot index, the same in every layer. A layer's :class:`LoraStack` holds

* ``data``: one flat buffer with every slot's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)`` at the slot's own rank
  ``r``, row-major (PEFT's layouts), back to back: nothing is padded to the layer's largest rank (S-LoRA's unified
  pool, per layer). ``a_off`` / ``b_off``: ``(capacity,)`` int64, where each slot's matrices start (multiples of
  :data:`~peft_csgmv.kernels.pool.ALIGN` elements). ``a`` / ``b`` are the kernels' :class:`~peft_csgmv.kernels.pool.
  Pooled` views of it;
* ``ranks``: ``(capacity,)`` int32 — the slot's rank in this layer, ``0`` where the adapter does not target the layer
  (or the slot is free); the kernels do no work for rank-0 slots;
* ``scalings``: ``(capacity,)`` fp32 — PEFT's ``layer.scaling[name]`` (``lora_alpha / r``, or ``lora_alpha / √r``
  with rsLoRA, with ``rank_pattern`` / ``alpha_pattern`` already applied by PEFT).

Where dtype and device allow, PEFT's own ``lora_A`` / ``lora_B`` parameters are views into ``data`` (``share``): each
adapter is stored once, and PEFT's forward, merges, saves and in-place edits work on the memory the kernels read.

Storage is allocated exactly for the adapters a stack is built with; an adapter loaded later goes into a hole a freed
one left, or at the end, and when neither has room the buffer is rebuilt with every live slot packed back to back
plus 1/16 of room to grow (so loading many adapters one by one costs amortized linear copying).

Stacked dtype: by default the adapters' own (PEFT keeps them in fp32 on a bf16/fp16 model, ``autocast_adapter_dtype``;
the stacks then hold fp32 and the kernels compute PEFT's numerics: fp32 products for fp32 activations, TF32 for
half-precision ones, whose own rounding is far coarser). ``enable_csgmv(model, dtype=torch.bfloat16)`` stacks in the
model's dtype instead (half the bytes, bf16 products: the numerics of PEFT with ``autocast_adapter_dtype=False``).
Host copies of ranks and scalings serve the torch backend without a device sync.

DoRA adapters add ``mag``: ``(capacity, out_features)`` fp32, the per-output scale ``magnitude / ‖W + scaling·B·A‖``
of each slot (1 for plain LoRA slots), and ``bias``: the base layer's bias in fp32 (zeros for none); both exist only
once a layer holds a DoRA adapter. ``lora_bias``: ``(capacity, out_features)`` fp32, each slot's ``lora_B`` bias
(PEFT's ``lora_bias=True``; zeros elsewhere), once a layer holds such an adapter.

Slots are set and cleared one at a time (``set_slot`` / ``clear_slot``), so loading or deleting one adapter never
restacks the others.

With the host tier (``max_resident_adapters``) the stacks of one device and dtype share one
:class:`~peft_csgmv.tier.DevicePages` instead: a page per slot, holding that slot's adapter in every layer of the group,
laid out as the adapter's host region, so that an adapter moves between host and device in one copy
(:mod:`peft_csgmv.tier`). A stack's ``data`` is then the pages' memory, and its offsets point into its slots' pages.
"""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from .kernels.pool import ALIGN, Pooled, rank_align
from .plan import write_buffer

if TYPE_CHECKING:
    from .tier import DevicePages


class SlotRegistry:
    """Model-wide adapter name → slot index. Freed slots are reused."""

    def __init__(self) -> None:
        self.names: list[str | None] = []  # slot -> name (None: free)
        self.index: dict[str, int] = {}

    @property
    def capacity(self) -> int:
        return len(self.names)

    def add(self, name: str) -> int:
        if name in self.index:
            return self.index[name]
        try:
            slot = self.names.index(None)
            self.names[slot] = name
        except ValueError:
            slot = len(self.names)
            self.names.append(name)
        self.index[name] = slot
        return slot

    def remove(self, name: str) -> int:
        slot = self.index.pop(name)
        self.names[slot] = None
        return slot


def layer_adapters(layer: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters a PEFT LoRA Linear or Embedding layer holds: name → (A ``(r, in)``, B ``(out, r)``) weights
    (for an embedding, ``in`` is the vocabulary: PEFT's ``lora_embedding_A`` / ``lora_embedding_B``)."""
    held = layer._modules
    embedding_a = held.get("lora_embedding_A")
    if embedding_a:
        return {name: (layer.lora_embedding_A[name], layer.lora_embedding_B[name]) for name in embedding_a}
    b_modules = held["lora_B"]._modules  # the module dicts, not Module.__getattr__: layers may hold thousands
    return {
        name: (module_param(a, "weight"), module_param(b_modules[name], "weight"))
        for name, a in held["lora_A"]._modules.items()
    }


def layer_adapter(layer: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One adapter's (A, B) weights in a PEFT LoRA Linear or Embedding layer (as :func:`layer_adapters`), ``None``
    where the layer does not hold it: a lookup, for layers that hold many adapters (the host tier looks up each
    adapter it brings in, in every layer: through the module dicts, not ``Module.__getattr__``)."""
    held = layer._modules
    embedding_a = held.get("lora_embedding_A")
    if embedding_a is not None and name in embedding_a:
        return layer.lora_embedding_A[name], layer.lora_embedding_B[name]
    a = held["lora_A"]._modules.get(name)
    if a is None:
        return None
    return module_param(a, "weight"), module_param(held["lora_B"]._modules[name], "weight")


def module_param(module: nn.Module, name: str) -> torch.Tensor | None:
    """``getattr(module, name, None)`` for a parameter, read from the module's own dict where it is there."""
    params = module._parameters
    return params[name] if name in params else getattr(module, name, None)


def weights_device(layer: nn.Module) -> torch.device:
    """Where a PEFT layer's adapter weights live (its stack follows them, never a call's inputs)."""
    for held in (layer.lora_A, layer.lora_embedding_A):
        for value in held.values():
            return value.device if isinstance(value, torch.Tensor) else next(value.parameters()).device
    weight = getattr(layer.get_base_layer(), "weight", None)
    return weight.device if weight is not None else next(layer.parameters()).device


# The stack's device tensors. Compiled code does not take them as graph inputs (hundreds of layers would make every
# call of a compiled graph check and pass thousands of tensors): the ``peft_csgmv::lora`` op finds its stack by
# :attr:`LoraStack.handle` and reads them when it runs (a CUDA graph captures their addresses). Replacing one, or a
# change of the launch shape (largest rank, rank alignment), bumps :attr:`LoraStack.version`, which compiled code
# guards on: it recompiles instead of reading freed memory or launching stale tiles.
_TENSORS = frozenset(("data", "a_off", "b_off", "ranks", "scalings", "mag", "bias", "lora_bias"))
VECTORS = (("ranks", torch.int32), ("scalings", torch.float32), ("a_off", torch.int64), ("b_off", torch.int64))
VECTOR_NAMES = frozenset(name for name, _ in VECTORS)
# The host mirrors' array type codes and the torch dtypes that view them (tier.DevicePages.cells): scalings as doubles.
MIRROR_TYPES = {"ranks": ("i", torch.int32), "scalings": ("d", torch.float64), "a_off": ("q", torch.int64),
                 "b_off": ("q", torch.int64)}  # fmt: skip
_handles = itertools.count()
_STACKS: "weakref.WeakValueDictionary[int, LoraStack]" = weakref.WeakValueDictionary()


# Compiled code decides each kernel layer's path once, when it is traced, from the layer's state (its stack's handle,
# version and kind, its sibling group, its base layer's kind; layers.compiled_route), and guards this one number for
# all of them in place of each fact it read: every change to such state (a stack's tensors or launch shape, groups
# learned or forgotten, a backend switched, the adapters PEFT's path serves in a layer: set_peft_rows) advances it,
# and graphs traced before then trace again.
ROUTE_EPOCH = 0


def bump_routes() -> None:
    """Compiled graphs traced before now decide their layers' paths anew (see :data:`ROUTE_EPOCH`)."""
    global ROUTE_EPOCH
    ROUTE_EPOCH += 1


def set_peft_rows(layer: nn.Module, names) -> None:
    """The adapters PEFT's own path serves in kernel layer ``layer`` (its record's ``peft_rows``), which compiled code's
    routes read: a change advances :data:`ROUTE_EPOCH`."""
    names = frozenset(names)
    record = layer._csgmv_record
    if record.peft_rows != names:
        record.peft_rows = names
        bump_routes()


def stack_by_handle(handle: int) -> "LoraStack":
    """The live stack with this :attr:`LoraStack.handle` (how the compiled path's op reaches a layer's stack)."""
    return _STACKS[handle]


def _up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


class LoraStack:
    """One layer's LoRA weights, every slot at its own rank (see the module docstring for the layout)."""

    lent = False  # (a :class:`LentStack` is: its tensors are one forward's copies, never bound to a plan)

    def __setattr__(self, name: str, value) -> None:
        if name in _TENSORS:
            self._bump()
            if name in VECTOR_NAMES and self.__dict__.get("pages") is not None:
                self.pages.dirty = True  # another tensor than its row of the group's table: rebuilt on upload
        elif name == "_views" and value is None and self.__dict__.get("pages") is not None:
            self.pages.dirty = True  # a slot changed: the group's tables are uploaded again
        object.__setattr__(self, name, value)

    def _bump(self) -> None:
        """A compiled graph that read this stack is stale (see ``_TENSORS``)."""
        object.__setattr__(self, "version", self.__dict__.get("version", 0) + 1)
        bump_routes()

    def __init__(
        self,
        in_features: int,
        out_features: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        embedding: bool = False,
        reserve: int = 0,
        pages: "DevicePages | None" = None,
        runs_on: torch.device | None = None,
    ) -> None:
        """``reserve``: elements of storage to allocate up front (:meth:`slot_elements` of the adapters to come).
        ``pages``: the host tier's :class:`DevicePages` of this device and dtype, whose memory is the stack's storage
        (slots then go where the tier reserves them, never packed or moved by the stack). ``runs_on``: the layer runs
        on another device than the stack's (an offloaded layer, :mod:`peft_csgmv.offload`: the stack waits in host
        memory, pinned where ``runs_on`` is a GPU, and each forward borrows it there: :meth:`lend`)."""
        self.handle = next(_handles)
        _STACKS[self.handle] = self
        self.launch_shape: tuple[int, int] | None = None  # (largest rank, rank alignment) the views were built with
        # With the host tier: the ranks of every adapter this layer holds, resident or not. The launch shape covers
        # them all, so that bringing adapters in and out of slots never changes it (compiled code would recompile).
        self.held_ranks: frozenset[int] = frozenset()
        self.held_max = 0
        self.embedding = embedding  # an embedding layer: A is gathered by token id instead of multiplied
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.device = device
        self.pages = pages
        self.runs_on = runs_on
        # Host storage that a GPU copies from while the host goes on (an offloaded layer's stack: :meth:`lend`).
        self.pin = runs_on is not None and runs_on.type == "cuda"
        self._lend_src: tuple | None = None  # (views, pinned per-slot vectors and extras) as :meth:`lend` last read
        self._lend_extents: tuple | None = None  # (views, slots, extents to copy, elements) as :meth:`lend` last cut
        if pages is None:
            self.data = torch.empty(reserve, dtype=dtype, device=device, pin_memory=self.pin)
        else:
            self.data = pages.data
            self.row = pages.join(self)
        # slot -> what it holds here, one record each (:class:`SlotRecord`): its place (``rel``: from the slot's base,
        # :meth:`base`), rank and length, the weights it came from (``a``: a restack copies a slot whose ``a`` is not
        # its adapter's weight), whether PEFT's parameters view it (``share``). With pages, a slot the tier reserved
        # but has not filled yet has a record without weights (``a`` None).
        self.records: dict[int, SlotRecord] = {}
        self.tail = 0  # end of the last extent allocated at the end of data
        self.a_off = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.b_off = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.ranks = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.a_off_host = [0] * capacity
        self.b_off_host = [0] * capacity
        self.ranks_host = [0] * capacity
        self.scalings_host = [0.0] * capacity
        self.lora_bias: torch.Tensor | None = (
            None  # (capacity, out) fp32 lora_B bias, once a lora_bias adapter is stacked
        )
        self.scaling_src: dict | None = None  # the layer's ``scaling`` dict the stack was built from
        self.mag: torch.Tensor | None = None  # (capacity, out) fp32 DoRA scale, once a DoRA adapter is stacked
        self.bias: torch.Tensor | None = None  # (out,) fp32 base bias, with mag
        self._views: tuple[Pooled, Pooled] | None = None

    @staticmethod
    def slot_elements(rank: int, in_features: int, out_features: int) -> int:
        """Elements of storage one slot of ``rank`` takes (both matrices, each aligned)."""
        return _up(rank * in_features) + _up(out_features * rank)

    @staticmethod
    def b_start(rank: int, in_features: int) -> int:
        """Where a slot's ``B`` starts, in elements from the slot's start (after its aligned ``A``)."""
        return _up(rank * in_features)

    @property
    def capacity(self) -> int:
        return len(self.ranks_host)

    @property
    def r_max(self) -> int:
        """The largest rank of any slot, or of any adapter the layer holds with the host tier (at least 1): the width
        of the shrink's output."""
        return max(max(self.ranks_host, default=0), self.held_max) or 1

    def hold_ranks(self, ranks) -> None:
        """The host tier: the ranks of every adapter this layer holds (see :attr:`held_ranks`)."""
        ranks = frozenset(ranks)
        if ranks != self.held_ranks:
            self.held_ranks, self.held_max = ranks, max(ranks, default=0)
            self._views = None

    def refresh(self) -> None:
        """Bring the device's per-slot vectors (ranks, scalings, offsets) in line with the host's and build :attr:`a`
        / :attr:`b`: after slots change, before the kernels run. Done lazily by :attr:`a` / :attr:`b` too; compiled
        code reads the stack as it is, so its owner refreshes a stack after changing it."""
        self._pooled()

    def _upload(self) -> None:
        """The host's per-slot vectors to the device: four copies for however many slots changed, into the same
        tensors (their addresses are static: compiled graphs and bound launches keep reading them). With
        :attr:`pages`, the group's tables, once for all its stacks."""
        if self.pages is not None:
            if self.pages.dirty or self.pages.dirty_slots:
                self.pages.upload()
            return
        for name, dtype in VECTORS:
            dev, src = getattr(self, name), torch.tensor(getattr(self, name + "_host"), dtype=dtype)
            write_buffer(dev, src)

    def _pooled(self) -> tuple[Pooled, Pooled]:
        views = self._views
        if views is None:
            self._upload()
            ranks, cap = tuple(self.ranks_host), self.capacity
            distinct = set(ranks)  # a few distinct ranks among many slots: each one's alignment checked once
            distinct.discard(0)
            r, align = self.r_max, rank_align(distinct.union(self.held_ranks))
            if self.launch_shape != (r, align):  # compiled launches use these as tile sizes: recompile
                self.launch_shape = (r, align)
                self._bump()
            views = self._views = (
                Pooled(self.data, self.a_off, tuple(self.a_off_host), ranks, (cap, r, self.in_features), False, align),
                Pooled(self.data, self.b_off, tuple(self.b_off_host), ranks, (cap, self.out_features, r), True, align),
            )
        return views

    @property
    def a(self) -> Pooled:
        """Every slot's ``lora_A``, as the kernels take it (a :class:`~peft_csgmv.kernels.pool.Pooled`; the same object
        until a slot or the storage changes)."""
        return self._views[0] if self._views is not None else self._pooled()[0]

    @property
    def b(self) -> Pooled:
        """Every slot's ``lora_B``, as :attr:`a`."""
        return self._views[1] if self._views is not None else self._pooled()[1]

    def slot_a(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s ``lora_A`` ``(r, in)``: a view of the storage."""
        k = self.in_features
        return self.data.as_strided(
            (self.ranks_host[slot], k), (k, 1), self.data.storage_offset() + self.a_off_host[slot]
        )

    def slot_b(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s ``lora_B`` ``(out, r)``: a view of the storage."""
        r = self.ranks_host[slot]
        return self.data.as_strided((self.out_features, r), (r, 1), self.data.storage_offset() + self.b_off_host[slot])

    @property
    def nbytes(self) -> int:
        """Device memory held by this stack (with :attr:`pages`, the per-slot tensors only: the pages are shared by
        every stack of their group, :attr:`~peft_csgmv.tier.DevicePages.nbytes`)."""
        data = None if self.pages is not None else self.data
        tensors = (data, self.a_off, self.b_off, self.ranks, self.scalings, self.mag, self.bias, self.lora_bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    @property
    def used_bytes(self) -> int:
        """Bytes of :attr:`data` that hold a slot's weights (the rest: holes left by freed slots, room to grow)."""
        return sum(rec.length for rec in self.records.values()) * self.data.element_size()

    def ensure_capacity(self, capacity: int) -> None:
        """Make room for slots ``0 .. capacity-1`` (new slots have rank 0)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        if self.mag is not None:
            self.mag = torch.cat([self.mag, self.mag.new_ones(extra, self.out_features)])
        if self.lora_bias is not None:
            self.lora_bias = torch.cat([self.lora_bias, self.lora_bias.new_zeros(extra, self.out_features)])
        self.ranks = torch.cat([self.ranks, self.ranks.new_zeros(extra)])
        self.scalings = torch.cat([self.scalings, self.scalings.new_zeros(extra)])
        self.a_off = torch.cat([self.a_off, self.a_off.new_zeros(extra)])
        self.b_off = torch.cat([self.b_off, self.b_off.new_zeros(extra)])
        # (new lists: with pages, the host lists are views of the group's mirrors, which the next upload rebuilds)
        self.ranks_host = [*self.ranks_host, *[0] * extra]
        self.scalings_host = [*self.scalings_host, *[0.0] * extra]
        self.a_off_host = [*self.a_off_host, *[0] * extra]
        self.b_off_host = [*self.b_off_host, *[0] * extra]
        self._views = None

    # -- storage ------------------------------------------------------------------------------------------------------

    def _alloc(self, length: int) -> int:
        """The start of ``length`` free elements of :attr:`data`: at the end, else the first hole that fits, else
        after the storage is rebuilt with the live slots packed and room added."""
        if self.tail + length <= self.data.numel():
            start, self.tail = self.tail, self.tail + length
            return start
        end = 0
        for start, used in sorted((rec.rel, rec.length) for rec in self.records.values()):
            if start - end >= length:
                return end
            end = start + used
        self._repack(length)
        start, self.tail = self.tail, self.tail + length
        return start

    def compact(self) -> None:
        """Storage of exactly the live slots, packed back to back, where holes and room to grow take more than 2%."""
        if self.pages is not None:  # the tier's pages: fixed places, nothing to pack
            return
        used = sum(rec.length for rec in self.records.values())
        if self.data.numel() > used + used // 50:
            self._repack(0, room=False)

    def _repack(self, extra: int, room: bool = True) -> None:
        """New storage: the live slots back to back, then room for ``extra`` elements and (``room``) 1/16 of the whole
        more."""
        used = sum(rec.length for rec in self.records.values())
        size = used + extra + ((used + extra) // 16 if room else 0)
        data = torch.empty(size, dtype=self.dtype, device=self.device, pin_memory=self.pin)
        pos, held = 0, {}
        for slot, rec in sorted(self.records.items(), key=lambda kv: kv[1].rel):
            data[pos : pos + rec.length] = self.data[rec.rel : rec.rel + rec.length]
            held[slot] = rec._replace(rel=pos, b_rel=pos + rec.b_rel - rec.rel)
            self._set_offsets(slot, pos, self.ranks_host[slot])
            pos += rec.length
        self.data, self.records, self.tail = data, held, pos
        self._views = None
        self._point_shared()

    def repage(self) -> None:
        """:attr:`pages` were rebuilt with pages of another size: every slot is at the same place in its new page (its
        record's ``rel`` holds); its offsets and PEFT's views follow."""
        for slot, rec in self.records.items():
            self._set_offsets(slot, self.base(slot) + rec.rel, self.ranks_host[slot])
        self._point_shared()

    def base(self, slot: int) -> int:
        """Where the places of slot ``slot``'s records count from in :attr:`data`: its page's start with
        :attr:`pages`, else the start of the storage."""
        return self.pages.start(slot) if self.pages is not None else 0

    def _set_offsets(self, slot: int, start: int, rank: int) -> None:
        self.a_off_host[slot], self.b_off_host[slot] = start, start + self.b_start(rank, self.in_features)
        self._views = None  # the device copies follow on refresh

    def _free(self, slot: int) -> None:
        rec = self.records.pop(slot, None)
        if rec is not None and self.pages is None and rec.rel + rec.length == self.tail:
            self.tail = rec.rel

    # -- slots --------------------------------------------------------------------------------------------------------

    def set_slot(
        self,
        slot: int,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        dora: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        lora_bias: torch.Tensor | None = None,
        share: bool = False,
    ) -> None:
        """Copy one adapter's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)`` weights into ``slot``; for DoRA,
        ``dora = (mag (out,), base bias (out,) or None)``; ``lora_bias``: ``lora_B``'s bias ``(out,)``, if any.

        ``share``: ``lora_a`` / ``lora_b`` are PEFT's parameters, of this stack's dtype: afterwards they are views into
        the slot (``.data`` re-pointed; from another device, as the host tier brings an adapter in, that is their move
        to this one), so the adapter is stored once, and PEFT's forward, merges, saves and in-place edits all work on
        the stack's memory (:meth:`release_shared` gives them their own again). Weights from pinned host memory are
        copied asynchronously, in stream order."""
        r = lora_a.shape[0]
        if lora_a.shape[1] != self.in_features or lora_b.shape != (self.out_features, r):
            raise ValueError(
                f"adapter weights A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a layer of "
                f"{self.in_features} → {self.out_features} features"
            )
        self.ensure_capacity(slot + 1)
        self._release(slot)
        # Detached sources into the stack's own (never grad-requiring) storage: nothing for autograd to record.
        if lora_a.device == self.device and self._aliases(lora_a, lora_b):
            # Copies first: the sources may be views of this very slot (a restack of shared weights).
            a_val = lora_a.detach().to(dtype=self.dtype, copy=True)
            b_val = lora_b.detach().to(dtype=self.dtype, copy=True)
        else:  # memory of their own, or elsewhere (pinned host memory): one asynchronous copy into the slot
            a_val, b_val = lora_a.detach(), lora_b.detach()
        length = self.slot_elements(r, self.in_features, self.out_features)
        rec = self.records.get(slot)
        if self.pages is not None:  # where the host tier laid this adapter out in its page (a record, maybe reserved)
            rel = self.records[slot].rel
        elif rec is None or rec.length != length:
            self._free(slot)
            rel = self._alloc(length)
        else:
            rel = rec.rel
        self._set_offsets(slot, self.base(slot) + rel, r)
        self.ranks_host[slot] = r
        dst_a, dst_b = self.slot_a(slot), self.slot_b(slot)
        dst_a.copy_(a_val, non_blocking=True)
        dst_b.copy_(b_val, non_blocking=True)
        if share:
            lora_a.data, lora_b.data = dst_a, dst_b
        self.scalings_host[slot] = float(scaling)
        b_rel = rel + self.b_start(r, self.in_features)
        self.records[slot] = SlotRecord(rel, b_rel, r, length, lora_a, lora_b, share, lora_bias)
        self.set_extras(slot, dora, lora_bias)

    def set_extras(
        self, slot: int, dora: tuple[torch.Tensor, torch.Tensor | None] | None, lora_bias: torch.Tensor | None
    ) -> None:
        """Slot ``slot``'s DoRA scale and ``lora_B`` bias (see :meth:`set_slot`), or their neutral values."""
        if dora is not None:
            mag, bias = dora
            if self.mag is None:
                self.mag = torch.ones((self.capacity, self.out_features), dtype=torch.float32, device=self.device)
                self.bias = torch.zeros(self.out_features, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                self.mag[slot] = mag.detach().to(device=self.device, dtype=torch.float32)
                if bias is not None:
                    self.bias.copy_(bias.detach().float())
        elif self.mag is not None:
            with torch.no_grad():
                self.mag[slot] = 1.0
        if lora_bias is not None and self.lora_bias is None:
            self.lora_bias = torch.zeros((self.capacity, self.out_features), dtype=torch.float32, device=self.device)
        if self.lora_bias is not None:
            with torch.no_grad():
                if lora_bias is None:
                    self.lora_bias[slot] = 0.0
                else:
                    self.lora_bias[slot] = lora_bias.detach().to(device=self.device, dtype=torch.float32)

    def _aliases(self, *tensors: torch.Tensor) -> bool:
        """Whether any of ``tensors`` lives in this stack's storage."""
        mine = self.data.untyped_storage().data_ptr()
        return any(t.untyped_storage().data_ptr() == mine for t in tensors)

    def _point_shared(self) -> None:
        """Re-point every shared parameter at its view of the current storage."""
        for slot, rec in self.records.items():
            if rec.share:
                rec.a.data, rec.b.data = self.slot_a(slot), self.slot_b(slot)

    def _release(self, slot: int) -> None:
        """Give a shared slot's parameters their own memory again (a copy of their values)."""
        rec = self.records.get(slot)
        if rec is not None and rec.share:
            rec.a.data, rec.b.data = rec.a.data.clone(), rec.b.data.clone()
            self.records[slot] = rec._replace(share=False)

    def release_slot(self, slot: int) -> None:
        """Slot ``slot``'s shared parameters own their memory again, and its next restack copies them in afresh (its
        record keeps the slot's place, forgets its weights)."""
        self._release(slot)
        rec = self.records.get(slot)
        if rec is not None:
            self.records[slot] = rec._replace(a=None, b=None)

    def release_shared(self) -> None:
        """Every shared parameter owns its memory again (``disable_csgmv``, a layer unpatched or restacked)."""
        for slot in list(self.records):
            self._release(slot)

    @property
    def shared_bytes(self) -> int:
        """Bytes of PEFT's adapter weights that live in this stack instead of a second copy."""
        return sum(
            rec.a.numel() * rec.a.element_size() + rec.b.numel() * rec.b.element_size()
            for rec in self.records.values()
            if rec.share
        )

    def clear_slot(self, slot: int) -> None:
        """Make ``slot`` a no-op in this layer (rank 0); its storage is freed for other slots."""
        if slot >= self.capacity:
            return
        self._release(slot)
        self._empty(slot)

    def _empty(self, slot: int) -> None:
        """Slot ``slot`` (within capacity) at rank 0, its storage freed, its extras neutral."""
        self._free(slot)
        if self.ranks_host[slot]:  # the device copies follow on refresh (with pages: this slot's column of the tables)
            self.__dict__["_views"] = None
            if self.pages is not None:  # (the host lists below are views of its mirrors: DevicePages.cells)
                self.pages.dirty_slots.add(slot)
        if self.mag is not None or self.lora_bias is not None:
            self.set_extras(slot, None, None)
        self.ranks_host[slot] = 0
        self.scalings_host[slot] = 0.0

    def lend(self, device: torch.device, slots: frozenset) -> "LentStack":
        """The stack on ``device`` for one forward of its layer (an offloaded layer's: :attr:`runs_on`): the weights of
        ``slots`` (the call's; every other slot is left unwritten, and no plan of the call reads it), the per-slot
        vectors and the DoRA / ``lora_bias`` rows, each copied in stream order on the current stream (from pinned host
        memory to a GPU: no host sync). The copies are the forward's alone: nothing keeps them once the layer's
        kernels are queued (the caching allocator reuses their memory in stream order), so nothing of an offloaded
        layer's adapters stays on its device between forwards, as accelerate keeps nothing of the layer there."""
        views = self._pooled()
        pin = device.type == "cuda"
        src = self._lend_src
        if src is None or src[0] is not views:
            tensors = (self.a_off, self.b_off, self.ranks, self.scalings, self.mag, self.bias, self.lora_bias)
            held = tuple(None if t is None else t.pin_memory() if pin and not t.is_pinned() else t for t in tensors)
            src = self._lend_src = (views, held)
        cut = self._lend_extents
        if cut is None or cut[0] is not views or cut[1] is not slots:
            cut = self._lend_extents = (views, slots, *self._extents(slots))
        extents, numel = cut[2], cut[3]
        data = torch.empty(max(numel, 1), dtype=self.dtype, device=device)
        for start, end in extents:
            data[start:end].copy_(self.data[start:end], non_blocking=True)
        a_off, b_off, ranks, scalings, mag, bias, lora_bias = (
            None if t is None else t.to(device, non_blocking=True) for t in src[1]
        )
        a, b = views
        return LentStack(
            embedding=self.embedding,
            a=a._replace(data=data, offsets=a_off),
            b=b._replace(data=data, offsets=b_off),
            ranks=ranks,
            scalings=scalings,
            mag=mag,
            bias=bias,
            lora_bias=lora_bias,
            r_max=self.r_max,
            ranks_host=self.ranks_host,
            scalings_host=self.scalings_host,
            device=device,
        )

    def _extents(self, slots) -> tuple[tuple[tuple[int, int], ...], int]:
        """The storage that holds ``slots``' weights, as ``(start, end)`` element ranges (adjacent ones merged), and
        the elements a copy needs to reach the last of them."""
        spans = sorted(
            (self.base(slot) + rec.rel, self.base(slot) + rec.rel + rec.length)
            for slot, rec in self.records.items()
            if slot in slots and slot < len(self.ranks_host) and self.ranks_host[slot]
        )
        merged: list[list[int]] = []
        for start, end in spans:
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return tuple((s, e) for s, e in merged), (merged[-1][1] if merged else 0)

    @torch.inference_mode(False)  # PEFT's weights view the new tensors (see sync.outside_inference_mode)
    def to(self, device: torch.device) -> "LoraStack":
        """Move the stack (after the model was moved). Every tensor is copied before any is replaced, so a copy
        that fails leaves the stack as it was."""
        names = [n for n in sorted(_TENSORS) if getattr(self, n) is not None and (n != "data" or self.pages is None)]
        moved = {n: getattr(self, n).to(device) for n in names}
        if self.pages is not None:  # the group's pages move once, for every stack of the group
            moved["data"] = self.pages.to(device).data
        for n, t in moved.items():
            setattr(self, n, t)
        self.device = torch.device(device)
        self._views = None
        self._point_shared()  # PEFT's parameters were moved on their own: back to one copy, the stack's
        self.refresh()
        return self


class LentStack(NamedTuple):
    """An offloaded layer's stack on its layer's device for one forward (:meth:`LoraStack.lend`): what the kernels
    and the torch reference read of a stack, the weights those of the call's slots only."""

    embedding: bool
    a: Pooled
    b: Pooled
    ranks: torch.Tensor
    scalings: torch.Tensor
    mag: torch.Tensor | None
    bias: torch.Tensor | None
    lora_bias: torch.Tensor | None
    r_max: int
    ranks_host: list
    scalings_host: list
    device: torch.device
    lent: bool = True


def empty_slot(slot: int, stacks) -> None:
    """The host tier moved slot ``slot``'s adapter out of ``stacks``: the slot is empty in each (rank 0), and PEFT's
    parameters that viewed it are left as they are (the tier has pointed them at host memory). No copies to make, so
    :meth:`LoraStack.clear_slot` without its release; one loop over the layers, not a call per layer."""
    for stack in stacks:  # (the slot's record goes: its parameters keep the host views the tier gave them)
        if slot < len(stack.ranks_host):
            stack._empty(slot)
        else:
            stack.records.pop(slot, None)


class SlotRecord(NamedTuple):
    """What one layer's slot holds (:attr:`LoraStack.records`), and, with the host tier, one layer's part of an
    adapter's page as :meth:`~peft_csgmv.tier.DevicePages.place` reads it: the tier works each part's place and rank
    out once, when it lays the adapter out, and a bring-in stores the part itself as the slot's record (one write per
    layer). It names no stack (a stack holds its records: no reference cycle); the tier keeps each part's stack
    beside it."""

    rel: int  # where its A starts, in elements from the slot's base (its page's start: :meth:`LoraStack.base`)
    b_rel: int  # where its B starts (after the aligned A)
    rank: int
    length: int  # the elements it takes (:meth:`LoraStack.slot_elements`)
    a: torch.Tensor | None  # PEFT's lora_A / lora_B weights (None: a place reserved, no weights in it yet)
    b: torch.Tensor | None
    share: bool  # PEFT's parameters, of the stack's dtype: views of the page (else copied into it)
    bias: torch.Tensor | None  # lora_B's bias (PEFT's lora_bias=True)
