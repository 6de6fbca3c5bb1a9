"""CUDA-only tests: the compiled Triton kernels in bf16/fp16/fp32 against a float64 reference and against stock PEFT.
Skipped without a CUDA device (see conftest.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import add_adapters, assert_close, tiny_model

from peft_csgmv import BatchPlan, disable_csgmv, enable_csgmv
from peft_csgmv.kernels import expand, expand_reference, shrink, shrink_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _stack(num_slots, ranks, k, n, dtype, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    r_max = max(ranks)
    a = torch.zeros(num_slots, r_max, k, dtype=torch.float64)
    b = torch.zeros(num_slots, n, r_max, dtype=torch.float64)
    for s, r in enumerate(ranks):
        a[s, :r] = torch.randn(r, k, generator=g, dtype=torch.float64) / k**0.5
        b[s, :, :r] = torch.randn(n, r, generator=g, dtype=torch.float64) / r**0.5
    scal = torch.linspace(0.5, 2.0, num_slots, dtype=torch.float32)
    return a.to(DEV, dtype), b.to(DEV, dtype), torch.tensor(ranks, dtype=torch.int32, device=DEV), scal.to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize(
    "k,n,ranks,row_slots,tpr,chunk",
    [
        (2048, 2048, [16] * 32, list(range(32)), 1, 16),  # decode, 32 distinct
        (2048, 8192, [8, 16, 64, 128], [0, 1, 2, 3, -1, 0, 2, 1], 1, 16),  # decode, mixed ranks, base rows
        (8192, 2048, [16, 64], [0, 1, 1, -1], 250, 128),  # prefill, chunk 128 with remainder
        (4096, 14336, [16] * 8, [0] * 16, 64, 128),  # prefill, one adapter
        (2048, 4096, [16, 64] * 8, list(range(16)), 64, 64),  # prefill, 16 runs of 64: 64-row tiles
        (4096, 2048, [16, 64] * 16, list(range(32)), 16, 16),  # prefill, 32 runs of 16: 16-row tiles
        (2049, 431, [1, 3, 0, 17], [0, 1, 2, 3, 0, -1], 33, 16),  # odd dims, rank 0 slot
    ],
    ids=["decode32", "mixed-ranks", "prefill-chunk", "prefill-one", "prefill-runs64", "prefill-runs16", "odd"],
)
def test_kernels_vs_float64(dtype, k, n, ranks, row_slots, tpr, chunk):
    torch.manual_seed(0)
    a, b, r, scal = _stack(len(ranks), ranks, k, n, dtype)
    plan = BatchPlan.build(row_slots, tpr, DEV)
    assert plan.chunk_size == chunk
    x = torch.randn(plan.num_tokens, k, device=DEV).to(dtype)
    y = torch.randn(plan.num_tokens, n, device=DEV).to(dtype)
    y0 = y.clone()
    t = shrink(x, a, r, plan)
    expand(t, b, r, scal, plan, y)
    ranks_h, scal_h = r.tolist(), scal.tolist()
    t_ref = shrink_reference(x.double(), a.double(), ranks_h, plan)
    y_ref = expand_reference(t_ref, b.double(), ranks_h, scal_h, plan, y0.double())
    assert_close(y, y_ref, dtype, scale=4.0, what=f"y ({dtype})")
    base_rows = [i * tpr + j for i, s in enumerate(row_slots) for j in range(tpr) if s < 0 or ranks[s] == 0]
    if base_rows:
        assert torch.equal(y[base_rows], y0[base_rows])


def _per_adapter_logits(pm, ids, mask, names):
    """Each row's logits from its own adapter's stock PEFT run (base rows under ``disable_adapter``), and the base
    logits. (PEFT's own ``adapter_names`` path cannot serve OPT, whose MLP sees flattened tokens.)"""
    with torch.no_grad(), pm.disable_adapter():
        base = pm(ids, attention_mask=mask).logits.float()
    ref = base.clone()
    with torch.no_grad():
        for name in set(names) - {"__base__"}:
            pm.set_adapter(name)
            rows = [i for i, n in enumerate(names) if n == name]
            ref[rows] = pm(ids, attention_mask=mask).logits.float()[rows]
    return ref, base


def _assert_mixed_batch_matches(pm, names, dtype, stack_dtype=None, what="", ids=None):
    """A mixed batch of ``names`` through csgmv against each row's own stock PEFT run, with ``dtype``'s tolerance;
    ``ids``: the token ids (any view), default random prompts with some left padding."""
    if ids is None:
        ids = torch.randint(3, 97, (len(names), 12), device=DEV)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
    else:
        mask = torch.ones(ids.shape, dtype=torch.long, device=DEV)
    ref, base = _per_adapter_logits(pm, ids, mask, names)
    assert (ref - base).abs().max() > 0.05, "the adapters do not change the output"
    enable_csgmv(pm, dtype=stack_dtype)
    try:
        out = pm(ids, attention_mask=mask, adapter_ids=names).logits.float()
    finally:
        disable_csgmv(pm)
    assert_close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()) * 2, what=what)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "opt"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("stack_dtype", [None, torch.float32], ids=["stack-base-dtype", "stack-fp32"])
