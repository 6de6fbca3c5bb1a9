"""The host tier: ``enable_csgmv(model, max_resident_adapters=N)`` keeps at most N adapters in slots on the device; the
others' kernel-layer weights wait in host memory (pinned where CUDA is) and come into a slot when a call needs them,
the least recently used resident out. Checked here on the bookkeeping (which adapters are resident, in what order),
on results against stock PEFT through evictions, on a call that needs more adapters than fit (refused before
anything runs or moves), and on stock PEFT calls with an evicted adapter active."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from helpers import ALL_LINEAR, BASE, DEVICE, add_adapters, close, make_batch, per_adapter, stitch, tiny_model

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
ADAPTERS = ["a0", "a1", "a2", "a3", "a4"]


@pytest.fixture
def tiered():
    model, _ = tiny_model("llama")
    specs = {
        name: dict(r=4 + 2 * i, lora_alpha=8, target_modules=(["embed_tokens"] if i % 2 else []) + ALL_LINEAR)
        for i, name in enumerate(ADAPTERS)
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    # Every adapter's own stock PEFT run, before enabling: the reference for every call below.
    outs = per_adapter(model, [*ADAPTERS, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    return model, input_ids, mask, outs


def _call(model, input_ids, mask, outs, names):
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(got, stitch(outs, names), f"ids {names}")


def _weights(model, name):
    return [p for n, p in model.named_parameters() if f".{name}." in n and "lora_" in n]


def test_adapters_come_and_go_least_recently_used_first(tiered):
    model, input_ids, mask, outs = tiered
    assert csgmv_stats(model)["resident"] == ["a0", "a1"]
    assert all(p.device.type == "cpu" for p in _weights(model, "a3"))  # waiting in host memory
    if torch.cuda.is_available():  # pinned, so copies both ways are asynchronous
        assert all(p.is_pinned() for p in _weights(model, "a3"))
    _call(model, input_ids, mask, outs, ["a1", BASE, "a1", "a1"])  # a1 used: a0 is now the least recent
    assert csgmv_stats(model)["resident"] == ["a0", "a1"]
    _call(model, input_ids, mask, outs, ["a2", "a1", BASE, "a2"])  # a2 comes in, a0 (least recent) goes
    assert csgmv_stats(model)["resident"] == ["a2", "a1"]  # a call uses its adapters in order of first use
    _call(model, input_ids, mask, outs, ["a3", "a4", "a3", BASE])  # both go, both come
    assert csgmv_stats(model)["resident"] == ["a3", "a4"]
    _call(model, input_ids, mask, outs, ["a0", "a2", BASE, "a0"])  # the evicted ones again, with their weights
    assert csgmv_stats(model)["resident"] == ["a0", "a2"]
    if torch.cuda.is_available():
        assert all(p.is_pinned() for p in _weights(model, "a3"))  # evicted: copied out to pinned memory
    # The stacks' storage is the tier's pages, one per slot, each the size of the largest adapter's weights
    (pages,) = model._csgmv.tier.pages.values()
    largest = max(sum(p.numel() for p in _weights(model, name) if p.dim() == 2) for name in ADAPTERS)
    assert pages.count == 2 and largest <= pages.page_numel <= largest + 2 * 64 * len(model._csgmv.layers)
    assert csgmv_stats(model)["stack_bytes"] == pages.nbytes + sum(
        layer._csgmv_record.stack.nbytes for layer in model._csgmv.layers.values()
    )


def test_a_slot_refilled_at_once_is_emptied_only_where_its_new_adapter_has_no_part(tiered, monkeypatch):
    """A call that moves adapters evicts a resident and brings another into its slot at once: the slot is emptied
    only in the layers where the newcomer has no part (its bring-in writes every field of the others), and there it
    holds nothing (rank 0); every row gets its adapter's stock PEFT result."""
    import collections

    import peft_csgmv.slots as csgmv_slots

    model, input_ids, mask, outs = tiered
    emptied = collections.Counter()
    real = csgmv_slots.LoraStack._empty

    def counted(self, slot):
        emptied["embedding" if self.embedding else "linear"] += 1
        return real(self, slot)

    monkeypatch.setattr(csgmv_slots.LoraStack, "_empty", counted)
    assert csgmv_stats(model)["resident"] == ["a0", "a1"]
    _call(model, input_ids, mask, outs, ["a3", "a1", BASE, "a3"])  # a3 (every layer, the embedding too) for a0
    assert not emptied, f"a slot refilled in every layer was emptied first: {dict(emptied)}"
    _call(model, input_ids, mask, outs, ["a2", "a3", "a2", BASE])  # a2 (no embedding part) into a1's slot
    assert emptied == {"embedding": 1}, dict(emptied)
    state = model._csgmv
    slot = state.registry.index["a2"]
    embed = model.base_model.model.model.embed_tokens._csgmv_record.stack
    assert embed.ranks_host[slot] == 0 and slot not in embed.records
    linear = [layer._csgmv_record.stack for layer in state.layers.values() if layer._csgmv_record.stack is not embed]
    assert all(stack.ranks_host[slot] == 8 for stack in linear), "a2 (rank 8) is not in its slot in every layer"


def test_call_needing_more_adapters_than_fit_is_refused_first(tiered, kernel_calls):
    model, input_ids, mask, outs = tiered
    before = csgmv_stats(model)["resident"]
    with pytest.raises(ValueError, match=r"need 3 distinct adapters, more than the 2 that fit on the device"):
        model(input_ids, attention_mask=mask, adapter_ids=["a2", "a3", "a4", BASE])
    assert kernel_calls == [] and active_calls() == 0
    assert csgmv_stats(model)["resident"] == before, "a refused call moved adapters"
    _call(model, input_ids, mask, outs, ["a0", "a1", BASE, "a0"])


def test_stock_call_with_an_evicted_adapter_active(tiered):
    model, input_ids, mask, outs = tiered
    model.set_adapter("a4")  # in host memory
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask).logits  # no ids: PEFT's own forward
    close(got, outs["a4"], "stock call on an adapter that was in host memory")
    assert "a4" in csgmv_stats(model)["resident"]


