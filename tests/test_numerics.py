"""PEFT's numerics by default: on a bf16 model PEFT keeps adapters in fp32 (``autocast_adapter_dtype``), and
csgmv's stacks take the adapters' own dtype, so a mixed batch is as close to a float64 run as stock PEFT's own
single-adapter runs are (fp32 products for fp32 activations; TF32 against half-precision activations on the GPU).
``dtype=`` stays an explicit choice (bf16 stacks: measurably further from float64, as PEFT with bf16 adapters is).
The Triton interpreter rounds bf16 differently from a GPU, so on the CPU the default torch backend is compared; on
the GPU the same tests run the kernels."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import ALL_LINEAR, BASE, DEVICE, add_adapters, close, make_batch, per_adapter, stitch, tiny_model

from peft_csgmv import disable_csgmv, enable_csgmv

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
NAMES = [BASE, "a0", "a1", "a2", "a0", BASE, "a2", "a1", "a1"]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref).norm() / ref.norm()).item()


def _setup(device):
    """A bf16 Qwen2 (attention biases) with three fp32 adapters on every linear layer, a batch, and the float64
    reference logits of each row under its own adapter."""
    model, _ = tiny_model("qwen2", dtype=torch.bfloat16)
    specs = {
        # Large scalings: the adapters carry much of each layer's output, so their precision shows in the logits.
        "a0": dict(r=4, lora_alpha=64, target_modules=ALL_LINEAR),
        "a1": dict(r=8, lora_alpha=96, target_modules=ALL_LINEAR, use_rslora=True),
        "a2": dict(r=16, lora_alpha=128, target_modules=["q_proj", "v_proj", "down_proj"]),
    }
    pm = add_adapters(model, specs).to(device)
    assert all(p.dtype == torch.float32 for n, p in pm.named_parameters() if "lora_" in n), "PEFT's fp32 adapters"
    input_ids, mask = make_batch(len(NAMES), 11)
    input_ids, mask = input_ids.to(device), mask.to(device)
    ref_model = copy.deepcopy(pm).double()
    ref = stitch(per_adapter(ref_model, NAMES, lambda: ref_model(input_ids, attention_mask=mask).logits), NAMES)
    peft = stitch(per_adapter(pm, NAMES, lambda: pm(input_ids, attention_mask=mask).logits), NAMES)
    return pm, input_ids, mask, ref, peft


def _csgmv(pm, input_ids, mask, backend, dtype=None):
    enable_csgmv(pm, backend=backend, dtype=dtype)
    try:
        stack_dtypes = {layer._csgmv_record.stack.dtype for layer in pm._csgmv.layers.values()}
        with torch.no_grad():
            out = pm(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
    finally:
        disable_csgmv(pm)
    return out, stack_dtypes


def _check(device, backend, bound: float):
    pm, input_ids, mask, ref, peft = _setup(device)
    err_peft = _rel(peft, ref)
    out, dtypes = _csgmv(pm, input_ids, mask, backend)
    assert dtypes == {torch.float32}, f"default stacks {dtypes}: not the adapters' own dtype"
    err = _rel(out, ref)
    print(f"relative L2 to float64: PEFT {err_peft:.4g}, csgmv {err:.4g}")
    assert err <= bound * err_peft, f"csgmv {err:.4g} vs PEFT {err_peft:.4g} (bound {bound}x)"
    bf16, dtypes = _csgmv(pm, input_ids, mask, backend, dtype=torch.bfloat16)
    assert dtypes == {torch.bfloat16}
    err_bf16 = _rel(bf16, ref)
    print(f"relative L2 to float64 with bf16 stacks: {err_bf16:.4g}")
    assert err_bf16 > 1.5 * err, "bf16 stacks should be measurably further from float64: the test would prove nothing"


def test_fp32_adapters_on_bf16_model_match_peft_numerics():
    """The default backend: on the CPU fp32 products, so csgmv is as close to float64 as PEFT's own runs (to
    accumulation order); on the GPU the Triton kernels with TF32 products against the bf16 activations."""
    _check(DEVICE, "auto", bound=1.02 if DEVICE.type == "cpu" else 1.25)


def test_wider_adapter_added_later_retypes_the_stack():
    """A layer stacked for bf16 adapters gets an fp32 adapter later: its stack becomes fp32 (every slot copied
    again), so the fp32 adapter is computed as PEFT computes it."""
    model, targets = tiny_model("llama", dtype=torch.bfloat16)
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    pm = (
        get_peft_model(
            model, LoraConfig(r=4, target_modules=targets, init_lora_weights=False), "h", autocast_adapter_dtype=False
        )
        .to(DEVICE)
        .eval()
    )
    enable_csgmv(pm, backend="torch")
    layer = next(iter(pm._csgmv.layers.values()))
    assert layer._csgmv_record.stack.dtype == torch.bfloat16
    pm.add_adapter("f", LoraConfig(r=8, target_modules=targets, init_lora_weights=False))  # PEFT: fp32
    input_ids, mask = make_batch(3, 5)
    names = ["h", "f", BASE]
    outs = per_adapter(pm, names, lambda: pm(input_ids, attention_mask=mask).logits)
    with torch.no_grad():
        got = pm(input_ids, attention_mask=mask, adapter_ids=names).logits
    assert layer._csgmv_record.stack.dtype == torch.float32
    # The fp32 adapter's and the base rows as PEFT computes them; the bf16 adapter's rows now in fp32, closer to
    # float64 than PEFT's bf16 products, within bf16's tolerance of them.
    close(got, stitch(outs, names), "after an fp32 adapter joined bf16 ones", dtype=torch.bfloat16)
