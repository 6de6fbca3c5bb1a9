"""Parity of csgmv mixed-adapter batches with stock PEFT, the way PEFT tests its own ``adapter_names`` path.

Every adapter is randomly initialised (``init_lora_weights=False``) and each test first checks that the adapters
really change the output. A mixed batch is then compared

* row by row against stock PEFT runs of the same batch with that row's adapter active (``set_adapter``; base rows
  under ``with model.disable_adapter()``), so that padding and shapes are the same, and
* against PEFT's own mixed-batch path (``adapter_names=``), computed before ``enable_csgmv``.

Most tests run on both backends: ``torch`` (the reference kernels) and ``triton`` (under the Triton interpreter on
CPU, which is slow: models are tiny, sequences short, and the heavier generation tests run Triton on a subset of
architectures). Everything is fp32, where the Triton interpreter's ``tl.dot`` is exact enough. Where CUDA is
available the same tests run on the GPU (real Triton kernels).
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    CLEAR_MARGIN,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    assert_generations_differ,
    assert_mixed_batch_matches,
    close,
    greedy_kwargs,
    interleaved,
    make,
    make_batch,
    norm,
    per_adapter,
    stitch,
    tiny_model,
)
from peft import LoraConfig

from peft_csgmv import disable_csgmv, enable_csgmv, is_csgmv_enabled
from peft_csgmv._compat import cache_kwarg, output_cache
from peft_csgmv.executor import active_calls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

ARCHS = ["llama", "qwen2", "mistral", "gpt2", "opt"]


# --------------------------------------------------------------------------------------------------------------------
# forward parity
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_forward_parity(arch, backend, kernel_calls):
    """Left-padded batch, base rows interleaved with two adapters of different rank and alpha."""
    model = make(arch)
    input_ids, mask = make_batch(6, 5)
    names = interleaved(6)

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = per_adapter(model, names, run)
    assert_adapters_matter(outs)
    expected = stitch(outs, names)
    # OPT flattens hidden states to (batch * seq, features) before fc1/fc2, where PEFT's own layer-level length check
    # rejects adapter_names; csgmv handles it (rows = a whole multiple of the ids), so OPT compares to per-adapter runs.
    peft_mixed = None
    if arch != "opt":
        with torch.no_grad():
            peft_mixed = run(adapter_names=names)
        close(peft_mixed, expected, "PEFT adapter_names vs per-adapter runs")

    enable_csgmv(model, backend=backend)
    out = run(adapter_ids=names)
    assert kernel_calls and all(flag == (backend == "triton") for flag in kernel_calls)
    close(out, expected, f"{arch}/{backend} csgmv vs per-adapter runs")
    if peft_mixed is not None:
        close(out, peft_mixed, f"{arch}/{backend} csgmv vs PEFT adapter_names")
    assert active_calls() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapter_config_variants(backend):
    """Different ranks and alphas, rsLoRA, rank_pattern / alpha_pattern, and an adapter on only some layers."""
    _, targets = tiny_model("llama")
    specs = {
        "small": dict(r=2, lora_alpha=3, target_modules=targets),
        "rs": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=targets),
        "pat": dict(
            r=4,
            lora_alpha=4,
            target_modules=targets,
            rank_pattern={"q_proj": 8, "layers.1.mlp.down_proj": 2},
            alpha_pattern={"v_proj": 32},
        ),  # fmt: skip
        "part": dict(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj"], layers_to_transform=[1]),
    }
    model = make("llama", specs)
    layers = model.base_model.model.model.layers
    # The configs took effect as intended (else the test would not cover what it says).
    assert layers[0].self_attn.q_proj.r["pat"] == 8 and layers[0].self_attn.k_proj.r["pat"] == 4
    assert layers[1].mlp.down_proj.r["pat"] == 2 and layers[0].mlp.down_proj.r["pat"] == 4
    assert layers[0].self_attn.v_proj.scaling["pat"] == 32 / 4
    assert layers[0].self_attn.q_proj.scaling["rs"] == pytest.approx(16 / 8**0.5)
    assert "part" not in layers[0].self_attn.q_proj.r and layers[1].self_attn.q_proj.r["part"] == 6
    assert "part" not in layers[1].self_attn.k_proj.r

    input_ids, mask = make_batch(6, 5, seed=1)
    names = ["small", "rs", BASE, "pat", "part", "small"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = per_adapter(model, names, run)
    assert_adapters_matter(outs)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = run(adapter_names=names)

    enable_csgmv(model, backend=backend)
    out = run(adapter_ids=names)
    close(out, expected, "csgmv vs per-adapter runs")
    close(out, peft_mixed, "csgmv vs PEFT adapter_names")
    # The stacks carry PEFT's per-layer rank and scaling (pattern-adjusted), rank 0 where an adapter is absent.
    state = model._csgmv
    for layer in state.layers.values():
        stack = layer._csgmv_record.stack
        for name, slot in state.registry.index.items():
            assert stack.ranks_host[slot] == layer.r.get(name, 0)
            assert stack.scalings_host[slot] == pytest.approx(layer.scaling.get(name, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_base(backend, kernel_calls):
    """None and "__base__" both mean base; an all-base batch is the base model bit for bit and runs no kernel."""
    model = make()
    input_ids, mask = make_batch(3, 5)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids, attention_mask=mask).logits
    with torch.no_grad():
        adapted = model(input_ids, attention_mask=mask).logits
    assert (adapted - base).abs().max() > CLEAR_MARGIN

    enable_csgmv(model, backend=backend)
    for ids in ([None, BASE, None], [BASE] * 3, [None] * 3, [None]):
        out = model(input_ids, attention_mask=mask, adapter_ids=ids).logits
        assert torch.equal(out, base), ids
    assert kernel_calls == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_rows_same_adapter(backend):
    model = make()
    input_ids, mask = make_batch(3, 5)

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = per_adapter(model, ["a1", BASE], run)
    assert_adapters_matter(outs)
    enable_csgmv(model, backend=backend)
    close(run(adapter_ids=["a1"] * 3), outs["a1"], "three rows of a1")
    close(run(adapter_ids=["a1"]), outs["a1"], "one id for three rows")


def test_id_spellings():
    """adapter_names (PEFT's spelling) and adapter_ids, lists and tuples, None and "__base__": all the same call."""
    model = make()
    input_ids, mask = make_batch(3, 5)
    names = [BASE, "a0", "a1"]
    with torch.no_grad():
        peft_mixed = model(input_ids, attention_mask=mask, adapter_names=names).logits

    enable_csgmv(model, backend="torch")
    ref = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(ref, peft_mixed, "adapter_ids vs PEFT adapter_names")
    for kw in (
        dict(adapter_names=names),
        dict(adapter_ids=[None, "a0", "a1"]),
        dict(adapter_names=[None, "a0", "a1"]),
        dict(adapter_ids=tuple(names)),
    ):
        assert torch.equal(model(input_ids, attention_mask=mask, **kw).logits, ref), kw
    # input_ids as a keyword too (the batch size is read from either).
    assert torch.equal(model(input_ids=input_ids, attention_mask=mask, adapter_ids=names).logits, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ids_cover_consecutive_rows(backend):
    """A batch that is a whole multiple of len(ids): each id covers that many consecutive rows (repeat_interleave)."""
    model = make()
    input_ids, mask = make_batch(4, 5)
    ids = ["a0", "a1"]
    expanded = ["a0", "a0", "a1", "a1"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = per_adapter(model, expanded, run)
    assert_adapters_matter(outs)
    with torch.no_grad():
        peft_mixed = run(adapter_names=expanded)
    enable_csgmv(model, backend=backend)
    out = run(adapter_ids=ids)
    close(out, stitch(outs, expanded), "csgmv vs per-adapter runs")
    close(out, peft_mixed, "csgmv vs PEFT adapter_names with expanded names")
    # Not tiled: [a1, base] must not act like [a1, base, a1, base].
    out2 = run(adapter_ids=["a1", None])
    close(out2, stitch({**outs, **per_adapter(model, ["a1", BASE], run)}, ["a1", "a1", BASE, BASE]), "[a1, None]")


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapters_change_output(backend):
    """The same prompt in every row: each csgmv row differs clearly from the others and from the base model."""
    model = make()
    input_ids, mask = make_batch(1, 6, left_pad=False)
    input_ids, mask = input_ids.repeat(3, 1), mask.repeat(3, 1)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids, attention_mask=mask).logits
    enable_csgmv(model, backend=backend)
    out = model(input_ids, attention_mask=mask, adapter_ids=[None, "a0", "a1"]).logits
    assert torch.equal(out[0], base[0])  # base row: untouched by the kernels
    for i in (1, 2):
        assert (out[i] - base[i]).abs().max() > CLEAR_MARGIN, f"row {i} looks like the base model"
    assert (out[1] - out[2]).abs().max() > CLEAR_MARGIN, "a0 and a1 rows look alike"


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_cache_decode(backend):
    """Prefill, then one decode step with past_key_values, matches PEFT's adapter_names and per-adapter runs."""
    model = make()
    input_ids, mask = make_batch(3, 5)
    names = [BASE, "a0", "a1"]
    next_ids = torch.tensor([[11], [12], [13]], device=DEVICE)
    mask2 = torch.cat([mask, torch.ones_like(next_ids)], dim=1)

    def two_steps(**kw):
        first = model(input_ids, attention_mask=mask, use_cache=True, **kw)
        cache = {cache_kwarg(model): output_cache(first)}  # transformers 5.24 renamed past_key_values to cache
        second = model(next_ids, attention_mask=mask2, use_cache=True, **cache, **kw)
        return torch.cat([first.logits, second.logits], dim=1)

    outs = per_adapter(model, names, two_steps)
    assert_adapters_matter(outs)
    with torch.no_grad():
        peft_mixed = two_steps(adapter_names=names)
    enable_csgmv(model, backend=backend)
    out = two_steps(adapter_ids=names)
    close(out, stitch(outs, names), "csgmv vs per-adapter runs")
    close(out, peft_mixed, "csgmv vs PEFT adapter_names")


# --------------------------------------------------------------------------------------------------------------------
# generate
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,backend",
    [
        ("llama", "torch"),
        ("llama", "triton"),
        ("gpt2", "torch"),
        ("gpt2", "triton"),
        ("opt", "torch"),
        ("qwen2", "torch"),
    ],  # fmt: skip
)
def test_greedy_generate(arch, backend):
    """Greedy generate (prefill + KV-cache decode steps), left-padded: token-identical in fp32 to PEFT's adapter_names
    generate and to per-adapter runs."""
    model = make(arch)
    input_ids, mask = make_batch(3, 5, seed=2)
    names = [BASE, "a0", "a1"]
    kw = greedy_kwargs()

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = per_adapter(model, names, gen)
    assert_generations_differ(outs)
    expected = stitch(outs, names)
    peft_mixed = None
    if arch != "opt":  # see test_forward_parity
        with torch.no_grad():
            peft_mixed = gen(adapter_names=names)
        assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend=backend)
    out = gen(adapter_ids=names)
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"
    if peft_mixed is not None:
        assert torch.equal(out, peft_mixed)
    assert torch.equal(gen(adapter_names=names), out)  # PEFT's spelling takes the same path
    assert active_calls() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_beam_search(backend):
    """num_beams=2: the layers see batch × beams rows; token-identical to per-adapter and PEFT adapter_names runs."""
    model = make()
    input_ids, mask = make_batch(3, 5, seed=3)
    names = ["a1", BASE, "a0"]
    kw = greedy_kwargs(4, num_beams=2)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = per_adapter(model, names, gen)
    expected = stitch(outs, names)
    assert_generations_differ(outs)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=names)
    assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend=backend)
    out = gen(adapter_ids=names)
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"


