"""One copy of every adapter: where the stack's dtype and device are the adapter's, PEFT's ``lora_A`` / ``lora_B``
weights become views into csgmv's stacks. Checked by storage identity and by counting the bytes of every live
tensor, and by what must keep working on those views: in-place edits seen by the next call without restacking,
stock PEFT calls, merge / unmerge, ``save_pretrained``, ``delete_adapter``, ``disable_csgmv`` (PEFT owns its
memory again)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ALL_LINEAR,
    BASE,
    DEVICE,
    add_adapters,
    close,
    interleaved,
    make,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)
from peft import PeftModel

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
NAMES = ["a0", BASE, "a1", "a2", "a0"]


def _model(ranks=(8, 8, 8)):
    model, _ = tiny_model("llama")
    specs = {
        f"a{i}": dict(r=r, lora_alpha=2 * r, target_modules=["embed_tokens", *ALL_LINEAR]) for i, r in enumerate(ranks)
    }
    return add_adapters(model, specs).to(DEVICE)


def _lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "lora_" in n}


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _stack_tensors(model) -> list[torch.Tensor]:
    out = []
    for layer in model._csgmv.layers.values():
        st = layer._csgmv_record.stack
        tensors = (st.data, st.a_off, st.b_off, st.ranks, st.scalings, st.mag, st.bias, st.lora_bias)
        out += [t for t in tensors if t is not None]
    return out


def _check_outputs(model, what: str, names=NAMES):
    input_ids, mask = make_batch(len(names), 6)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(got, stitch(outs, names), what)


def test_adapters_are_stored_once():
    model = _model()
    params = _lora_params(model)
    peft_bytes = _storage_bytes(params.values())
    enable_csgmv(model, backend="torch")
    stacks = {t.untyped_storage().data_ptr() for t in _stack_tensors(model)}
    for name, p in params.items():
        assert p.untyped_storage().data_ptr() in stacks, f"{name} is not stored in a stack"
    total = _storage_bytes([*params.values(), *_stack_tensors(model)])
    assert total <= 1.02 * peft_bytes, f"{total} bytes with csgmv against {peft_bytes} for PEFT alone"
    assert csgmv_stats(model)["shared_bytes"] == peft_bytes
    _check_outputs(model, "shared storage")


def test_in_place_edits_are_seen_without_restacking():
    model = _model()
    enable_csgmv(model, backend="torch")
    with torch.no_grad():
        for name, p in _lora_params(model).items():
            if ".a1" in name and "lora_B" in name:
                p.mul_(3.0)
    _check_outputs(model, "after an in-place edit")


@pytest.mark.parametrize("ranks", [(8, 8, 8), (2, 8, 16)], ids=["one-rank", "mixed-ranks"])
def test_stock_peft_merge_save_delete_on_shared_weights(tmp_path, ranks):
    model = _model(ranks)
    enable_csgmv(model, backend="torch")
    input_ids, mask = make_batch(3, 5)
    model.set_adapter("a2")
    with torch.no_grad():
        stock = model(input_ids, attention_mask=mask).logits  # no ids: PEFT's own forward on the shared weights
        model.merge_adapter()
        merged = model(input_ids, attention_mask=mask).logits
        model.unmerge_adapter()
        again = model(input_ids, attention_mask=mask).logits
    close(merged, stock, "merged")
    close(again, stock, "unmerged")
    model.save_pretrained(tmp_path, selected_adapters=["a2"])
    fresh, _ = tiny_model("llama")
    loaded = PeftModel.from_pretrained(fresh.to(DEVICE), tmp_path / "a2", adapter_name="a2").eval()
    with torch.no_grad():
        close(loaded(input_ids, attention_mask=mask).logits, stock, "saved and loaded back")
    held = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["a0"].weight
    kept = held.detach().clone()
    model.delete_adapter("a0")
    _check_outputs(model, "after delete_adapter", names=["a1", BASE, "a2"])
    assert torch.equal(held, kept), "a deleted adapter's weight changed: its slot was reused while still shared"


def test_disable_gives_peft_its_memory_back():
    model = _model()
    before = {n: p.detach().clone() for n, p in _lora_params(model).items()}
    enable_csgmv(model, backend="torch")
    held = _stack_tensors(model)  # kept alive, so no new tensor can take their addresses
    stacks = {t.untyped_storage().data_ptr() for t in held}
    disable_csgmv(model)
    for name, p in _lora_params(model).items():
        assert p.untyped_storage().data_ptr() not in stacks, f"{name} still lives in a stack"
        assert torch.equal(p, before[name])


@pytest.mark.parametrize("tier", [None, 2], ids=["all-resident", "host-tier"])
def test_a_cast_model_is_restacked_in_its_new_dtype(tier):
    """``model.to(torch.float64)`` after enabling gives PEFT's weights new tensors of a new dtype: the next call stacks
    them again in that dtype (stock PEFT's float64 results, not the float32 stack's), shared again, so an in-place
    edit after the cast is seen too."""
    model = _model()
    enable_csgmv(model, backend="torch", max_resident_adapters=tier)
    input_ids, mask = make_batch(len(NAMES), 5)
    model(input_ids, attention_mask=mask, adapter_ids=["a0", BASE, "a1", "a1", "a0"])
    model.to(torch.float64)
    names = ["a0", BASE, "a1", "a1", "a0"]

    def check(what):
        outs = per_adapter(model, sorted(set(names)), lambda: model(input_ids, attention_mask=mask).logits)
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        assert got.dtype == torch.float64
        close(got, stitch(outs, names), what)

    check("after model.to(float64)")
    stacks = {t.untyped_storage().data_ptr() for t in _stack_tensors(model)}
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert q.lora_B["a0"].weight.untyped_storage().data_ptr() in stacks, "not shared again after the cast"
    with torch.no_grad():
        q.lora_B["a0"].weight.mul_(3.0)
    check("an in-place edit after the cast")


def test_other_stack_dtype_keeps_a_separate_copy():
    """``dtype=`` other than the adapters': the stack is a converted copy; PEFT's weights stay its own."""
    model = _model()
    enable_csgmv(model, backend="torch", dtype=torch.float64)
    stacks = {t.untyped_storage().data_ptr() for t in _stack_tensors(model)}
    assert not any(p.untyped_storage().data_ptr() in stacks for p in _lora_params(model).values())
    assert csgmv_stats(model)["shared_bytes"] == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_mixed_ranks_are_stored_at_their_own_ranks(backend):
    """Mixed ranks (2, 8, 16 in every layer) are stored unpadded: the bytes with csgmv are PEFT's alone (≤ 1.02×), and
    the kernels read each slot at its own rank."""
    model = _model(ranks=(2, 8, 16))
    params = _lora_params(model)
    peft_bytes = _storage_bytes(params.values())
    enable_csgmv(model, backend=backend)
    stacks = {t.untyped_storage().data_ptr() for t in _stack_tensors(model)}
    assert all(p.untyped_storage().data_ptr() in stacks for p in params.values())
    assert all(p.is_contiguous() for p in params.values())  # PEFT's own layouts: saves and state_dicts as before
    total = _storage_bytes([*params.values(), *_stack_tensors(model)])
    assert total <= 1.02 * peft_bytes, f"{total} bytes with csgmv against {peft_bytes} for PEFT alone"
    _check_outputs(model, "mixed ranks, shared")


def _add(model, name, r):
    from peft import LoraConfig

    model.add_adapter(name, LoraConfig(r=r, lora_alpha=2 * r, target_modules=ALL_LINEAR, init_lora_weights=False))
    model.to(DEVICE)


def test_adapters_loaded_and_deleted_after_enabling_reuse_and_grow_the_storage():
    """Adapters loaded after enabling take a freed slot's room or grow the storage (every live slot packed again,
    PEFT's views re-pointed): results stay PEFT's at every step, and storage stays near PEFT's bytes."""
    model = _model(ranks=(4, 8, 16))
    enable_csgmv(model, backend="torch")
    stack = next(m for n, m in model._csgmv.layers.items() if n.endswith("q_proj"))._csgmv_record.stack
    data = stack.data
    model.delete_adapter("a1")  # frees rank-8 room in every layer
    _add(model, "b0", 4)  # fits in the hole: no new storage
    _check_outputs(model, "rank 4 in a rank-8 hole", names=["b0", "a0", BASE, "a2"])
    assert stack.data is data
    for i, r in enumerate((32, 2, 16, 8)):  # more than the storage holds: it grows, once per layer at most a few times
        _add(model, f"c{i}", r)
    names = ["c0", "a2", "c1", BASE, "b0", "c2", "c3", "a0"]
    _check_outputs(model, "adapters added after enabling", names=names)
    assert stack.data is not data
    params = _lora_params(model)
    stacks = {t.untyped_storage().data_ptr() for t in _stack_tensors(model)}
    assert all(p.untyped_storage().data_ptr() in stacks for p in params.values()), "a view was not re-pointed"
    total = _storage_bytes([*params.values(), *_stack_tensors(model)])
    peft_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert total <= 1.15 * peft_bytes, f"{total} bytes with csgmv against {peft_bytes} for PEFT alone"
    enable_csgmv(model, backend="torch")  # a restack packs exactly again
    total = _storage_bytes([*_lora_params(model).values(), *_stack_tensors(model)])
    assert total <= 1.02 * peft_bytes
    _check_outputs(model, "restacked", names=names)