def test_model_parity_half(arch, dtype, stack_dtype):
    model, targets = tiny_model(arch)
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "b": dict(r=16, lora_alpha=8, target_modules=targets[:2], use_rslora=True),
        "c": dict(r=4, lora_alpha=4, target_modules=targets),
    }
    pm = add_adapters(model.to(DEV), specs)
    pm.to(dtype)  # adapters in the model dtype too, as a half-precision deployment would have them
    _assert_mixed_batch_matches(pm, ["__base__", "a", "b", "c", "a", "__base__"], dtype, stack_dtype, f"{arch} logits")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp32_greedy_generate_token_identical(arch):
    model, targets = tiny_model(arch)
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "b": dict(r=32, lora_alpha=8, target_modules=targets),
    }
    pm = add_adapters(model.to(DEV), specs)
    names = ["a", "__base__", "b", "a", "b"]
    ids = torch.randint(3, 97, (len(names), 10), device=DEV)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = pm.generate(input_ids=ids, adapter_names=names, **kw)
        ref_beam = pm.generate(input_ids=ids, adapter_names=names, num_beams=3, **kw)
    enable_csgmv(pm)
    try:
        out = pm.generate(input_ids=ids, adapter_ids=names, **kw)
        out_beam = pm.generate(input_ids=ids, adapter_ids=names, num_beams=3, **kw)
    finally:
        disable_csgmv(pm)
    assert torch.equal(out, ref)
    assert torch.equal(out_beam, ref_beam)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dora_parity_half(arch, dtype):
    """DoRA adapters mixed with plain ones, in half precision, against each adapter's own PEFT run."""
    model, targets = tiny_model(arch)
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "d": dict(r=16, lora_alpha=16, target_modules=targets, use_dora=True),
    }
    pm = add_adapters(model.to(DEV), specs)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    pm.to(dtype)
    _assert_mixed_batch_matches(pm, ["d", "__base__", "a", "d", "a"], dtype, what=f"{arch} DoRA logits")


