"""The call's mapping: the driver prepares the plan of every step shape a call's arguments tell before its layers run;
layers only read it (``csgmv_stats(model)["unforeseen_plans"]`` counts the plans a layer had to make)."""

from __future__ import annotations

import pytest
import torch
from helpers import BASE, DEVICE, close, greedy_kwargs, make, make_batch, per_adapter, stitch

from peft_csgmv import adapter_ids_scope, csgmv_stats, disable_csgmv, enable_csgmv

NAMES = ["a0", BASE, "a1", "a0"]


@pytest.fixture
def enabled():
    model = make("llama", embedding=True)  # (the embedding's LoRA reads the same plans as the linear layers')
    enable_csgmv(model, backend="torch")
    yield model
    disable_csgmv(model)


def test_forward_plans_are_prepared_by_the_driver(enabled):
    """A forward, with and without ``logits_to_keep``: every plan its layers read was prepared when the call opened,
    and the logits are each adapter's own run's."""
    model = enabled
    input_ids, mask = make_batch(4, 6)
    with torch.no_grad():
        full = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
        kept = model(input_ids, attention_mask=mask, adapter_ids=NAMES, logits_to_keep=2).logits
    assert csgmv_stats(model)["unforeseen_plans"] == 0
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    close(full, stitch(outs, NAMES), "forward")
    close(kept, stitch(outs, NAMES)[:, -2:], "logits_to_keep=2")


@pytest.mark.parametrize("extra", [{}, {"num_beams": 2}, {"num_return_sequences": 2, "do_sample": True}])
def test_generate_plans_are_prepared_by_the_driver(enabled, extra):
    """``generate`` (greedy, beams, returned sequences): its prefill and decode steps' plans were prepared when the
    call opened, on the rows transformers expands them to."""
    model = enabled
    input_ids, mask = make_batch(4, 5)
    kwargs = greedy_kwargs(3)
    kwargs.update(extra)
    with torch.no_grad():
        model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kwargs)
    assert csgmv_stats(model)["unforeseen_plans"] == 0


def test_a_shape_no_driver_foresaw_is_made_on_first_read(enabled):
    """Layers called directly inside ``adapter_ids_scope`` (no call arguments to tell their shape): the plan is made
    on the first layer's read, counted once, and the result is still PEFT's."""
    model = enabled
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(4, 3, layer.in_features, device=DEVICE)
    with torch.no_grad():
        with adapter_ids_scope(model, NAMES):
            got = layer(x)
            again = layer(x)
        outs = per_adapter(model, NAMES, lambda: layer(x))
    assert csgmv_stats(model)["unforeseen_plans"] == 1
    close(got, stitch(outs, NAMES), "direct layer call")
    assert torch.equal(got, again)
