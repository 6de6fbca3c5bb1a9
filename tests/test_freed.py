"""A model csgmv patched is freed as soon as its last reference goes, as a stock PEFT model is: ``del model`` gives
its memory back at once (on a GPU: before the next model loads), not whenever Python's cyclic collector next runs.
Each case runs with the collector off and checks that the model, every parameter it had and csgmv's stacks died
with the last reference; stock PEFT's run of the same calls is checked first, so a case where stock PEFT itself
lingers (compiled code keeps its models until the collector runs) is not claimed."""

from __future__ import annotations

import gc
import inspect
import weakref

import pytest
import torch
from helpers import DEVICE, make, make_batch

from peft_csgmv import adapter_ids_scope, disable_csgmv, enable_csgmv

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
IDS = ["a0", None, "a1", "a0"]


def _calls(model, ids) -> None:
    """A forward and a ``generate``, with ``ids`` (``None``: stock PEFT's calls, adapter ``a0`` active)."""
    input_ids, mask = make_batch(len(IDS), 5)
    input_ids, mask = input_ids.to(DEVICE), mask.to(DEVICE)
    extra = {} if ids is None else {"adapter_ids": ids}
    with torch.no_grad():
        model(input_ids=input_ids, attention_mask=mask, **extra)
        model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                       **extra)  # fmt: skip


def _enabled(model):
    enable_csgmv(model)
    _calls(model, IDS)


def _tier(model):
    """The host tier, with moves both ways, a merge and an ``add_weighted_adapter`` of an adapter in host memory."""
    enable_csgmv(model, max_resident_adapters=2)
    _calls(model, IDS)
    _calls(model, ["a2", "a0", None, "a2"])  # a1 leaves for a2
    model.set_adapter("a1")
    model.merge_adapter()
    model.unmerge_adapter()
    model.add_weighted_adapter(["a1", "a2"], [0.5, 0.5], "mix", combination_type="cat")
    with adapter_ids_scope(model, ["mix"]):
        pass


def _disabled(model):
    _enabled(model)
    disable_csgmv(model)
    _calls(model, None)


def _peft_path(model):
    """A module csgmv serves through PEFT's path (``modules_to_save``), beside the kernel layers."""
    enable_csgmv(model)
    _calls(model, IDS)


SCENARIOS = {"enabled": _enabled, "host tier": _tier, "disabled": _disabled, "peft path": _peft_path}


def _build(scenario: str):
    specs = {
        name: dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]) for name in ("a0", "a1", "a2")
    }
    if scenario == "peft path":
        specs["a1"]["modules_to_save"] = ["lm_head"]
    return make("llama", specs=specs).to(DEVICE)


def _dropped(scenario: str, csgmv: bool) -> list[weakref.ref]:
    """Weak references to the model of ``scenario``, its parameters and (``csgmv``) its stacks' tensors, after the
    scenario's calls (stock PEFT's forward and generate where not ``csgmv``) and the last reference dropped."""
    model = _build(scenario)
    refs = [weakref.ref(model), *(weakref.ref(p) for p in model.parameters())]
    if csgmv:
        SCENARIOS[scenario](model)
        records = [m.__dict__.get("_csgmv_record") for m in model.modules()]
        stacks = [r.stack for r in records if r is not None and r.stack is not None]
        assert stacks or scenario == "disabled", "no kernel layer: the case proves nothing about csgmv's stacks"
        refs += [weakref.ref(t) for s in stacks for t in (s.data, s.ranks, s.a_off)]
        refs += [weakref.ref(s) for s in stacks]
        del stacks
    else:
        model.set_adapter("a0")
        _calls(model, None)
    del model
    return refs


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_a_dropped_model_is_freed_at_once(scenario):
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        stock = [r for r in _dropped(scenario, csgmv=False) if r() is not None]
        if stock:  # (then csgmv has nothing to be held to here)
            pytest.skip(f"stock PEFT's model outlived its last reference here too ({len(stock)} objects)")
        refs = _dropped(scenario, csgmv=True)
        alive = [r() for r in refs if r() is not None]
        assert not alive, (
            f"{len(alive)} of {len(refs)} objects (the model, its parameters, csgmv's stacks) outlived the model's "
            f"last reference, held by reference cycles until the collector runs; first: {type(alive[0]).__name__}"
        )
    finally:
        if enabled:
            gc.enable()
        gc.collect()


def test_methods_set_on_instances_read_as_bound_methods():
    """The methods csgmv sets on instances (see ``layers.WeakMethod``: a layer's merges, the walks, the LoRA model's
    ``add_weighted_adapter``) call, introspect and name as the bound methods they stand for; the model's ``forward``
    and ``generate`` come from a subclass of its class of the same name."""
    model = _build("enabled")
    cls = type(model)
    enable_csgmv(model, max_resident_adapters=2)
    assert type(model) is not cls and isinstance(model, cls) and type(model).__name__ == cls.__name__
    assert model.forward.__self__ is model and "forward" not in model.__dict__
    assert inspect.signature(model.named_parameters) == inspect.signature(torch.nn.Module().named_parameters)
    layer = next(m for m in model.modules() if getattr(m.__dict__.get("_csgmv_record"), "stack", None) is not None)
    bound = type(layer).get_delta_weight.__get__(layer)
    assert layer.get_delta_weight.__self__ is layer and layer.get_delta_weight.__name__ == "get_delta_weight"
    assert inspect.signature(layer.get_delta_weight) == inspect.signature(bound)
    assert torch.equal(layer.get_delta_weight("a0"), bound("a0"))
    weighted = model.base_model.__dict__["add_weighted_adapter"]
    assert weighted.__self__ is model.base_model
    assert list(inspect.signature(weighted).parameters)[:3] == ["adapters", "weights", "adapter_name"]
    disable_csgmv(model)
    assert type(model) is cls and "get_delta_weight" not in layer.__dict__


def test_a_model_with_a_forward_of_its_own_keeps_it():
    """A model with an instance-level ``forward`` (accelerate's ``prepare`` sets one) gets csgmv's over it, which
    calls it; ``disable_csgmv`` gives it back. Calls with ids give stock PEFT's per-adapter results."""
    import types

    from helpers import per_adapter, stitch

    model = _build("enabled")
    calls = []

    def own_forward(self, *args, **kwargs):
        calls.append(kwargs.get("adapter_ids"))
        return type(self).forward(self, *args, **kwargs)

    own = model.__dict__["forward"] = types.MethodType(own_forward, model)
    input_ids, mask = make_batch(len(IDS), 5)
    input_ids, mask = input_ids.to(DEVICE), mask.to(DEVICE)
    names = [name or "__base__" for name in IDS]
    expected = stitch(per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits), names)
    classes = {name: type(m) for name, m in model.named_modules()}
    enable_csgmv(model)
    assert type(model) is classes[""] and model.__dict__["forward"] is not own
    calls.clear()
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=IDS).logits
    assert calls == [None], "the model's own forward did not run (once, without the ids csgmv took)"
    from helpers import close

    close(got, expected, "a csgmv call through the model's own forward")
    disable_csgmv(model)
    assert model.__dict__["forward"] is own and "generate" not in model.__dict__
    assert {name: type(m) for name, m in model.named_modules()} == classes
