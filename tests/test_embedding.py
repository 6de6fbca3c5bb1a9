"""LoRA on embeddings through the kernels: the embedding-A gather (``kernels.embedding_shrink``) plus the expand step.

Kernel against a float64 oracle; models against each adapter's own stock PEFT run and PEFT's ``adapter_names``:
a plain embedding, Gemma3's scaled embedding (``embed_scale``), tied input/output embeddings, and an embedding with
``max_norm``, which stays on PEFT's own path."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ALL_LINEAR,
    BACKENDS,
    BASE,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    assert_close,
    assert_mixed_batch_matches,
    close,
    greedy_kwargs,
    interleaved,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)
from peft import LoraConfig, get_peft_model

from peft_csgmv import BatchPlan, disable_csgmv, enable_csgmv
from peft_csgmv.kernels import embedding_shrink, embedding_shrink_reference
from peft_csgmv.patching import is_patched

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "row_slots,tpr,ranks",
    [([0, 1, -1, 2], 3, [4, 16, 1]), ([1] * 20, 1, [0, 8, 3]), ([2, 0, 0, -1, 1], 17, [5, 0, 16])],
    ids=["mixed", "one-slot-decode", "chunks-rank0"],
)
def test_embedding_shrink_vs_float64(row_slots, tpr, ranks, dtype):
    vocab, r_max = 301, max(ranks)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(len(ranks), r_max, vocab, generator=g, dtype=torch.float64)
    for s, r in enumerate(ranks):
        a[s, r:] = 1e3  # padding past a slot's rank must never be read
    plan = BatchPlan.build(row_slots, tpr, DEVICE)
    ids = torch.randint(0, vocab, (plan.num_tokens,), generator=g).to(DEVICE)
    ranks_t = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
    sentinel = -7.0
    t = torch.full((plan.num_tokens, r_max), sentinel, device=DEVICE)
    embedding_shrink(ids, a.to(DEVICE, dtype), ranks_t, plan, t)
    expected = torch.full((plan.num_tokens, r_max), sentinel, dtype=torch.float64)
    for i, slot in enumerate(s for s in row_slots for _ in range(tpr)):
        if slot >= 0:
            r = ranks[slot]
            expected[i, :r] = a[slot, :r, ids[i].item()].to(dtype).double()
    assert_close(t.cpu(), expected, torch.float32, what="embedding shrink")
    ref = embedding_shrink_reference(ids, a.to(DEVICE, dtype), ranks, plan, torch.full_like(t, sentinel))
    assert_close(ref.cpu(), expected, torch.float32, what="embedding shrink reference")


def _check(model, backend, rows=6, seq=7, generate=False):
    names = interleaved(rows)
    input_ids, mask = make_batch(rows, seq)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    with torch.no_grad():
        peft_mixed = model(input_ids, attention_mask=mask, adapter_names=names).logits
    enable_csgmv(model, backend=backend)
    try:
        embed = model.get_input_embeddings()
        got = model(input_ids, attention_mask=mask, adapter_ids=[None if n == BASE else n for n in names]).logits
        if generate:
            kw = greedy_kwargs(4, pad_token_id=0)
            gen = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, **kw)
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "csgmv vs per-adapter PEFT runs")
    close(got, peft_mixed, "csgmv vs PEFT adapter_names")
    if generate:
        ref = per_adapter(model, names, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
        assert torch.equal(gen, stitch(ref, names))
    return embed


def _embedding_layer(model):
    from peft.tuners.lora import Embedding as LoraEmbedding

    layers = [m for m in model.modules() if isinstance(m, LoraEmbedding)]
    assert len(layers) == 1
    return layers[0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_llama_embedding_through_kernels(backend, kernel_calls):
    model, _ = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "v_proj"]),
        "a1": dict(r=8, lora_alpha=4, target_modules=["embed_tokens", *ALL_LINEAR]),
        "a2": dict(r=2, lora_alpha=4, target_modules=ALL_LINEAR),  # no embedding LoRA: rank 0 there
    }
    model = add_adapters(model, specs).to(DEVICE)
    layer = _embedding_layer(model)
    enable_csgmv(model, backend=backend)
    assert is_patched(layer) and layer._csgmv_record.stack.embedding
    disable_csgmv(model)
    _check(model, backend, generate=backend == "torch")
    assert kernel_calls, "no kernel ran"


def test_gemma3_scaled_embedding():
    """Gemma3 multiplies embeddings by ``embed_scale`` (√hidden); PEFT scales the LoRA output the same way."""
    model, _ = tiny_model("gemma3")
    assert float(model.get_input_embeddings().embed_scale) != 1.0
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
        "a1": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "v_proj"]),
    }
    _check(add_adapters(model, specs).to(DEVICE), "torch")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tied_embeddings_with_embedding_lora(backend):
    model, _ = tiny_model("llama", tie_word_embeddings=True)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
        "a1": dict(r=8, lora_alpha=4, target_modules=["embed_tokens", "o_proj"]),
    }
    model = add_adapters(model, specs).to(DEVICE)
    _check(model, backend)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().get_base_layer().weight


class MaxNormNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16, max_norm=1.0)
        self.out = torch.nn.Linear(16, 8)

    def forward(self, x):
        return self.out(self.emb(x))


def test_max_norm_embedding_takes_peft_path():
    """``max_norm`` renormalises looked-up rows inside F.embedding: that embedding keeps PEFT's own path."""
    torch.manual_seed(0)
    model = get_peft_model(MaxNormNet(), LoraConfig(init_lora_weights=False, r=4, target_modules=["emb", "out"]),
                           adapter_name="a0")  # fmt: skip
    model.add_adapter("a1", LoraConfig(init_lora_weights=False, r=2, lora_alpha=6, target_modules=["emb", "out"]))
    model = model.eval().to(DEVICE)
    x = torch.randint(0, 50, (5, 3), device=DEVICE)
    names = interleaved(5)
    outs = per_adapter(model, names, lambda: model(x))
    assert_adapters_matter(outs)
    enable_csgmv(model, backend="torch")
    try:
        layer = _embedding_layer(model)
        assert is_patched(layer) and layer._csgmv_record.stack is None
        got = model(x, adapter_ids=names)
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "max_norm embedding")


def _embedding_lora_model(dtype):
    """A tiny Llama with two adapters on the embedding (and linear layers), in ``dtype``."""
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", *targets]),
        "b": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    }
    return add_adapters(model.to("cuda"), specs).to(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_embedding_lora_half(dtype):
    """Embedding LoRA through the gather kernel, mixed with linear LoRA, in half precision."""
    pm = _embedding_lora_model(dtype)
    assert_mixed_batch_matches(pm, ["a", "__base__", "b", "a", "b"], dtype, what="embedding LoRA logits")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("view", ["last-column", "every-other-row"])
def test_embedding_lora_strided_ids_half(dtype, view):
    """Token ids as a hand-written decode loop passes them (``seq[:, -1:]``) or every other row: strided views reach
    the embedding gather kernel, in half precision."""
    pm = _embedding_lora_model(dtype)
    names = ["a", "__base__", "b", "a", "b"]
    wide = torch.randint(3, 97, (2 * len(names), 9), device="cuda")
    ids = wide[: len(names), -1:] if view == "last-column" else wide[::2]
    assert not ids.is_contiguous()
    assert_mixed_batch_matches(pm, names, dtype, what=f"embedding LoRA, {view} ids", ids=ids)
