"""The host tier (``enable_csgmv(model, max_resident_adapters=N)``): at most N adapters hold a slot on the device; the
others' kernel-layer weights wait in host memory (pinned where CUDA is) and come into a slot when a call needs them,
the least recently used resident out.

Layout. The stacks of one device and dtype share one :class:`DevicePages`: a page per slot, holding
the slot's adapter in every layer of the group, laid out as that adapter's host region (a :class:`Placement`: its
layers in order, each one's ``A`` then ``B``). Bringing an adapter in is one host-to-device copy of its region into
its page, after which each layer's slot only records where it is and PEFT's parameters are re-pointed at it; moving
it out is one copy back, and PEFT's parameters are re-pointed at the region. What the pages do not hold (DoRA
magnitudes, ``lora_B`` biases, weights of another dtype than their stack's, adapters PEFT's path serves in a kernel
layer) moves on its own, parameter by parameter, into a second region.

MoE expert LoRA (experts layers, :mod:`peft_csgmv.moe`): an experts layer's stacks have a slot per slot of the
registry (as many as may be resident), sized for every adapter's rank; an adapter's expert weights (PEFT's ``lora_A`` /
``lora_B`` of each expert parameter, :class:`ExpertsPart`) wait in a third region of its host memory, packed, and a
bring-in copies each into its slot of the stack (:meth:`~peft_csgmv.moe.MoeStack.set_slot`: PEFT's weights of the
stack's rank become views of the slot again), an eviction copies them back out and clears the slot.
"""

from __future__ import annotations

import array
import collections
import contextlib
import functools
import gc
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple

import torch
from torch import nn

from .plan import write_buffer
from .slots import (
    MIRROR_TYPES,
    VECTORS,
    LoraStack,
    SlotRecord,
    SlotRegistry,
    empty_slot,
    layer_adapter,
    module_param,
    set_peft_rows,
)


class ExpertsPart(NamedTuple):
    """One adapter's LoRA on one expert parameter of an experts layer."""

    layer: nn.Module  # the experts layer (its record's ``experts``: the stacks, rebuilt at restacks, read at each move)
    param: str  # "gate_up_proj" / "down_proj"
    wrapper: nn.Module  # PEFT's ParamWrapper of that parameter (the adapter's scaling is read from it at each move)
    a: torch.Tensor  # PEFT's lora_A.weight (r·E, K)
    b: torch.Tensor  # PEFT's lora_B.weight (N, r·E)


def experts_parts(experts_layers, name: str) -> tuple[list[ExpertsPart], list[tuple[torch.Tensor, torch.device]]]:
    """Adapter ``name``'s :class:`ExpertsPart` s in ``experts_layers``, and the weights of it that those layers
    leave to PEFT's path (``peft_rows``: refused there), which move parameter by parameter, with their device."""
    from .moe import param_wrappers

    parts, rest = [], []
    for layer in experts_layers:
        record = layer._csgmv_record
        for param, w in param_wrappers(layer)[1].items():
            if name not in w.lora_A:
                continue
            a, b = w.lora_A[name].weight, w.lora_B[name].weight
            stack = (record.experts or {}).get(param)
            if name in record.peft_rows or stack is None:
                device = w.get_param().device
                rest += [(p, device) for m in (w.lora_A[name], w.lora_B[name]) for p in m.parameters()]
            else:
                parts.append(ExpertsPart(layer, param, w, a, b))
    return parts, rest


@dataclass
class Placement:
    """Where one adapter's kernel-layer weights go: its :class:`~peft_csgmv.slots.SlotRecord` per kernel layer that
    serves it, by group of pages and in layer order, with each part's layer (``layers``: PEFT's scaling is read from
    it at every bring-in), those layers' DoRA entries (``dora``: layer, stack, ``lora_B`` bias), the elements its page
    takes in each group's pages, the parameters that move on their own (``rest``, with their layer's device), and the
    layers where PEFT's path serves its rows."""

    parts: dict[DevicePages, list[SlotRecord]] = field(default_factory=dict)
    part_stacks: dict[DevicePages, list[LoraStack]] = field(default_factory=dict)  # each part's stack, in step
    layers: dict[DevicePages, list[nn.Module]] = field(default_factory=dict)
    dora: list[tuple[nn.Module, LoraStack, torch.Tensor | None]] = field(default_factory=list)
    numel: dict[DevicePages, int] = field(default_factory=dict)
    rest: list[tuple[torch.Tensor, torch.device]] = field(default_factory=list)
    peft_layers: list[nn.Module] = field(default_factory=list)
    views: dict = field(default_factory=dict)  # region key -> HostTier.regions' tuple for that region
    stack_list: list[LoraStack] = field(default_factory=list)  # the stacks of its parts, in order
    stacks: frozenset = frozenset()  # the same, as a set
    columns: dict[DevicePages, PageColumns] = field(default_factory=dict)  # its parts as table columns (lay_out)
    experts: list[ExpertsPart] = field(default_factory=list)  # its expert LoRA, a part per experts parameter

    def all_parts(self) -> Iterator[tuple[LoraStack, SlotRecord]]:
        """Every part with its stack, group by group."""
        for pages, parts in self.parts.items():
            yield from zip(self.part_stacks[pages], parts)

    def shared(self, pages: DevicePages) -> tuple[list[torch.Tensor], list[int]]:
        """The parameters of group ``pages`` that are views of the page, and their element offsets in it."""
        params, offsets = [], []
        for part in self.parts.get(pages, ()):
            if part.share:
                params += (part.a, part.b)
                offsets += (part.rel, part.b_rel)
        return params, offsets


