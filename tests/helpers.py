"""Shared test helpers: tiny random-weight models, PEFT adapters, and one tolerance table."""

from __future__ import annotations

import torch

# One per-dtype tolerance table (absolute, relative) for comparing against stock PEFT / a float64 reference.
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0, what: str = ""):
    """Compare with the tolerance of ``dtype`` (default: ``actual``'s), scaled by ``scale``; on failure say where and by
    how much."""
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    bound = atol * scale + rtol * scale * expected.abs()
    bad = diff > bound
    if bad.any():
        idx = tuple(int(i) for i in (bad.nonzero()[0]))
        raise AssertionError(
            f"{what} mismatch: {int(bad.sum())} of {bad.numel()} elements off; worst |diff| {diff.max().item():.3g}; "
            f"first at {idx}: got {actual[idx].item():.6g}, expected {expected[idx].item():.6g}"
        )


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def tiny_model(arch: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A tiny random-weight causal LM built from a config (no hub): llama, qwen2 (attention biases), mistral, gpt2
    (Conv1D), opt. Returns (model, target_modules covering every linear layer)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4)
    if arch == "llama":
        cfg = tf.LlamaConfig(intermediate_size=80, num_key_value_heads=2, **common)
        model, targets = tf.LlamaForCausalLM(cfg), ALL_LINEAR
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(intermediate_size=80, num_key_value_heads=2, **common)
        model, targets = tf.Qwen2ForCausalLM(cfg), ALL_LINEAR
    elif arch == "mistral":
        cfg = tf.MistralConfig(intermediate_size=80, num_key_value_heads=2, **common)
        model, targets = tf.MistralForCausalLM(cfg), ALL_LINEAR
    elif arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=97, n_embd=48, n_layer=2, n_head=4, n_positions=64)
        model, targets = tf.GPT2LMHeadModel(cfg), ["c_attn", "c_proj", "c_fc"]
    elif arch == "opt":
        cfg = tf.OPTConfig(
            vocab_size=97, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, ffn_dim=80,
            word_embed_proj_dim=48, max_position_embeddings=64,
        )  # fmt: skip
        model, targets = tf.OPTForCausalLM(cfg), ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    else:
        raise ValueError(arch)
    model.generation_config.pad_token_id = 0
    return model.to(dtype).eval(), targets


def add_adapters(model, specs: dict, seed: int = 1):
    """Wrap ``model`` into a PeftModel with one LoRA adapter per ``specs`` entry (name → LoraConfig kwargs); every
    adapter is randomly initialised (``init_lora_weights=False``) so it really changes the output."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    peft_model = None
    for name, kw in specs.items():
        config = LoraConfig(init_lora_weights=False, **kw)
        if peft_model is None:
            peft_model = get_peft_model(model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    return peft_model.eval()
