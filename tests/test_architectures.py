"""Parity of csgmv mixed-adapter batches on more architectures and layer placements, against stock PEFT.

Same method as ``test_parity.py`` (whose helpers this module uses): every adapter is randomly initialised, each test
first checks that the adapters really change the output, and a mixed batch is compared row by row against stock PEFT
runs with that row's adapter active (base rows under ``disable_adapter()``) and against PEFT's own ``adapter_names``
path. Covered here:

* ``lm_head`` as a LoRA target: ``generate`` asks for the last position's logits only (``logits_to_keep``), so
  ``lm_head`` sees ``rows × 1`` tokens while every other layer sees ``rows × prompt``; plans are keyed by the shape
  each layer sees;
* Gemma3 (text), Phi-3 (fused ``qkv_proj`` / ``gate_up_proj``), GPT-J;
* encoder-decoder ``generate`` (BART, T5), greedy and with beams: the encoder sees the original batch, the decoder
  ``batch × beams`` rows (each id covers ``rows // len(ids)`` consecutive rows);
* tied input/output embeddings with ``lm_head`` not targeted.

``torch`` backend everywhere; ``triton`` (interpreted on CPU, slow) on a subset.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers as tf
from helpers import (
    ALL_LINEAR,
    BACKENDS,
    BASE,
    CLEAR_MARGIN,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    assert_generations_differ,
    close,
    greedy_kwargs,
    make_batch,
    norm,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

VOCAB = 97


# --------------------------------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------------------------------


def build(arch: str, seed: int = 0):
    """A tiny random-weight model of ``arch`` (``helpers.tiny_model``; ``llama_tied``: Llama with tied embeddings) and
    the LoRA target modules covering its linear layers. Skips the test when this transformers version lacks the
    classes or cannot build them."""
    if arch == "llama_tied":
        return tiny_model("llama", seed=seed, tie_word_embeddings=True)
    return tiny_model(arch, seed=seed)


def make(arch: str, specs=None, seed: int = 0, alpha: float = 8):
    """``arch`` with two adapters of different rank and alpha on every linear layer (or ``specs``)."""
    model, targets = build(arch, seed=seed)
    if specs is None:
        specs = {
            "a0": dict(r=4, lora_alpha=alpha, target_modules=targets),
            "a1": dict(r=8, lora_alpha=alpha / 2, target_modules=targets),
        }
    return add_adapters(model, specs).to(DEVICE)


def stock_or_skip(arch: str, fn):
    """A first stock PEFT run, before csgmv is involved: when it raises, this transformers version's ``arch`` is
    broken (not csgmv), and the test is skipped with the reason."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"stock PEFT on a tiny {arch} fails in transformers {tf.__version__}: {type(exc).__name__}: {exc}")


def assert_rows_distinguish(outs: dict, names):
    """For every row, the output of the row's own adapter differs from that of every other adapter (and of the base
    model) at that row: a row that got another row's adapter would show."""
    for i, own in enumerate(norm(n) for n in names):
        for other, out in outs.items():
            if other == own:
                continue
            if out.is_floating_point():
                diff = (outs[own][i].double() - out[i].double()).abs().max().item()
                assert diff > CLEAR_MARGIN, f"row {i}: {own} and {other} differ by only {diff:.3g}"
            else:
                assert not torch.equal(outs[own][i], out[i]), f"row {i}: {own} and {other} generate the same tokens"