def test_merges_of_adapters_in_host_memory(tiered):
    """PEFT's merges compute with adapter weights outside a forward: the weights of an adapter waiting in host memory
    are lent to the layer's device for the call (on the GPU, host weights merged into device weights fail otherwise),
    and stay where they were. ``merge_adapter`` / ``unmerge_adapter`` of an evicted adapter and ``get_delta_weight``
    of another: stock PEFT's numbers."""
    model, input_ids, mask, outs = tiered
    hosted = [n for n in ADAPTERS if n not in csgmv_stats(model)["resident"]]
    name, other = hosted[0], hosted[1]
    where = [(p.device, p.data_ptr()) for p in _weights(model, name)]
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.base_layer.weight.detach().clone()
    model.set_adapter(name)
    model.merge_adapter()
    assert [(p.device, p.data_ptr()) for p in _weights(model, name)] == where, "the merge moved the adapter"
    delta = layer.lora_B[name].weight.double().cpu() @ layer.lora_A[name].weight.double().cpu() * layer.scaling[name]
    close(layer.base_layer.weight.cpu(), (base.double().cpu() + delta).to(base.dtype), "merged base weight")
    model.unmerge_adapter()
    close(layer.base_layer.weight, base, "unmerged base weight")
    with torch.no_grad():
        close(model(input_ids, attention_mask=mask).logits, outs[name], f"stock PEFT {name} after unmerge")
    A, B = layer.lora_A[other].weight, layer.lora_B[other].weight
    where = [(p.device, p.data_ptr()) for p in (A, B)]
    got = layer.get_delta_weight(other)
    assert got.device == base.device and [(p.device, p.data_ptr()) for p in (A, B)] == where
    close(got.cpu(), (B.double().cpu() @ A.double().cpu() * layer.scaling[other]).to(got.dtype), "delta weight")


@pytest.mark.parametrize("combination", ["cat", "svd"])
def test_weighted_adapter_of_adapters_in_host_memory(combination):
    """PEFT's ``add_weighted_adapter`` reads the weights it combines (``cat``: directly; ``svd``: through each layer's
    delta weight): those of adapters waiting in host memory are lent to the device for the call (on the GPU they would
    meet device weights otherwise) and stay in host memory. The new adapter: stock PEFT's, in a stock run and in a
    call with ids."""
    model, _ = tiny_model("llama")
    specs = {name: dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR) for i, name in enumerate(ADAPTERS)}
    model = add_adapters(model, specs).to(DEVICE)
    twin = copy.deepcopy(model)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    hosted = [n for n in ADAPTERS if n not in csgmv_stats(model)["resident"]]
    where = [(p.device, p.data_ptr()) for n in hosted for p in _weights(model, n)]
    input_ids, mask = make_batch(4, 6)
    for m in (twin, model):
        m.add_weighted_adapter(hosted[:2], [0.7, 1.3], "mix", combination_type=combination)
    assert [(p.device, p.data_ptr()) for n in hosted for p in _weights(model, n)] == where
    outs = per_adapter(twin, ["mix", "a0"], lambda: twin(input_ids, attention_mask=mask).logits)
    _call(model, input_ids, mask, outs, ["mix", "a0", "mix", "a0"])
    model.set_adapter("mix")
    with torch.no_grad():
        close(model(input_ids, attention_mask=mask).logits, outs["mix"], "stock run of the combined adapter")
    disable_csgmv(model)
    assert "add_weighted_adapter" not in model.base_model.__dict__


def test_edits_survive_eviction_and_disable_brings_everything_back(tiered):
    model, input_ids, mask, outs = tiered
    with torch.no_grad():
        for p in _weights(model, "a0"):
            p.mul_(1.0)  # an in-place edit through the shared view (kept trivial: the reference stays right)
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # a0 and a1 go to host memory
    _call(model, input_ids, mask, outs, ["a0", "a1", BASE, "a0"])  # and come back
    disable_csgmv(model)
    device = model.base_model.model.model.embed_tokens.weight.device
    assert all(p.device == device for n, p in model.named_parameters() if "lora_" in n)
    for name in ADAPTERS:
        model.set_adapter(name)
        with torch.no_grad():
            close(model(input_ids, attention_mask=mask).logits, outs[name], f"stock PEFT {name} after disable")


@pytest.mark.gpu
@pytest.mark.parametrize("call", ["ids", "stock"])
def test_weights_moved_out_are_in_host_memory_when_the_call_returns(tiered, call):
    """The copies to host memory are asynchronous, on a stream of their own beside the copies in (the call waits for
    them as it ends, not before it brings adapters in): an adapter moved out by a call with ids, or by a stock call
    whose active adapter came in, has its device values, including an edit queued just before the call, in host
    memory when the call returns, however much GPU work was queued ahead; the adapter that took its slot gives stock
    PEFT's logits (its copy in waited for the copy out)."""
    model, input_ids, mask, outs = tiered
    moved = _weights(model, "a0")  # resident, the least recently used: the next move takes its slot
    expected = [p.detach().cpu() + 0.5 for p in moved]
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU work ahead of the edit and the call's copies
    with torch.no_grad():
        for p in moved:
            p.add_(0.5)  # on the device only, queued behind the sleep: its host region holds the values from before
    with torch.no_grad():
        if call == "ids":
            names = ["a3", BASE, "a3", "a3"]
            logits = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        else:
            names = ["a3"] * 4
            model.set_adapter("a3")
            logits = model(input_ids, attention_mask=mask).logits
    got = [p.detach().clone() for p in moved]  # host memory as it is now: no wait on the GPU
    assert all(p.device.type == "cpu" for p in moved) and "a0" not in csgmv_stats(model)["resident"]
    for g, e in zip(got, expected):
        assert torch.equal(g, e), "a weight moved out was read back before its copy to host memory ended"
    close(logits, stitch(outs, names), "the adapter that came into the slot")