@pytest.mark.parametrize("tier", [None, 3], ids=["all-resident", "host-tier"])
def test_state_made_under_inference_mode_is_usable_outside_it(tier):
    """``enable_csgmv``, calls with ids (their plans and workspaces), an adapter added later and the host tier's moves,
    all first done inside ``torch.inference_mode()``: the stacks PEFT's weights view, the host regions and the plans'
    buffers are normal tensors, not inference tensors. So afterwards, outside it, PEFT's ``set_adapter`` (which sets
    ``requires_grad``) works, and calls with ids (reusing the plans) give stock PEFT's results; ``disable_csgmv``
    inside inference mode leaves PEFT's weights normal too."""
    from peft import LoraConfig

    model = _model()
    input_ids, mask = make_batch(len(NAMES), 5)
    late = LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, init_lora_weights=False)
    with torch.inference_mode():
        enable_csgmv(model, backend="triton", max_resident_adapters=tier)
        model(input_ids, attention_mask=mask, adapter_ids=NAMES)  # plans and workspaces of this shape
        model.add_adapter("a3", late)
        model(input_ids, attention_mask=mask, adapter_ids=["a3", BASE, "a3", "a0", "a3"])  # synced, tier moves
    params = _lora_params(model)
    assert not any(p.is_inference() for p in params.values()), "PEFT's weights point into inference tensors"
    for name in ("a0", "a1", "a2", "a3"):
        model.set_adapter(name)
        assert all(p.requires_grad for n, p in params.items() if f".{name}." in n)
    model.eval()
    names = [BASE if n is None else n for n in NAMES]
    outs = per_adapter(model, sorted(set(names)), lambda: model(input_ids, attention_mask=mask).logits)
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
    close(got, stitch(outs, names), "outside inference mode, on plans made inside it")
    with torch.inference_mode():
        disable_csgmv(model)
    assert not any(p.is_inference() for p in _lora_params(model).values())
    model.set_adapter("a1")