def test_beam_search_num_return_sequences():
    model = make()
    input_ids, mask = make_batch(3, 5, seed=4)
    names = ["a0", "a1", None]
    kw = greedy_kwargs(4, num_beams=2, num_return_sequences=2)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = per_adapter(model, names, gen)
    assert_generations_differ(outs)
    expanded = [n for n in names for _ in range(2)]
    expected = stitch(outs, expanded)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=[norm(n) for n in names])
    assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend="torch")
    out = gen(adapter_ids=names)
    assert out.shape[0] == 2 * len(names)
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"


def test_sampling_num_return_sequences():
    """do_sample with num_return_sequences=2: the layers see 2 × batch rows (each prompt repeated in place).

    PEFT's own adapter_names path cannot run this (it only expands the names for beam search). On CPU,
    ``torch.multinomial`` draws one random number per row and step, independent of the other rows' distributions, so
    with the same seed every row equals that row of its adapter's own full-batch sampling run (not assumed of CUDA).
    """
    model = make()
    input_ids, mask = make_batch(2, 5, seed=5)
    names = ["a0", "a1"]
    kw = dict(max_new_tokens=5, min_new_tokens=5, do_sample=True, num_return_sequences=2, top_k=0, temperature=1.5)

    def gen(**extra):
        torch.manual_seed(1234)
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = per_adapter(model, names, gen)
    assert_generations_differ(outs)
    enable_csgmv(model, backend="torch")
    out = gen(adapter_ids=names)
    assert out.shape == (2 * len(names), input_ids.shape[1] + 5)
    assert torch.equal(out[:, : input_ids.shape[1]], input_ids.repeat_interleave(2, dim=0))
    if DEVICE.type == "cpu":
        assert torch.equal(out, stitch(outs, ["a0", "a0", "a1", "a1"])), f"\n{out}\n{outs}"