def placement_of(layers, name: str, kernel_reason: Callable[[nn.Module, str], str | None]) -> Placement:
    """Adapter ``name``'s :class:`Placement` over the kernel ``layers`` (their stacks built with pages)."""
    placement = Placement()
    for layer in layers:
        weights = layer_adapter(layer, name)
        if weights is None:
            continue
        params = adapter_params(layer, name)
        stack: LoraStack = layer._csgmv_record.stack
        if kernel_reason(layer, name) is not None:
            placement.peft_layers.append(layer)
            placement.rest += [(p, stack.device) for p in params]
            continue
        a, b = weights
        pages = stack.pages
        rel = placement.numel.get(pages, 0)
        r, k = a.shape
        length = LoraStack.slot_elements(r, k, stack.out_features)
        placement.numel[pages] = rel + length
        share = isinstance(a, nn.Parameter) and a.dtype == b.dtype == stack.dtype
        bias = None if stack.embedding else module_param(layer._modules["lora_B"][name], "bias")
        part = SlotRecord(rel, rel + LoraStack.b_start(r, k), r, length, a, b, share, bias)
        placement.parts.setdefault(pages, []).append(part)
        placement.part_stacks.setdefault(pages, []).append(stack)
        placement.layers.setdefault(pages, []).append(layer)
        if layer.use_dora.get(name, False):
            placement.dora.append((layer, stack, bias))
        placement.rest += [(p, stack.device) for p in params if not (share and (p is a or p is b))]
    placement.stack_list = [stack for stack, _ in placement.all_parts()]
    placement.stacks = frozenset(placement.stack_list)
    return placement


