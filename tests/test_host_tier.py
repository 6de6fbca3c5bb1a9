"""The host tier: ``enable_csgmv(model, max_resident_adapters=N)`` keeps at most N adapters in slots on the device; the
others' kernel-layer weights wait in host memory (pinned where CUDA is) and come into a slot when a call needs them,
the least recently used resident out. Checked here on the bookkeeping (which adapters are resident, in what order),
on results against stock PEFT through evictions, on a call that needs more adapters than fit (refused before
anything runs or moves), and on stock PEFT calls with an evicted adapter active."""

from __future__ import annotations

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
    assert csgmv_stats(model)["stack_bytes"] == csgmv_stats(model)["shared_bytes"] + sum(
        layer._csgmv_stack.nbytes - layer._csgmv_stack.shared_bytes for layer in model._csgmv.layers.values()
    )


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
    """Host memory comes out of slabs (the pinned allocator would round each adapter's buffer up to a power of two);
    an adapter's region is the same memory every time, and a deleted adapter's region goes to the next one of its
    size."""
    from peft_csgmv.slots import HostArena

    arena = HostArena(pin=False, slab_bytes=4096)
    a = arena.region("a", torch.float32, 300)  # 1200 bytes, 1216 with alignment
    b = arena.region("b", torch.bfloat16, 300)
    c = arena.region("c", torch.float32, 300)
    assert len(arena.slabs) == 1 and arena.nbytes == 4096, "three regions fit one slab"
    assert a.data_ptr() % 64 == 0 and b.data_ptr() % 64 == 0 and c.data_ptr() % 64 == 0
    assert arena.region("a", torch.float32, 300).data_ptr() == a.data_ptr(), "an adapter keeps its region"
    a.fill_(1.0)
    c.fill_(3.0)
    assert torch.equal(a, torch.ones(300)) and torch.equal(c, torch.full((300,), 3.0)), "regions overlap"
    d = arena.region("d", torch.float32, 300)  # no room left: a new slab
    assert len(arena.slabs) == 2 and d.data_ptr() not in (a.data_ptr(), c.data_ptr())
    arena.forget("a")
    e = arena.region("e", torch.float32, 300)  # a's size: a's memory
    assert e.data_ptr() == a.data_ptr() and len(arena.slabs) == 2
    big = arena.region("big", torch.float32, 5000)  # larger than a slab: a slab of its own
    assert big.numel() == 5000 and len(arena.slabs) == 3


def test_every_adapter_holds_its_host_region_from_the_start(tiered):
    """Residents get their host regions when the model is enabled (pinning host memory is slow: no call pays for it):
    evictions copy into those regions, and calls that move adapters both ways allocate no host memory."""
    model, input_ids, mask, outs = tiered
    host = model._csgmv.host
    assert {name for name, _ in host.regions} == set(ADAPTERS)
    reserved = {key: region.data_ptr() for key, region in host.regions.items()}
    slabs = host.nbytes
    _call(model, input_ids, mask, outs, ["a3", "a4", BASE, "a3"])  # a0 and a1 leave for the regions they hold
    _call(model, input_ids, mask, outs, ["a0", "a2", BASE, "a0"])  # a0 comes back, a2 in; a3 and a4 leave
    assert host.nbytes == slabs, "a call allocated host memory"
    assert {key: region.data_ptr() for key, region in host.regions.items()} == reserved
    region = {(name, r.dtype): r for (name, _), r in host.regions.items()}
    for p in _weights(model, "a3"):
        r = region["a3", p.dtype]
        assert r.data_ptr() <= p.data_ptr() < r.data_ptr() + r.numel() * r.element_size(), "a3 left for its region"


def test_deleted_adapter_frees_its_host_region(tiered):
    model, input_ids, mask, outs = tiered
    host = model._csgmv.host
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


@pytest.mark.parametrize("where", ["set_slot", "run_pending", "settle"])
def test_failed_bring_in_leaves_no_stale_slot(where, monkeypatch):
    """A bring-in that fails part way (here: an injected error while filling slots, while running the batched copies,
    or after them) leaves no slot claiming weights it was not given: the next calls, with the same adapters and
    others, give every row its adapter's stock PEFT result."""
    import peft_csgmv.model as csgmv_model
    import peft_csgmv.slots as csgmv_slots

    model, _ = tiny_model("llama")
    specs = {
        n: dict(r=4 + 2 * i, lora_alpha=8, target_modules=ALL_LINEAR) for i, n in enumerate(["a0", "a1", "a2", "a3"])
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(4, 6)
    outs = per_adapter(model, [*specs, BASE], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    calls = []
    owner, attr = {
        "set_slot": (csgmv_slots.LoraStack, "set_slot"),
        "run_pending": (csgmv_model, "run_pending"),
        "settle": (csgmv_model, "_settle"),
    }[where]
    real = getattr(owner, attr)

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5 or where != "set_slot":  # one call each of the others per bring-in
            raise RuntimeError("out of memory (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, attr, failing)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        model(input_ids, attention_mask=mask, adapter_ids=["a2", "a3", BASE, "a2"])
    monkeypatch.setattr(owner, attr, real)
    assert active_calls() == 0 and "a2" not in csgmv_stats(model)["resident"]
    for names in (["a2", "a3", BASE, "a2"], ["a0", "a2", "a0", BASE], ["a3", "a1", BASE, "a3"]):
        _call(model, input_ids, mask, outs, names)


def test_packed_views_are_the_slices_they_replace():
    """``_packed_views`` (the views a moving adapter's weights take of its host region or of its staging copy on the
    GPU): each weight's shape, contiguous, packed one after another or at given element offsets, on a buffer that is
    itself a view at an offset of a larger one; writes through them land in the buffer."""
    from peft_csgmv.model import _packed_views

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
