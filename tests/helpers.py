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
_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Architectures a transformers version may lack or fail to build tiny: tiny_model skips the test there.
_OPTIONAL = {"gemma3", "phi3", "gptj", "bart", "t5"}


def _arch(arch: str, layers: int, hidden: int, vocab: int, intermediate: int, heads: int, kv_heads: int):
    """(config class, model class, config fields, LoRA targets covering every linear layer) of a tiny ``arch``."""
    llama_like = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=intermediate, num_key_value_heads=kv_heads)  # fmt: skip
    if arch in ("llama", "qwen2", "mistral"):
        name = {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[arch]
        return f"{name}Config", f"{name}ForCausalLM", llama_like, ALL_LINEAR
    if arch == "gemma3":
        # A sliding window shorter than the prompts, and layers of each attention type. Embeddings tied by default.
        types = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
        fields = dict(llama_like, head_dim=hidden // heads, sliding_window=4, layer_types=types,
                      max_position_embeddings=64, **_IDS)  # fmt: skip
        return "Gemma3TextConfig", "Gemma3ForCausalLM", fields, ALL_LINEAR
    if arch == "phi3":
        fields = dict(llama_like, max_position_embeddings=64, **_IDS)
        return "Phi3Config", "Phi3ForCausalLM", fields, ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    if arch == "gpt2":
        fields = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, n_positions=64)
        return "GPT2Config", "GPT2LMHeadModel", fields, ["c_attn", "c_proj", "c_fc"]
    if arch == "gptj":
        fields = dict(vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=heads, rotary_dim=8, n_positions=64,
                      **_IDS)  # fmt: skip
        return "GPTJConfig", "GPTJForCausalLM", fields, ["q_proj", "k_proj", "v_proj", "out_proj", "fc_in", "fc_out"]
    if arch == "opt":
        fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      ffn_dim=intermediate, word_embed_proj_dim=hidden, max_position_embeddings=64)  # fmt: skip
        return "OPTConfig", "OPTForCausalLM", fields, ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
    if arch == "bart":
        # init_std well above BART's default 0.02: with that, a model this small greedily repeats one token whatever
        # the prompt or adapter, and generation tests would prove nothing.
        fields = dict(
            vocab_size=vocab, d_model=hidden, encoder_layers=layers, decoder_layers=layers,
            encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=intermediate,
            decoder_ffn_dim=intermediate, max_position_embeddings=64, decoder_start_token_id=2,
            forced_bos_token_id=None, forced_eos_token_id=None, init_std=0.5, **_IDS,
        )  # fmt: skip
        targets = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]
        return "BartConfig", "BartForConditionalGeneration", fields, targets
    if arch == "t5":
        fields = dict(vocab_size=vocab, d_model=hidden, d_kv=hidden // heads, d_ff=intermediate, num_layers=layers,
                      num_decoder_layers=layers, num_heads=heads, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0)  # fmt: skip
        return "T5Config", "T5ForConditionalGeneration", fields, ["q", "k", "v", "o", "wi", "wo"]
    raise ValueError(arch)


def tiny_model(
    arch: str, dtype: torch.dtype = torch.float32, seed: int = 0, *, layers: int = 2, hidden: int = 48,
    vocab: int = 97, intermediate: int = 80, heads: int = 4, kv_heads: int = 2, model_class: str | None = None,
    **config,
):  # fmt: skip
    """The tests' one tiny random-weight model builder, from a config (no hub): llama, qwen2 (attention biases),
    mistral, gpt2 (Conv1D), opt (flattened MLP tokens), gemma3 (text; scaled, tied embeddings), phi3 (fused
    ``qkv_proj`` / ``gate_up_proj``), gptj, bart and t5 (encoder-decoder). ``layers``, ``hidden``, ``vocab``,
    ``intermediate``, ``heads``, ``kv_heads`` size it; ``model_class`` names another transformers class for the config
    (e.g. ``LlamaForSequenceClassification``); ``config``: further config fields (``tie_word_embeddings=True``, ...).
    Skips the test where this transformers lacks an optional architecture or cannot build it tiny.
    Returns (model in ``dtype``, eval mode; target_modules covering every linear layer)."""
    import pytest
    import transformers as tf

    config_name, model_name, fields, targets = _arch(arch, layers, hidden, vocab, intermediate, heads, kv_heads)
    model_name = model_class or model_name
    config_cls, model_cls = getattr(tf, config_name, None), getattr(tf, model_name, None)
    if arch in _OPTIONAL and (config_cls is None or model_cls is None):
        pytest.skip(f"transformers {tf.__version__} has no {config_name if config_cls is None else model_name}")
    torch.manual_seed(seed)
    try:
        model = model_cls(config_cls(**fields, **config))
    except (ImportError, TypeError, ValueError, AttributeError, NotImplementedError) as exc:
        if arch not in _OPTIONAL:
            raise
        pytest.skip(f"cannot build a tiny {arch} with transformers {tf.__version__}: {type(exc).__name__}: {exc}")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = 0
    return model.to(dtype).eval(), targets