class _Streams:
    """Stand-ins for CUDA's streams and events that log what the host tier asks of them (the copies themselves run
    on the CPU, done when they return): the order of the asynchronous moves, checked without a GPU."""

    def __init__(self):
        self.log: list[tuple] = []
        self.current = self.active = _Stream(self, "current")
        self.made: list = []
        self.done: set = set()  # the events that read as completed

    @classmethod
    def install(cls, monkeypatch) -> "_Streams":
        """Stand-ins in CUDA's place for the host tier (its streams made anew: call ``clear`` when done)."""
        from peft_csgmv import tier as tier_module

        streams = cls()
        monkeypatch.setattr(tier_module, "streamed", lambda device: True)
        monkeypatch.setattr(torch.cuda, "Event", streams.event)
        monkeypatch.setattr(torch.cuda, "Stream", streams.stream)
        monkeypatch.setattr(torch.cuda, "current_stream", streams.current_stream)
        monkeypatch.setattr(torch.cuda, "stream", streams.on)
        streams.clear()
        return streams

    @staticmethod
    def clear() -> None:
        from peft_csgmv import tier as tier_module

        tier_module.copy_stream.cache_clear()

    def event(self):
        return _Event(self)

    def stream(self, device=None):
        stream = _Stream(self, f"out{len(self.made)}")
        self.made.append(stream)
        return stream

    def current_stream(self, device=None):
        return self.active

    def on(self, stream):
        streams = self

        class _On:
            def __enter__(self):
                streams.active = stream
                streams.log.append(("on", stream.name))

            def __exit__(self, *exc):
                streams.active = streams.current
                streams.log.append(("off", stream.name))

        return _On()


class _Stream:
    def __init__(self, streams, name):
        self.streams, self.name = streams, name

    def wait_stream(self, other):
        self.streams.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event):
        self.streams.log.append(("wait_event", self.name, event.id))

    def synchronize(self):
        self.streams.log.append(("sync", self.name))


class _Event:
    count = 0

    def __init__(self, streams):
        self.streams = streams

    def record(self, stream):
        _Event.count += 1
        self.id, self.stream = _Event.count, stream.name
        self.streams.log.append(("record", stream.name, self.id))

    def synchronize(self):
        self.streams.log.append(("event_sync", self.id))

    def query(self):
        self.streams.log.append(("query", self.id))
        return self.id in self.streams.done


def test_an_adapter_brought_in_ahead_copies_beside_the_running_work(monkeypatch):
    """``bring_in_ahead`` (continuous batching's, for a waiting request's adapter), as on CUDA with stand-in streams:
    the resident it evicts leaves on the copy-out stream; its page copy runs on a copy-in stream of its own, once
    that stream waited for the current one (whose queued work may still read the slot), and an event marks it; the
    adapter reads as not ready until that event completes (asked, never waited for); the first call that uses it
    makes the current stream wait for the event before its layers run. Nothing waits on the host, and the logits are
    stock PEFT's."""

    model, _ = tiny_model("llama")
    specs = {name: dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR) for i, name in enumerate(ADAPTERS)}
    model = add_adapters(model, specs)
    input_ids, mask = (t.cpu() for t in make_batch(4, 6))
    outs = per_adapter(model, [*ADAPTERS, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    streams = _Streams.install(monkeypatch)
    state = model._csgmv
    try:
        assert state.bring_in_ahead(["a2"], keep={"a0"}) == ["a2"]
        assert csgmv_stats(model)["resident"] == ["a0", "a2"]
        log = streams.log
        copy_out, copy_in = (stream.name for stream in streams.made)
        on_in = log.index(("on", copy_in))
        assert ("wait_stream", copy_in, "current") in log[:on_in], "the copy in did not wait for the current stream"
        assert log.index(("on", copy_out)) < on_in, "the evicted adapter's page left after the new one came"
        marks = [step[2] for step in log if step[:2] == ("record", copy_in)]
        assert len(marks) == 1 and log.index(("record", copy_in, marks[0])) > max(
            i for i, step in enumerate(log) if step == ("off", copy_in)
        )
        assert not state.tier.ready("a2") and ("query", marks[0]) in log
        assert not any(step[0] in ("sync", "event_sync") for step in log), "the host waited"
        streams.log.clear()
        _call(model, input_ids, mask, outs, ["a2", BASE, "a0", "a2"])
        assert ("wait_event", "current", marks[0]) in streams.log, "the call did not wait for the copy in"
        assert "a2" not in state.tier.ahead and state.tier.ready("a2")
        streams.done.add(marks[0])
    finally:
        _Streams.clear()


def test_moves_order_their_copies_through_streams_and_events(monkeypatch):
    """The host tier's asynchronous moves, as on CUDA (stand-in streams and events log each step): each page leaves on
    the copy-out stream once it has waited for the current stream (whose work may still write the page); the
    adapter that takes the page waits for that page's event on the current stream before its copy in; the call
    never waits for a whole stream, and it waits for events recorded after all its copies out before it returns.
    Logits stay stock PEFT's throughout."""

    model, _ = tiny_model("llama")
    specs = {name: dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR) for i, name in enumerate(ADAPTERS)}
    model = add_adapters(model, specs)  # on the CPU, whatever the machine: the streams are stand-ins
    input_ids, mask = (t.cpu() for t in make_batch(4, 6))
    outs = per_adapter(model, [*ADAPTERS, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    streams = _Streams.install(monkeypatch)
    try:
        # (residents a0, a1 after enabling; then each call's missing adapters evict the least recently used)
        for names, moves in (
            (["a2", "a3", BASE, "a2"], 2),
            (["a0", BASE, "a0", "a0"], 1),
            (["a4", "a1", "a4", BASE], 2),
        ):
            streams.log.clear()
            _call(model, input_ids, mask, outs, names)
            log = streams.log
            assert ("sync", "current") not in log and ("sync", "out0") not in log, "a call waited for a whole stream"
            outs_recorded = {}  # event id -> position, for the events after a page's copy out
            for i, step in enumerate(log):
                if step[0] == "on":
                    assert log[i - 1] == ("wait_stream", "out0", "current"), "a copy out did not wait for the stream"
                    assert log[i + 1] == ("off", "out0") and log[i + 2][:2] == ("record", "out0")
                    outs_recorded[log[i + 2][2]] = i + 2
            assert len(outs_recorded) == moves, f"ids {names}: {len(outs_recorded)} pages copied out, not {moves}"
            waits = [step[2] for step in log if step[0] == "wait_event"]
            assert sorted(waits) == sorted(outs_recorded), "a copy in did not wait for its page's copy out alone"
            last_out = max(outs_recorded.values())
            finals = {step[2] for i, step in enumerate(log) if step[0] == "record" and i > last_out}
            awaited = {step[1] for step in log if step[0] == "event_sync"}
            assert finals and finals <= awaited, "the call returned before its copies out were awaited"
    finally:
        _Streams.clear()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_max_resident(bad):
    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, target_modules=targets)})
    with pytest.raises(ValueError, match="max_resident_adapters must be a positive int"):
        enable_csgmv(model, max_resident_adapters=bad)