@pytest.mark.parametrize("tier", [None, 2], ids=["all-resident", "host-tier"])
def test_adapter_deleted_and_added_again_with_an_equal_config_is_stacked_anew(tier):
    """An adapter deleted and added again under the same name, with a config equal to its old one (a copy) and new
    weights: the adapters' names are as before, in order, and their configs compare equal, yet the next call sees a
    new adapter (configs are told apart by identity) and serves the new weights, as stock PEFT does."""
    import copy

    model = _model()
    enable_csgmv(model, backend="torch", max_resident_adapters=tier)
    names = ["a2", BASE, "a0", "a2"]
    _check_outputs(model, "before", names)
    config = copy.deepcopy(model.peft_config["a2"])
    config.init_lora_weights = False
    model.delete_adapter("a2")
    torch.manual_seed(123)
    model.add_adapter("a2", copy.deepcopy(config))
    model.to(DEVICE)
    assert list(model.peft_config) == ["a0", "a1", "a2"] and model.peft_config["a2"] == config
    _check_outputs(model, "a2 added again with new weights", names)


@pytest.mark.gpu
def test_model_moved_after_enable():
    """Moving the model between devices after enable_csgmv: the stacks follow on the next call, the result still
    matches, and no binding keeps the old device's stack tensors alive."""
    model = make("llama")
    names = interleaved(5)
    input_ids, mask = make_batch(5, 6)
    enable_csgmv(model)
    try:
        on_gpu = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        model(input_ids, attention_mask=mask, adapter_ids=names)  # the plan's second use binds the launches
        model(input_ids, attention_mask=mask, adapter_ids=names)  # and the third runs them
        model.to("cpu")
        on_cpu = model(input_ids.cpu(), attention_mask=mask.cpu(), adapter_ids=names).logits
        for run in model._csgmv.executor.plans.values():
            for binding in run.bound.values():
                if hasattr(binding, "tensors"):
                    assert all(t is None or t.device.type == "cpu" for t in binding.tensors)
        model.to("cuda")
        back = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    close(on_cpu, on_gpu.cpu(), "after moving to the CPU")
    close(back, on_gpu, "after moving back")