@contextlib.contextmanager
def record_inputs(modules: dict):
    """Record the leading shape (all but the feature axis) of every input each module sees: {label: [shape, ...]}."""
    seen = {label: [] for label in modules}
    handles = [
        module.register_forward_pre_hook(lambda _m, args, label=label: seen[label].append(tuple(args[0].shape[:-1])))
        for label, module in modules.items()
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def patched_names(model) -> set[str]:
    return set(model._csgmv.layers)


# --------------------------------------------------------------------------------------------------------------------
# lm_head as a LoRA target
# --------------------------------------------------------------------------------------------------------------------


def lm_head_specs():
    with_head = ALL_LINEAR + ["lm_head"]
    return {
        "a0": dict(r=4, lora_alpha=8, target_modules=with_head),
        "a1": dict(r=8, lora_alpha=4, target_modules=with_head),
        # lm_head only: its rows are right only if lm_head's own LoRA is applied to them.
        "head": dict(r=6, lora_alpha=12, target_modules=["lm_head"]),
    }


def lm_head_of(model):
    return model.base_model.model.lm_head


def q_proj_of(model):
    return model.base_model.model.model.layers[0].self_attn.q_proj


@pytest.mark.parametrize("backend", BACKENDS)
def test_lm_head_forward(backend, kernel_calls):
    """Full logits, ``logits_to_keep=1`` (lm_head sees one token per row of a strided slice of the hidden states)
    and ``logits_to_keep=2``, in one mixed batch with base rows."""
    model = make("llama", lm_head_specs())
    input_ids, mask = make_batch(5, 6)
    names = ["head", BASE, "a0", "a1", "head"]
    lm_head, q_proj = lm_head_of(model), q_proj_of(model)
    assert set(lm_head.lora_A) == {"a0", "a1", "head"} and "head" not in q_proj.lora_A  # the premise

    def run(keep, **kw):
        return model(input_ids, attention_mask=mask, logits_to_keep=keep, **kw).logits

    expected, peft_mixed = {}, {}
    for keep in (0, 1, 2):
        outs = per_adapter(model, names, lambda: run(keep))
        assert_adapters_matter(outs)
        assert_rows_distinguish(outs, names)
        expected[keep] = stitch(outs, names)
        assert expected[keep].shape == (5, keep or 6, VOCAB)
        with torch.no_grad():
            peft_mixed[keep] = run(keep, adapter_names=names)
        close(peft_mixed[keep], expected[keep], f"logits_to_keep={keep}: PEFT adapter_names vs per-adapter runs")

    enable_csgmv(model, backend=backend)
    for keep in (0, 1, 2):
        kernel_calls.clear()
        with record_inputs({"lm_head": lm_head, "q_proj": q_proj}) as seen:
            out = run(keep, adapter_ids=names)
        assert seen == {"lm_head": [(5, keep or 6)], "q_proj": [(5, 6)]}
        # One kernel call per patched layer: lm_head too, on the csgmv path.
        assert len(kernel_calls) == len(patched_names(model)) and all(f == (backend == "triton") for f in kernel_calls)
        close(out, expected[keep], f"logits_to_keep={keep}/{backend}: csgmv vs per-adapter runs")
        close(out, peft_mixed[keep], f"logits_to_keep={keep}/{backend}: csgmv vs PEFT adapter_names")
    assert "base_model.model.lm_head" in patched_names(model)
    assert active_calls() == 0


@pytest.mark.parametrize(
    "backend,task_type",
    [("torch", None), ("torch", "CAUSAL_LM"), ("triton", None)],
    ids=["torch", "torch-causal-lm", "triton"],
)
def test_lm_head_greedy_generate(backend, task_type):
    """Greedy generate with lm_head targeted: in prefill lm_head sees ``rows × 1`` tokens (``logits_to_keep``) while
    the other layers see ``rows × prompt``; token-identical to per-adapter runs and to PEFT's adapter_names."""
    specs = lm_head_specs()
    if task_type is not None:
        specs = {name: dict(spec, task_type=task_type) for name, spec in specs.items()}
    model = make("llama", specs)
    input_ids, mask = make_batch(4, 5, seed=2)
    names = ["a0", "head", BASE, "a1"]
    kw = greedy_kwargs(5)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = per_adapter(model, names, gen)
    assert_generations_differ(outs)
    assert_rows_distinguish(outs, names)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=names)
    assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend=backend)
    with record_inputs({"lm_head": lm_head_of(model), "q_proj": q_proj_of(model)}) as seen:
        out = gen(adapter_ids=names)
    # The situation under test really arose: lm_head never saw the prompt, q_proj did (prefill), then one token.
    assert seen["lm_head"] == [(4, 1)] * 5, seen["lm_head"]
    assert seen["q_proj"] == [(4, 5)] + [(4, 1)] * 4, seen["q_proj"]
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"
    assert torch.equal(out, peft_mixed)
    assert active_calls() == 0


# --------------------------------------------------------------------------------------------------------------------
# more decoder-only architectures
# --------------------------------------------------------------------------------------------------------------------