def test_error_raised_after_validation_moves_nothing():
    """PEFT's own refusal that comes after the ids are validated (aLoRA with beams) still comes before any adapter
    moves into a slot."""
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(r=4, target_modules=["q_proj"], alora_invocation_tokens=[7], task_type="CAUSAL_LM"),
    }
    model = add_adapters(model, specs).to(DEVICE)
    enable_csgmv(model, backend="torch", max_resident_adapters=1)
    assert csgmv_stats(model)["resident"] == ["a0"]
    input_ids, mask = make_batch(2, 6)
    with pytest.raises(ValueError, match="Beam search not yet supported for aLoRA"):
        model.generate(
            input_ids=input_ids, attention_mask=mask, adapter_ids=["al", None], num_beams=2, max_new_tokens=2
        )
    assert csgmv_stats(model)["resident"] == ["a0"] and active_calls() == 0


def test_host_arena_packs_adapters_into_slabs_and_reuses_regions():
    """Host memory comes out of slabs (the pinned allocator would round each adapter's buffer up to a power of two),
    sized to what the tier announces (or doubling the arena); an adapter's region is the same memory every time, and a
    deleted adapter's region goes to the next one of its size."""
    from peft_csgmv.tier import HostArena

    arena = HostArena(pin=False, slab_bytes=4096)
    wanted = [("a", torch.float32, 300), ("b", torch.bfloat16, 300), ("c", torch.float32, 300)]
    assert [arena.missing(*w) for w in wanted] == [1216, 640, 1216], "bytes rounded up to 64"
    arena.expect(sum(arena.missing(*w) for w in wanted))
    a, b, c = (arena.region(*w) for w in wanted)
    assert len(arena.slabs) == 1 and arena.nbytes == 3072, "one slab, sized to the three regions announced"
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0 and c.data_ptr() % 64 == 0
    assert arena.region("a", torch.float32, 300).data_ptr() == a.data_ptr(), "an adapter keeps its region"
    assert arena.missing("a", torch.float32, 300) == 0
    a.fill_(1.0)
    c.fill_(3.0)
    assert torch.equal(a, torch.ones(300)) and torch.equal(c, torch.full((300,), 3.0)), "regions overlap"
    arena.expect(arena.missing("d", torch.float32, 300))
    d = arena.region("d", torch.float32, 300)  # no room left, a small region announced: the arena doubles
    assert len(arena.slabs) == 2 and arena.nbytes == 6144 and d.data_ptr() not in (a.data_ptr(), c.data_ptr())
    arena.expect(0)
    arena.forget("a")
    assert arena.missing("e", torch.float32, 300) == 0, "a freed region of its size waits"
    e = arena.region("e", torch.float32, 300)  # a's size: a's memory
    assert e.data_ptr() == a.data_ptr() and len(arena.slabs) == 2
    big = arena.region("big", torch.float32, 5000)  # larger than a slab: a slab of its own
    assert big.numel() == 5000 and len(arena.slabs) == 3 and arena.slabs[-1].numel() == 20032


def test_adapters_loaded_later_grow_the_host_memory_by_doubling(tiered):
    """An adapter loaded after enabling gets its host region on the next call; the arena, sized to the first
    adapters, grows by a slab as large as it was (not one slab per adapter), and the late adapter serves calls."""
    from peft import LoraConfig

    model, input_ids, mask, outs = tiered
    host = model._csgmv.tier.host
    first = host.nbytes
    model.add_adapter("late", LoraConfig(r=6, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False))
    late = per_adapter(model, ["late"], lambda: model(input_ids, attention_mask=mask).logits)
    _call(model, input_ids, mask, {**outs, **late}, ["late", BASE, "a0", "late"])
    assert any(key[0] == "late" for key in host.regions)
    # (pinned, the first slab is rounded up to a power of two: the late region may fit what is left of it)
    assert host.pin or len(host.slabs) == 2
    assert all(slab.numel() >= first for slab in host.slabs[1:]), "a new slab smaller than the arena was"


@pytest.mark.parametrize("low_cpu_mem_usage", [False, True])
def test_adapters_loaded_after_enabling_leave_the_device_as_they_load(tiered, tmp_path, low_cpu_mem_usage):
    """With the host tier, ``load_adapter`` and ``add_adapter`` after enabling send an adapter beyond
    ``max_resident_adapters`` to host memory at once, before any call (PEFT puts it on the device first): loading many
    adapters never holds more than N + 1 on the device. PEFT's ``low_cpu_mem_usage`` load (its weights empty until
    the state dict comes) works too; the adapters then serve calls with stock PEFT's results."""
    from peft import LoraConfig

    model, input_ids, mask, outs = tiered
    tier = model._csgmv.tier
    model.save_pretrained(str(tmp_path), selected_adapters=["a2"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.load_adapter(str(tmp_path / "a2"), adapter_name="again", low_cpu_mem_usage=low_cpu_mem_usage)
        model.add_adapter("added", LoraConfig(r=6, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False))
    assert not [w for w in caught if str(w.message).startswith("csgmv")], [str(w.message) for w in caught]
    resident = csgmv_stats(model)["resident"]
    assert len(resident) == 2 and "again" not in resident and "added" not in resident
    for name in ("again", "added"):
        regions = [r for key, r in tier.host.regions.items() if key[0] == name]
        assert regions, f"{name} has no host region"
        for p in _weights(model, name):
            assert any(r.data_ptr() <= p.data_ptr() < r.data_ptr() + r.nbytes for r in regions), f"{name} on device"
    added = per_adapter(model, ["added"], lambda: model(input_ids, attention_mask=mask).logits)
    _call(model, input_ids, mask, {**outs, **added, "again": outs["a2"]}, ["again", BASE, "added", "again"])


def test_no_host_memory_while_every_adapter_has_a_slot():
    """``max_resident_adapters`` at or above the adapters loaded: none can leave the device, so the tier holds no host
    memory, nor page views made ahead for moves; the adapter that makes them more than N reserves every adapter's region
    at once (and leaves itself), and the pages get their views."""
    from peft import LoraConfig

    model, _ = tiny_model("llama")
    model = add_adapters(model, {n: dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR) for n in ("a0", "a1")})
    enable_csgmv(model.to(DEVICE), backend="torch", max_resident_adapters=3)
    model.add_adapter("a2", LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR))
    stats = csgmv_stats(model)
    assert stats["host_bytes"] == 0 and len(stats["resident"]) == 3
    (pages,) = model._csgmv.tier.pages.values()
    assert not pages.views
    model.add_adapter("a3", LoraConfig(r=8, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False))
    stats = csgmv_stats(model)
    assert "a3" not in stats["resident"] and stats["host_bytes"] > 0
    assert {key[0] for key in model._csgmv.tier.host.regions} == {"a0", "a1", "a2", "a3"}
    assert len(model._csgmv.tier.host.slabs) == 1, "one announcement for the four"
    assert {slot for slot, _ in pages.views} == set(range(pages.count))


