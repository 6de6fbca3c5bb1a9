"""QLoRA: PEFT's bitsandbytes LoRA layers (``lora.bnb.Linear4bit`` / ``lora.bnb.Linear8bitLt``) on the kernels.

The base layer stays bitsandbytes' own (``y = base(x)`` on the quantized weight); the kernels add every row's adapter
onto it. A tiny Llama is saved with ``save_pretrained`` and loaded back through transformers' ``BitsAndBytesConfig``
(nf4 4-bit, or LLM.int8()), as a QLoRA model is in practice; then PEFT wraps its bnb layers. Parity as in
``test_parity.py``: each mixed-batch row against stock PEFT's run of the same batch with that row's adapter.

Tolerances. Stock PEFT is deterministic here (its run-to-run difference, measured in the tests, is 0 on CPU and on
the H200, and is added to every bound), but the quantized bases *amplify* last-bit differences: bitsandbytes rounds
each layer's input (its 4-bit CPU kernel on AVX512-BF16 machines casts it to bf16; 8-bit quantizes every row to int8),
so an fp32 ulp of difference in one LoRA delta can flip one such rounding in a later layer. Measured, max |logits
difference| to per-adapter PEFT runs: CPU fp32 compute, 84 batches, 4-bit and 8-bit: 0 with the torch backend, up to
2.2e-3 (typically 1e-7 to 5e-4) with the Triton interpreter; H200 fp32 compute, 10 batches: 4-bit 7.5e-7, 8-bit 9.7e-4
with either backend, which is also how far PEFT's own ``adapter_names`` path is from its per-adapter runs there; H200
bf16 compute: 2e-2 (layers: one bf16 ulp). Each layer's output on the same input differs by at most 1.3e-6 in fp32.
Hence two checks:

* every patched layer's output, recomputed by PEFT on the *same* input: the compute dtype's tolerance
  (``helpers.TOLERANCES``, 1e-5 in fp32 on CPU), which catches any error of a single layer;
* end to end, the logits: the bf16 row of the table, the precision bitsandbytes rounds activations to (2e-2: ~10x the
  worst amplified fp32-compute difference measured, and well below each adapter's effect, >0.5); in bf16 compute
  (GPU), bf16's tolerance scaled by the logits' magnitude x2, as ``helpers.assert_mixed_batch_matches`` does.

Skipped where bitsandbytes is not installed, or its backend cannot run a layer type on the device (the reason says
why). bitsandbytes' AVX512-BF16 CPU path repacks 4-bit weights in blocks of 32 output features, so every projection
of the tiny model has a multiple of 32 outputs.
"""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from helpers import (
    ALL_LINEAR,
    BACKENDS,
    BASE,
    DEVICE,
    TOLERANCES,
    add_adapters,
    assert_adapters_matter,
    assert_generations_differ,
    greedy_kwargs,
    make_batch,
    norm,
    per_adapter,
    stitch,
    tiny_model,
)

from peft_csgmv import disable_csgmv, enable_csgmv

bnb = pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