# --------------------------------------------------------------------------------------------------------------------
# stock behaviour around the fast path
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_ids_is_stock_peft(backend, kernel_calls):
    model = make()
    input_ids, mask = make_batch(3, 5)
    with torch.no_grad():
        stock_a0 = model(input_ids, attention_mask=mask).logits
        gen_a0 = model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(3))
        model.set_adapter("a1")
        stock_a1 = model(input_ids, attention_mask=mask).logits
        model.set_adapter("a0")
    assert (stock_a0 - stock_a1).abs().max() > CLEAR_MARGIN

    enable_csgmv(model, backend=backend)
    assert torch.equal(model(input_ids, attention_mask=mask).logits, stock_a0)
    assert torch.equal(model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(3)), gen_a0)
    model.set_adapter("a1")
    assert torch.equal(model(input_ids, attention_mask=mask).logits, stock_a1)
    model.set_adapter("a0")
    assert torch.equal(model(input_ids, attention_mask=mask).logits, stock_a0)
    assert kernel_calls == []


def test_disable_adapter_ignores_ids(kernel_calls):
    model = make()
    input_ids, mask = make_batch(3, 5)
    with torch.no_grad(), model.disable_adapter():
        base = model(input_ids, attention_mask=mask).logits
        base_gen = model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(3))
        # Stock PEFT does not even validate adapter_names there: an unknown name and a wrong length are ignored.
        peft_ignored = model(input_ids, attention_mask=mask, adapter_names=["nope"] * 2).logits
    assert torch.equal(peft_ignored, base)
    enable_csgmv(model, backend="torch")
    names = ["a0", "a1", "a0"]
    assert (model(input_ids, attention_mask=mask, adapter_ids=names).logits - base).abs().max() > CLEAR_MARGIN
    kernel_calls.clear()
    with model.disable_adapter():
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_ids=names).logits, base)
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_names=names).logits, base)
        gen = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, **greedy_kwargs(3))
        assert torch.equal(gen, base_gen)
        # As in PEFT, not even validated.
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_ids=["nope"] * 2).logits, base)
    assert kernel_calls == []
    # And enabled again afterwards.
    assert (model(input_ids, attention_mask=mask, adapter_ids=names).logits - base).abs().max() > CLEAR_MARGIN

    # LoraModel.disable_adapter_layers() disables the layers without PeftModel's flag: the layers still fall back.
    model.base_model.disable_adapter_layers()
    try:
        kernel_calls.clear()
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_ids=names).logits, base)
        assert kernel_calls == []
    finally:
        model.base_model.enable_adapter_layers()
    assert (model(input_ids, attention_mask=mask, adapter_ids=names).logits - base).abs().max() > CLEAR_MARGIN