def test_every_adapter_holds_its_host_region_from_the_start(tiered):
    """Residents get their host regions when the model is enabled (pinning host memory is slow: no call pays for it):
    evictions copy into those regions, and calls that move adapters both ways allocate no host memory."""
    model, input_ids, mask, outs = tiered
    host = model._csgmv.tier.host
    assert {key[0] for key in host.regions} == set(ADAPTERS)
    reserved = {key: region.data_ptr() for key, region in host.regions.items()}
    slabs = host.nbytes
    needed = sum(-(-region.nbytes // 64) * 64 for region in host.regions.values())
    assert needed <= slabs <= (2 * needed if host.pin else needed), "host memory sized to the adapters"
    assert len(host.slabs) == 1
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # a0 and a1 leave for the regions they hold
    _call(model, input_ids, mask, outs, ["a0", "a2", BASE, "a0"])  # a0 comes back, a2 in; a3 and a4 leave
    assert host.nbytes == slabs, "a call allocated host memory"
    assert {key: region.data_ptr() for key, region in host.regions.items()} == reserved
    (region,) = [r for key, r in host.regions.items() if key[0] == "a3"]  # its page's layout: one region
    for p in _weights(model, "a3"):
        assert region.data_ptr() <= p.data_ptr() < region.data_ptr() + region.nbytes, "a3 left for its region"


def test_deleted_adapter_frees_its_host_region(tiered):
    model, input_ids, mask, outs = tiered
    host = model._csgmv.tier.host
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # a0 and a1 are copied out to host memory
    held = {k: v.data_ptr() for k, v in host.regions.items() if k[0] == "a0"}
    assert held, "an evicted adapter has a host region"
    model.delete_adapter("a0")
    _call(model, input_ids, mask, outs, ["a3", "a1", BASE, "a3"])  # the next call sees the deletion
    assert not any(k[0] == "a0" for k in host.regions)
    assert sum(len(v) for v in host.spare.values()) == len(held)


def test_dora_and_lora_bias_adapters_through_evictions():
    """Adapters with weights the stacks do not hold (a DoRA magnitude, a ``lora_B`` bias) go to host memory and come
    back with them: each call's rows as their adapter's own stock PEFT run, through several rounds of evictions."""
    model, _ = tiny_model("llama")
    specs = {
        "d": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR, use_dora=True),
        "b": dict(r=6, lora_alpha=8, target_modules=ALL_LINEAR, lora_bias=True),
        "p": dict(r=4, lora_alpha=16, target_modules=ALL_LINEAR),
        "q": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*specs, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    for names in (["p", "q", BASE, "p"], ["d", "b", "d", BASE], ["q", "p", "q", "q"], ["b", "d", BASE, "b"]):
        _call(model, input_ids, mask, outs, names)
        assert set(csgmv_stats(model)["resident"]) == set(names) - {BASE}
    disable_csgmv(model)
    for name in specs:
        model.set_adapter(name)
        with torch.no_grad():
            close(model(input_ids, attention_mask=mask).logits, outs[name], f"stock PEFT {name} after disable")


def test_alora_rows_through_evictions():
    """An aLoRA adapter (its rows on PEFT's path in the layers it targets) evicted and brought back: every call gives
    PEFT's own mixed-batch result for its ids."""
    model, targets = tiny_model("llama")
    invocation = [7, 8]
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"),
        "a1": dict(r=6, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=invocation,
            task_type="CAUSAL_LM",
        ),
    }  # fmt: skip
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 8)
    input_ids[:, 3:5] = torch.tensor(invocation, device=DEVICE)
    calls = (["al", "a0", BASE, "al"], ["a1", "a0", "a1", BASE], ["al", "a1", "al", "a1"], ["a0", "al", BASE, "a0"])
    with torch.no_grad():  # stock PEFT's own mixed batches: the reference
        expected = [model(input_ids, attention_mask=mask, adapter_names=names).logits for names in calls]
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    for names, want in zip(calls, expected):
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        close(got, want, f"ids {names}")
        assert set(csgmv_stats(model)["resident"]) == set(names) - {BASE}