ARCH_TARGET_CHECKS = {
    # module-name suffixes that must be among the patched layers (the architecture's characteristic linears)
    "gemma3": ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"],
    "phi3": ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"],
    "gptj": ["transformer.h.0.attn.q_proj", "transformer.h.1.mlp.fc_out"],
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["gemma3", "phi3", "gptj"])
def test_forward_parity_arch(arch, backend, kernel_calls):
    """Left-padded batch (longer than Gemma3's sliding window), base rows interleaved with two adapters."""
    model = make(arch)
    input_ids, mask = make_batch(6, 7)
    names = [BASE, "a0", "a1", "a1", BASE, "a0"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs = stock_or_skip(arch, lambda: per_adapter(model, names, run))
    assert_adapters_matter(outs)
    assert_rows_distinguish(outs, names)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = run(adapter_names=names)
    close(peft_mixed, expected, "PEFT adapter_names vs per-adapter runs")

    enable_csgmv(model, backend=backend)
    out = run(adapter_ids=names)
    patched = patched_names(model)
    for suffix in ARCH_TARGET_CHECKS[arch]:
        assert f"base_model.model.{suffix}" in patched, (suffix, sorted(patched))
    assert len(kernel_calls) == len(patched) and all(f == (backend == "triton") for f in kernel_calls)
    close(out, expected, f"{arch}/{backend} csgmv vs per-adapter runs")
    close(out, peft_mixed, f"{arch}/{backend} csgmv vs PEFT adapter_names")
    assert active_calls() == 0


@pytest.mark.parametrize(
    "arch,backend", [("phi3", "torch"), ("phi3", "triton"), ("gemma3", "torch"), ("gptj", "torch")]
)
def test_greedy_generate_arch(arch, backend):
    """Greedy generate (prefill + KV-cache decode), left-padded: token-identical to per-adapter runs and to PEFT's
    adapter_names generate."""
    model = make(arch)
    input_ids, mask = make_batch(3, 5, seed=2)
    names = [BASE, "a0", "a1"]
    kw = greedy_kwargs(5)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = stock_or_skip(arch, lambda: per_adapter(model, names, gen))
    assert_generations_differ(outs)
    assert_rows_distinguish(outs, names)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=names)
    assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend=backend)
    out = gen(adapter_ids=names)
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"
    assert torch.equal(out, peft_mixed)
    assert active_calls() == 0


@pytest.mark.parametrize("arch", ["llama_tied", "gemma3"])
def test_tied_embeddings_lm_head_not_targeted(arch):
    """Tied input/output embeddings, lm_head not a target: lm_head stays the plain tied module (not patched, weight
    still shared with the embedding), and forward and greedy generate match per-adapter runs."""
    model = make(arch)
    inner = model.base_model.model
    assert inner.lm_head.weight is inner.model.embed_tokens.weight  # the premise: a tied model
    assert type(inner.lm_head) is torch.nn.Linear
    input_ids, mask = make_batch(3, 6, seed=1)
    names = ["a1", BASE, "a0"]

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    def gen(**kw):
        return model.generate(input_ids=input_ids, attention_mask=mask, **greedy_kwargs(4), **kw)

    outs = stock_or_skip(arch, lambda: per_adapter(model, names, run))
    assert_adapters_matter(outs)
    assert_rows_distinguish(outs, names)
    gens = per_adapter(model, names, gen)
    assert_generations_differ(gens)
    assert_rows_distinguish(gens, names)

    enable_csgmv(model, backend="torch")
    close(run(adapter_ids=names), stitch(outs, names), f"{arch}: csgmv vs per-adapter runs")
    assert torch.equal(gen(adapter_ids=names), stitch(gens, names))
    assert not any(name.endswith("lm_head") for name in patched_names(model))
    assert "forward" not in inner.lm_head.__dict__
    assert inner.lm_head.weight is inner.model.embed_tokens.weight


# --------------------------------------------------------------------------------------------------------------------
# encoder-decoder
# --------------------------------------------------------------------------------------------------------------------


def seq2seq_layers(model, arch: str) -> dict:
    """One encoder layer, one decoder self-attention layer and one cross-attention layer (which sees the encoder
    output, expanded to the decoder's rows)."""
    inner = model.base_model.model
    if arch == "bart":
        enc, dec = inner.model.encoder.layers[0], inner.model.decoder.layers[0]
        return {"encoder": enc.self_attn.q_proj, "decoder": dec.self_attn.q_proj, "cross_kv": dec.encoder_attn.k_proj}
    enc, dec = inner.encoder.block[0], inner.decoder.block[0]
    return {
        "encoder": enc.layer[0].SelfAttention.q,
        "decoder": dec.layer[0].SelfAttention.q,
        "cross_kv": dec.layer[1].EncDecAttention.k,
    }


# (prompt seed, lora_alpha of a0; a1 gets half) for which every row's adapter changes that row's generation
SEQ2SEQ_SETUP = {"bart": (1, 16), "t5": (1, 32)}


