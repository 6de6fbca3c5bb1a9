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


def test_packed_steps_rewrite_one_plan_at_fixed_addresses():
    """Packed steps (continuous batching) of the same size and as many distinct adapters share one plan at fixed
    addresses, rewritten per step (so launches bound on it stay bound): each step's live segments are its own plan's,
    the rest empty; a step with more distinct adapters gets a plan sized for them; an all-base step gets no kernels."""
    from peft_csgmv.mapping import PlanCache
    from peft_csgmv.plan import BatchPlan

    cache = PlanCache()
    steps = [(0, 0, -1, 1, 1, 1, 0, -1), (1, -1, -1, 0, 0, 1, 1, 1), (2, 2, 2, -1, 0, 1, 1, 0)]
    runs = [cache.run_for_tokens(slots, "cpu") for slots in steps[:1]]
    for slots in steps:
        run = cache.run_for_tokens(slots, "cpu")
        want = BatchPlan.from_token_slots(slots, "cpu", chunk_size=run.plan.chunk_size)
        live = want.num_segments
        assert run.plan.num_segments >= live
        assert torch.equal(run.plan.permutation, want.permutation)
        indptr = run.plan.seg_indptr.tolist()
        assert indptr[: live + 1] == want.seg_indptr.tolist() and set(indptr[live:]) == {indptr[live]}
        assert run.plan.seg_slot.tolist()[:live] == want.seg_slot.tolist()
        assert run.plan.runs == want.runs
        runs.append(run)
    assert runs[0] is runs[1] is runs[2], "two steps of two adapters: one plan"
    assert runs[0].plan.permutation.data_ptr() == runs[2].plan.permutation.data_ptr()
    assert runs[3] is not runs[0], "three adapters: a plan sized for four runs"
    assert cache.run_for_tokens((-1,) * 8, "cpu").plan.is_empty


def test_token_slots_for_flattened_rows_beams_alora_and_packed_steps():
    """A MoE layer's experts see a step's rows × tokens flattened: each id's slot over its consecutive tokens (its
    rows: beams, returned sequences), an aLoRA row's adapter on its last tokens only, a packed step's slots padded
    with base tokens; one tensor per size and device, shared by the step's layers."""
    from peft_csgmv.mapping import Mapping

    m = Mapping(row_slots=(0, -1, 1), names=("a0", BASE, "a1"), arg_name="adapter_ids")
    assert m.token_slots_for(6) == (0, 0, -1, -1, 1, 1)  # 3 rows × 2 tokens, or 6 beams × 1 token: the same
    assert m.token_slots_for(3) == (0, -1, 1)
    t = m.token_slots_for(12, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [0] * 4 + [-1] * 4 + [1] * 4
    assert m.token_slots_for(12, torch.device("cpu")) is t
    with pytest.raises(ValueError, match="whole multiple"):
        m.token_slots_for(7)
    alora = Mapping(row_slots=(0, 1), names=("a0", "al"), arg_name="adapter_ids", row_keep=(None, 2))
    assert alora.token_slots_for(8) == (0, 0, 0, 0, -1, -1, 1, 1)
    packed = Mapping(row_slots=(), names=(), arg_name="adapter_ids", token_slots=(1, 1, -1, 0))
    assert packed.token_slots_for(6) == (1, 1, -1, 0, -1, -1)