def test_bringing_adapters_in_leaves_the_collector_as_it_was(tiered):
    """Adapters are moved with Python's cyclic collector paused (a burst of short-lived objects); afterwards it is on
    or off as the caller had it."""
    import gc

    model, input_ids, mask, outs = tiered
    assert gc.isenabled()
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # both come in, two go out
    assert gc.isenabled()
    gc.disable()
    try:
        _call(model, input_ids, mask, outs, ["a0", "a2", BASE, "a0"])
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("where", ["place", "page", "evict"])
def test_failed_bring_in_leaves_no_stale_slot(where, monkeypatch):
    """A bring-in that fails part way (here: an injected error while the layers' slots are set, at the second page
    copy, or while a resident is moved out) leaves no slot claiming weights it was not given: the next calls, with
    the same adapters and others, give every row its adapter's stock PEFT result."""
    import peft_csgmv.tier as csgmv_tier

    model, _ = tiny_model("llama")
    specs = {
        n: dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR) for i, n in enumerate(["a0", "a1", "a2", "a3"])
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*specs, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    calls = []
    owner, attr, nth = {
        "place": (csgmv_tier.DevicePages, "place", 1),  # a2's layers: the fifth fails, four slots set before it
        "page": (csgmv_tier.DevicePages, "page", 4),  # two pages out (a0, a1), then a2's in, then a3's
        "evict": (csgmv_tier.HostTier, "evict", 2),
    }[where]
    real = getattr(owner, attr)

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            if where == "place":  # part way through the group's layers
                pages, slot, stacks, parts, scalings, *_ = args
                real(pages, slot, stacks[:4], parts[:4], scalings[:4], pages.columns(stacks[:4], parts[:4]))
            raise RuntimeError("out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, failing)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        model(input_ids, attention_mask=mask, adapter_ids=["a2", "a3", BASE, "a2"])
    monkeypatch.setattr(owner, attr, real)
    assert active_calls() == 0 and "a2" not in csgmv_stats(model)["resident"]
    state = model._csgmv
    held = set(state.registry.index.values())
    for name, layer in state.layers.items():
        stack = layer._csgmv_record.stack
        stale = [slot for slot, rank in enumerate(stack.ranks_host) if rank and slot not in held]
        assert not stale, f"{name}: slots {stale} hold no adapter but keep a rank (a half-done bring-in's)"
    for names in (["a2", "a3", BASE, "a2"], ["a0", "a2", "a0", BASE], ["a3", "a1", BASE, "a3"]):
        _call(model, input_ids, mask, outs, names)


def test_packed_views_are_the_slices_they_replace():
    """``packed_views`` (the views a moving adapter's weights take of its host region or of its staging copy on the
    GPU): each weight's shape, contiguous, packed one after another or at given element offsets, on a buffer that is
    itself a view at an offset of a larger one; writes through them land in the buffer."""
    from peft_csgmv.tier import packed_views as _packed_views

    slab = torch.arange(200, dtype=torch.float32)
    buf = slab[37:137]  # a region of a slab: storage offset 37
    params = [torch.empty(3, 4), torch.empty(5), torch.empty(2, 1, 3), torch.empty(0, 7)]
    packed = _packed_views(buf, params)
    pos = 0
    for p, v in zip(params, packed):
        assert v.shape == p.shape and v.is_contiguous()
        assert torch.equal(v, buf[pos : pos + p.numel()].view(p.shape))
        pos += p.numel()
    at = [50, 0, 80, 99]
    for p, v, start in zip(params, _packed_views(buf, params, at), at):
        assert torch.equal(v, buf[start : start + p.numel()].view(p.shape))
    packed[0].fill_(-1.0)
    assert torch.equal(slab[37:49], torch.full((12,), -1.0)) and slab[36] == 36 and slab[49] == 49


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def test_residents_live_in_their_pages_and_move_in_one_copy_each(tiered, monkeypatch):
    """The stacks' storage is the tier's pages: every resident's PEFT weights are views of its slot's page, every
    other adapter's of its host region; bringing an adapter in is one copy of its region into its page, moving one
    out one copy back (on a GPU: one host-to-device and one device-to-host copy, whatever the number of weights)."""
    from peft_csgmv.tier import DevicePages

    model, input_ids, mask, outs = tiered
    tier = model._csgmv.tier
    (pages,) = tier.pages.values()
    copies = []
    real = DevicePages.page

    def page(self, slot, numel):
        copies.append(slot)
        return real(self, slot, numel)

    monkeypatch.setattr(DevicePages, "page", page)
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # a0 and a1 out, a3 and a4 in
    assert len(copies) == 4, f"{len(copies)} page copies for two adapters out and two in"
    slots = model._csgmv.registry.index
    for name in ADAPTERS:
        weights = _weights(model, name)
        if name in ("a3", "a4"):
            assert {_storage(p) for p in weights} == {_storage(pages.data)}, f"{name} is not in the pages"
            lo = pages.data.data_ptr() + pages.start(slots[name]) * pages.data.element_size()
            hi = lo + pages.page_numel * pages.data.element_size()
            assert all(lo <= p.data_ptr() < hi for p in weights), f"{name} is not in its slot's page"
        else:
            (region,) = [r for key, r in tier.host.regions.items() if key[0] == name]
            assert {_storage(p) for p in weights} == {_storage(region)}, f"{name} is not in its host region"


def test_a_larger_adapter_loaded_later_grows_the_pages():
    """An adapter larger than the pages, loaded after enabling, gets pages of its size: the residents keep their
    places in the new pages (PEFT's weights with them), and every call still gives each row its adapter's result,
    against an untouched copy of the model with the same adapters."""
    import copy

    from peft import LoraConfig

    model, _ = tiny_model("llama")
    specs = {n: dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR) for n in ("a0", "a1", "a2")}
    model = add_adapters(model, specs).to(DEVICE)
    reference = copy.deepcopy(model)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    (pages,) = model._csgmv.tier.pages.values()
    small = pages.page_numel
    big = dict(r=12, lora_alpha=16, target_modules=ALL_LINEAR, init_lora_weights=False)
    for m in (model, reference):
        torch.manual_seed(5)
        m.add_adapter("big", LoraConfig(**big))  # (with the tier, the pages grow here: big goes to host memory)
    assert pages.page_numel > 2 * small
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(
        reference, ["a0", "a1", "a2", "big", BASE], lambda: reference(input_ids, attention_mask=mask).logits
    )
    _call(model, input_ids, mask, outs, ["a0", "a1", BASE, "a0"])
    _call(model, input_ids, mask, outs, ["big", "a0", BASE, "big"])  # big comes into the grown pages, a0 stays
    a0 = _weights(model, "a0")  # resident through the growth: its weights moved with its page
    assert {_storage(p) for p in a0} == {_storage(pages.data)}, "a0's weights still view the old pages"
    # Every slot gets small adapters again, at the places they had in the old pages (slot 0's start is the same):
    # their weights must view the new pages (views of the old storage kept from before would still fit the key).
    for names in (["a1", "big", "a1", BASE], ["a2", "a0", BASE, "a2"], ["big", "a2", "big", "a2"], ["a0", "a1"] * 2,
                  ["a2", "a0"] * 2, ["a1", "a2", BASE, "a1"]):  # fmt: skip
        _call(model, input_ids, mask, outs, names)
        for name in csgmv_stats(model)["resident"]:
            assert {_storage(p) for p in _weights(model, name)} == {_storage(pages.data)}, f"{name} after {names}"


