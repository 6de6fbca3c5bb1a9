"""The host tier (``enable_csgmv(model, max_resident_adapters=N)``): at most N adapters hold a slot on the device; the
others' kernel-layer weights wait in host memory (pinned where CUDA is) and come into a slot when a call needs them,
the least recently used resident out.

Layout. The stacks of one device and dtype share one :class:`~peft_csgmv.slots.DevicePages`: a page per slot, holding
the slot's adapter in every layer of the group, laid out as that adapter's host region (a :class:`Placement`: its
layers in order, each one's ``A`` then ``B``). Bringing an adapter in is one host-to-device copy of its region into
its page, after which each layer's slot only records where it is and PEFT's parameters are re-pointed at it; moving
it out is one copy back, and PEFT's parameters are re-pointed at the region. What the pages do not hold (DoRA
magnitudes, ``lora_B`` biases, weights of another dtype than their stack's, adapters PEFT's path serves in a kernel
layer) moves on its own, parameter by parameter, into a second region.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .slots import (
    DevicePages,
    HostArena,
    LoraStack,
    PageColumns,
    SlotRecord,
    layer_adapter,
    module_param,
    set_peft_rows,
    vacate,
)


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
        stack: LoraStack = layer._csgmv_stack
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

    def __init__(self) -> None:
        self.lru: collections.OrderedDict = collections.OrderedDict()  # resident names, least recently used first
        self.host = HostArena(pin=torch.cuda.is_available())
        self.pages: dict[tuple[torch.device, torch.dtype], DevicePages] = {}
        self.placements: dict[str, Placement] = {}
        # (pages, slot) -> the event after that page's last copy out (:meth:`park`), until a copy in waits for it
        self.page_out: dict[tuple[DevicePages, int], torch.cuda.Event] = {}

    def pages_for(self, device: torch.device, dtype: torch.dtype) -> DevicePages:
        key = (torch.device(device), dtype)
        pages = self.pages.get(key)
        if pages is None:
            pages = self.pages[key] = DevicePages(device, dtype)
        return pages

    def lay_out(self, layers, names, registry, kernel_reason) -> None:
        """Every adapter's placement, pages to fit them (one per slot), each layer's held ranks (its launch shape
        then stays put as adapters come and go), and each resident's places reserved in its slot's page. A resident
        whose places moved (its weights replaced by others of another shape) gets memory of
        its own first, so that the restack that follows copies it into its new places whole. Each adapter's table
        columns and, where the adapters have one or two layouts, every slot's page views for them are made here, so
        that a call's moves only use them."""
        layers = list(layers)
        self.page_out.clear()  # (the caller waited for every copy out: host_copies_done)
        self.placements = {name: placement_of(layers, name, kernel_reason) for name in names}
        live = {layer._csgmv_stack.pages for layer in layers}
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
            layer._csgmv_stack.hold_ranks(held.get(layer._csgmv_stack, ()))
        places = [
            (slot, stack, part)
            for slot, name in enumerate(registry.names)
            for stack, part in (self.placements[name].all_parts() if name is not None else ())
        ]
        moved = set()
        for slot, stack, part in places:
            record = stack.held.get(slot)
            if record is not None and record.rel != part.rel:
                moved.add(slot)
        for slot in moved:
            for layer in layers:
                layer._csgmv_stack.release_slot(slot)
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
            record = stack.held.get(slot)
            if record is None or record.rel != part.rel:
                stack.held[slot] = part._replace(a=None, b=None, share=False)

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
        return wanted

    def hosted(self, name: str) -> bool:
        """Whether adapter ``name``'s page weights wait in host memory (not on their stacks' devices)."""
        return any(part.share and part.a.device != stack.device for stack, part in self.placements[name].all_parts())

    def park(self, name: str, slot: int | None = None) -> None:
        """Adapter ``name``'s weights into its host regions, PEFT's parameters re-pointed at them (weights there
        already stay). ``slot``: the adapter is resident there: each group's page leaves in one copy, on CUDA on the
        device's copy-out stream (:func:`out_stream`), after the work queued so far on the current one, so that it
        runs beside the copies in of the adapters that come in (each waits for the copy out of its slot's page:
        :meth:`bring_in`)."""
        for pages, region, params, views in self.regions(name):
            if slot is not None and pages is not None:
                page = pages.page(slot, region.numel())
                if streamed(page.device):
                    stream = out_stream(page.device)
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

    def bring_in(self, name: str, slot: int, dora_scale, dora_refused: set) -> None:
        """Adapter ``name`` from its host regions into slot ``slot``: one copy per group of pages, the rest of its
        parameters to their layers' devices, then each layer's slot set at its place in the page."""
        placement = self.placements[name]
        for pages, region, _, _ in self.regions(name):
            if pages is not None:
                page = pages.page(slot, region.numel())
                out = self.page_out.pop((pages, slot), None)
                if out is not None:  # the page's copy out to its last adapter's region first
                    torch.cuda.current_stream(page.device).wait_event(out)
                page.copy_(region, non_blocking=True)
        for p, device in placement.rest:
            if p.device != device:
                p.data = p.data.to(device, copy=True, non_blocking=True)
        for pages, parts in placement.parts.items():
            scalings = [layer.scaling[name] for layer in placement.layers[pages]]
            pages.place(slot, placement.part_stacks[pages], parts, scalings, placement.columns[pages])
        for layer, stack, bias in placement.dora:
            stack.set_extras(slot, dora_scale(layer, name), bias)
        for layer in placement.peft_layers:
            set_peft_rows(layer, layer._csgmv_peft | {name})
            if layer.use_dora.get(name, False):
                dora_refused.add(name)

    def evict(self, name: str, slot: int, empty: bool = True) -> list[LoraStack]:
        """Adapter ``name`` out of slot ``slot`` to its host regions (copied out first: a copy that fails leaves it
        resident as it was), its slot emptied in every layer; the stacks that held it. ``empty=False``: the caller
        fills the slot again at once (:meth:`refill`) and empties it where the next adapter does not overwrite it;
        here the stacks only let go of its parameters (which now view host memory)."""
        placement = self.placements[name]
        self.park(name, slot)
        stacks = placement.stack_list
        if empty:
            vacate(slot, stacks)
        else:
            for stack in stacks:
                stack.held.pop(slot, None)  # (PEFT's parameters now view host memory: no longer the slot's)
        for layer in placement.peft_layers:
            set_peft_rows(layer, layer._csgmv_peft - {name})
        return stacks

    def refill(self, name: str, slot: int, held: list[LoraStack]) -> None:
        """Before adapter ``name`` comes into slot ``slot``, which ``held`` (stacks :meth:`evict` left as they were)
        still describe: the slot emptied in those of them that ``name``'s bring-in does not write (every field it
        would empty, the bring-in sets anew in the others)."""
        placement = self.placements[name]
        vacate(slot, [stack for stack in held if stack not in placement.stacks])


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
def out_stream(device: torch.device) -> "torch.cuda.Stream":
    """The stream that copies device pages out to host memory on CUDA ``device`` (one per device)."""
    return torch.cuda.Stream(device)


def _copy_streams(layers) -> Iterator["torch.cuda.Stream"]:
    """The streams that copy adapter weights to host memory for ``layers`` on CUDA: each device's current stream
    (the weights that move parameter by parameter) and its copy-out stream (the pages)."""
    for device in {layer._csgmv_stack.device for layer in layers}:
        if streamed(device):
            yield torch.cuda.current_stream(device)
            yield out_stream(device)


def copies_out(layers) -> list:
    """Events after the asynchronous copies of adapter weights to pinned host memory queued so far, on each stream
    that makes them for ``layers`` (none on the CPU, where they are done already): a call that moved adapters out
    waits for them as it ends (:func:`settle`), before host code may read those weights, instead of before it brings
    others in. The copies then overlap the bring-ins' host work and their copies in, and the wait is for them alone,
    not for all queued work."""
    events = []
    for stream in _copy_streams(layers):
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    return events


def settle(events) -> None:
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
