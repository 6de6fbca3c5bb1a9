"""A model spread over devices (accelerate's ``device_map``): every layer's stack lives on that layer's device, a call's
plan reaches each device once (one build and copy per device per call, not one per layer), and the results are stock
PEFT's. The plan bookkeeping is checked on the CPU with a second, fake device (``meta``); the model itself on two GPUs
where there are two (skipped otherwise)."""

from __future__ import annotations

import pytest
import torch
from helpers import ALL_LINEAR, BASE, add_adapters, close, greedy_kwargs, per_adapter, stitch, tiny_model

from peft_csgmv import enable_csgmv
from peft_csgmv.executor import Executor
from peft_csgmv.mapping import Mapping
from peft_csgmv.plan import BatchPlan

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
NAMES = ["a0", BASE, "a1", "a0", "a1", BASE]


@pytest.fixture
def builds(monkeypatch):
    """Every BatchPlan.build call's device."""
    calls = []
    build = BatchPlan.build.__func__

    def counting(cls, row_slots, tokens_per_row, device, *args, **kwargs):
        calls.append(torch.device(device))
        return build(cls, row_slots, tokens_per_row, device, *args, **kwargs)

    monkeypatch.setattr(BatchPlan, "build", classmethod(counting))
    return calls


def test_a_call_builds_one_plan_per_device(builds):
    """Layers on two devices ask the executor for their plan, many times each: it is built once per device, and a
    later call with the same ids builds nothing."""
    executor = Executor("torch", lambda layer: None)
    devices = [torch.device("cpu"), torch.device("meta")]
    for _ in range(2):
        executor.begin(Mapping(row_slots=(0, -1, 1, 0), names=("a0", BASE, "a1", "a0"), arg_name="adapter_ids"))
        try:
            runs = {d: {id(executor.mapping.plan(4, 3, d)) for _layer in range(5)} for d in devices}
        finally:
            executor.end()
        assert all(len(r) == 1 for r in runs.values()), "layers of one device got different plans"
    assert builds == devices, f"plans built on {builds}"
    assert {key[3] for key in executor.plans} == set(devices)  # the plan cache (by slots, repeat, tokens, device)


def _split_model(dtype=torch.float32):
    """A tiny Llama with its two decoder layers on two GPUs (accelerate's dispatch, as ``device_map`` loads it), and
    two adapters on all linear layers."""
    from accelerate import dispatch_model

    model, _ = tiny_model("llama", dtype=dtype)
    device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
                  "model.rotary_emb": 1, "lm_head": 1}  # fmt: skip
    model = dispatch_model(model, device_map=device_map)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", *ALL_LINEAR]),
        "a1": dict(r=8, lora_alpha=4, target_modules=ALL_LINEAR),
    }
    return add_adapters(model, specs)


def _prompts(seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (len(NAMES), seq), generator=g).to("cuda:0")
    return input_ids, torch.ones_like(input_ids)


@two_gpus
def test_device_map_over_two_gpus_matches_stock_peft(builds):
    model = _split_model()
    input_ids, mask = _prompts(7, seed=0)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model)
    stacks = {n: layer._csgmv_record.stack.device for n, layer in model._csgmv.layers.items()}
    assert {d.index for d in stacks.values()} == {0, 1}
    for name, device in stacks.items():
        assert device == torch.device("cuda", 1 if "layers.1" in name else 0), f"{name}'s stack on {device}"
    builds.clear()
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
    close(got, stitch(outs, NAMES), "device_map over two GPUs")
    assert sorted(d.index for d in builds) == [0, 1], f"plans built on {builds}: one per device per call"


@two_gpus
def test_device_map_generate_over_two_gpus(builds):
    model = _split_model()
    input_ids, mask = _prompts(5, seed=1)
    kw = greedy_kwargs(6)
    outs = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    enable_csgmv(model)
    builds.clear()
    with torch.no_grad():
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
    assert torch.equal(got, stitch(outs, NAMES))
    # One plan per device for the prompt and one per device for the decode steps (cached across them).
    assert sorted(d.index for d in builds) == [0, 0, 1, 1], f"plans built on {builds}"


@two_gpus
def test_host_tier_with_device_map_over_two_gpus():
    """The host tier on a model spread over two GPUs: each GPU holds pages of its own layers, one adapter resident
    (``max_resident_adapters=1``), and calls that move adapters in and out on both GPUs give stock PEFT's results."""
    model = _split_model()
    input_ids, mask = _prompts(7, seed=2)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, max_resident_adapters=1)
    assert {pages.device.index for pages in model._csgmv.tier.pages.values()} == {0, 1}
    for names in (["a0", BASE, "a0", BASE, "a0", BASE], ["a1", BASE, "a1", "a1", BASE, BASE], ["a0"] * 6):
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        close(got, stitch(outs, names), f"device_map over two GPUs, host tier, ids {names}")
    with pytest.raises(ValueError, match="distinct adapters"):
        model(input_ids, attention_mask=mask, adapter_ids=NAMES)


@two_gpus
def test_device_map_static_cache_over_two_gpus_as_stock_peft():
    """transformers' static cache (compiled decode) on a model spread over two GPUs: where stock PEFT generates with
    it, csgmv's mixed batch gives each row its adapter's tokens; where transformers refuses the placement, csgmv raises
    what stock PEFT raises."""
    model = _split_model()
    input_ids, mask = _prompts(5, seed=3)
    kw = greedy_kwargs(4, cache_implementation="static")
    try:
        outs = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
        stock_error = None
    except Exception as exc:  # noqa: BLE001 (what stock PEFT raises is the expectation)
        stock_error = exc
    enable_csgmv(model)
    if stock_error is not None:
        with pytest.raises(type(stock_error)):
            model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
        return
    with torch.no_grad():
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
    assert torch.equal(got, stitch(outs, NAMES))