@pytest.mark.parametrize("backend", BACKENDS)
def test_seq2seq_forward(backend):
    """BART forward with decoder inputs: encoder and decoder rows both follow the ids."""
    model = make("bart", alpha=16)
    input_ids, mask = make_batch(4, 6, seed=1)
    decoder_input_ids = make_batch(4, 3, seed=7, left_pad=False)[0]
    names = ["a1", BASE, "a0", "a1"]

    def run(**kw):
        return model(input_ids=input_ids, attention_mask=mask, decoder_input_ids=decoder_input_ids, **kw).logits

    outs = stock_or_skip("bart", lambda: per_adapter(model, names, run))
    assert_adapters_matter(outs)
    assert_rows_distinguish(outs, names)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = run(adapter_names=names)
    close(peft_mixed, expected, "PEFT adapter_names vs per-adapter runs")

    enable_csgmv(model, backend=backend)
    out = run(adapter_ids=names)
    close(out, expected, f"bart/{backend} csgmv vs per-adapter runs")
    close(out, peft_mixed, f"bart/{backend} csgmv vs PEFT adapter_names")


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize(
    "arch,backend,task_type",
    [("bart", "torch", None), ("bart", "triton", None), ("t5", "torch", None), ("t5", "torch", "SEQ_2_SEQ_LM")],
    ids=["bart-torch", "bart-triton", "t5-torch", "t5-torch-seq2seq-lm"],
)
def test_seq2seq_generate(arch, backend, task_type, num_beams):
    """Encoder-decoder generate, greedy and beam search: the encoder sees the original rows, the decoder (and the
    cross-attention projections of the encoder output) ``rows × num_beams``. Token-identical to per-adapter runs and
    to PEFT's adapter_names (which gives the encoder the original ids under beam search)."""
    seed, alpha = SEQ2SEQ_SETUP[arch]
    specs = None
    if task_type is not None:
        _, targets = build(arch)
        specs = {
            "a0": dict(r=4, lora_alpha=alpha, target_modules=targets, task_type=task_type),
            "a1": dict(r=8, lora_alpha=alpha / 2, target_modules=targets, task_type=task_type),
        }
    model = make(arch, specs, alpha=alpha)
    rows = 3
    input_ids, mask = make_batch(rows, 6, seed=seed)
    names = ["a1", BASE, "a0"]
    new_tokens = 5
    kw = greedy_kwargs(new_tokens, num_beams=num_beams)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = stock_or_skip(arch, lambda: per_adapter(model, names, gen))
    assert_generations_differ(outs)
    assert_rows_distinguish(outs, names)
    expected = stitch(outs, names)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=names)
    assert torch.equal(peft_mixed, expected), f"PEFT adapter_names:\n{peft_mixed}\n!=\n{expected}"

    enable_csgmv(model, backend=backend)
    with record_inputs(seq2seq_layers(model, arch)) as seen:
        out = gen(adapter_ids=names)
    # The situation under test really arose: the encoder ran once on the original rows, the decoder on rows × beams
    # (6 prompt tokens; the decoder starts from one token and decodes one at a time over its cache).
    assert seen["encoder"] == [(rows, 6)], seen["encoder"]
    assert seen["decoder"] and set(seen["decoder"]) == {(rows * num_beams, 1)}, seen["decoder"]
    assert seen["cross_kv"] and set(seen["cross_kv"]) == {(rows * num_beams, 6)}, seen["cross_kv"]
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"
    assert torch.equal(out, peft_mixed)
    assert torch.equal(gen(adapter_names=names), out)  # PEFT's spelling takes the same path
    assert active_calls() == 0


def test_seq2seq_beam_search_num_return_sequences():
    """num_beams=2 with num_return_sequences=2 on BART: the output has rows × 2 sequences, each row's both from its
    own adapter's run."""
    seed, alpha = SEQ2SEQ_SETUP["bart"]
    model = make("bart", alpha=alpha)
    input_ids, mask = make_batch(3, 6, seed=seed)
    names = ["a0", None, "a1"]
    kw = greedy_kwargs(4, num_beams=2, num_return_sequences=2)

    def gen(**extra):
        return model.generate(input_ids=input_ids, attention_mask=mask, **kw, **extra)

    outs = stock_or_skip("bart", lambda: per_adapter(model, names, gen))
    assert_generations_differ(outs)
    expanded = [n for n in names for _ in range(2)]
    assert_rows_distinguish(outs, expanded)
    expected = stitch(outs, expanded)
    with torch.no_grad():
        peft_mixed = gen(adapter_names=[norm(n) for n in names])
    assert torch.equal(peft_mixed, expected)

    enable_csgmv(model, backend="torch")
    out = gen(adapter_ids=names)
    assert out.shape[0] == 2 * len(names)
    assert torch.equal(out, expected), f"\n{out}\n!=\n{expected}"