def test_pages_rebuilt_in_place_give_new_bring_ins_views_of_the_new_memory(tiered):
    """Pages rebuilt with room for one more page keep every slot at the same offsets: adapters brought in after that
    (the same ones, at the same places) get views of the new memory, not of the old (a bring-in reuses its slot's
    views while the memory holds), and every call keeps PEFT's per-adapter results."""
    model, input_ids, mask, outs = tiered
    for names in (["a2", "a3"] * 2, ["a0", "a1"] * 2):  # every adapter brought in once before
        _call(model, input_ids, mask, outs, names)
    (pages,) = model._csgmv.tier.pages.values()
    old = _storage(pages.data)
    pages.fit(pages.count + 1, pages.page_numel)
    assert _storage(pages.data) != old
    for names in (["a2", "a3"] * 2, ["a0", "a1"] * 2, ["a2", "a3"] * 2, ["a1", "a0"] * 2):
        _call(model, input_ids, mask, outs, names)
        for name in csgmv_stats(model)["resident"]:
            assert {_storage(p) for p in _weights(model, name)} == {_storage(pages.data)}, f"{name} after {names}"


def _tables_hold_the_host_lists(model, pages) -> None:
    """Every stack's device vectors are its rows of the group's tables and hold its host lists."""
    for layer in model._csgmv.layers.values():
        stack = layer._csgmv_record.stack
        for name in ("ranks", "scalings", "a_off", "b_off"):
            vector = getattr(stack, name)
            assert vector.data_ptr() == pages.table[name][stack.row].data_ptr(), f"{name} is not its table row"
            host = torch.tensor(getattr(stack, name + "_host"), dtype=vector.dtype)
            assert torch.equal(vector[: stack.capacity].cpu(), host), f"{name} of a stack differs from its host list"


def test_a_call_that_moves_adapters_uploads_the_slot_vectors_once(tiered, monkeypatch):
    """Every layer's per-slot vectors (ranks, scalings, offsets) are rows of one table per vector: a call that moves
    adapters uploads each table once, not four vectors per layer, and each layer's row holds its values."""
    from peft_csgmv.tier import DevicePages

    model, input_ids, mask, outs = tiered
    uploads = []
    real = DevicePages.upload

    def upload(self):
        uploads.append(1)
        real(self)

    monkeypatch.setattr(DevicePages, "upload", upload)
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # two out, two in
    assert len(uploads) == 1, f"{len(uploads)} uploads in one call"
    (pages,) = model._csgmv.tier.pages.values()
    _tables_hold_the_host_lists(model, pages)
    _call(model, input_ids, mask, outs, ["a3", "a4", "a3", "a4"])  # nothing moves: nothing uploaded
    assert len(uploads) == 1


def test_adapters_of_another_dtype_through_evictions():
    """Adapters whose weights are narrower than the model (bf16 beside fp32 ones on an fp32 model: PEFT's path
    serves their rows, and their weights move on their own, outside the pages) come and go through the tier with
    stock PEFT's per-adapter numbers, in calls and in stock runs."""
    model, _ = tiny_model("llama")
    specs = {
        f"a{i}": dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR + (["embed_tokens"] if i == 1 else []))
        for i in range(5)
    }
    model = add_adapters(model, specs).to(DEVICE)
    for name, p in model.named_parameters():
        if ".a2." in name or ".a4." in name:
            p.data = p.data.to(torch.bfloat16)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*specs, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    calls = (["a2", "a0", BASE, "a2"], ["a4", "a1", "a4", "a1"], ["a3", "a2", BASE, "a3"], ["a0", "a4", "a0", BASE])
    for names in calls:
        _call(model, input_ids, mask, outs, names)
        assert set(csgmv_stats(model)["resident"]) == set(names) - {BASE}
    for name in specs:
        model.set_adapter(name)
        with torch.no_grad():
            close(model(input_ids, attention_mask=mask).logits, outs[name], f"stock {name} through the tier")


def _tiered_with_upload_spy(monkeypatch, specs: dict, resident: int):
    """``specs``' adapters on a tiny Llama, stock PEFT's logits of each (and the base model's) on a batch of 4 × 6, then
    the host tier with ``resident`` slots; every upload of the group's tables records ``(dirty, sorted dirty
    slots)`` in ``seen``. Returns ``(model, input_ids, mask, outs, pages, seen)``."""
    from peft_csgmv.tier import DevicePages

    model, _ = tiny_model("llama")
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*specs, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=resident)
    seen = []
    real = DevicePages.upload

    def upload(self):
        seen.append((self.dirty, sorted(self.dirty_slots)))
        real(self)

    monkeypatch.setattr(DevicePages, "upload", upload)
    (pages,) = model._csgmv.tier.pages.values()
    return model, input_ids, mask, outs, pages, seen


def test_moves_of_a_few_adapters_upload_only_their_columns(monkeypatch):
    """A call that moves one or two adapters among many slots updates only those slots' columns of the tables' host
    mirrors (not every slot of every stack), and the device tables then hold exactly every stack's host
    lists (ranks, scalings, offsets): stock PEFT's per-adapter logits through a run of moves, with mixed ranks and an
    adapter on the embedding (whose layers the others do not all have)."""
    names = [f"b{i}" for i in range(10)]
    specs = {
        name: dict(
            r=2 + 2 * (i % 4), lora_alpha=4 + i, target_modules=(["embed_tokens"] if i % 3 == 0 else []) + ALL_LINEAR
        )
        for i, name in enumerate(names)
    }
    model, input_ids, mask, outs, pages, seen = _tiered_with_upload_spy(monkeypatch, specs, 8)
    calls = [names[:4], names[4:8], [names[8], names[0], BASE, names[1]], [names[9], names[2], names[8], BASE],
             [names[3], names[4], names[5], names[6]], [names[7], names[0], names[9], names[1]]]  # fmt: skip
    for ids in calls:
        _call(model, input_ids, mask, outs, ids)
        assert not pages.dirty and not pages.dirty_slots
        _tables_hold_the_host_lists(model, pages)
    columns = [slots for dirty, slots in seen if not dirty]
    assert columns and all(0 < len(slots) <= 2 for slots in columns), f"no call uploaded only its columns: {seen}"