@pytest.mark.parametrize("backend", BACKENDS)
def test_disable_csgmv_restores_stock(backend):
    model = make()
    input_ids, mask = make_batch(3, 5)
    names = [BASE, "a0", "a1"]
    with torch.no_grad():
        stock = model(input_ids, attention_mask=mask).logits
        peft_mixed = model(input_ids, attention_mask=mask, adapter_names=names).logits
        stock_gen = model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(3))

    enable_csgmv(model, backend=backend)
    fast = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(fast, peft_mixed, "csgmv vs PEFT adapter_names")
    assert is_csgmv_enabled(model)

    assert disable_csgmv(model) is model
    assert not is_csgmv_enabled(model)
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__
    for module in model.modules():
        assert not any(k.startswith("_csgmv") for k in module.__dict__), module
        assert "forward" not in module.__dict__, module
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask=mask).logits, stock)
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_names=names).logits, peft_mixed)
        assert torch.equal(model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(3)), stock_gen)
        # adapter_ids means nothing to stock PEFT any more: transformers swallows the stray forward kwarg (the active
        # adapter a0 is applied to every row), and generate rejects it.
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_ids=names).logits, stock)
        with pytest.raises(ValueError, match="adapter_ids"):
            model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, max_new_tokens=2)
    disable_csgmv(model)  # idempotent
    # And it can be enabled again.
    enable_csgmv(model, backend=backend)
    assert torch.equal(model(input_ids, attention_mask=mask, adapter_ids=names).logits, fast)


