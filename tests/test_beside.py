"""The LoRA beside the base product (``peft_csgmv::lora_linear``, and ``lora_group_linear`` for a sibling group): in
compiled code a plain Linear layer's base product and LoRA are one op (on CUDA the LoRA on a side stream, by default for
base weights of 16 MiB or more; ``PEFT_CSGMV_BESIDE=1`` forces it on any device), bit for bit the numbers of the base
product followed by the ``lora`` op; layers with hooks keep the ``lora`` op; the static-cache decode on other
architectures; the launches beside the base go without programmatic dependent launch. On the GPU (``gpu``): chains of
layers and of q/k/v groups, eagerly and replayed from a CUDA graph, against the serial launches."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    add_adapters,
    close,
    compiled_ops,
    graphs,
    make,
    make_batch,
    per_adapter,
    static_and_eager,
    stitch,
    tiny_model,
)

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_linear_layers_run_beside_their_base_product(backend, monkeypatch):
    """In compiled code a plain Linear layer's base product and LoRA are one ``peft_csgmv::lora_linear`` (on CUDA the
    LoRA beside the base product) and its output ``y + delta``: stock PEFT's per-adapter logits, bit for bit the
    numbers of the base product followed by the ``lora`` op (``PEFT_CSGMV_BESIDE=0``; the first is the default on CUDA,
    ``PEFT_CSGMV_BESIDE=1`` turns it on for every device; ``PEFT_CSGMV_BESIDE_MIN_MIB`` keeps smaller base weights
    after). The embedding, and a layer whose base has a forward hook (which must run), keep the ``lora`` op."""
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    model = make(embedding=True)
    input_ids, mask = make_batch(3, 5)
    names = ["a0", BASE, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend=backend)
    linear = csgmv_stats(model)["kernel_layers"] - 1  # all but embed_tokens
    beside, ops = compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    close(beside, stitch(outs, names), "compiled, beside")
    assert ops == {"lora_linear": linear, "lora": 1}, ops

    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "0")
    enable_csgmv(model, backend=backend)
    after, ops = compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    assert ops == {"lora": linear + 1}, ops
    assert torch.equal(beside, after), "the LoRA beside the base product gave other numbers"

    # a floor on the base weight's bytes (16 MiB by default on CUDA, set here): only the MLP's 80×48 weights
    # (15360 bytes) beside
    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    monkeypatch.setenv("PEFT_CSGMV_BESIDE_MIN_MIB", str(12000 / 2**20))
    enable_csgmv(model, backend=backend)
    some, ops = compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    assert ops == {"lora_linear": 6, "lora": linear + 1 - 6}, ops
    assert torch.equal(some, beside)
    monkeypatch.delenv("PEFT_CSGMV_BESIDE_MIN_MIB")

    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    enable_csgmv(model, backend=backend)
    calls = []
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    handle = q.base_layer.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    try:
        hooked, ops = compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    finally:
        handle.remove()
    assert ops == {"lora_linear": linear - 1, "lora": 2}, ops
    assert calls, "the base layer's forward hook did not run"
    assert torch.equal(hooked, beside)

    # accelerate's device_map hooks replace the base layer's forward on the instance (moving inputs and weights to
    # where they must be): it must run, so that layer keeps the lora op
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    seen = []

    class Record(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(args[0].shape)
            return args, kwargs

    v = model.base_model.model.model.layers[1].self_attn.v_proj
    add_hook_to_module(v.base_layer, Record())
    try:
        hooked, ops = compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    finally:
        remove_hook_from_module(v.base_layer)
    assert ops == {"lora_linear": linear - 1, "lora": 2}, ops
    assert seen, "accelerate's hook on the base layer did not run"
    assert torch.equal(hooked, beside)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "opt"])
def test_static_cache_beside_across_architectures(arch, monkeypatch):
    """The LoRA beside the base product (the default on CUDA, forced here) through transformers' static-cache decode on
    other layouts: Qwen2's biased projections with a ``lora_bias`` adapter, GPT-2's ``Conv1D`` (no ``nn.Linear``: the
    ``lora`` op), OPT's flattened MLP tokens. fp32: eager csgmv's tokens, one graph for two id lists, and stock PEFT's
    per-adapter logits from the compiled forward."""
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    base, targets = tiny_model(arch)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }
    if arch == "qwen2":
        specs["a1"]["lora_bias"] = True
    model = add_adapters(base, specs).to(DEVICE)
    input_ids, mask = make_batch(3, 5)
    names = ["a1", BASE, "a0"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch")
    logits, ops = compiled_ops(model, ["a1", None, "a0"], input_ids, mask)
    close(logits, stitch(outs, names), f"{arch}, compiled forward")
    beside = sum(1 for layer in model.modules() if type(getattr(layer, "base_layer", None)) is torch.nn.Linear)
    assert ops.get("lora_linear", 0) == beside and ops.get("lora", 0) == csgmv_stats(model)["kernel_layers"] - beside
    before = graphs()
    for ids in (["a1", None, "a0"], ["a0", "a1", "a1"]):
        static, eager = static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"{arch}, ids {ids}: the compiled decode generated other tokens"
    assert graphs() - before == 1, f"{graphs() - before} graphs compiled"


def test_lora_linear_launches_without_pdl_beside_the_base(monkeypatch):
    """The LoRA's launches beside the base product go without programmatic dependent launch (across the CUDA graph's
    fork and join it idled the GPU), where every other launch on the device takes it; and the default on CUDA is the
    LoRA beside the base product (``PEFT_CSGMV_BESIDE`` unset), on other devices after it."""
    from peft_csgmv import ops
    from peft_csgmv.executor import Executor
    from peft_csgmv.kernels import launch
    from peft_csgmv.mapping import StaticPlan

    model = make()
    enable_csgmv(model, backend="triton")
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    stack, base = layer._csgmv_record.stack, layer.base_layer
    static = StaticPlan(2, 2, 1, DEVICE)
    static.fill((0, 1))
    seen = []

    def shrink(x, a, ranks, plan, t=None):  # records the launch's choice; launches nothing
        seen.append(("shrink", launch.with_pdl(x.device, ())[0]))
        return torch.zeros(1, x.shape[0], 16) if t is None else t

    def expand(t, *args, out, **kwargs):
        seen.append(("expand", launch.with_pdl(out.device, ())[0]))
        return out

    monkeypatch.setattr(launch, "pdl", lambda device: True)
    monkeypatch.setattr(ops.kernels, "shrink", shrink)
    monkeypatch.setattr(ops.kernels, "expand", expand)
    x = torch.randn(2, layer.in_features, device=DEVICE)
    with torch.no_grad():
        ops.lora_linear(x, base.weight, base.bias, static.permutation, static.seg_indptr, static.seg_slot,
                        stack.handle, stack.version, static.chunk, True)  # fmt: skip
        assert seen == [("shrink", False), ("expand", False)], seen
        ops.lora(x, base(x), static.permutation, static.seg_indptr, static.seg_slot, None, stack.handle,
                 stack.version, static.chunk, True)  # fmt: skip
    assert seen[2:] == [("shrink", True), ("expand", True)], seen
    monkeypatch.undo()

    monkeypatch.delenv("PEFT_CSGMV_BESIDE", raising=False)
    monkeypatch.delenv("PEFT_CSGMV_BESIDE_MIN_MIB", raising=False)
    ex = Executor("triton", lambda layer: None)
    assert ex.beside_on(torch.device("cuda", 0)) and not ex.beside_on(torch.device("cpu"))
    assert ex.beside_min_bytes == 16 * 2**20, "by default only base weights of 16 MiB or more run beside"
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "0")
    assert not Executor("triton", lambda layer: None).beside_on(torch.device("cuda", 0))
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    forced = Executor("triton", lambda layer: None)
    assert forced.beside_on(torch.device("cpu")) and forced.beside_min_bytes == 0
    monkeypatch.setenv("PEFT_CSGMV_BESIDE_MIN_MIB", "2")
    assert Executor("triton", lambda layer: None).beside_min_bytes == 2 * 2**20


def _beside_matches_serial(chain, device) -> None:
    """``chain(x, beside)`` over 20 random bf16 inputs (32, 2048): beside gives the serial numbers bit for bit, eagerly
    (one stream: no side stream made) and replayed from a CUDA graph (the side stream forked under capture) with a new
    input before each replay."""
    from peft_csgmv import ops

    with torch.no_grad():
        inputs = [torch.randn(32, 2048, device="cuda", dtype=torch.bfloat16) for _ in range(20)]
        serial = [chain(x, beside=False) for x in inputs]
        assert all(torch.isfinite(s).all() and s.abs().sum() > 0 for s in serial)
        ops._SIDE_STREAMS.pop(device, None)
        for x, want in zip(inputs, serial):
            assert torch.equal(chain(x, beside=True), want), "eager: beside differs from one after the other"
        assert device not in ops._SIDE_STREAMS, "run eagerly, the LoRA forked onto a side stream"
        static_x = inputs[0].clone()
        chain(static_x, beside=True)  # warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static_x, beside=True)
        assert device in ops._SIDE_STREAMS, "captured, the LoRA did not run on a side stream"
        for x, want in zip(inputs, serial):
            static_x.copy_(x)
            graph.replay()
            assert torch.equal(out, want), "replayed: beside differs from one after the other"


@pytest.mark.gpu
def test_group_beside_base_products_gives_the_serial_results():
    """``peft_csgmv::lora_group_linear`` (a q/k/v group's LoRA on a side stream beside the three base products, one
    fork and one join) over a chain of blocks, each reading what the last wrote: bit for bit the base products followed
    by ``peft_csgmv::lora_group`` on one stream, eagerly and replayed from a CUDA graph with a new input before each of
    20 replays."""
    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model, _ = tiny_model(
        "llama", torch.bfloat16, layers=6, hidden=2048, vocab=128, intermediate=256, heads=16, kv_heads=8
    )
    targets = ["q_proj", "k_proj", "v_proj"]
    specs = {f"a{i}": dict(r=8 + 8 * (i % 2), lora_alpha=32, target_modules=targets) for i in range(32)}
    pm = add_adapters(model, specs)
    pm.to(torch.bfloat16).to("cuda")
    enable_csgmv(pm)
    blocks = [[getattr(layer.self_attn, t) for t in targets] for layer in pm.base_model.model.model.layers]
    device = torch.device("cuda", torch.cuda.current_device())
    static = StaticPlan(32, 32, 1, device)
    static.fill(tuple(-1 if i % 5 == 0 else (7 * i) % 32 for i in range(32)))
    plan = (static.permutation, static.seg_indptr, static.seg_slot)

    def chain(x, beside: bool):
        for members in blocks:
            stacks = [m._csgmv_record.stack.handle for m in members]
            versions = [m._csgmv_record.stack.version for m in members]
            if beside:
                weights, biases = [m.base_layer.weight for m in members], [m.base_layer.bias for m in members]
                outs = ops.lora_group_linear(x, weights, biases, *plan, stacks, versions, static.chunk, True)
                ys, deltas = outs[:3], outs[3:]
            else:
                ys = [m.base_layer(x) for m in members]
                deltas = ops.lora_group(x, *plan, stacks, versions, static.chunk, True)
            q, k, v = [(y + d).to(y.dtype) for y, d in zip(ys, deltas)]
            x = q + torch.cat([k, v], dim=1)
        return x

    _beside_matches_serial(chain, device)
    disable_csgmv(pm)


@pytest.mark.gpu
@pytest.mark.parametrize("adapters", ["fp32", "bf16"])
def test_lora_beside_base_product_gives_the_serial_results(adapters):
    """``peft_csgmv::lora_linear`` (the LoRA on a side stream beside the base product, joined before it returns) over
    a chain of layers, each reading what the last wrote: bit for bit the base product followed by the ``lora`` op,
    eagerly (one stream) and replayed from a CUDA graph (the side stream, forked under capture) with a new input before
    each of 20 replays (a missing join would read ``delta`` before it is written, or let the next layer overwrite a
    buffer the side stream still reads)."""
    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model, _ = tiny_model(  # PEFT keeps its adapters in fp32 on it
        "llama", torch.bfloat16, layers=8, hidden=2048, vocab=128, intermediate=256, heads=16, kv_heads=16
    )
    pm = add_adapters(model, {f"a{i}": dict(r=16, lora_alpha=32, target_modules=["q_proj"]) for i in range(32)})
    if adapters == "bf16":
        pm.to(torch.bfloat16)
    pm.to("cuda")
    enable_csgmv(pm)
    layers = [layer.self_attn.q_proj for layer in pm.base_model.model.model.layers]
    assert layers[0]._csgmv_record.stack.a.dtype == (torch.float32 if adapters == "fp32" else torch.bfloat16)
    device = torch.device("cuda", torch.cuda.current_device())
    static = StaticPlan(32, 32, 1, device)
    static.fill(tuple(-1 if i % 5 == 0 else (7 * i) % 32 for i in range(32)))  # base rows too
    plan = (static.permutation, static.seg_indptr, static.seg_slot)

    def chain(x, beside: bool):
        for layer in layers:
            stack, base = layer._csgmv_record.stack, layer.base_layer
            if beside:
                y, delta = ops.lora_linear(
                    x, base.weight, base.bias, *plan, stack.handle, stack.version, static.chunk, True
                )
                x = (y + delta).to(y.dtype)
            else:
                y = torch.nn.functional.linear(x, base.weight, base.bias)
                x = ops.lora(x, y, *plan, None, stack.handle, stack.version, static.chunk, True)
        return x

    _beside_matches_serial(chain, device)
    disable_csgmv(pm)
