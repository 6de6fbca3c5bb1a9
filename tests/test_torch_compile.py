"""``torch.compile`` of a csgmv model or one patched layer, with adapter ids: one graph for any ids of a batch shape,
stock PEFT's per-adapter logits, PEFT's per-layer switch, in-place edits seen without a recompile and a larger rank
recompiling once, the fused decode launch; on the GPU (``gpu``), bf16 compiled logits within PEFT's own compile
difference. CPU runs use the ``aot_eager`` backend."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    ID_LISTS,
    add_adapters,
    close,
    graphs,
    make,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import adapter_ids_scope, csgmv_stats, enable_csgmv

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def test_torch_compile_model_forward():
    """``torch.compile(model)`` (the PeftModel) with ids in forward: the model's forward is one graph for any ids of
    the batch shape (the wrapper's validation runs eagerly, outside it), with stock PEFT's per-adapter logits."""
    model = make(embedding=True)
    enable_csgmv(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS:
        names = [BASE if i is None else i for i in ids]
        outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        with torch.no_grad():
            got = compiled(input_ids, attention_mask=mask, adapter_ids=ids).logits
        close(got, stitch(outs, names), f"compiled model, ids {ids}")
    assert graphs() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layer_fullgraph(backend):
    """``torch.compile(fullgraph=True)`` of one patched layer's forward: no graph break, eager's output, and no
    recompile when the ids change."""
    model = make()
    enable_csgmv(model, backend=backend)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(3, 4, layer.in_features, device=DEVICE)
    for ids in ID_LISTS:
        with torch.no_grad(), adapter_ids_scope(model, ids):
            got, want = compiled(x), layer(x)
        close(got, want, f"compiled layer, ids {ids}")
    with torch.no_grad():
        close(compiled(x), layer(x), "compiled layer outside a call: stock PEFT (the active adapter)")
    assert graphs() == 2  # inside a call, and outside one


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_switched_off_runs_its_base_layer(compiled):
    """PEFT's per-layer switch (``layer.enable_adapters(False)``) holds in csgmv calls as in stock PEFT's runs: that
    layer gives its base layer's output for every row, eagerly and in compiled code (where the switch is a guard:
    turning it off recompiles instead of reusing the graph traced with the layer on)."""
    model = make()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    input_ids, mask = make_batch(3, 5)
    ids = ["a0", None, "a1"]

    def stock_off():
        layer.enable_adapters(False)  # per_adapter's disable_adapter() turns every layer back on when it ends
        return model(input_ids, attention_mask=mask).logits

    with torch.no_grad():
        off = stitch(per_adapter(model, ids, stock_off), ids)
        layer.enable_adapters(True)
        on = stitch(per_adapter(model, ids, lambda: model(input_ids, attention_mask=mask).logits), ids)
    assert (off - on).abs().max() > 1e-3, "the layer's adapters do not change the output"
    enable_csgmv(model, backend="torch")
    run = torch.compile(model, backend="aot_eager", dynamic=False) if compiled else model
    with torch.no_grad():
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, on, "layer on")
        layer.enable_adapters(False)
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, off, "layer off")
        layer.enable_adapters(True)
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, on, "layer on again")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_follows_stack_changes(backend):
    """Under ``torch.compile``: an in-place edit of an adapter's weights is seen by the next call with no recompile
    (the op reads the stack's memory); an adapter of a larger rank (a new launch shape) recompiles once, and gives
    stock PEFT's result."""
    model = make()
    enable_csgmv(model, backend=backend)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    input_ids, mask = make_batch(3, 5)
    ids = ["a0", None, "a1"]

    def check(ids, what):
        names = [BASE if i is None else i for i in ids]
        outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        with torch.no_grad():
            got = compiled(input_ids, attention_mask=mask, adapter_ids=ids).logits
        close(got, stitch(outs, names), what)

    check(ids, "compiled")
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["a1"].weight.mul_(3.0)
    check(ids, "after an in-place edit")
    assert graphs() == 1
    from peft import LoraConfig

    wide = LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model.add_adapter("wide", wide)
    model.to(DEVICE)
    check(["wide", "a0", None], "an adapter of a larger rank")
    assert graphs() == 2


def test_compiled_fused_decode_one_launch_per_layer(monkeypatch):
    """``PEFT_CSGMV_FUSED_DECODE=1``: in compiled code, each LoRA layer of a decode-sized call is one fused launch
    (the expand computing the A product itself, no shrink launch), with stock PEFT's per-adapter logits."""
    import collections

    import peft_csgmv.kernels as kernels

    monkeypatch.setenv("PEFT_CSGMV_FUSED_DECODE", "1")
    model = make()
    input_ids, mask = make_batch(3, 5)
    names = ["a0", BASE, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="triton")
    launches = collections.Counter()
    shrink, expand = kernels.shrink, kernels.expand

    def counted_shrink(*args, **kwargs):
        launches["shrink"] += 1
        return shrink(*args, **kwargs)

    def counted_expand(*args, **kwargs):
        launches["fused" if kwargs.get("x") is not None else "expand"] += 1
        return expand(*args, **kwargs)

    monkeypatch.setattr(kernels, "shrink", counted_shrink)
    monkeypatch.setattr(kernels, "expand", counted_expand)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False, fullgraph=False)
    with torch.no_grad():
        got = compiled(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits
    close(got, stitch(outs, names), "fused, compiled")
    assert launches == {"fused": csgmv_stats(model)["kernel_layers"]}, launches


@pytest.mark.gpu
def test_bf16_compiled_logits_within_peft_own_compile_difference():
    """bf16 on the GPU: csgmv's compiled forward (inductor) differs from its eager one by no more than PEFT's own
    compiled forward differs from PEFT's eager one (twice that, for margin), for each row's adapter."""
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=8, lora_alpha=16, target_modules=targets),
        "a1": dict(r=16, lora_alpha=16, target_modules=targets),
    }
    pm = add_adapters(model.to("cuda"), specs).to(torch.bfloat16)
    input_ids, mask = (t.to("cuda") for t in make_batch(4, 9))
    names = ["a0", BASE, "a1", "a0"]
    with torch.no_grad():
        pm.set_adapter("a0")
        peft_eager = pm(input_ids, attention_mask=mask).logits.float()
        peft_compiled = torch.compile(pm, dynamic=False)(input_ids, attention_mask=mask).logits.float()
        peft_gap = (peft_compiled - peft_eager).abs().max().item()
        torch._dynamo.reset()
        enable_csgmv(pm)
        eager = pm(input_ids, attention_mask=mask, adapter_ids=names).logits.float()
        compiled = torch.compile(pm, dynamic=False)(input_ids, attention_mask=mask, adapter_ids=names).logits.float()
    gap = (compiled - eager).abs().max().item()
    assert gap <= 2 * max(peft_gap, 1e-2), f"csgmv compiled vs eager {gap:.3g}, PEFT's own {peft_gap:.3g}"
