"""Shared test helpers: tiny random-weight models, PEFT adapters, and one tolerance table."""

from __future__ import annotations

import torch

# One per-dtype tolerance table (absolute, relative) for comparing against stock PEFT / a float64 reference.
# On the GPU, fp32 results of cuBLAS and of the kernels differ in summation order (cuBLAS splits K too), and through a
# few layers that reaches ~1.5e-5 on values near 0.4; the CPU runs sum in one order and keep the tighter bound.
_FP32 = (5e-5, 5e-5) if torch.cuda.is_available() else (1e-5, 1e-5)
TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: _FP32,
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None, scale: float = 1.0, what: str = ""
):
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


def compile_config(backend="aot_eager"):
    """transformers' ``CompileConfig`` for the static-cache path in tests: ``fullgraph=True`` (a graph break fails),
    ``backend`` (a name or a callable), no CUDA graphs, and forced on every device (transformers compiles the decode
    step on CUDA only, unless told)."""
    from transformers import CompileConfig

    config = CompileConfig(fullgraph=True, backend=backend, mode=None, dynamic=False)
    config._compile_all_devices = True
    return config


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


# Parity helpers shared by the model-level tests.

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BASE = "__base__"
# Smallest max-abs difference between two adapters' logits (or an adapter's and the base model's) that counts as
# "the adapter clearly changes the output"; parity tolerances are ~1e-5.
CLEAR_MARGIN = 1e-2


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


def two_adapters(targets):
    return {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }


def make(arch: str = "llama", specs=None, dtype=torch.float32):
    model, targets = tiny_model(arch, dtype=dtype)
    return add_adapters(model, specs if specs is not None else two_adapters(targets)).to(DEVICE)


def make_batch(rows: int, seq: int, seed: int = 0, left_pad: bool = True):
    """Random prompts (ids >= 3, clear of bos/eos/pad) with left padding: row ``i`` has ``i % 3`` pad tokens."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (rows, seq), generator=g)
    mask = torch.ones_like(input_ids)
    if left_pad:
        for i in range(rows):
            mask[i, : i % 3] = 0
            input_ids[i, : i % 3] = 0
    return input_ids.to(DEVICE), mask.to(DEVICE)


def interleaved(rows: int, adapters=("a0", "a1")) -> list[str]:
    cycle = [BASE, *adapters]
    return [cycle[i % len(cycle)] for i in range(rows)]


def norm(name):
    return BASE if name is None else name


def close(actual: torch.Tensor, expected: torch.Tensor, what: str = "", dtype=None):
    """assert_close, plus same shape and no NaN/inf (a NaN would slip through an elementwise ``diff > bound``)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), f"{what}: non-finite values"
    assert_close(actual, expected, dtype=dtype, what=what)


@torch.no_grad()
def per_adapter(model, names, fn) -> dict:
    """``fn()`` once per distinct adapter of ``names`` through stock PEFT, over the whole batch: ``set_adapter(name)``
    for adapters, ``disable_adapter()`` for base rows. Returns {name: output}; the active adapter is restored."""
    previous = model.active_adapter
    outs = {}
    try:
        for name in dict.fromkeys(norm(n) for n in names):
            if name == BASE:
                with model.disable_adapter():
                    outs[name] = fn()
            else:
                model.set_adapter(name)
                outs[name] = fn()
    finally:
        model.set_adapter(previous)
    return outs


def stitch(outs: dict, names) -> torch.Tensor:
    """Row ``i`` of the output of ``names[i]``'s own run."""
    return torch.stack([outs[norm(n)][i] for i, n in enumerate(names)])


def assert_generations_differ(outs: dict):
    """Each pair of generation runs (adapters and base) produced different tokens somewhere."""
    keys = list(outs)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert not torch.equal(outs[a], outs[b]), f"{a} and {b} generate the same tokens: the test proves nothing"


def assert_adapters_matter(outs: dict):
    """Each pair of runs (adapters and base) differs clearly, so parity below is not vacuous."""
    keys = list(outs)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            diff = (outs[a].double() - outs[b].double()).abs().max().item()
            assert diff > CLEAR_MARGIN, f"{a} vs {b}: outputs differ by only {diff:.3g}; the test would prove nothing"


def greedy_kwargs(new_tokens: int = 5, **extra):
    # min_new_tokens: no row stops early at an eos token, so every per-adapter run has the same length.
    return dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **extra)