class HostTier:
    """The host tier's state: the residents in least-recently-used order, the host memory, the device pages of each
    (device, dtype) group and every adapter's :class:`Placement`."""

    def __init__(self, capacity: int, registry: SlotRegistry) -> None:
        self.capacity = capacity  # at most this many adapters have slots (enable_csgmv's max_resident_adapters)
        self.registry = registry  # the model's name -> slot registry, which the tier's moves keep
        self.lru: collections.OrderedDict = collections.OrderedDict()  # resident names, least recently used first
        self.host = HostArena(pin=torch.cuda.is_available())
        self.pages: dict[tuple[torch.device, torch.dtype], DevicePages] = {}
        self.placements: dict[str, Placement] = {}
        # (pages, slot) -> the event after that page's last copy out (:meth:`to_host`), until a copy in waits for it
        self.page_out: dict[tuple[DevicePages, int], torch.cuda.Event] = {}
        self.experts_layers: list[nn.Module] = []  # the model's experts layers (MoE expert LoRA), as of lay_out
        self.experts_dirty: set = set()  # experts stacks whose slot vectors changed on the host since their upload
        # Adapters brought in ahead (:meth:`bring_in_ahead`) whose page copies may still run on a copy-in stream:
        # name -> [(device, event after its copies)], until the current stream waits for them (:meth:`settle`).
        self.ahead: dict[str, list] = {}
        self.ahead_out: list = []  # the copies out of the residents they evicted, for the next call to wait for

    # -- a call's adapters made resident ---------------------------------------------------------------------------

    def check_fits(self, needed, what: str) -> None:
        """Refuse a call that needs more distinct adapters than have slots (before anything moves)."""
        if len(needed) > self.capacity:
            raise ValueError(
                f"this call's `{what}` need {len(needed)} distinct adapters, more than the {self.capacity} that "
                f"fit on the device (enable_csgmv(..., max_resident_adapters={self.capacity})): split the batch "
                "or raise max_resident_adapters"
            )

    def make_resident(self, needed, layers: list, dora_scale, dora_refused) -> list:
        """Give every adapter in ``needed`` a slot: the least recently used residents that are not needed go back to
        host memory, the needed ones come in (one copy of each into its slot's page; PEFT's weights become views of it
        again). ``needed`` fits: :meth:`check_fits` ran first. ``layers``: the model's kernel layers. Returns the events
        of the copies out still in flight (:func:`copies_out`), which the caller settles before host code may read the
        weights that went out (as its call ends)."""
        self.settle(needed)
        missing = [n for n in needed if n not in self.registry.index]
        out, self.ahead_out = self.ahead_out, []
        if missing:
            with no_gc_pauses():
                try:
                    out += self._bring_in(missing, needed, layers, dora_scale, dora_refused)
                except BaseException:
                    self._abandon(missing, layers)
                    raise
        for name in needed:
            self.lru.move_to_end(name)
        return out

    def bring_in_ahead(self, names, keep, layers: list, dora_scale, dora_refused) -> list[str]:
        """Bring adapters ``names`` into slots before a step needs them (continuous batching: the adapters of
        requests still waiting), evicting none of ``keep`` (the running requests' adapters and those on their way:
        the caller's). As :meth:`make_resident` does, but each page's copy runs on the device's copy-in stream
        (:func:`copy_stream`), after the work queued so far on the current one and beside the steps queued after it:
        the running batch does not wait for it. Each adapter is :meth:`ready` once its copies are done; every use
        (:meth:`make_resident`) and every move out (:meth:`to_host`) first makes the current stream wait for them
        (:meth:`settle`). On the CPU the copies are done when this returns. The names brought in."""
        missing = [n for n in dict.fromkeys(names) if n not in self.registry.index]
        if not missing:
            return []
        needed = {*keep, *missing}  # (adapters brought in ahead before are evicted last, their copies settled first)
        with no_gc_pauses():
            try:
                self.ahead_out += self._bring_in(missing, needed, layers, dora_scale, dora_refused, ahead=True)
            except BaseException:
                self._abandon(missing, layers)
                raise
        events = []
        for device in {pages.device for pages in self.pages.values()}:
            if streamed(device):
                event = torch.cuda.Event()
                event.record(copy_stream(device, "in"))
                events.append((device, event))
        if events:
            for name in missing:
                self.ahead[name] = events
        return missing

    def ready(self, name: str) -> bool:
        """Whether adapter ``name``'s slot holds its weights on the device now (not still on their way from
        :meth:`bring_in_ahead`; asks the device without waiting for it)."""
        events = self.ahead.get(name)
        return events is None or all(event.query() for _, event in events)

    def settle(self, names) -> None:
        """The current stream waits (on the device, not the host) for the copies in of ``names`` brought in ahead,
        before any work queued after this reads or moves their slots."""
        if not self.ahead:
            return
        for name in names:
            for device, event in self.ahead.pop(name, ()):
                torch.cuda.current_stream(device).wait_event(event)

    def _bring_in(self, missing: list[str], needed, layers: list, dora_scale, dora_refused, ahead=False) -> list:
        """:meth:`make_resident`'s moves: evict the least recently used residents that are not needed (adapters
        still on their way from :meth:`bring_in_ahead` last), then bring ``missing`` into their slots (``ahead``: on
        the copy-in stream); the events of the copies out."""
        registry = self.registry
        victims = [n for n in self.lru if n not in needed and n not in self.ahead]
        victims += [n for n in self.lru if n not in needed and n in self.ahead]
        # Slots whose adapter left, by the stacks that still describe it: a slot's next adapter writes the same
        # fields in the stacks it has a part in, so the slot is emptied only in the others (most often none).
        held: dict[int, list[LoraStack]] = {}
        try:
            for name in missing:
                if len(registry.index) >= self.capacity:
                    victim = victims.pop(0)
                    self.settle([victim])
                    slot = registry.index[victim]
                    # Its weights leave the slot as they are (edits included), copied out first: a copy that fails
                    # leaves the adapter resident and shared as it was.
                    held[slot] = self.evict(victim, slot, empty=False)
                    registry.remove(victim)
                    self.lru.pop(victim)
                registry.add(name)
                self.lru[name] = None
            out = copies_out([*layers, *self.experts_layers]) if held else []
            stacks = {layer._csgmv_record.stack for layer in layers}
            for stack in stacks:
                stack.ensure_capacity(registry.capacity)
            for name in missing:
                slot = registry.index[name]
                if slot in held:
                    self.refill(name, slot, held.pop(slot))
                self.bring_in(name, slot, dora_scale, dora_refused, ahead)
        finally:  # (slots left unfilled: emptied in full, as an eviction does)
            for slot, left in held.items():
                empty_slot(slot, left)
        for stack in stacks:
            stack.refresh()
        self.upload_experts()
        return out

    def _abandon(self, missing: list[str], layers: list) -> None:
        """Undo a bring-in that failed part way (out of memory, an interrupt): the adapters it was bringing in leave
        their slots and the registry again, and their weights go back to their host regions, so no slot claims
        weights it was not given and the next call brings them in afresh; the residents evicted for them stay in
        host memory."""
        for name in missing:
            slot = self.registry.index.get(name)
            if slot is None:
                continue
            self.to_host(name)  # from wherever each weight got to: its page, its host region, the device
            empty_slot(slot, [layer._csgmv_record.stack for layer in layers])
            for layer in self.experts_layers:
                for stack in (layer._csgmv_record.experts or {}).values():
                    if slot < stack.num_slots:
                        self.experts_dirty.add(stack)
                        stack.clear_slot(slot)
            for layer in layers:
                if name in layer._csgmv_record.peft_rows:
                    set_peft_rows(layer, layer._csgmv_record.peft_rows - {name})
            self.registry.remove(name)
            self.lru.pop(name, None)
        for layer in layers:
            layer._csgmv_record.stack.refresh()
        self.upload_experts()
        host_copies_done([*layers, *self.experts_layers])
        self.page_out.clear()

    # -- pages and placements ----------------------------------------------------------------------------------------

    def pages_for(self, device: torch.device, dtype: torch.dtype) -> DevicePages:
        key = (torch.device(device), dtype)
        pages = self.pages.get(key)
        if pages is None:
            pages = self.pages[key] = DevicePages(device, dtype)
        return pages

    def lay_out(self, layers, names, registry, kernel_reason, experts_layers=()) -> None:
        """Every adapter's placement, pages to fit them (one per slot), each layer's held ranks (its launch shape
        then stays put as adapters come and go), and each resident's places reserved in its slot's page. A resident
        whose places moved (its weights replaced by others of another shape) gets memory of
        its own first, so that the restack that follows copies it into its new places whole. Each adapter's table
        columns and, where the adapters have one or two layouts, every slot's page views for them are made here, so
        that a call's moves only use them. ``experts_layers``: the model's experts layers (their stacks built
        already, a slot per slot that may be resident): each adapter's :class:`ExpertsPart` s."""
        layers = list(layers)
        self.settle(list(self.ahead))  # (copies in still on their way land before pages move or are laid out anew)
        self.page_out.clear()  # (the caller waited for every copy out: host_copies_done)
        self.experts_layers = list(experts_layers)
        self.placements = {name: placement_of(layers, name, kernel_reason) for name in names}
        for name, placement in self.placements.items():
            placement.experts, rest = experts_parts(self.experts_layers, name)
            placement.rest += rest
        live = {layer._csgmv_record.stack.pages for layer in layers}
        self.pages = {key: pages for key, pages in self.pages.items() if pages in live}
        need: dict[DevicePages, int] = {}
        for placement in self.placements.values():
            for pages, numel in placement.numel.items():
                need[pages] = max(need.get(pages, 0), numel)
        for pages in live:
            pages.fit(max(registry.capacity, 1), need.get(pages, 0))
        held: dict[LoraStack, set[int]] = {}
        for placement in self.placements.values():
            for stack, part in placement.all_parts():
                held.setdefault(stack, set()).add(part.rank)
        for layer in layers:
            layer._csgmv_record.stack.hold_ranks(held.get(layer._csgmv_record.stack, ()))
        places = [
            (slot, stack, part)
            for slot, name in enumerate(registry.names)
            for stack, part in (self.placements[name].all_parts() if name is not None else ())
        ]
        moved = set()
        for slot, stack, part in places:
            record = stack.records.get(slot)
            if record is not None and record.rel != part.rel:
                moved.add(slot)
        for slot in moved:
            for layer in layers:
                layer._csgmv_record.stack.release_slot(slot)
        layouts: dict[DevicePages, dict] = {}
        for placement in self.placements.values():  # each adapter's columns, once, and the pages' views of them
            for pages, parts in placement.parts.items():
                stacks = placement.part_stacks[pages]
                columns = placement.columns[pages] = pages.columns(stacks, parts)
                layouts.setdefault(pages, {}).setdefault(columns.layout, (stacks, parts))
        if any(name not in registry.index for name in names):  # (while every adapter has a slot, none moves)
            for pages, of_pages in layouts.items():
                pages.prepare_views(of_pages)
        for slot, stack, part in places:  # reserved: the restack that follows (or a bring-in) fills it
            record = stack.records.get(slot)
            if record is None or record.rel != part.rel:
                stack.records[slot] = part._replace(a=None, b=None, share=False)

    def regions(self, name: str) -> list[tuple[DevicePages | None, torch.Tensor, list, list]]:
        """Adapter ``name``'s host regions as ``(pages, region, parameters, their views of it)``: one per group of
        pages, laid out as the page, with the parameters that are views of the page while it is resident; one per
        dtype for the rest (``pages`` None), packed. Made once per region (an adapter keeps its regions)."""
        placement = self.placements[name]
        out = []
        for group, dtype, numel, tag in self._wanted(name):
            region = self.host.region(name, dtype, numel, tag)
            key = (region.data_ptr(), region.dtype, region.numel())
            held = placement.views.get(key)
            if held is None:
                if isinstance(group, DevicePages):
                    params, offsets = placement.shared(group)
                    held = (group, region, params, packed_views(region, params, offsets))
                else:
                    held = (None, region, group, packed_views(region, group))
                placement.views[key] = held
            out.append(held)
        return out

    def _wanted(self, name: str) -> list[tuple]:
        """Adapter ``name``'s host regions as ``(group, dtype, numel, tag)``: a group of pages, or the parameters that
        move on their own (one region per dtype)."""
        placement = self.placements[name]
        wanted: list = [(pages, pages.dtype, numel, str(pages.device)) for pages, numel in placement.numel.items()]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, _ in placement.rest:
            by_dtype.setdefault(p.dtype, []).append(p)
        for dtype, params in by_dtype.items():
            wanted.append((params, dtype, sum(p.numel() for p in params), "rest"))
        by_dtype = {}
        for part in placement.experts:
            by_dtype.setdefault(part.a.dtype, []).append(part.a)
            by_dtype.setdefault(part.b.dtype, []).append(part.b)
        for dtype, params in by_dtype.items():
            wanted.append((params, dtype, sum(p.numel() for p in params), "experts"))
        return wanted

    def hosted(self, name: str) -> bool:
        """Whether adapter ``name``'s page weights wait in host memory (not on their stacks' devices)."""
        return any(part.share and part.a.device != stack.device for stack, part in self.placements[name].all_parts())

    def to_host(self, name: str, slot: int | None = None) -> None:
        """Adapter ``name``'s weights into its host regions, PEFT's parameters re-pointed at them (weights there
        already stay). ``slot``: the adapter is resident there: each group's page leaves in one copy, on CUDA on the
        device's copy-out stream (:func:`copy_stream`), after the work queued so far on the current one, so that it
        runs beside the copies in of the adapters that come in (each waits for the copy out of its slot's page:
        :meth:`bring_in`)."""
        self.settle([name])  # (a copy in from bring_in_ahead still on its way lands first)
        for pages, region, params, views in self.regions(name):
            if slot is not None and pages is not None:
                page = pages.page(slot, region.numel())
                if streamed(page.device):
                    stream = copy_stream(page.device, "out")
                    stream.wait_stream(torch.cuda.current_stream(page.device))
                    with torch.cuda.stream(stream):
                        region.copy_(page, non_blocking=True)
                    done = self.page_out[(pages, slot)] = torch.cuda.Event()
                    done.record(stream)
                else:
                    region.copy_(page)
            else:
                _gather(region, params, views)
            for view, p in zip(views, params):
                p.data = view

    def reserve(self, names) -> None:
        """Host regions for ``names`` now (pinning host memory is slow: no call should pay for it), the host memory
        for all of them asked for at once (:meth:`HostArena.expect`), so that it is sized to them."""
        self.host.expect(
            sum(
                self.host.missing(name, dtype, numel, tag)
                for name in names
                for _, dtype, numel, tag in self._wanted(name)
            )
        )
        for name in names:
            self.regions(name)
        self.host.expect(0)

    def bring_in(self, name: str, slot: int, dora_scale, dora_refused: set, ahead: bool = False) -> None:
        """Adapter ``name`` from its host regions into slot ``slot``: one copy per group of pages, the rest of its
        parameters to their layers' devices, then each layer's slot set at its place in the page. ``ahead``: the
        page copies on the device's copy-in stream (:meth:`bring_in_ahead`; the pages exist already, so nothing is
        allocated there), the rest on the current one."""
        placement = self.placements[name]
        sides = {}  # pages -> the copy-in stream their copies take (ahead, on CUDA)
        for pages, region, _, _ in self.regions(name):
            if pages is not None:
                page = pages.page(slot, region.numel())
                side = None
                if ahead and streamed(page.device):
                    side = sides[pages] = copy_stream(page.device, "in")
                    side.wait_stream(torch.cuda.current_stream(page.device))  # (the slot's last readers first)
                out = self.page_out.pop((pages, slot), None)
                if out is not None:  # the page's copy out to its last adapter's region first
                    (side or torch.cuda.current_stream(page.device)).wait_event(out)
                with on_stream(side):
                    page.copy_(region, non_blocking=True)
        for p, device in placement.rest:
            if p.device != device:
                p.data = p.data.to(device, copy=True, non_blocking=True)
        for pages, parts in placement.parts.items():
            scalings = [layer.scaling[name] for layer in placement.layers[pages]]
            pages.place(slot, placement.part_stacks[pages], parts, scalings, placement.columns[pages], sides.get(pages))
        if placement.dora:
            for side in sides.values():  # (DoRA's scale reads the weights: their copies in first)
                torch.cuda.current_stream(side.device).wait_stream(side)
        for layer, stack, bias in placement.dora:
            stack.set_extras(slot, dora_scale(layer, name), bias)
        for part in placement.experts:  # (its expert weights, from their host region into the stacks' slot)
            stack = part.layer._csgmv_record.experts[part.param]
            self.experts_dirty.add(stack)
            stack.set_slot(slot, part.a, part.b, part.wrapper.scaling[name])
        for layer in placement.peft_layers:
            set_peft_rows(layer, layer._csgmv_record.peft_rows | {name})
            if layer.use_dora.get(name, False):
                dora_refused.add(name)

    def evict(self, name: str, slot: int, empty: bool = True) -> list[LoraStack]:
        """Adapter ``name`` out of slot ``slot`` to its host regions (copied out first: a copy that fails leaves it
        resident as it was), its slot emptied in every layer; the stacks that held it. ``empty=False``: the caller
        fills the slot again at once (:meth:`refill`) and empties it where the next adapter does not overwrite it;
        here the stacks only let go of its parameters (which now view host memory)."""
        placement = self.placements[name]
        self.to_host(name, slot)
        self.clear_experts(name, slot)
        stacks = placement.stack_list
        if empty:
            empty_slot(slot, stacks)
        else:
            for stack in stacks:
                stack.records.pop(slot, None)  # (PEFT's parameters now view host memory: no longer the slot's)
        for layer in placement.peft_layers:
            set_peft_rows(layer, layer._csgmv_record.peft_rows - {name})
        return stacks

    def clear_experts(self, name: str, slot: int) -> None:
        """Slot ``slot`` emptied in the experts stacks where adapter ``name`` has a part (its weights moved out
        already: :meth:`to_host`)."""
        for part in self.placements[name].experts:
            stack = part.layer._csgmv_record.experts.get(part.param)
            if stack is not None and slot < stack.num_slots:
                self.experts_dirty.add(stack)
                stack.clear_slot(slot)

    def upload_experts(self) -> None:
        """The experts stacks' slot vectors that moves changed, uploaded (once per stack and call)."""
        dirty, self.experts_dirty = self.experts_dirty, set()
        for stack in dirty:
            stack.upload()

    def refill(self, name: str, slot: int, held: list[LoraStack]) -> None:
        """Before adapter ``name`` comes into slot ``slot``, which ``held`` (stacks :meth:`evict` left as they were)
        still describe: the slot emptied in those of them that ``name``'s bring-in does not write (every field it
        would empty, the bring-in sets anew in the others)."""
        placement = self.placements[name]
        empty_slot(slot, [stack for stack in held if stack not in placement.stacks])


