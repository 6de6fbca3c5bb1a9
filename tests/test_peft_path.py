"""Modules csgmv has no kernel for but PEFT can mix per row take PEFT's own mixed-batch path inside a csgmv call:
LoRA on convolutions, `modules_to_save` and trainable tokens (embeddings with ``max_norm``: tests/test_embedding.py).
Each case is compared with every adapter's own stock PEFT run (and PEFT's ``adapter_names`` where it works)."""

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
    close,
    greedy_kwargs,
    interleaved,
    make,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)
from peft import LoraConfig, get_peft_model

from peft_csgmv import disable_csgmv, enable_csgmv

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _perturb(params, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.5)


def _check_forward(model, backend, rows=6, seq=7, peft_mixed_works=True):
    names = interleaved(rows)
    input_ids, mask = make_batch(rows, seq)

    def fwd():
        return model(input_ids, attention_mask=mask).logits

    outs = per_adapter(model, names, fwd)
    assert_adapters_matter(outs)
    if peft_mixed_works:
        with torch.no_grad():
            peft_mixed = model(input_ids, attention_mask=mask, adapter_names=names).logits
    enable_csgmv(model, backend=backend)
    try:
        got = model(input_ids, attention_mask=mask, adapter_ids=[None if n == BASE else n for n in names]).logits
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "csgmv vs per-adapter PEFT runs")
    if peft_mixed_works:
        close(got, peft_mixed, "csgmv vs PEFT adapter_names")
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_modules_to_save_lm_head(backend):
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR, modules_to_save=["lm_head"]),
        "a1": dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR),
    }
    model = make("llama", specs)
    _perturb(model.base_model.model.lm_head.modules_to_save["a0"].parameters(), seed=3)
    # PEFT's own adapter_names path raises KeyError here (a1 has no lm_head copy); per-adapter runs are the reference.
    _check_forward(model, backend, peft_mixed_works=False)


def test_modules_to_save_in_beam_search():
    """generate with beams: the lm_head copies see batch × beams rows, each id covering its row's beams."""
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR, modules_to_save=["lm_head"]),
        "a1": dict(r=8, lora_alpha=4, target_modules=ALL_LINEAR, modules_to_save=["lm_head"]),
    }
    model = make("llama", specs)
    for i, name in enumerate(["a0", "a1"]):
        _perturb(model.base_model.model.lm_head.modules_to_save[name].parameters(), seed=10 + i)
    names = interleaved(3)
    input_ids, mask = make_batch(3, 6)
    kw = greedy_kwargs(4, num_beams=2, pad_token_id=0)

    def gen():
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw)

    outs = per_adapter(model, names, gen)
    enable_csgmv(model, backend="torch")
    try:
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, **kw)
    finally:
        disable_csgmv(model)
    assert torch.equal(got, stitch(outs, names))


@pytest.mark.parametrize("backend", BACKENDS)
def test_trainable_tokens(backend):
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR, trainable_token_indices=[3, 4, 5, 6, 7, 8]),
        "a1": dict(r=8, lora_alpha=4, target_modules=ALL_LINEAR),
    }
    model = make("llama", specs)
    deltas = [p for n, p in model.named_parameters() if "trainable_tokens_delta" in n and "a0" in n]
    assert deltas, "no trainable-token parameters found"
    _perturb(deltas, seed=5)
    # PEFT's own adapter_names path raises KeyError here (a1 holds no trainable tokens); per-adapter runs are the
    # reference.
    _check_forward(model, backend, peft_mixed_works=False)


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(4, 8, kernel_size=3, padding=1)
        self.fc = torch.nn.Linear(8 * 5, 6)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_lora(backend):
    torch.manual_seed(0)
    model = get_peft_model(ConvNet(), LoraConfig(init_lora_weights=False, r=2, target_modules=["conv", "fc"]),
                           adapter_name="a0")  # fmt: skip
    model.add_adapter("a1", LoraConfig(init_lora_weights=False, r=3, lora_alpha=6, target_modules=["conv", "fc"]))
    model = model.eval().to(DEVICE)
    x = torch.randn(5, 4, 5, device=DEVICE)
    names = interleaved(5)
    outs = per_adapter(model, names, lambda: model(x))
    assert_adapters_matter(outs)
    enable_csgmv(model, backend=backend)
    try:
        got = model(x, adapter_ids=names)
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "conv net")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_classification_heads(backend):
    """A LoRA classifier per task (SEQ_CLS: PEFT saves each adapter's own ``score`` head): one mixed batch scores every
    row with its own adapter and head."""
    base, _ = tiny_model("llama", model_class="LlamaForSequenceClassification", num_labels=3, pad_token_id=0)
    model = None
    for i, name in enumerate(["a0", "a1"]):
        config = LoraConfig(task_type="SEQ_CLS", init_lora_weights=False, r=4 + 4 * i, target_modules=ALL_LINEAR)
        if model is None:
            model = get_peft_model(base, config, adapter_name=name)
        else:
            model.add_adapter(name, config)
    model = model.eval().to(DEVICE)
    for i, name in enumerate(["a0", "a1"]):
        _perturb(model.base_model.model.score.modules_to_save[name].parameters(), seed=20 + i)
    names = interleaved(6)
    input_ids, mask = make_batch(6, 7)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    enable_csgmv(model, backend=backend)
    try:
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "per-row classifier heads")


def test_adapters_narrower_than_the_model_take_peft_path():
    """bf16 adapters on an fp32 model (``autocast_adapter_dtype=False`` leaves them so): PEFT rounds each layer's
    input to bf16 before their products, so their rows take PEFT's path, with PEFT's numbers, beside an fp32 adapter
    on the kernels; with ``dtype=`` the kernels serve them all (no PEFT rows)."""
    import warnings

    model, targets = tiny_model("llama")
    specs = {
        "f": dict(r=4, lora_alpha=8, target_modules=targets),
        "h": dict(r=6, lora_alpha=8, target_modules=targets + ["embed_tokens"]),
    }
    model = add_adapters(model, specs).to(DEVICE)
    for name, p in model.named_parameters():
        if ".h." in name:
            p.data = p.data.to(torch.bfloat16)
    input_ids, mask = make_batch(4, 6)
    names = ["h", "f", BASE, "h"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        enable_csgmv(model, backend="torch")
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    assert all(layer._csgmv_record.peft_rows == {"h"} for layer in model._csgmv.layers.values() if "h" in layer.lora_A)
    assert any("PEFT's own mixed-batch path" in str(w.message) for w in caught)
    close(got, stitch(outs, names), "bf16 adapter rows on an fp32 model")
    enable_csgmv(model, backend="torch", dtype=torch.float32)
    assert not any(layer._csgmv_record.peft_rows for layer in model._csgmv.layers.values())