def _embedding_lora_model(dtype):
    """A tiny Llama with two adapters on the embedding (and linear layers), in ``dtype``."""
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", *targets]),
        "b": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    }
    return add_adapters(model.to(DEV), specs).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_embedding_lora_half(dtype):
    """Embedding LoRA through the gather kernel, mixed with linear LoRA, in half precision."""
    pm = _embedding_lora_model(dtype)
    _assert_mixed_batch_matches(pm, ["a", "__base__", "b", "a", "b"], dtype, what="embedding LoRA logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("view", ["last-column", "every-other-row"])
def test_embedding_lora_strided_ids_half(dtype, view):
    """Token ids as a hand-written decode loop passes them (``seq[:, -1:]``) or every other row: strided views reach
    the embedding gather kernel, in half precision."""
    pm = _embedding_lora_model(dtype)
    names = ["a", "__base__", "b", "a", "b"]
    wide = torch.randint(3, 97, (2 * len(names), 9), device=DEV)
    ids = wide[: len(names), -1:] if view == "last-column" else wide[::2]
    assert not ids.is_contiguous()
    _assert_mixed_batch_matches(pm, names, dtype, what=f"embedding LoRA, {view} ids", ids=ids)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_alora_mixed_half(dtype):
    """aLoRA rows (PEFT's forward in each layer) mixed with kernel rows, in half precision: the same logits as PEFT's
    own ``adapter_names`` path."""
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[7, 8],
                   task_type="CAUSAL_LM"),
    }  # fmt: skip
    pm = add_adapters(model.to(DEV), specs).to(dtype)
    names = ["al", "a", "__base__", "al", "a"]
    ids = torch.randint(9, 97, (len(names), 10), device=DEV)
    ids[:, 4:6] = torch.tensor([7, 8], device=DEV)
    with torch.no_grad():
        ref = pm(ids, adapter_names=names).logits.float()
        base = pm(ids, adapter_names=["__base__"] * len(names)).logits.float()
    assert (ref[0] - base[0]).abs().max() > 0.05
    enable_csgmv(pm)
    try:
        with torch.no_grad():
            out = pm(ids, adapter_ids=names).logits.float()
    finally:
        disable_csgmv(pm)
    assert_close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()) * 2, what="aLoRA mixed logits")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lora_bias_half(dtype):
    """``lora_bias=True`` adapters mixed with plain ones, in half precision."""
    model, targets = tiny_model("qwen2")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "lb": dict(r=4, lora_alpha=8, target_modules=targets, lora_bias=True),
    }
    pm = add_adapters(model.to(DEV), specs)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B.lb.bias" in name:
                p.add_(0.5 * torch.randn_like(p))
    pm.to(dtype)
    _assert_mixed_batch_matches(pm, ["lb", "__base__", "a", "lb", "a"], dtype, what="lora_bias logits")


def test_bound_launches_on_later_calls():
    """From the third call with the same ids on, the layers go through the bound launches (device addresses,
    prepared argument lists): every patched layer has a binding, and the output is bit-identical to the first call's
    and matches per-adapter PEFT runs."""
    from helpers import close, interleaved, make, make_batch, per_adapter, stitch

    model = make("llama")
    names = interleaved(6)
    input_ids, mask = make_batch(6, 7)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model)
    try:
        from peft_csgmv.kernels import BoundLayer

        first = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        model(input_ids, attention_mask=mask, adapter_ids=names)  # a plan's second use binds its launches
        runs = list(model._csgmv.executor.plans.values())
        bound = [b for r in runs for b in r.bound.values()]
        assert bound and all(isinstance(b, BoundLayer) for b in bound), "no bound launches after the second call"
        second = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    assert torch.equal(first, second)
    close(second, stitch(outs, names), "bound launches vs per-adapter runs")


def test_model_moved_after_enable():
    """Moving the model between devices after enable_csgmv: the stacks follow on the next call, the result still
    matches, and no binding keeps the old device's stack tensors alive."""
    from helpers import close, interleaved, make, make_batch

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
        model.to(DEV)
        back = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    close(on_cpu, on_gpu.cpu(), "after moving to the CPU")
    close(back, on_gpu, "after moving back")