@pytest.mark.parametrize("backend", BACKENDS)
def test_adapter_lifecycle_after_enable(backend):
    """add_adapter / delete_adapter on an enabled model are picked up by the next call; freed slots are reused
    without stale weights; a re-added name gets its new weights."""
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=attention),
        "a1": dict(r=8, lora_alpha=4, target_modules=attention),
    }
    model = make("llama", specs)
    input_ids, mask = make_batch(4, 4)

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    def check(names, what):
        outs = per_adapter(model, names, run)
        assert_adapters_matter(outs)
        close(run(adapter_ids=names), stitch(outs, names), what)

    enable_csgmv(model, backend=backend)
    check([BASE, "a0", "a1", "a0"], "initial")
    a0_slot = model._csgmv.registry.index["a0"]
    patched = set(model._csgmv.layers)

    # A larger rank than any so far (the stacks grow), and down_proj, which no adapter targeted before: PEFT wraps
    # new LoRA layers, which csgmv must patch on the next call.
    torch.manual_seed(11)
    model.add_adapter(
        "a2", LoraConfig(init_lora_weights=False, r=12, lora_alpha=6, target_modules=["q_proj", "down_proj"])
    )
    check(["a2", "a0", BASE, "a1"], "after add_adapter(a2)")
    assert {n for n in model._csgmv.layers if n not in patched} == {
        f"base_model.model.model.layers.{i}.mlp.down_proj" for i in range(2)
    }

    model.delete_adapter("a0")
    with pytest.raises(ValueError, match="non-existing adapter"):
        run(adapter_ids=["a0", "a1", "a2", None])
    assert active_calls() == 0
    check(["a1", "a2", "a2", BASE], "after delete_adapter(a0)")

    # a3 reuses a0's slot but targets only k_proj: every other layer must have that slot cleared.
    torch.manual_seed(12)
    model.add_adapter("a3", LoraConfig(init_lora_weights=False, r=2, lora_alpha=8, target_modules=["k_proj"]))
    check(["a3", "a1", BASE, "a2"], "after add_adapter(a3)")
    assert model._csgmv.registry.index["a3"] == a0_slot

    # Re-adding a deleted name with new weights and targets: the new weights are used.
    model.delete_adapter("a1")
    torch.manual_seed(13)
    model.add_adapter(
        "a1", LoraConfig(init_lora_weights=False, r=3, lora_alpha=5, target_modules=["v_proj", "up_proj"])
    )
    check(["a1", "a3", "a2", "a1"], "after re-adding a1")


