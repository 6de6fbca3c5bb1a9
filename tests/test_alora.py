"""aLoRA (activated LoRA: an adapter that applies from its invocation tokens on) in the kernels. A call's token mapping
gives an aLoRA row's tokens before the invocation no adapter and the rest the row's adapter (PEFT's offsets, computed
once per call), so aLoRA rows mix with plain LoRA and base rows in one launch per layer. The reference is stock PEFT
one adapter at a time (the active adapter, PEFT's own offsets)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    close,
    compile_config,
    greedy_kwargs,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import BatchPlan, csgmv_stats, enable_csgmv
from peft_csgmv.kernels import expand_reference, shrink_reference

INVOCATION = [7, 8]


def _model(seed: int = 1):
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], alora_invocation_tokens=INVOCATION,
            task_type="CAUSAL_LM",
        ),
        "al2": dict(
            r=6, lora_alpha=16, target_modules=["q_proj", "o_proj"], alora_invocation_tokens=[9],
            task_type="CAUSAL_LM",
        ),
    }  # fmt: skip
    return add_adapters(model, specs, seed=seed).to(DEVICE)


def _prompts(rows: int, seq: int):
    """Prompts whose rows invoke the aLoRA adapters at different places; row 2 invokes neither."""
    input_ids, mask = make_batch(rows, seq)
    input_ids[input_ids == 9] = 10  # (only where placed below)
    for i in range(rows):
        if i % 4 == 2:
            continue
        at = 3 + i % (seq - 5)
        input_ids[i, at : at + 2] = torch.tensor(INVOCATION, device=DEVICE)
        input_ids[i, seq - 2 - i % 3] = 9
    return input_ids, mask


def test_plan_maps_each_rows_last_tokens():
    """A plan with ``row_tokens`` gives each row's slot to its last tokens only, the others are base tokens; the
    torch reference over it equals a float64 loop over tokens."""
    g = torch.Generator().manual_seed(0)
    rows, tpr, width, out, r = 5, 4, 6, 5, 3
    row_slots, keep = [1, -1, 0, 1, 0], [1, 4, 0, 4, 2]
    plan = BatchPlan.build(row_slots, tpr, chunk_size=2, row_tokens=keep)
    token_slot = []
    for s, k in zip(row_slots, keep):
        token_slot += [s if s >= 0 and j >= tpr - k else -1 for j in range(tpr)]
    perm = plan.permutation.tolist()
    assert sorted(perm) == list(range(rows * tpr))
    bounds, seg_slot = plan.seg_indptr.tolist(), plan.seg_slot.tolist()
    covered = {t: seg_slot[i] for i in range(len(seg_slot)) for t in perm[bounds[i] : bounds[i + 1]]}
    assert covered == {t: s for t, s in enumerate(token_slot) if s >= 0}
    assert all(b - a <= 2 for a, b in zip(bounds, bounds[1:]))
    a = torch.randn(2, r, width, generator=g)
    b = torch.randn(2, out, r, generator=g)
    ranks, scalings = [r, r], [0.5, 2.0]
    x = torch.randn(rows * tpr, width, generator=g)
    y = torch.randn(rows * tpr, out, generator=g)
    want = y.double().clone()
    for t, s in enumerate(token_slot):
        if s >= 0:
            want[t] += scalings[s] * (x[t].double() @ a[s].double().T) @ b[s].double().T
    got = y.clone()
    t = shrink_reference(x, a, ranks, plan)
    expand_reference(t, b, ranks, torch.tensor(scalings), plan, got)
    close(got, want.float(), "masked plan")


@pytest.mark.parametrize("backend", BACKENDS)
def test_alora_rows_run_in_the_kernels(backend, kernel_calls):
    """aLoRA rows mixed with plain LoRA and base rows: each row's logits equal stock PEFT with that adapter alone, and
    no layer runs PEFT's forward for them (csgmv_stats)."""
    model = _model()
    input_ids, mask = _prompts(6, 10)
    names = ["al", "a0", "al2", "al", BASE, "al2"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    enable_csgmv(model, backend=backend)
    stats = csgmv_stats(model)
    assert stats["peft_row_layers"] == 0 and stats["peft_path_modules"] == 0
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(got, stitch(outs, names), "mixed aLoRA logits")
    if backend == "triton":
        assert kernel_calls, "the kernels did not run"
    # Before the invocation an aLoRA row is the base model; after it, it is not; row 2 never invokes its adapter.
    base = outs[BASE]
    assert (got[0, :3] - base[0, :3]).abs().max() < 1e-5
    assert (got[0, -1] - base[0, -1]).abs().max() > 1e-3
    close(got[2], base[2], "a row that never invokes its aLoRA adapter")


def test_alora_generate_equals_each_adapter_alone():
    """Greedy generate with aLoRA rows among others: the tokens of each adapter's own stock PEFT run (fp32)."""
    model = _model()
    input_ids, mask = _prompts(4, 9)
    names = ["al", "a0", "al2", "al"]
    kw = greedy_kwargs(5)
    outs = per_adapter(model, names, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    enable_csgmv(model, backend="torch")
    got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, **kw)
    assert torch.equal(got, stitch(outs, names))


def test_alora_static_cache_generate():
    """transformers' static-cache compiled decode (aot_eager, full graph) with aLoRA rows: each row's tokens equal
    its adapter's own eager stock PEFT run, and a second call with other ids reuses the graph."""
    model = _model()
    input_ids, mask = _prompts(4, 9)
    kw = greedy_kwargs(4)
    calls = (["al", "a0", "al2", BASE], ["a0", "al", "al", "al2"])
    expected = []
    for names in calls:
        outs = per_adapter(model, names, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
        expected.append(stitch(outs, names))
    enable_csgmv(model, backend="torch")
    torch._dynamo.reset()
    try:
        for names, want in zip(calls, expected):
            got = model.generate(
                input_ids=input_ids, attention_mask=mask, adapter_ids=names, cache_implementation="static",
                compile_config=compile_config(), **kw,
            )  # fmt: skip
            assert torch.equal(got, want), names
    finally:
        torch._dynamo.reset()


def test_alora_offsets_passed_by_the_caller():
    """``alora_offsets`` given with the call are the ones used, as in PEFT; a wrong count is refused before the call
    runs."""
    model = _model()
    input_ids, mask = _prompts(3, 8)
    names = ["al", "a0", "al"]
    offsets = [2, None, 5]
    with torch.no_grad():
        want = model(input_ids, attention_mask=mask, adapter_names=names, alora_offsets=offsets).logits
    enable_csgmv(model, backend="torch")
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names, alora_offsets=offsets).logits
        close(got, want, "caller's offsets")
        with pytest.raises(ValueError, match="alora_offsets"):
            model(input_ids, attention_mask=mask, adapter_ids=names, alora_offsets=[2, 3])


@pytest.mark.parametrize("backend", BACKENDS)
def test_alora_under_torch_compile(backend):
    """``torch.compile(model)`` with aLoRA rows in ``forward``: the compiled prefill reads the static plan of its shape,
    whose rows keep their adapter from the invocation on; each row's logits equal its adapter's own stock PEFT run,
    for two calls with other ids."""
    model = _model()
    input_ids, mask = _prompts(4, 9)
    calls = (["al", "a0", "al2", BASE], ["al2", "al", BASE, "al"])
    expected = []
    for names in calls:
        outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        expected.append(stitch(outs, names))
    enable_csgmv(model, backend=backend)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager", dynamic=False)
        for names, want in zip(calls, expected):
            with torch.no_grad():
                got = compiled(input_ids, attention_mask=mask, adapter_ids=names).logits
            close(got, want, f"compiled {names}")
    finally:
        torch._dynamo.reset()