QUANTS = ["4bit", "8bit"]
# Interleaved base rows (both spellings) and three adapters; a2 targets only some modules.
NAMES = [BASE, "a0", "a1", "a2", None, "a1", "a0", "a2"]
SPECS = {
    "a0": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "a1": dict(r=8, lora_alpha=4, target_modules=ALL_LINEAR),
    "a2": dict(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"]),
}
LOGITS_TOL = torch.bfloat16  # see the module docstring


# --------------------------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------------------------


@functools.cache
def _cannot_run(quant: str, device: str, dtype: torch.dtype) -> str | None:
    """Why bitsandbytes cannot run a ``quant`` layer on ``device`` with ``dtype`` activations (None if it can)."""
    try:
        torch.manual_seed(0)
        weight = torch.randn(32, 64) / 8
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if quant == "4bit":
                layer = bnb.nn.Linear4bit(64, 32, bias=False, compute_dtype=dtype, quant_type="nf4")
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4")
            else:
                layer = bnb.nn.Linear8bitLt(64, 32, bias=False, has_fp16_weights=False)
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
            layer = layer.to(device).eval()
            x = torch.randn(3, 64).to(device, dtype)
            y = layer(x)
            expected = x.float() @ weight.to(device).T
            error = ((y.float() - expected).norm() / expected.norm()).item()
        # nf4 keeps ~10% relative error on a random matrix, int8 ~1%: more means a broken kernel.
        if y.shape != (3, 32) or not error < 0.25:
            return f"wrong output (shape {tuple(y.shape)}, relative error {error:.3g})"
    except Exception as exc:  # noqa: BLE001 - any failure of the backend means: skip, and say why
        return f"{type(exc).__name__}: {exc}"
    return None


def _require(quant: str, device: torch.device, dtype: torch.dtype) -> None:
    reason = _cannot_run(quant, str(device), dtype)
    if reason is not None:
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot run a {quant} layer on {device} ({dtype}): {reason}")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A tiny random-weight Llama saved to disk (from_pretrained quantizes while loading; no hub)."""
    model, _ = tiny_model("llama", hidden=64, intermediate=128)
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path


def quantized(path, quant: str, dtype: torch.dtype = torch.float32, device: torch.device = DEVICE):
    """The saved Llama loaded in 4-bit (nf4, ``dtype`` compute) or 8-bit on ``device``, with the SPECS adapters."""
    import transformers as tf
    from peft.tuners.lora import bnb as lora_bnb

    _require(quant, device, dtype)
    if quant == "4bit":
        config = tf.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    else:
        config = tf.BitsAndBytesConfig(load_in_8bit=True)
    device_map = {"": (device.index or 0) if device.type == "cuda" else device.type}
    base = tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map=device_map, dtype=dtype)
    base.generation_config.pad_token_id = 0
    model = add_adapters(base, SPECS)
    # PEFT wrapped the bnb layers into its bnb LoRA classes (else this would test plain lora.Linear).
    lora_cls, bnb_cls = {
        "4bit": (lora_bnb.Linear4bit, bnb.nn.Linear4bit),
        "8bit": (lora_bnb.Linear8bitLt, bnb.nn.Linear8bitLt),
    }[quant]
    layers = [m for m in model.modules() if hasattr(m, "lora_A")]
    assert len(layers) == 14 and all(type(m) is lora_cls for m in layers), {type(m) for m in layers}
    assert all(isinstance(m.get_base_layer(), bnb_cls) for m in layers)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert set(q_proj.lora_A) == {"a0", "a1", "a2"}
    assert set(model.base_model.model.model.layers[0].self_attn.k_proj.lora_A) == {"a0", "a1"}
    return model