def _gather(region: torch.Tensor, params: list[torch.Tensor], views: list[torch.Tensor]) -> None:
    """Copy ``params`` into their ``views`` of ``region``, where they are not there already. All of them on one GPU:
    gathered there and sent in one copy (hundreds of small copies would each pay the copy engine's setup)."""
    todo = [(v, p) for v, p in zip(views, params) if p.data_ptr() != v.data_ptr() or p.device != v.device]
    if not todo:
        return
    device = params[0].device
    if len(todo) == len(params) > 1 and device.type == "cuda" and all(p.device == device for p in params):
        staging = torch.empty(region.numel(), dtype=region.dtype, device=device)
        base = region.storage_offset()
        offsets = [v.storage_offset() - base for v in views]
        torch._foreach_copy_(packed_views(staging, params, offsets), [p.data for p in params])
        region.copy_(staging, non_blocking=True)  # the staging buffer's next user comes later in stream order
        return
    for view, p in todo:
        view.copy_(p.data, non_blocking=True)


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """Python's cyclic collector off for a burst of short-lived objects (the views of moving adapters), then back as
    it was. Collections in the middle of it would promote thousands of them to older generations and set off full
    collections, each of which walks every object of a model that holds thousands of adapters (~1 s for 300 adapters
    of a 112-layer model on the CPU); off, they die young, uncounted."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def streamed(device: torch.device) -> bool:
    """Whether copies between ``device`` and host memory are asynchronous (CUDA): they then run on streams and are
    awaited through events (on the CPU they are done when they return)."""
    return device.type == "cuda"


@functools.cache
def copy_stream(device: torch.device, way: str) -> "torch.cuda.Stream":
    """The stream that copies pages on CUDA ``device``, one per device and way: ``"out"`` to host memory (the
    residents that leave their slots), ``"in"`` into their slots (adapters brought in ahead,
    :meth:`HostTier.bring_in_ahead`)."""
    return torch.cuda.Stream(device)


def on_stream(stream: "torch.cuda.Stream | None"):
    """Within: ``stream`` is the current stream (nothing where it is ``None``)."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _copy_streams(layers) -> Iterator["torch.cuda.Stream"]:
    """The streams that copy adapter weights to host memory for ``layers`` on CUDA: each device's current stream
    (the weights that move parameter by parameter) and its copy-out stream (the pages)."""
    for device in {_record_device(layer._csgmv_record) for layer in layers}:
        if streamed(device):
            yield torch.cuda.current_stream(device)
            yield copy_stream(device, "out")