def tiny_moe(arch: str, layers: int = 2, dtype: torch.dtype = torch.float32, **config):
    """A tiny MoE causal LM with transformers' 3D experts (``qwen3_moe``, ``mixtral``, ``olmoe``, ``gpt_oss``), random
    weights on DEVICE: experts of order one (the default init's 0.02 leaves their outputs near 1e-4), gpt-oss's expert
    biases set (it leaves them at zero; its low ``swiglu_limit`` keeps the clamp after the gate/up LoRA active),
    ``q_proj`` / ``v_proj`` of order one too. ``config``: further config fields (``experts_implementation=...``)."""
    import transformers

    common = dict(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, num_experts_per_tok=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    common.update(config)
    if arch == "qwen3_moe":
        built = transformers.Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=24, num_experts=6)
        cls = transformers.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        built = transformers.MixtralConfig(**common, intermediate_size=24, num_local_experts=6)
        cls = transformers.MixtralForCausalLM
    elif arch == "olmoe":
        common.pop("head_dim")  # (OLMoE's head size is hidden / heads)
        built = transformers.OlmoeConfig(**common, intermediate_size=24, num_experts=6)
        cls = transformers.OlmoeForCausalLM
    else:
        built = transformers.GptOssConfig(**common, intermediate_size=24, num_local_experts=6, swiglu_limit=0.3)
        cls = transformers.GptOssForCausalLM
    torch.manual_seed(0)
    model = cls(built).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".mlp." in name:
                param.normal_(0, 0.5 if name.endswith("_bias") else 0.2)
            elif "q_proj" in name or "v_proj" in name:
                param.normal_(0, 0.3)
    model.generation_config.pad_token_id = 0
    return model.to(DEVICE, dtype)


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
# The enable_csgmv backends the model-level tests run on (the CPU runs Triton's interpreter).
BACKENDS = ["torch", "triton"]
# Smallest max-abs difference between two adapters' logits (or an adapter's and the base model's) that counts as
# "the adapter clearly changes the output"; parity tolerances are ~1e-5.
CLEAR_MARGIN = 1e-2


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


def two_adapters(targets, embedding: bool = False):
    """a0 (rank 4, alpha 8; also on ``embed_tokens`` with ``embedding``) and a1 (rank 8, alpha 4) on ``targets``."""
    return {
        "a0": dict(r=4, lora_alpha=8, target_modules=(["embed_tokens"] if embedding else []) + targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }


def make(arch: str = "llama", specs=None, dtype=torch.float32, embedding: bool = False):
    """A tiny ``arch`` on DEVICE with ``specs``' adapters, by default ``two_adapters`` on every linear layer."""
    model, targets = tiny_model(arch, dtype=dtype)
    return add_adapters(model, specs if specs is not None else two_adapters(targets, embedding)).to(DEVICE)


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


# Compiled-path helpers (transformers' static cache, torch.compile).

ID_LISTS = [["a0", None, "a1"], ["a1", "a0", None], ["a0", "a0", "a1"]]


def graphs() -> int:
    """How many distinct graphs dynamo compiled since its counters were last cleared (the ``fresh_dynamo`` fixture)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def static_and_eager(model, input_ids, mask, ids, new_tokens: int = 4):
    """Greedy tokens of ``generate`` with ``ids`` on transformers' static cache (its compiled decode, forced on any
    device) and on the default dynamic cache (eager), ``new_tokens`` each."""
    kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ids, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
    static = model.generate(cache_implementation="static", compile_config=compile_config(), **kw)
    return static, model.generate(**kw)


def compiled_ops(model, ids, input_ids, mask):
    """The logits of ``torch.compile(model)`` with ``ids``, and how many of each csgmv op its graph holds, by op name
    (``lora``, ``lora_linear``, ``lora_group``)."""
    import collections

    seen = collections.Counter()

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            name = str(node.target)
            if node.op == "call_function" and name.startswith("peft_csgmv."):
                seen[name.split(".")[1]] += 1
        return gm.forward

    compiled = torch.compile(model, backend=backend, dynamic=False, fullgraph=False)
    with torch.no_grad():
        logits = compiled(input_ids, attention_mask=mask, adapter_ids=ids).logits
    torch._dynamo.reset()
    return logits, seen


# Half-precision mixed batches on the GPU (tests marked ``gpu``).


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


def assert_mixed_batch_matches(pm, names, dtype, stack_dtype=None, what="", ids=None):
    """A mixed batch of ``names`` through csgmv against each row's own stock PEFT run, with ``dtype``'s tolerance
    scaled by the logits' magnitude x2; ``ids``: the token ids (any view), default random prompts with some left
    padding."""
    from peft_csgmv import disable_csgmv, enable_csgmv

    if ids is None:
        ids = torch.randint(3, 97, (len(names), 12), device=DEVICE)
        mask = torch.ones_like(ids)
        mask[0, :3] = 0
    else:
        mask = torch.ones(ids.shape, dtype=torch.long, device=DEVICE)
    ref, base = _per_adapter_logits(pm, ids, mask, names)
    assert (ref - base).abs().max() > 0.05, "the adapters do not change the output"
    enable_csgmv(pm, dtype=stack_dtype)
    try:
        out = pm(ids, attention_mask=mask, adapter_ids=names).logits.float()
    finally:
        disable_csgmv(pm)
    assert_close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()) * 2, what=what)