def assert_within(actual, expected, tol_dtype, noise=0.0, scale=1.0, what=""):
    """|actual - expected| <= noise + scale * (atol + rtol * |expected|), with ``tol_dtype``'s row of TOLERANCES;
    ``noise``: stock PEFT's own run-to-run difference."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all() and torch.isfinite(expected).all(), f"{what}: non-finite values"
    atol, rtol = TOLERANCES[tol_dtype]
    actual, expected = actual.double(), expected.double()
    diff = (actual - expected).abs()
    bad = diff > noise + scale * (atol + rtol * expected.abs())
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{what} mismatch: {int(bad.sum())} of {bad.numel()} elements off; worst |diff| {diff.max().item():.3g} "
            f"(PEFT's own run-to-run difference {noise:.3g}); first at {idx}: got {actual[idx].item():.6g}, expected "
            f"{expected[idx].item():.6g}"
        )


def peft_reference(model, names, fn):
    """``fn()`` (a tensor, or a list of them) once per distinct adapter of ``names`` through stock PEFT, twice:
    (per-adapter outputs, stock PEFT's run-to-run difference: the largest over both runs)."""
    outs = per_adapter(model, names, fn)
    again = per_adapter(model, names, fn)
    noise = 0.0
    for k in outs:
        for a, b in zip(*(o if isinstance(o, list) else [o] for o in (outs[k], again[k]))):
            noise = max(noise, (a.double() - b.double()).abs().max().item())
    return outs, noise


class LayerRecorder:
    """Records each LoRA layer's (input, output) during one call, to recompute the outputs with stock PEFT."""

    def __init__(self, model):
        self.layers = {n: m for n, m in model.named_modules() if hasattr(m, "lora_A")}
        self.seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.handles = []

    def __enter__(self):
        for name, layer in self.layers.items():
            hook = functools.partial(self._record, name)
            self.handles.append(layer.register_forward_hook(hook))
        return self

    def _record(self, name, module, args, output):
        assert name not in self.seen, f"{name} ran twice in one forward"
        self.seen[name] = (args[0].detach().clone(), output.detach().clone())

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def check(self, model, names, tol_dtype, scale=1.0, what=""):
        """Every recorded output against PEFT's forward of that layer on the recorded input, row by row."""
        assert set(self.seen) == set(self.layers), "not every LoRA layer ran"
        with torch.no_grad():
            outs, noise = peft_reference(model, names, lambda: [self.layers[n](x) for n, (x, _) in self.seen.items()])
        for j, (name, (_, got)) in enumerate(self.seen.items()):
            want = torch.stack([outs[norm(n)][j][i] for i, n in enumerate(names)])
            assert_within(got, want, tol_dtype, noise, scale, f"{what} layer {name}")


def mixed_batch_parity(model, backend, tol_dtype, logits_scale=1.0, layer_scale=1.0, stack_dtype=None, what=""):
    """One mixed batch of NAMES through csgmv against stock PEFT: per layer and end to end (logits)."""
    input_ids, mask = make_batch(len(NAMES), 7)

    def run(**kw):
        return model(input_ids, attention_mask=mask, **kw).logits

    outs, noise = peft_reference(model, NAMES, run)
    assert_adapters_matter(outs)
    expected = stitch(outs, NAMES)
    with torch.no_grad():
        peft_mixed = run(adapter_names=[norm(n) for n in NAMES])
    enable_csgmv(model, backend=backend, dtype=stack_dtype)
    try:
        with LayerRecorder(model) as recorder:
            got = run(adapter_ids=NAMES)
        assert len(model._csgmv.layers) == 14, "not every bnb LoRA layer is on the kernels"
        recorder.check(model, NAMES, tol_dtype, layer_scale, what)
    finally:
        disable_csgmv(model)
    assert_within(got, expected, LOGITS_TOL, noise, logits_scale, f"{what} logits vs per-adapter runs")
    assert_within(got, peft_mixed, LOGITS_TOL, noise, logits_scale, f"{what} logits vs PEFT adapter_names")
    return got, expected


# --------------------------------------------------------------------------------------------------------------------
# fp32 compute (CPU; on CUDA where available)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant", QUANTS)
def test_forward_parity(saved_llama, quant, backend, kernel_calls):
    model = quantized(saved_llama, quant)
    mixed_batch_parity(model, backend, torch.float32, what=f"{quant}/{backend}")
    assert kernel_calls and all(flag == (backend == "triton") for flag in kernel_calls)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quant", QUANTS)
def test_greedy_generate_token_identical(saved_llama, quant, backend):
    model = quantized(saved_llama, quant)
    input_ids, mask = make_batch(len(NAMES), 6, seed=2)
    kw = greedy_kwargs(5)
    outs = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    assert_generations_differ(outs)
    enable_csgmv(model, backend=backend)
    try:
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
    finally:
        disable_csgmv(model)
    assert torch.equal(got, stitch(outs, NAMES)), f"{quant}/{backend}: greedy tokens differ from per-adapter PEFT"


# --------------------------------------------------------------------------------------------------------------------
# bf16 compute on CUDA (the Triton interpreter's bf16 tl.dot is wrong, so these run on the GPU only)
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("stack_dtype", [None, torch.float32], ids=["stack-default", "stack-fp32"])
@pytest.mark.parametrize("quant", QUANTS)
def test_gpu_bf16_parity(saved_llama, quant, stack_dtype, kernel_calls):
    model = quantized(saved_llama, quant, torch.bfloat16, torch.device("cuda"))
    # As helpers.assert_mixed_batch_matches: bf16's tolerance scaled by the logits' magnitude (x2: PEFT rounds each
    # LoRA delta to bf16 before adding it to the base output, the kernels round the sum once).
    with torch.no_grad(), model.disable_adapter():
        ids, mask = make_batch(len(NAMES), 7)
        magnitude = model(ids, attention_mask=mask).logits.abs().max().item()
    got, _ = mixed_batch_parity(
        model, "auto", torch.bfloat16, max(1.0, magnitude) * 2, 2.0, stack_dtype, f"{quant}/bf16/{stack_dtype}"
    )
    assert got.dtype == torch.bfloat16
    assert kernel_calls and all(kernel_calls), "the Triton kernels did not run"