def _chain(layers, plan, x, out_of_place):
    """``x`` through ``layers`` of base matmul + LoRA, each layer's input the previous layer's output: every kernel
    reads what the one before it wrote, and the shrinks of all layers share one workspace (``t``)."""
    t = None
    for w, a, b, r, scal in layers:
        y = x @ w
        if t is None:
            t = shrink(x, a, r, plan)
        else:
            shrink(x, a, r, plan, t=t)
        x = expand(t, b, r, scal, plan, y, out=torch.empty_like(y) if out_of_place else None)
    return x


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "out-of-place"])
def test_pdl_launches_give_the_serial_launches_results(out_of_place, monkeypatch):
    """On Hopper the kernels launch with programmatic dependent launch (each may start while the one before it ends,
    and waits for it before touching activations): a chain of layers, each reading what the last wrote, gives
    bit for bit what launches that wait in full give, eagerly and replayed from a CUDA graph, 20 times over."""
    from peft_csgmv.kernels import launch

    if torch.cuda.get_device_capability()[0] < 9 or not launch._triton_has_pdl():
        pytest.skip("programmatic dependent launch needs sm_90 and a Triton with launch_pdl")
    torch.manual_seed(0)
    dt, k = torch.bfloat16, 2048
    layers = []
    for i in range(12):
        a, b, r, scal = _stack(32, [16] * 32, k, k, dt, seed=i)
        layers.append((torch.randn(k, k, device=DEV, dtype=dt) / k**0.5, a, b, r, scal))
    rows = list(range(32))
    if out_of_place:
        # Base rows too, in segments of slot -1 as a static plan has them (out of place, the plan covers every row).
        from peft_csgmv.mapping import StaticPlan
        from peft_csgmv.ops import _plan

        rows[::5] = [-1] * len(rows[::5])
        static = StaticPlan(32, 32, 1, torch.device(DEV))
        static.fill(tuple(rows))
        plan = _plan(static.permutation, static.seg_indptr, static.seg_slot, static.chunk, runs=False)
    else:
        plan = BatchPlan.build(rows, 1, DEV)
    x = torch.randn(32, k, device=DEV, dtype=dt)

    def results():
        eager = [_chain(layers, plan, x, out_of_place) for _ in range(20)]
        static_x = x.clone()
        _chain(layers, plan, static_x, out_of_place)  # warm up (compile) outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = _chain(layers, plan, static_x, out_of_place)
        replays = []
        for _ in range(20):
            graph.replay()
            replays.append(out.clone())
        return eager, replays

    launch.reset_pdl()
    assert launch.pdl(torch.device(DEV, torch.cuda.current_device()))
    with_pdl = results()
    monkeypatch.setenv("PEFT_CSGMV_PDL", "0")
    launch.reset_pdl()
    try:
        assert not launch.pdl(torch.device(DEV, torch.cuda.current_device()))
        eager, _ = results()
    finally:
        monkeypatch.delenv("PEFT_CSGMV_PDL")
        launch.reset_pdl()
    serial = eager[0]
    assert torch.isfinite(serial).all() and serial.abs().sum() > 0
    for got in with_pdl[0] + with_pdl[1]:
        assert torch.equal(got, serial)


def _beside_matches_serial(chain, device) -> None:
    """``chain(x, beside)`` over 20 random bf16 inputs (32, 2048): beside gives the serial numbers bit for bit, eagerly
    (one stream: no side stream made) and replayed from a CUDA graph (the side stream forked under capture) with a new
    input before each replay."""
    from peft_csgmv import ops

    with torch.no_grad():
        inputs = [torch.randn(32, 2048, device=DEV, dtype=torch.bfloat16) for _ in range(20)]
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


def test_group_beside_base_products_gives_the_serial_results():
    """``peft_csgmv::lora_group_linear`` (a q/k/v group's LoRA on a side stream beside the three base products, one
    fork and one join) over a chain of blocks, each reading what the last wrote: bit for bit the base products followed
    by ``peft_csgmv::lora_group`` on one stream, eagerly and replayed from a CUDA graph with a new input before each of
    20 replays."""
    import transformers as tf

    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=2048, intermediate_size=256, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=8,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    targets = ["q_proj", "k_proj", "v_proj"]
    specs = {f"a{i}": dict(r=8 + 8 * (i % 2), lora_alpha=32, target_modules=targets) for i in range(32)}
    pm = add_adapters(model, specs)
    pm.to(torch.bfloat16).to(DEV)
    enable_csgmv(pm)
    blocks = [[getattr(layer.self_attn, t) for t in targets] for layer in pm.base_model.model.model.layers]
    device = torch.device(DEV, torch.cuda.current_device())
    static = StaticPlan(32, 32, 1, device)
    static.fill(tuple(-1 if i % 5 == 0 else (7 * i) % 32 for i in range(32)))
    plan = (static.permutation, static.seg_indptr, static.seg_slot)

    def chain(x, beside: bool):
        for members in blocks:
            stacks = [m._csgmv_stack.handle for m in members]
            versions = [m._csgmv_stack.version for m in members]
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