def _record_device(record) -> torch.device:
    """Where a kernel layer's stack is, or an experts layer's stacks."""
    if record.stack is not None:
        return record.stack.device
    return next(iter(record.experts.values())).a.device if record.experts else torch.device("cpu")


def copies_out(layers) -> list:
    """Events after the asynchronous copies of adapter weights to pinned host memory queued so far, on each stream
    that makes them for ``layers`` (none on the CPU, where they are done already): a call that moved adapters out
    waits for them as it ends (:func:`wait_for_copies`), before host code may read those weights, instead of before it
    brings others in. The copies then overlap the bring-ins' host work and their copies in, and the wait is for them
    alone, not for all queued work."""
    events = []
    for stream in _copy_streams(layers):
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def wait_for_copies(events) -> None:
    """Wait for the copies :func:`copies_out` marked."""
    for event in events:
        event.synchronize()


def host_copies_done(layers) -> None:
    """Wait for every asynchronous copy of adapter weights to pinned host memory for ``layers`` (and all work queued
    before them) before host code may read them: where adapters are laid out anew, and after a failed bring-in."""
    for stream in _copy_streams(layers):
        stream.synchronize()


def packed_views(flat: torch.Tensor, params, offsets=None) -> list[torch.Tensor]:
    """Contiguous views of the 1-D ``flat``, one of each parameter's shape: packed one after another, or at element
    ``offsets`` of ``flat``. ``as_strided`` on ``flat``'s storage: slicing and then viewing costs ~5 µs more per view,
    paid for each of an adapter's hundreds of weights."""
    base = flat.storage_offset()
    views, pos = [], 0
    for i, p in enumerate(params):
        shape = p.shape
        start = pos if offsets is None else offsets[i]
        views.append(flat.as_strided(shape, _contiguous_strides(shape), base + start))
        pos += p.numel()
    return views


@functools.lru_cache(maxsize=None)
def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


