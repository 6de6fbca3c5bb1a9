"""DoRA in mixed batches (PEFT's own ``adapter_names`` refuses DoRA): every DoRA adapter's per-output scale is folded
into the expand step. Compared with each adapter's own stock PEFT run."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BASE,
    add_adapters,
    assert_adapters_matter,
    assert_mixed_batch_matches,
    close,
    greedy_kwargs,
    interleaved,
    make,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import disable_csgmv, enable_csgmv

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _dora_model(arch):
    _, targets = tiny_model(arch)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "d0": dict(r=8, lora_alpha=16, target_modules=targets, use_dora=True),
        "d1": dict(r=4, lora_alpha=4, target_modules=targets[:2], use_dora=True, use_rslora=True),
    }
    model = make(arch, specs)
    # PEFT initialises the magnitude to the weight norm (scale 1 at the start); move it so DoRA really matters.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn(p.shape, generator=g).to(p.device))
    return model


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])  # qwen2: biases; gpt2: Conv1D with biases
def test_dora_forward_matches_per_adapter_runs(arch, backend):
    model = _dora_model(arch)
    names = interleaved(7, adapters=("a0", "d0", "d1"))
    input_ids, mask = make_batch(7, 6)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    enable_csgmv(model, backend=backend)
    try:
        got = model(input_ids, attention_mask=mask, adapter_ids=[None if n == BASE else n for n in names]).logits
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), f"{arch} DoRA mixed batch")


def test_dora_greedy_generate_token_identical():
    model = _dora_model("llama")
    names = interleaved(4, adapters=("d0", "a0", "d1"))
    input_ids, mask = make_batch(4, 6)
    kw = greedy_kwargs(5, pad_token_id=0)
    outs = per_adapter(model, names, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    enable_csgmv(model, backend="torch")
    try:
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names, **kw)
    finally:
        disable_csgmv(model)
    assert torch.equal(got, stitch(outs, names))


def test_split_k_layers_with_dora_and_lora_bias():
    """Layers wide enough that the shrink splits K (partial planes in the plan's workspace, summed by expand), with
    plain, DoRA and ``lora_bias`` adapters in one batch through the Triton kernels: parity with per-adapter runs."""
    from helpers import DEVICE

    from peft_csgmv.kernels import shrink_splits

    base, _ = tiny_model("llama", layers=1, hidden=256, intermediate=256)
    targets = ["q_proj", "o_proj", "down_proj"]
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "d0": dict(r=8, lora_alpha=16, target_modules=targets, use_dora=True),
        "b0": dict(r=4, lora_alpha=4, target_modules=targets, lora_bias=True),
    }
    model = add_adapters(base, specs).to(DEVICE)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name or "lora_B.b0.bias" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g).to(p.device))
    names = interleaved(6, adapters=("a0", "d0", "b0"))
    input_ids, mask = make_batch(6, 5)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    enable_csgmv(model, backend="triton")
    try:
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        runs = list(model._csgmv.executor.plans.values())
        assert runs and all(shrink_splits(r.plan, 256) > 1 for r in runs), "the layers did not split K"
        assert any(planes > 1 for r in runs for (_, planes) in r.workspaces), "no split-K workspace was used"
    finally:
        disable_csgmv(model)
    close(got, stitch(outs, names), "split-K layers with DoRA and lora_bias")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dora_parity_half(arch, dtype):
    """DoRA adapters mixed with plain ones, in half precision, against each adapter's own PEFT run."""
    model, targets = tiny_model(arch)
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "d": dict(r=16, lora_alpha=16, target_modules=targets, use_dora=True),
    }
    pm = add_adapters(model.to("cuda"), specs)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
    pm.to(dtype)
    assert_mixed_batch_matches(pm, ["d", "__base__", "a", "d", "a"], dtype, what=f"{arch} DoRA logits")
