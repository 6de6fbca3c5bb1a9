"""The expert-LoRA prototype (:func:`peft_csgmv.moe.moe_lora_forward`) against stock PEFT, one adapter at a time.

Tiny MoE configs in fp32 (on the CPU: the kernels under the Triton interpreter), with the kernels and with their torch
reference, and in bf16 on a GPU: PEFT's
``target_parameters`` adapters of different ranks and scalings (``init_lora_weights=False``), a layer's experts fed
the same hidden states and routing; each token of the mixed batch takes ``["__base__", a0, a1][i % 3]``, and its row
must equal the row PEFT returns with that adapter alone (the base experts for ``__base__``), under each of
transformers' experts implementations.
"""

from __future__ import annotations

import helpers
import pytest
import torch
from helpers import BASE, DEVICE, assert_close

from peft_csgmv.moe import moe_lora_forward, param_wrappers, stack_from_peft


def _has_3d_experts() -> bool:
    """transformers keeps MoE experts as 3D parameters (5 and later) and PEFT reaches them (``target_parameters``)."""
    import inspect

    import transformers
    from peft import LoraConfig

    experts = getattr(getattr(transformers.models, "qwen3_moe", None), "modeling_qwen3_moe", None)
    return (
        experts is not None
        and hasattr(experts, "Qwen3MoeExperts")
        and "target_parameters" in inspect.signature(LoraConfig).parameters
    )


pytestmark = pytest.mark.skipif(
    not _has_3d_experts(), reason="needs transformers' 3D experts and PEFT's target_parameters"
)

TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {"a0": dict(r=4, lora_alpha=8), "a1": dict(r=8, lora_alpha=4, use_rslora=True)}
NAMES = [BASE, "a0", "a1"]
CLEAR_MARGIN = 1e-2


def tiny_moe(arch: str, experts_implementation: str, dtype=torch.float32):
    """A one-layer MoE model (helpers.tiny_moe): ``(model, its MoE block)``."""
    model = helpers.tiny_moe(arch, layers=1, dtype=dtype, experts_implementation=experts_implementation)
    return model, model.model.layers[0].mlp


def peft_model(model):
    from peft import LoraConfig, get_peft_model

    pm = None
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(10 + i)
        config = LoraConfig(target_modules=[], target_parameters=TARGETS, init_lora_weights=False, **spec)
        if pm is None:
            pm = get_peft_model(model, config, adapter_name=name)
        else:
            pm.add_adapter(name, config)
    return pm.eval()


def routing(block, hidden):
    """The block's router on ``hidden``: ``(top_k_index, top_k_weights)``."""
    router = block.gate if hasattr(block, "gate") else block.router
    _, weights, index = router(hidden)
    return index, weights


DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    # PEFT folds the delta into the bf16 weight (one rounding of W + ΔW); the kernels add the LoRA to the product.
    pytest.param(torch.bfloat16, id="bf16", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss", "mixtral"])
def test_mixed_tokens_match_peft_one_adapter_at_a_time(arch, implementation, backend, dtype):
    model, block = tiny_moe(arch, implementation, dtype)
    pm = peft_model(model)
    wrapper = block.experts
    experts, wrappers = param_wrappers(wrapper)
    assert set(wrappers) == {"gate_up_proj", "down_proj"} and experts.config._experts_implementation == implementation
    hidden = torch.randn(23, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE, dtype)
    index, weights = routing(block, hidden)

    with torch.no_grad():
        expected = {}
        for name in ADAPTERS:
            pm.set_adapter(name)
            expected[name] = wrapper(hidden, index, weights)
        with pm.disable_adapter():
            expected[BASE] = wrapper(hidden, index, weights)
        for name in ADAPTERS:  # the adapters really change the output
            assert (expected[name] - expected[BASE]).abs().max() > CLEAR_MARGIN, f"{name} changes nothing"

        slots = [NAMES[i % 3] for i in range(hidden.shape[0])]
        stacks = {param: stack_from_peft(w, list(ADAPTERS)) for param, w in wrappers.items()}
        token_slot = [-1 if name == BASE else list(ADAPTERS).index(name) for name in slots]
        got = moe_lora_forward(experts, hidden, index, weights, token_slot, stacks, backend=backend)

    want = torch.stack([expected[name][i] for i, name in enumerate(slots)])
    scale = max(1.0, want.abs().max().item())
    assert got.dtype == dtype
    assert_close(got.cpu(), want.cpu(), dtype=dtype, scale=scale, what=f"{arch}/{implementation}/{backend}")


def test_gpt_oss_clamp_is_active():
    """The gpt-oss case above reaches its activation's clamp (the LoRA must be added before it, as PEFT's folded
    weight adds it)."""
    model, block = tiny_moe("gpt_oss", "eager")
    experts = block.experts
    hidden = torch.randn(23, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    index, _ = routing(block, hidden)
    with torch.no_grad():
        e = index[:, 0]
        gate_up = torch.bmm(hidden.unsqueeze(1), experts.gate_up_proj[e]).squeeze(1) + experts.gate_up_proj_bias[e]
    assert (gate_up.abs() > experts.limit).float().mean() > 0.2