@pytest.mark.parametrize("adapters", ["fp32", "bf16"])
def test_lora_beside_base_product_gives_the_serial_results(adapters):
    """``peft_csgmv::lora_linear`` (the LoRA on a side stream beside the base product, joined before it returns) over
    a chain of layers, each reading what the last wrote: bit for bit the base product followed by the ``lora`` op,
    eagerly (one stream) and replayed from a CUDA graph (the side stream, forked under capture) with a new input before
    each of 20 replays (a missing join would read ``delta`` before it is written, or let the next layer overwrite a
    buffer the side stream still reads)."""
    import transformers as tf

    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    cfg = tf.LlamaConfig(
        vocab_size=128, hidden_size=2048, intermediate_size=256, num_hidden_layers=8, num_attention_heads=16,
        num_key_value_heads=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)  # PEFT keeps its adapters in fp32 on it
    pm = add_adapters(model, {f"a{i}": dict(r=16, lora_alpha=32, target_modules=["q_proj"]) for i in range(32)})
    if adapters == "bf16":
        pm.to(torch.bfloat16)
    pm.to(DEV)
    enable_csgmv(pm)
    layers = [layer.self_attn.q_proj for layer in pm.base_model.model.model.layers]
    assert layers[0]._csgmv_stack.a.dtype == (torch.float32 if adapters == "fp32" else torch.bfloat16)
    device = torch.device(DEV, torch.cuda.current_device())
    static = StaticPlan(32, 32, 1, device)
    static.fill(tuple(-1 if i % 5 == 0 else (7 * i) % 32 for i in range(32)))  # base rows too
    plan = (static.permutation, static.seg_indptr, static.seg_slot)

    def chain(x, beside: bool):
        for layer in layers:
            stack, base = layer._csgmv_stack, layer.base_layer
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


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_deferred_stop_check_gives_the_undeferred_sequences(cache, monkeypatch):
    """``defer_stop_check`` (on by default for calls that do not sample): transformers' deferred loop on CUDA gives the
    sequences of its undeferred loop, in fp32, where every row stops on an EOS token before ``max_new_tokens`` (the
    deferred loop runs one more step and takes it back), greedy and sampled (the same seed), over the dynamic cache
    and the static cache's compiled steps. The deferred loop really ran: transformers built its DeferredStopCheck."""
    from transformers.generation import utils as generation

    from peft_csgmv import _compat

    if not _compat._install_deferred_stop_check():
        pytest.skip("this transformers has no DeferredStopCheck")
    built = []
    original_init = generation.DeferredStopCheck.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(generation.DeferredStopCheck, "__init__", counting_init)
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "b": dict(r=16, lora_alpha=8, target_modules=targets),
    }
    pm = add_adapters(model.to(DEV), specs)
    names = ["a", "__base__", "b", "a", "b"]
    input_ids = torch.randint(3, 97, (len(names), 10), device=DEV, generator=torch.Generator(DEV).manual_seed(0))
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), adapter_ids=names, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    enable_csgmv(pm)
    try:
        for sample in (False, True):
            extra = dict(do_sample=True, top_k=20) if sample else dict(do_sample=False)

            def run(defer: bool, **more):
                enable_csgmv(pm, defer_stop_check=defer)
                torch.manual_seed(7)
                with torch.no_grad():
                    return pm.generate(**kw, **extra, **more)

            # The same logits processors as below (no minimum length), with an EOS token the rows do not reach.
            free = run(False, max_new_tokens=8, eos_token_id=model.config.vocab_size - 1)
            # Each row's third new token is an EOS token: every row stops by the third step.
            eos = sorted(set(free[:, input_ids.shape[1] + 2].tolist()))
            before = len(built)
            undeferred = run(False, max_new_tokens=8, eos_token_id=eos)
            assert len(built) == before
            deferred = run(True, max_new_tokens=8, eos_token_id=eos)
            assert len(built) == before + 1, "the deferred loop did not run"
            assert undeferred.shape[1] < input_ids.shape[1] + 8, "no early stop: the test proves nothing"
            assert torch.equal(deferred, undeferred), f"sample={sample}: the deferred loop changed the sequences"
    finally:
        disable_csgmv(pm)
