"""MoE expert LoRA with the host tier: ``enable_csgmv(model, max_resident_adapters=N)`` on a model whose adapters
target the experts' 3D ``gate_up_proj`` / ``down_proj`` (PEFT's ``target_parameters``). At most N adapters hold a slot
of the experts stacks (the registry's slot, the one the attention projections' pages use); the others' expert weights
wait in their host regions and are copied into a slot when a call needs them, the least recently used resident out.

Tiny two-layer Qwen3-MoE and gpt-oss models in fp32 on the CPU, five adapters of different ranks and alphas (some
with LoRA on the attention projections too), two resident. Every call's rows are checked against stock PEFT running
each row's adapter alone, captured before enabling; base rows against the base model.
"""

from __future__ import annotations

import pytest
import torch
from helpers import BASE, DEVICE, assert_adapters_matter, assert_generations_differ, greedy_kwargs, per_adapter, stitch
from test_moe import EXPERTS, close, moe_peft, prompts
from test_moe_prototype import _has_3d_experts

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = [
    pytest.mark.skipif(not _has_3d_experts(), reason="needs transformers' 3D experts and PEFT's target_parameters"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
]

RANKS = [4, 8, 2, 8, 6]
ADAPTERS = {
    f"a{i}": dict(
        r=r,
        lora_alpha=4 + 4 * i,
        use_rslora=i == 2,
        target_modules=(["q_proj", "v_proj"] if i % 2 else []),
        target_parameters=EXPERTS,
    )
    for i, r in enumerate(RANKS)
}
NAMES = list(ADAPTERS)
# Calls of three rows and more, each needing at most two adapters: every adapter comes in and goes out.
CALLS = [
    ["a0", BASE, "a1", "a0"],
    ["a2", "a3", BASE, "a2"],
    ["a1", "a1", BASE, "a1"],  # one adapter: a2 or a3 stays
    ["a4", "a0", "a4", BASE],
    ["a3", BASE, "a2", "a3"],
    ["a1", "a4", "a1", "a4"],
    [BASE, BASE, BASE, BASE],
    ["a0", "a2", BASE, "a0"],
]


def _expert_weights(pm, name) -> list[torch.Tensor]:
    from peft.tuners.lora.layer import ParamWrapper

    return [w for m in pm.modules() if isinstance(m, ParamWrapper) and name in m.lora_A
            for w in (m.lora_A[name].weight, m.lora_B[name].weight)]  # fmt: skip


def _experts_stacks(pm) -> list:
    return [s for m in pm.modules() for s in (getattr(m.__dict__.get("_csgmv_record"), "experts", None) or {}).values()]


def _views_stack(w, stacks) -> bool:
    ptr = w.untyped_storage().data_ptr()
    return any(ptr in (s.a.untyped_storage().data_ptr(), s.b.untyped_storage().data_ptr()) for s in stacks)


def _in_region(pm, name, w) -> bool:
    """Whether ``w`` lies in one of adapter ``name``'s host regions."""
    regions = [r for key, r in pm._csgmv.tier.host.regions.items() if key[0] == name]
    return w.device.type == "cpu" and any(r.data_ptr() <= w.data_ptr() < r.data_ptr() + r.nbytes for r in regions)


def _check_places(pm) -> None:
    """Every resident's expert weights, of any rank, are views of its slot, the others' wait in their host regions;
    each stack's slot ranks are its residents' (none elsewhere)."""
    state = pm._csgmv
    stacks = _experts_stacks(pm)
    resident = state.registry.index
    for name in NAMES:
        for w in _expert_weights(pm, name):
            if name in resident:
                assert w.device.type == torch.device(DEVICE).type, f"{name} is resident but its weight is not"
            else:
                assert _in_region(pm, name, w), f"{name} is not resident but its expert weight is not in host memory"
                assert not _views_stack(w, stacks)
    from peft.tuners.lora.layer import ParamWrapper

    for m in pm.modules():
        record = m.__dict__.get("_csgmv_record")
        if record is None or not record.experts:
            continue
        from peft_csgmv.moe import param_wrappers

        for param, w in param_wrappers(m)[1].items():
            stack = record.experts[param]
            assert isinstance(w, ParamWrapper) and stack.num_slots == state.max_resident
            want = [0] * stack.num_slots
            for name, slot in resident.items():
                want[slot] = w.r.get(name, 0)
            assert list(stack.ranks_host) == want and stack.ranks.tolist() == want
            for name in resident:
                if name not in w.lora_A:
                    continue
                views = _views_stack(w.lora_A[name].weight, [stack]) and _views_stack(w.lora_B[name].weight, [stack])
                assert views, f"{name} (r={w.r[name]}, stack R={stack.rank}) does not view its slot"


def _tiered(arch, backend="torch", adapters=ADAPTERS, max_resident=2, rows=4, seq=5):
    pm = moe_peft(arch, adapters)
    ids = prompts(rows, seq, seed=3)
    outs = per_adapter(pm, [*adapters, BASE], lambda: pm(ids).logits)
    assert_adapters_matter(outs)
    enable_csgmv(pm, backend=backend, max_resident_adapters=max_resident)
    return pm, ids, outs


def _call(pm, ids, outs, names):
    with torch.no_grad():
        got = pm(ids, adapter_ids=names).logits
    close(got, stitch(outs, names), f"ids {names}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_mixed_calls_through_evictions_match_peft_per_adapter(arch, backend):
    """Calls that each need two of the five adapters bring them in and move the least recently used out: every row
    is its adapter's stock PEFT result, every adapter's expert weights are where the tier says (a resident's views
    of its slot, the others' in host memory), and ``csgmv_stats`` reads what is held."""
    pm, ids, outs = _tiered(arch, backend)
    stats = csgmv_stats(pm)
    assert stats["expert_layers"] == 2 and stats["kernel_layers"] == 4 and stats["resident"] == ["a0", "a1"]
    stacks = _experts_stacks(pm)
    assert len(stacks) == 4 and all(s.num_slots == 2 and s.rank == max(RANKS) for s in stacks)
    assert stats["expert_stack_bytes"] == sum(s.nbytes for s in stacks)
    assert stats["stack_bytes"] >= stats["expert_stack_bytes"] > 0
    hosted = sum(w.nbytes for n in NAMES[2:] for w in _expert_weights(pm, n))
    assert stats["host_bytes"] >= hosted
    _check_places(pm)
    for names in CALLS:
        _call(pm, ids, outs, names)
        want = [n for n in dict.fromkeys(names) if n != BASE]
        assert set(want) <= set(csgmv_stats(pm)["resident"]) and len(csgmv_stats(pm)["resident"]) == 2
        _check_places(pm)
        stats = csgmv_stats(pm)
        shared = sum(w.nbytes for n in stats["resident"] for w in _expert_weights(pm, n) if _views_stack(w, stacks))
        assert stats["shared_bytes"] >= shared and _expert_shared(pm) == shared
    assert csgmv_stats(pm)["resident"] == ["a0", "a2"]


def _expert_shared(pm) -> int:
    return sum(s.shared_bytes for s in _experts_stacks(pm))


def test_adapters_without_expert_lora_take_slots_of_adapters_with():
    """An adapter with LoRA on the attention projections only takes the slot of one with expert LoRA: the experts
    stacks' slot is emptied (its rows run the base experts), and the other way round."""
    specs = dict(ADAPTERS, a4=dict(r=6, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    pm, ids, outs = _tiered("qwen3_moe", adapters=specs)
    for names in (["a4", "a3", BASE, "a4"], ["a1", "a2", "a1", "a2"], ["a4", "a0", "a4", "a0"], ["a2", "a4"] * 2):
        _call(pm, ids, outs, names)
        _check_places(pm)  # (a4's slot: rank 0 in every experts stack)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_generate_cycles_through_every_adapter(arch):
    """Greedy generate calls, each with two adapters and base rows, cycling through all five (beams in one):
    the tokens of each row are its adapter's stock PEFT generation."""
    pm = moe_peft(arch, ADAPTERS)
    ids = prompts(3, 4, seed=1)
    kw = greedy_kwargs(4)
    beams = greedy_kwargs(3, num_beams=2)
    calls = [["a0", "a1", BASE], ["a2", BASE, "a3"], ["a4", "a4", "a0"], [BASE, "a1", "a2"], ["a3", "a4", "a3"]]
    expected = per_adapter(pm, [*NAMES, BASE], lambda: pm.generate(input_ids=ids, **kw))
    assert_generations_differ(expected)
    expected_beams = per_adapter(pm, ["a2", "a3", BASE], lambda: pm.generate(input_ids=ids, **beams))
    enable_csgmv(pm, backend="torch", max_resident_adapters=2)
    for names in calls:
        got = pm.generate(input_ids=ids, adapter_ids=names, **kw)
        assert torch.equal(got, stitch(expected, names)), names
    names = ["a2", "a3", BASE]
    assert torch.equal(pm.generate(input_ids=ids, adapter_ids=names, **beams), stitch(expected_beams, names))
    _check_places(pm)


def test_call_needing_more_adapters_than_fit_is_refused_before_anything_moves():
    pm, ids, outs = _tiered("qwen3_moe")
    _call(pm, ids, outs, ["a3", "a2", BASE, "a3"])
    before = csgmv_stats(pm)["resident"]
    stacks = _experts_stacks(pm)
    held = [(s.a.clone(), s.b.clone(), s.ranks.clone(), s.ranks_host) for s in stacks]
    places = {n: [w.data_ptr() for w in _expert_weights(pm, n)] for n in NAMES}
    with pytest.raises(ValueError, match=r"need 3 distinct adapters, more than the 2 that fit on the device"):
        pm(ids, adapter_ids=["a0", "a1", "a4", BASE])
    assert active_calls() == 0 and csgmv_stats(pm)["resident"] == before, "a refused call moved adapters"
    assert _experts_stacks(pm) == stacks
    for s, (a, b, ranks, ranks_host) in zip(stacks, held):
        assert torch.equal(s.a, a) and torch.equal(s.b, b) and torch.equal(s.ranks, ranks)
        assert s.ranks_host == ranks_host
    assert places == {n: [w.data_ptr() for w in _expert_weights(pm, n)] for n in NAMES}
    _call(pm, ids, outs, ["a0", "a1", BASE, "a0"])


@pytest.mark.parametrize("nth", [1, 3])
def test_failed_bring_in_leaves_nothing_half_moved(nth, monkeypatch):
    """A bring-in that fails part way through the experts stacks (an injected error at the nth slot set: part of an
    adapter's expert weights in their slots, or one adapter in and the next failing) is undone before the error
    reaches the caller: the incoming adapters are not resident, their expert weights are back in host memory, no
    experts slot keeps a rank, and the next calls give every row its stock PEFT result."""
    from peft_csgmv import moe

    experts_only = {n: {**spec, "target_modules": []} for n, spec in ADAPTERS.items()}
    pm, ids, outs = _tiered("qwen3_moe", adapters=experts_only)
    real = moe.MoeStack.set_slot
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == nth:
            raise RuntimeError("out of memory (injected)")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(moe.MoeStack, "set_slot", failing)
    with pytest.raises(RuntimeError, match="injected"), torch.no_grad():
        pm(ids, adapter_ids=["a2", "a3", BASE, "a2"])
    monkeypatch.setattr(moe.MoeStack, "set_slot", real)
    resident = csgmv_stats(pm)["resident"]
    assert active_calls() == 0 and "a2" not in resident and "a3" not in resident
    _check_places(pm)
    for names in (["a2", "a3", BASE, "a2"], ["a0", "a2", "a0", BASE], ["a3", "a1", BASE, "a3"]):
        _call(pm, ids, outs, names)
        _check_places(pm)


def test_disable_csgmv_gives_peft_its_weights_back():
    """After calls that moved every adapter, ``disable_csgmv``: PEFT's forward for each adapter equals its forward
    before enabling (the same values, the weights on the model's device, owning their memory: views of neither the
    stacks nor the host regions), and PEFT refuses mixed batches again."""
    from peft.tuners.lora.layer import ParamWrapper

    pm, ids, outs = _tiered("gpt_oss")
    for names in CALLS[:4]:
        _call(pm, ids, outs, names)
    stacks = _experts_stacks(pm)
    regions = list(pm._csgmv.tier.host.slabs)
    disable_csgmv(pm)
    assert all(type(m) is ParamWrapper for m in pm.modules() if isinstance(m, ParamWrapper))
    for name in NAMES:
        for w in _expert_weights(pm, name):
            assert w.device.type == torch.device(DEVICE).type and not _views_stack(w, stacks)
            ptr = w.untyped_storage().data_ptr()
            assert not any(r.untyped_storage().data_ptr() == ptr for r in regions), f"{name} views host memory"
    got = per_adapter(pm, [*NAMES, BASE], lambda: pm(ids).logits)
    for name in [*NAMES, BASE]:
        assert torch.equal(got[name], outs[name]), name
    with torch.no_grad(), pytest.raises(ValueError, match="mixed"):
        pm(ids, adapter_names=["a0", "a1", BASE, "a0"])


def test_stock_calls_and_edits_through_evictions():
    """PEFT's own forward on an adapter waiting in host memory (it comes in first), and an in-place edit of a
    resident's expert weight (a view of its slot), kept through its eviction and bringing back."""
    pm, ids, outs = _tiered("qwen3_moe")
    pm.set_adapter("a3")  # in host memory
    with torch.no_grad():
        close(pm(ids).logits, outs["a3"], "stock call on an adapter that waited in host memory")
    assert "a3" in csgmv_stats(pm)["resident"]
    _check_places(pm)
    stacks = _experts_stacks(pm)
    with torch.no_grad():
        for w in _expert_weights(pm, "a3")[1::2]:  # lora_B of a rank-8 adapter: a view of its slot
            assert _views_stack(w, stacks)
            w.mul_(-0.5)
    pm.set_adapter("a0")
    edited = per_adapter(pm, ["a3"], lambda: pm(ids).logits)  # PEFT's forward with the edited weights
    assert not torch.allclose(edited["a3"], outs["a3"])
    outs = {**outs, **edited}
    _call(pm, ids, outs, ["a1", "a2", BASE, "a1"])  # a3 goes out (its edit with it) ...
    assert "a3" not in csgmv_stats(pm)["resident"]
    _check_places(pm)
    _call(pm, ids, outs, ["a3", "a4", "a3", BASE])  # ... and comes back
    disable_csgmv(pm)
    close(per_adapter(pm, ["a3"], lambda: pm(ids).logits)["a3"], edited["a3"], "the edit after disable")


def test_adapters_loaded_and_deleted_after_enabling():
    """An adapter added after enabling beyond ``max_resident_adapters`` goes to host memory at once (its expert
    weights too); a wider one widens the stacks; deleting a resident frees its slot for a waiting one."""
    from peft import LoraConfig

    specs = {n: ADAPTERS[n] for n in ("a0", "a1", "a2")}
    pm, ids, outs = _tiered("gpt_oss", adapters=specs)
    torch.manual_seed(40)
    wide = dict(r=12, lora_alpha=6, target_modules=["q_proj"], target_parameters=EXPERTS)
    pm.add_adapter("a5", LoraConfig(init_lora_weights=False, **wide))
    assert "a5" not in csgmv_stats(pm)["resident"]
    assert all(_in_region(pm, "a5", w) for w in _expert_weights(pm, "a5"))
    assert all(s.rank == 12 for s in _experts_stacks(pm))
    pm.set_adapter("a0")
    added = per_adapter(pm, ["a5"], lambda: pm(ids).logits)
    outs = {**outs, **added}
    _call(pm, ids, outs, ["a5", "a2", BASE, "a5"])
    _call(pm, ids, outs, ["a0", "a1", "a0", BASE])
    pm.delete_adapter("a1")
    _call(pm, ids, outs, ["a5", "a0", "a5", BASE])
    _call(pm, ids, outs, ["a2", "a5", BASE, "a2"])
    global NAMES
    saved, NAMES = NAMES, ["a0", "a2", "a5"]
    try:
        _check_places(pm)
    finally:
        NAMES = saved


def test_continuous_batching_admits_within_the_resident_adapters():
    """transformers' continuous batching over expert LoRA with the host tier: five adapters' requests (and base
    ones), two resident at most; the router starts a waiting request only while its adapter fits beside the running
    ones' (``Router.admit``), and every request's tokens are its own stock PEFT run's."""
    from peft_csgmv.continuous import continuous_batching_available

    if not continuous_batching_available():
        pytest.skip("this transformers has no continuous batching")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pm = moe_peft("qwen3_moe", ADAPTERS)
    pm.get_base_model().generation_config.eos_token_id = None
    rows = prompts(7, 6, seed=2).tolist()
    rows[1], rows[3] = rows[1][:3], rows[3][:5]  # (uneven prompts)
    names = ["a0", "a1", BASE, "a2", "a3", "a4", "a1"]
    kw = greedy_kwargs(4, eos_token_id=None)
    want = []
    for row, name in zip(rows, names):
        ids = torch.tensor([row], device=DEVICE)
        want.append(per_adapter(pm, [name], lambda ids=ids: pm.generate(input_ids=ids, **kw))[name][0, len(row) :])
    assert len({tuple(w.tolist()) for w in want}) > 3, "the adapters change nothing: the test would prove nothing"
    enable_csgmv(pm, backend="torch", max_resident_adapters=2)
    most = []
    from peft_csgmv import continuous

    real_admit = continuous.Router.admit

    def admit(self, scheduler, candidates, processor=None):
        admitted = real_admit(self, scheduler, candidates, processor)
        running = {self.name_of(r) for r in list(scheduler.active_requests)}
        running |= {self.name_of(c.request_id) for c in admitted}
        most.append(len(running - {None, continuous.STOCK}))
        return admitted

    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=8)
    ids = [None if n == BASE else n for n in names]
    try:
        continuous.Router.admit = admit
        out = pm.generate_batch(rows, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
    finally:
        continuous.Router.admit = real_admit
    assert most and max(most) <= 2, most
    assert set(csgmv_stats(pm)["resident"]) <= set(NAMES) and len(csgmv_stats(pm)["resident"]) == 2
    disable_csgmv(pm)
    assert [out[f"req_{i}"].generated_tokens for i in range(len(rows))] == [w.tolist() for w in want]


def test_merges_of_adapters_in_host_memory():
    """PEFT's merges of an adapter whose expert weights wait in host memory (``merge_adapter``, ``unmerge_adapter``,
    ``merge_and_unload``) read them on the experts' device (lent for the call) and give PEFT's results; the lending is
    PEFT's own ``get_delta_weight`` again after ``disable_csgmv``."""
    from peft.tuners.lora.layer import ParamWrapper

    pm, ids, outs = _tiered("qwen3_moe")
    assert "a4" not in csgmv_stats(pm)["resident"]
    assert all(_in_region(pm, "a4", w) for w in _expert_weights(pm, "a4"))
    with torch.no_grad():
        before = pm(ids).logits  # (the active adapter, a0)
    pm.merge_adapter(["a4"])
    pm.unmerge_adapter()
    with torch.no_grad():
        close(pm(ids).logits, before, "after a merge and unmerge of a4")
    assert all(_in_region(pm, "a4", w) for w in _expert_weights(pm, "a4"))  # lent, not moved
    _call(pm, ids, outs, ["a4", "a3", BASE, "a4"])
    disable_csgmv(pm)
    assert not any("get_delta_weight" in m.__dict__ for m in pm.modules() if isinstance(m, ParamWrapper))
    pm.set_adapter("a2")
    merged = pm.merge_and_unload()
    with torch.no_grad():
        close(merged(ids).logits, outs["a2"], "merge_and_unload after disable")