def test_fp16_model_fp32_adapters():
    """fp16 base model (PEFT keeps LoRA weights in fp32), torch backend: by default the stacks are fp32, the adapters'
    own dtype, within fp16 tolerance of PEFT; ``dtype=float16`` rounds the adapter weights (looser tolerance)."""
    model = make(dtype=torch.float16)
    lora_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["a0"].weight
    assert lora_a.dtype == torch.float32  # autocast_adapter_dtype
    input_ids, mask = make_batch(3, 5)
    names = [BASE, "a0", "a1"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = per_adapter(model, names, run)
    assert_adapters_matter(outs)
    with torch.no_grad():
        peft_mixed = run(adapter_names=names)
    enable_csgmv(model, backend="torch", dtype=torch.float16)
    assert next(iter(model._csgmv.layers.values()))._csgmv_record.stack.data.dtype == torch.float16
    close(run(adapter_ids=names), peft_mixed, "fp16 stacks vs PEFT adapter_names", dtype=torch.bfloat16)
    enable_csgmv(model, backend="torch")  # enabling again with another dtype restacks in it: the adapters' own
    for layer in model._csgmv.layers.values():
        assert layer._csgmv_record.stack.data.dtype == torch.float32
    out = run(adapter_ids=names)
    assert out.dtype == torch.float16
    close(out, peft_mixed, "csgmv vs PEFT adapter_names", dtype=torch.float16)
    close(out, stitch(outs, names), "csgmv vs per-adapter runs", dtype=torch.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_enable_again_restacks_edited_weights(backend):
    """Adapter weights edited in place: calling enable_csgmv again restacks them (the documented way)."""
    model = make()
    input_ids, mask = make_batch(3, 5)
    names = ["a1", BASE, "a0"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    enable_csgmv(model, backend=backend)
    before = run(adapter_ids=names)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "lora_B") and "a0" in module.lora_B:
                module.lora_B["a0"].weight.mul_(-2.0)
    outs = per_adapter(model, names, run)
    expected = stitch(outs, names)
    assert (expected[2] - before[2]).abs().max() > CLEAR_MARGIN
    enable_csgmv(model, backend=backend)
    close(run(adapter_ids=names), expected, "after enable_csgmv again")


@pytest.mark.parametrize("how", ["rescale_adapter_scale", "set_scale", "scale_layer"])
def test_rescaled_adapters_are_restacked(how):
    """PEFT's ways of rescaling adapters after enable_csgmv reach the stacks: the next call matches stock PEFT."""
    from peft.helpers import rescale_adapter_scale
    from peft.tuners.lora import LoraLayer

    model = make("llama")
    names = interleaved(5)
    input_ids, mask = make_batch(5, 6)

    def fwd():
        return model(input_ids, attention_mask=mask).logits

    before = per_adapter(model, names, fwd)
    enable_csgmv(model, backend="torch")
    try:
        layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
        if how == "rescale_adapter_scale":
            with rescale_adapter_scale(model, 0.3):
                got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
                expected = stitch(per_adapter(model, names, fwd), names)
            after = model(input_ids, attention_mask=mask, adapter_ids=names).logits
            close(after, stitch(before, names), "after the context, the original scale")
        else:
            for layer in layers:
                if how == "set_scale":
                    layer.set_scale("a1", 0.25)
                else:
                    model.set_adapter("a0")
                    layer.scale_layer(2.0)  # scales the active adapter
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
            expected = stitch(per_adapter(model, names, fwd), names)
    finally:
        disable_csgmv(model)
    assert (expected - stitch(before, names)).abs().max() > CLEAR_MARGIN, "the rescale changed nothing"
    close(got, expected, f"after {how}")


def test_merge_and_unload_after_enable():
    """merge_and_unload on an enabled model behaves as in PEFT: the merged base model equals the active adapter's
    output, and carries no csgmv patch."""
    from peft_csgmv.patching import is_patched

    model = make("llama")
    model.set_adapter("a1")
    input_ids, mask = make_batch(3, 5)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask).logits
    enable_csgmv(model, backend="torch")
    merged = model.merge_and_unload()
    assert not any(is_patched(m) for m in merged.modules())
    with torch.no_grad():
        close(merged(input_ids, attention_mask=mask).logits, expected, "merged model")


def test_merge_then_unmerge_after_enable():
    model = make("llama")
    names = interleaved(4)
    input_ids, mask = make_batch(4, 5)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask, adapter_names=names).logits
    enable_csgmv(model, backend="torch")
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged adapters"):
        model(input_ids, attention_mask=mask, adapter_ids=names)
    model.unmerge_adapter()
    close(model(input_ids, attention_mask=mask, adapter_ids=names).logits, expected, "after unmerge", torch.float32)