def _module_params(module: nn.Module) -> list[torch.Tensor]:
    """``list(module.parameters())``, read straight from the module's own dict where it has no submodules (an
    ``nn.Linear``): the host tier reads every adapter's parameters in every layer, and the generator costs ~20 µs."""
    if module._modules:
        return list(module.parameters())
    return [p for p in module._parameters.values() if p is not None]


def adapter_params(layer: nn.Module, name: str) -> list[torch.Tensor]:
    """Adapter ``name``'s parameters in a kernel layer."""
    params = []
    held = layer._modules
    for key in ("lora_A", "lora_B", "lora_magnitude_vector"):
        holder = held.get(key)
        module = holder._modules.get(name) if holder is not None else None
        if module is not None:
            params += _module_params(module)
    for key in ("lora_embedding_A", "lora_embedding_B"):
        holder = held.get(key)
        if holder is not None and name in holder:
            params.append(holder[name])
    return params


def move_adapter(layer: nn.Module, name: str, device: torch.device) -> None:
    """Move adapter ``name``'s weights in a kernel layer to ``device`` (from pinned host memory: asynchronously)."""
    for p in adapter_params(layer, name):
        if p.device != device:
            p.data = p.data.to(device, copy=True, non_blocking=True)


class PageColumns(NamedTuple):
    """An adapter's parts (:class:`SlotRecord`, one per layer of a group) as the columns of the group's tables that a
    bring-in writes, worked out once per adapter (:meth:`DevicePages.columns`): with ``span``, the parts' rows are
    consecutive, first to last, and each table's column is written in one strided slice."""

    span: tuple[int, int] | None  # the parts' rows are range(*span), in order (else None: written cell by cell)
    rows: tuple[int, ...]  # each part's row of the tables
    ranks: array.array  # each part's rank ('i')
    rel: tuple[int, ...]  # where each part's A / B start in the page
    b_rel: tuple[int, ...]
    layout: int  # the same number for a group's adapters whose parts have the same rows, places and ranks (its views)