def test_moves_into_every_slot_write_the_mirrors_as_they_go(monkeypatch):
    """A call that brings an adapter into every slot uploads those columns from the tables' host mirrors, which the
    moves wrote as they set the stacks' host lists (the lists are not read again): the device tables then hold exactly
    every stack's host lists, and every row its adapter's stock PEFT result (mixed ranks, some adapters on the
    embedding, whose layers the others do not have)."""
    names = [f"c{i}" for i in range(9)]
    specs = {
        name: dict(r=2 + 2 * (i % 3), lora_alpha=3 + i, target_modules=(["embed_tokens"] if i % 2 else []) + ALL_LINEAR)
        for i, name in enumerate(names)
    }
    model, input_ids, mask, outs, pages, seen = _tiered_with_upload_spy(monkeypatch, specs, 3)
    for ids in ([*names[3:6], BASE], [*names[6:9], names[6]], [*names[:3], BASE], [names[4], BASE, *names[7:9]]):
        seen.clear()
        _call(model, input_ids, mask, outs, ids)
        assert seen == [(False, [0, 1, 2])], f"{ids}: {seen}"
        _tables_hold_the_host_lists(model, pages)


def test_adapters_on_some_layers_take_slots_from_adapters_on_all(monkeypatch):
    """A bring-in writes its slot's column of each table for all its layers at once where its layers are one run of
    the group's rows (an adapter on every linear layer), and cell by cell where they are not (attention's q / v only,
    the MLP only). Through moves that hand slots between such adapters: every row gets its adapter's stock PEFT
    result, the device tables hold exactly every stack's host lists, and each layer's rank in each slot is the slot's
    adapter's there (0 where that adapter has no part: nothing of the slot's last adapter is left)."""
    from peft_csgmv.tier import DevicePages

    kinds = [ALL_LINEAR, ["q_proj", "v_proj"], ["gate_proj", "up_proj", "down_proj"]]
    names = [f"d{i}" for i in range(6)]
    specs = {
        name: dict(r=2 + 2 * (i % 3), lora_alpha=5 + i, target_modules=kinds[i % 3]) for i, name in enumerate(names)
    }
    spans = []
    real_columns = DevicePages.columns

    def columns(self, stacks, parts):
        made = real_columns(self, stacks, parts)
        spans.append(made.span is not None)
        return made

    monkeypatch.setattr(DevicePages, "columns", columns)
    model, input_ids, mask, outs, pages, _ = _tiered_with_upload_spy(monkeypatch, specs, 2)
    state = model._csgmv
    calls = [[names[0], names[1], BASE, names[0]], [names[2], names[1], names[2], BASE], [names[3], names[5], BASE,
             names[3]], [names[4], names[0], names[4], names[4]], [names[2], names[1], BASE, names[1]]]  # fmt: skip
    for ids in calls:
        _call(model, input_ids, mask, outs, ids)
        _tables_hold_the_host_lists(model, pages)
        for layer in state.layers.values():
            stack = layer._csgmv_record.stack
            for slot, name in enumerate(state.registry.names):
                want = layer.r.get(name, 0) if name is not None and name in layer.lora_A else 0
                got = stack.ranks_host[slot]
                assert got == want, f"slot {slot} ({name}): rank {got}, not {want}"
    assert True in spans and False in spans, f"both ways of writing a column were not taken: {spans}"


@pytest.mark.parametrize("ranks", [(8,), (4, 8)], ids=["one layout", "two layouts"])
def test_page_views_are_made_when_enabling_not_in_the_calls(monkeypatch, ranks):
    """Adapters of one or two layouts (same targets, one or two ranks): every slot's page views for them are made when
    the model is enabled, so that no call makes one, even the first move into a slot; PEFT's weights of every
    resident view its slot's page where its own layout puts them, and every call and a stock call on an evicted
    adapter give stock PEFT's results."""
    from peft_csgmv.tier import DevicePages

    model, _ = tiny_model("llama")
    specs = {name: dict(r=ranks[i % len(ranks)], lora_alpha=8, target_modules=ALL_LINEAR) for i, name in
             enumerate(ADAPTERS)}  # fmt: skip
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*ADAPTERS, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    (pages,) = model._csgmv.tier.pages.values()
    assert {slot for slot, _ in pages.views} == set(range(pages.count))
    assert len({layout for _, layout in pages.views}) == len(ranks)
    made = []
    real = DevicePages.slot_views
    monkeypatch.setattr(DevicePages, "slot_views", lambda *args: made.append(args[1]) or real(*args))
    for names in (["a2", "a3", BASE, "a2"], ["a4", "a0", "a4", BASE], ["a1", BASE, "a2", "a1"], ["a3", "a0"] * 2):
        _call(model, input_ids, mask, outs, names)
        slots = model._csgmv.registry.index
        for name in csgmv_stats(model)["resident"]:
            got = {p.data_ptr() for p in _weights(model, name)}
            page = pages.data[pages.start(slots[name]) : pages.start(slots[name] + 1)]
            lo, hi = page.data_ptr(), page.data_ptr() + page.numel() * page.element_size()
            assert all(lo <= ptr < hi for ptr in got), f"{name}'s weights are not in its slot's page"
    assert made == [], f"calls made page views for slots {made}"
    hosted = next(n for n in ADAPTERS if n not in csgmv_stats(model)["resident"])
    model.set_adapter(hosted)
    with torch.no_grad():
        close(model(input_ids, attention_mask=mask).logits, outs[hosted], f"stock PEFT {hosted}, evicted")