def test_plan_built_once_per_shape(monkeypatch):
    """One plan per call per (rows × tokens) shape, shared by every layer: a forward through 14 LoRA layers builds
    one; a whole generate call builds one per distinct shape (prefill, lm_head's last position, decode steps), not one
    per layer or per step; a repeated call with the same ids builds none."""
    from peft_csgmv.plan import BatchPlan

    builds = []
    real = BatchPlan.build.__func__

    def counting(cls, *args, **kwargs):
        builds.append(args[1] if len(args) > 1 else kwargs.get("tokens_per_row"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(BatchPlan, "build", classmethod(counting))
    model = make("llama")
    names = interleaved(4)
    input_ids, mask = make_batch(4, 6)
    enable_csgmv(model, backend="torch")
    try:
        model(input_ids, attention_mask=mask, adapter_ids=names)
        assert builds == [6], builds
        model(input_ids, attention_mask=mask, adapter_ids=names)
        assert builds == [6], "a repeated call with the same ids and shape rebuilt its plan"
        builds.clear()
        model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=list(reversed(names)), **greedy_kwargs(6))
        assert builds == [6, 1], builds  # prefill; then lm_head's last position and every decode step share one
    finally:
        disable_csgmv(model)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_bias(backend, kernel_calls):
    """``lora_bias=True`` adapters in the kernels: each slot's ``lora_B`` bias is added in expand, before the
    scaling; parity with per-adapter runs and PEFT's ``adapter_names``."""
    _, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_bias=True),
    }
    model = make("llama", specs)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B.a1.bias" in name:
                p.add_(torch.randn(p.shape, generator=g).to(p.device) * 0.5)
    names = interleaved(6)
    input_ids, mask = make_batch(6, 7)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    with torch.no_grad():
        peft_mixed = model(input_ids, attention_mask=mask, adapter_names=names).logits
    enable_csgmv(model, backend=backend)
    try:
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    assert kernel_calls, "the kernels did not run"
    close(got, stitch(outs, names), "lora_bias vs per-adapter runs")
    close(got, peft_mixed, "lora_bias vs PEFT adapter_names")


def test_hooks_on_base_layers_still_run():
    """A patched layer calls its base layer's ``forward`` directly when nothing is hooked around it; a forward hook
    on the base layer (or a global one) makes it go through ``Module.__call__`` so the hook runs, as in stock PEFT."""
    model = make("llama")
    names = interleaved(4)
    input_ids, mask = make_batch(4, 5)
    base_q = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    seen = []
    enable_csgmv(model, backend="torch")
    try:
        expected = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        handle = base_q.register_forward_hook(lambda mod, inp, out: seen.append(out.shape) or out * 2)
        try:
            doubled = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        finally:
            handle.remove()
        assert seen == [torch.Size([4, 5, 48])], "the base layer's forward hook did not run"
        assert not torch.allclose(doubled, expected), "the hook's output change was lost"
        calls = []
        handle = torch.nn.modules.module.register_module_forward_pre_hook(
            lambda mod, inp: calls.append(mod) if mod is base_q else None
        )
        try:
            again = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        finally:
            handle.remove()
        assert calls == [base_q], "a global forward pre-hook did not see the base layer"
        assert torch.equal(again, expected)
    finally:
        disable_csgmv(model)


@pytest.mark.gpu
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
    pm = add_adapters(model.to("cuda"), specs)
    pm.to(dtype)  # adapters in the model dtype too, as a half-precision deployment would have them
    assert_mixed_batch_matches(pm, ["__base__", "a", "b", "c", "a", "__base__"], dtype, stack_dtype, f"{arch} logits")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_fp32_greedy_generate_token_identical(arch):
    model, targets = tiny_model(arch)
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "b": dict(r=32, lora_alpha=8, target_modules=targets),
    }
    pm = add_adapters(model.to("cuda"), specs)
    names = ["a", "__base__", "b", "a", "b"]
    ids = torch.randint(3, 97, (len(names), 10), device="cuda")
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_lora_bias_half(dtype):
    """``lora_bias=True`` adapters mixed with plain ones, in half precision."""
    model, targets = tiny_model("qwen2")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "lb": dict(r=4, lora_alpha=8, target_modules=targets, lora_bias=True),
    }
    pm = add_adapters(model.to("cuda"), specs)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B.lb.bias" in name:
                p.add_(0.5 * torch.randn_like(p))
    pm.to(dtype)
    assert_mixed_batch_matches(pm, ["lb", "__base__", "a", "lb", "a"], dtype, what="lora_bias logits")