class DevicePages:
    """The host tier's device memory for the stacks of one device and dtype: one page per slot, each holding the
    resident adapter of that slot in every stack of the group, laid out as the adapter's host region (its layers in
    order, each slot's ``A`` then ``B`` as :meth:`LoraStack.slot_elements` aligns them). Bringing an adapter in is
    then one host-to-device copy of its region into its page, moving it out one copy back; every stack of the group
    has :attr:`data` as its storage and per-slot offsets into it (``slot · page_numel`` + the layer's place in the
    page)."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.count = 0  # pages
        self.page_numel = 0  # elements per page
        self.data = torch.empty(0, dtype=dtype, device=self.device)
        self.stacks: "weakref.WeakSet[LoraStack]" = weakref.WeakSet()
        # Every stack's per-slot vectors as rows of one table each (a row per stack, :attr:`LoraStack.row`): a call
        # that moves adapters uploads four tables, not four vectors per layer. Each table has a host mirror whose
        # memory is a flat array (``cells``, in :data:`VECTORS` order, ``width`` slots a row; scalings as doubles,
        # PEFT's Python floats, rounded to fp32 on upload), and each stack's host lists are memoryviews of its rows
        # of them: a move writes a slot's column of a table for every layer in one strided slice (:meth:`place`), and
        # an upload is only the copies. ``dirty``: a stack joined, or replaced a vector or its host lists (the
        # mirrors are built again from every stack's host lists, which then view them); ``dirty_slots``: only these
        # slots' columns changed, written into the mirrors already.
        self.rows = 0
        self.width = 0
        self.table: dict[str, torch.Tensor] = {}
        self.mirror: dict[str, torch.Tensor] = {}
        self.cells: list[array.array] = []
        self.dirty = True
        self.dirty_slots: set[int] = set()
        # (slot, PageColumns.layout) -> each part's two views of the slot's page, while :attr:`data` holds: a view costs
        # the host ~2 µs, re-pointing a parameter at one ~0.3.
        self.views: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.layouts: dict[tuple, int] = {}  # (stack rows, places, ranks) of an adapter's parts -> PageColumns.layout

    def join(self, stack: "LoraStack") -> int:
        """Take ``stack`` into the group: its storage is :attr:`data`, its per-slot vectors a row of the tables."""
        self.stacks.add(stack)
        self.rows += 1
        self.dirty = True
        return self.rows - 1

    def upload(self) -> None:
        """Every stack's per-slot vectors (ranks, scalings, offsets) from the host to the device: one copy per table,
        into the same tensors while their shape holds (compiled graphs and bound launches keep reading them); each
        stack's vectors are views of its row. Where only :attr:`dirty_slots` changed, the mirrors hold them already
        (the moves wrote their columns, through the stacks' host lists or :meth:`place`) and the stacks' vectors are
        their rows already: the copies are all there is to do. Else the mirrors are built from every stack's host
        lists, every stack then at the group's width, its host lists views of its rows."""
        stacks = list(self.stacks)
        width = max((s.capacity for s in stacks), default=1)
        shape = (self.rows, width)
        full = self.dirty or any(tuple(getattr(self.mirror.get(name), "shape", ())) != shape for name, _ in VECTORS)
        if full:
            for s in stacks:
                s.ensure_capacity(width)
        cells_made = []
        for name, dtype in VECTORS:
            table = self.table.get(name)
            fresh = table is None or tuple(table.shape) != shape or table.device != self.device
            if fresh:
                table = self.table[name] = torch.zeros(shape, dtype=dtype, device=self.device)
            if full:
                flat = [0] * (self.rows * width)
                for s in stacks:
                    flat[s.row * width : (s.row + 1) * width] = getattr(s, name + "_host")
                typecode, host_dtype = MIRROR_TYPES[name]
                cells = array.array(typecode, flat)
                cells_made.append(cells)
                mirror = torch.frombuffer(cells, dtype=host_dtype) if cells else torch.zeros(0, dtype=host_dtype)
                mirror = self.mirror[name] = mirror.view(shape)  # the cells' memory
                rows = memoryview(cells)
                for s in stacks:  # (set directly: replacing host lists through __setattr__ marks nothing)
                    s.__dict__[name + "_host"] = rows[s.row * width : (s.row + 1) * width]
            else:
                mirror = self.mirror[name]
            # (a copy of the mirror, pinned: the next moves change the mirror while this copy may be in flight)
            src = mirror.to(dtype) if mirror.dtype != dtype else mirror
            write_buffer(table, src)
            if not (full or fresh):
                continue
            # Each stack's vector is its row of the table: made only where it is not already (a view per stack and
            # table would cost the host a microsecond each at every upload).
            start, row_bytes = table.data_ptr(), table.stride(0) * table.element_size()
            for s in stacks:
                vector = getattr(s, name)
                if vector.data_ptr() != start + s.row * row_bytes or vector.numel() != width:
                    setattr(s, name, table[s.row])
        if full:
            self.width, self.cells = width, cells_made
        self.dirty = False
        self.dirty_slots = set()

    def columns(self, stacks: "list[LoraStack]", parts: "list[SlotRecord]") -> PageColumns:
        """``parts``' :class:`PageColumns` (``stacks``: each one's; once per adapter: the host tier keeps them with its
        placement)."""
        rows = tuple(stack.row for stack in stacks)
        span = (rows[0], rows[-1] + 1) if rows and rows == tuple(range(rows[0], rows[-1] + 1)) else None
        rel, b_rel = tuple(part.rel for part in parts), tuple(part.b_rel for part in parts)
        ranks = array.array("i", [part.rank for part in parts])
        layout = self.layouts.setdefault((rows, rel, tuple(ranks)), len(self.layouts))
        return PageColumns(span, rows, ranks, rel, b_rel, layout)

    def place(
        self,
        slot: int,
        stacks: "list[LoraStack]",
        parts: "list[SlotRecord]",
        scalings,
        columns: PageColumns,
        stream: "torch.cuda.Stream | None" = None,
    ) -> None:
        """The host tier's bring-in: an adapter's ``parts`` in this group (one per layer, each of the stack at its
        place in ``stacks``, PEFT's scaling of each in ``scalings``; ``columns``: theirs, :meth:`columns`) set as slot
        ``slot`` of their stacks, at their places in
        the slot's page, where one copy of the adapter's region put its weights already. PEFT's weights become views
        of the slot (``share``, as :meth:`LoraStack.set_slot`'s) or, weights of another dtype, are copied in. Only
        this slot is touched: only its column of the tables is uploaded.

        This runs for each layer of every adapter brought in, so the slot's ranks, scalings and offsets in every
        layer are written as one column per table, into the mirrors the stacks' host lists view; one pass over the
        layers with plain writes is left, no method call per layer: re-pointing PEFT's two weights is most of it.
        ``stream``: where the page's own copy ran (a copy in ahead, :meth:`HostTier.bring_in_ahead`): the weights
        copied into the page here follow it there, after it (they write where it wrote)."""
        if slot >= self.width:
            for stack in stacks:
                stack.ensure_capacity(slot + 1)
        if self.dirty or slot >= self.width:  # the mirrors as wide as the stacks, their host lists views of them
            self.upload()
        base, width = slot * self.page_numel, self.width
        self.dirty_slots.add(slot)
        ranks_m, scalings_m, a_off_m, b_off_m = self.cells
        a_col = array.array("q", [base + rel for rel in columns.rel])
        b_col = array.array("q", [base + rel for rel in columns.b_rel])
        s_col = array.array("d", scalings)
        if columns.span is not None:
            cut = slice(columns.span[0] * width + slot, columns.span[1] * width, width)
            ranks_m[cut], scalings_m[cut], a_off_m[cut], b_off_m[cut] = columns.ranks, s_col, a_col, b_col
        else:
            for i, row in enumerate(columns.rows):
                cell = row * width + slot
                ranks_m[cell], scalings_m[cell] = columns.ranks[i], s_col[i]
                a_off_m[cell], b_off_m[cell] = a_col[i], b_col[i]
        views = self.views.get((slot, columns.layout))
        if views is None:
            views = self.slot_views(slot, stacks, parts, columns.layout)
        for stack, part, (dst_a, dst_b) in zip(stacks, parts, views):
            a, b = part.a, part.b
            stack.records[slot] = part  # the slot's record in this layer: the part itself
            stack.__dict__["_views"] = None  # (set directly: the stack's __setattr__ would mark the whole group dirty)
            if part.share:
                a.data, b.data = dst_a, dst_b
            else:
                with on_stream(stream):
                    dst_a.copy_(a.detach(), non_blocking=True)
                    dst_b.copy_(b.detach(), non_blocking=True)
            if part.bias is not None or stack.mag is not None or stack.lora_bias is not None:
                stack.set_extras(slot, None, part.bias)

    def slot_views(
        self, slot: int, stacks: "list[LoraStack]", parts: "list[SlotRecord]", layout: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each part's ``A`` and ``B`` as views of slot ``slot``'s page (``stacks``: each one's; ``layout``: theirs,
        :attr:`PageColumns.layout`), kept for the next adapter of that layout in this slot (a view costs the host
        ~2 µs: ~1 ms for an adapter of 224 weights)."""
        if len(self.views) >= 2 * max(self.count, 1):  # many layouts (mixed ranks): keep the host memory bounded
            self.views.clear()
        data, base = self.data, self.data.storage_offset() + slot * self.page_numel
        views = self.views[(slot, layout)] = [
            (
                data.as_strided((part.rank, stack.in_features), (stack.in_features, 1), base + part.rel),
                data.as_strided((stack.out_features, part.rank), (part.rank, 1), base + part.b_rel),
            )
            for stack, part in zip(stacks, parts)
        ]
        return views

    def prepare_views(self, layouts: "dict[int, tuple[list[LoraStack], list[SlotRecord]]]") -> None:
        """Every slot's views for each of ``layouts`` (layout -> the stacks and parts of an adapter of it) ahead of
        the calls, where they are few (one or two: adapters of the same ranks and targets), so that no call's first
        move into a slot makes them."""
        if not 0 < len(layouts) <= 2:
            return
        for slot in range(self.count):
            for layout, (stacks, parts) in layouts.items():
                if (slot, layout) not in self.views:
                    self.slot_views(slot, stacks, parts, layout)

    def start(self, slot: int) -> int:
        """Where slot ``slot``'s page starts in :attr:`data`."""
        return slot * self.page_numel

    def page(self, slot: int, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of slot ``slot``'s page."""
        return self.data.narrow(0, slot * self.page_numel, numel)

    def fit(self, count: int, page_numel: int) -> None:
        """Room for ``count`` pages of ``page_numel`` elements. Where the memory is rebuilt, each page's contents go to
        the start of its new page, and every stack of the group follows (:meth:`LoraStack.repage`: its slots'
        offsets, PEFT's views)."""
        count, page_numel = max(count, self.count), max(page_numel, self.page_numel)
        if (count, page_numel) == (self.count, self.page_numel):
            return
        data = torch.empty(count * page_numel, dtype=self.dtype, device=self.device)
        old_numel = self.page_numel
        if self.count and old_numel:
            old = self.data.view(self.count, old_numel)
            data.view(count, page_numel)[: self.count, :old_numel].copy_(old)
        self.data, self.count, self.page_numel = data, count, page_numel
        self.views.clear()
        for stack in list(self.stacks):
            stack.data = data
            stack.repage()

    def to(self, device: torch.device) -> "DevicePages":
        """The pages on ``device`` (moved once for every stack of the group)."""
        device = torch.device(device)
        if self.data.device != device:
            self.data, self.device = self.data.to(device), device
            self.views.clear()
        return self

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


class HostArena:
    """Host memory for the host tier's adapters: pinned where CUDA is (so copies both ways are asynchronous), carved
    out of slabs. The pinned allocator rounds every allocation up to a power of two, so one buffer per adapter would
    cost up to 2× its bytes (a 22 MiB adapter of the 1B layout takes 32 MiB); a slab of 1 GiB holds 46 of them.

    Slabs are sized to what is asked for: the tier tells the arena the bytes of the regions it is about to take
    (:meth:`expect`: every adapter's when the model is enabled, the new ones' when adapters are loaded later), and a
    new slab holds what is left of that, or as much as the arena held when it was told, whichever is more (so the
    first announcement is met exactly and later ones double the arena: few slow pinned allocations), up to
    ``slab_bytes`` a slab; pinned, rounded up to the power of two the allocator takes anyway. So a model of small
    adapters pins about their bytes, not a gigabyte.

    Each adapter keeps its region (one per dtype) for as long as it is loaded: evicting it again copies into the same
    memory, and a deleted adapter's region is reused by the next one of the same size."""

    ALIGN = 64  # bytes: every region starts on a 64-byte boundary

    def __init__(self, pin: bool, slab_bytes: int = 1 << 30) -> None:
        self.pin = pin
        self.slab_bytes = slab_bytes
        self.slabs: list[torch.Tensor] = []
        self.used = 0  # bytes taken in the last slab
        self.expected = 0  # bytes of regions announced and not yet carved (:meth:`expect`)
        self.grow = 0  # bytes held when the last announcement came: a new slab holds at least that much
        self.regions: dict[tuple[str, torch.dtype, str], torch.Tensor] = {}
        self.spare: dict[int, list[torch.Tensor]] = {}  # freed regions (uint8) by size

    def expect(self, nbytes: int) -> None:
        """The regions about to be taken need ``nbytes`` of new memory in all (:meth:`missing`); 0 once taken."""
        self.expected, self.grow = nbytes, self.nbytes

    def missing(self, name: str, dtype: torch.dtype, numel: int, tag: str = "") -> int:
        """The new memory :meth:`region` with these arguments would carve: 0 where the region is held already or a
        freed region of its size waits (:meth:`forget`)."""
        held = self.regions.get((name, dtype, tag))
        if held is not None and held.numel() == numel:
            return 0
        nbytes = self._aligned(numel * dtype.itemsize)
        return 0 if self.spare.get(nbytes) else nbytes

    def region(self, name: str, dtype: torch.dtype, numel: int, tag: str = "") -> torch.Tensor:
        """Adapter ``name``'s host memory for ``numel`` elements of ``dtype`` (the same memory on every call); ``tag``
        tells apart regions of one adapter and dtype (its page for a device, the rest of its weights)."""
        key = (name, dtype, tag)
        held = self.regions.get(key)
        if held is not None and held.numel() == numel:
            return held
        if held is not None:
            self._give_back(key)
        nbytes = self._aligned(numel * dtype.itemsize)
        spare = self.spare.get(nbytes)
        raw = spare.pop() if spare else self._carve(nbytes)
        held = self.regions[key] = raw[: numel * dtype.itemsize].view(dtype)
        return held

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        """``nbytes`` rounded up to :attr:`ALIGN`: the memory a region of ``nbytes`` takes."""
        return -(-nbytes // cls.ALIGN) * cls.ALIGN

    def _carve(self, nbytes: int) -> torch.Tensor:
        if not self.slabs or self.used + nbytes > self.slabs[-1].numel():
            size = min(self.slab_bytes, max(self.expected, self.grow))
            if self.pin and size > 0:
                size = min(self.slab_bytes, 1 << (size - 1).bit_length())
            size = max(size, nbytes)
            self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
            self.used = 0
        raw = self.slabs[-1][self.used : self.used + nbytes]
        self.used += nbytes
        self.expected = max(0, self.expected - nbytes)
        return raw

    def _give_back(self, key) -> None:
        held = self.regions.pop(key)
        raw = held.view(torch.uint8)
        nbytes = self._aligned(raw.numel())
        base = raw.untyped_storage()
        offset = raw.storage_offset()
        whole = torch.empty(0, dtype=torch.uint8).set_(base, offset, (nbytes,))
        self.spare.setdefault(nbytes, []).append(whole)

    def forget(self, name: str) -> None:
        """Adapter ``name`` was deleted: its regions go to the next adapter of the same size."""
        for key in [k for k in self.regions if k[0] == name]:
            self._give_back(key)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` views the arena's memory."""
        ptr = t.untyped_storage().data_ptr()
        return any(slab.untyped_storage().data_ptr() == ptr for slab in self.slabs)

    @property
    def nbytes(self) -> int:
        """Host memory held (slabs)."""
        return sum(s.numel() for s in self.slabs)
