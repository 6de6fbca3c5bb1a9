"""pytest plugin for ``benchmarks/peft_tests/run.py``: runs PEFT's own mixed-batch tests, unchanged, either on stock
PEFT or with every ``PeftModel`` passed through ``peft_csgmv.enable_csgmv`` before it serves its first call with
``adapter_names``.

Loaded with ``-p plugin`` (``benchmarks/peft_tests/`` on ``PYTHONPATH``); configured by environment variables:

* ``PEER_MODE``: ``stock`` (no patching) or ``csgmv`` (default ``stock``).
* ``PEER_BACKEND``: ``enable_csgmv(..., backend=...)`` (default ``auto``).
* ``PEER_RESULTS``: path of a JSON-lines file that gets one record per test (outcome, exception, csgmv activity).
* ``PEER_DTYPE``: ``bf16`` loads every transformers model the tests load (hub id or tiny) in bf16, where the test
  gives no dtype of its own (PEFT then keeps the adapters in fp32); ``fp32`` (default) leaves them as the tests load
  them.
* ``PEER_TINY_MODELS``: ``1`` (default) builds a tiny random-weight model from a config for each hub model id the
  tests load (the hub is out of reach here), ``0`` loads the real hub models.

The csgmv wrapper: ``forward`` and ``generate`` of ``peft.PeftModel`` and of every subclass that defines its own
(``PeftModelForCausalLM``, ``...Seq2SeqLM``, ...) are replaced at class level by a wrapper. On a call with
``adapter_names`` not None it runs ``enable_csgmv(self)`` once per instance, then calls the method that
``enable_csgmv`` gave the model (the model's class becomes csgmv's subclass of it, which defines ``forward`` and
``generate``; a model with a method of its own gets an instance attribute), which takes the ids and calls PEFT's
method of the class below, i.e. this wrapper again, which then goes straight to PEFT's own code (a per-model re-entry
guard, since csgmv may hand ``adapter_names`` on to PEFT for adapters it leaves to PEFT). Calls without
``adapter_names`` are untouched (and once enabled, ``model(...)`` reaches csgmv's method directly anyway). Every
PEFT test in the selection calls the ``PeftModel`` (``model(...)``, ``model.forward(...)``, ``model.generate(...)``),
never the tuner model, so this catches all of them; a call with ``adapter_names`` that reaches a tuner model or
layer directly is counted (``tuner_calls``) so that the table shows it.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
import zlib

import pytest

MODE = os.environ.get("PEER_MODE", "stock")
BACKEND = os.environ.get("PEER_BACKEND", "auto")
RESULTS = os.environ.get("PEER_RESULTS")
TINY_MODELS = os.environ.get("PEER_TINY_MODELS", "1") == "1"
DTYPE = os.environ.get("PEER_DTYPE", "fp32")

# The tests this harness runs: (file name, class name or None, test function name or None for the whole class).
SELECTION = [
    ("test_custom_models.py", "TestMixedAdapterBatches", None),
    ("test_decoder_models.py", None, "test_mixed_adapter_batches"),
    ("test_decoder_models.py", None, "test_generate_with_mixed_adapter_batches"),
    ("test_encoder_decoder_models.py", None, "test_mixed_adapter_batches"),
    ("test_encoder_decoder_models.py", None, "test_generate_with_mixed_adapter_batches"),
    ("test_target_parameters.py", None, "test_mixed_adapter_batches"),
    ("test_target_parameters.py", None, "test_generate_with_mixed_adapter_batches"),
    ("test_trainable_tokens.py", "TestTrainableTokens", "test_multiple_adapters_mixed_forward"),
]


# --------------------------------------------------------------------------------------------------------------------
# per-test record of what csgmv did
# --------------------------------------------------------------------------------------------------------------------

_LOG: dict = {}


def _reset_log() -> None:
    _LOG.clear()
    _LOG.update(enabled=0, enable_errors=[], enable_warnings=[], csgmv_calls=0, tuner_calls=0, tiny_models=[])


_reset_log()


# --------------------------------------------------------------------------------------------------------------------
# csgmv wrapper
# --------------------------------------------------------------------------------------------------------------------


_INSIDE: set[int] = set()  # ids of the models whose csgmv instance method is running


def _wrap_peft_method(cls, name: str) -> None:
    original = cls.__dict__[name]
    if getattr(original, "__peer_original__", None) is not None:
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("adapter_names") is not None and id(self) not in _INSIDE:
            from peft_csgmv import enable_csgmv, is_csgmv_enabled

            if not is_csgmv_enabled(self):
                try:
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        enable_csgmv(self, backend=BACKEND)
                    for w in caught:
                        _LOG["enable_warnings"].append(f"{w.category.__name__}: {str(w.message).splitlines()[0]}")
                        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
                except Exception as exc:
                    _LOG["enable_errors"].append(
                        f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    )
                    raise
                _LOG["enabled"] += 1
            # csgmv's method (its subclass of the model's class defines it; a model with a method of its own gets an
            # instance attribute): whatever the model resolves to, unless that is still this wrapper
            patched = getattr(self, name)
            if getattr(getattr(patched, "__func__", None), "__peer_original__", None) is None:
                _LOG["csgmv_calls"] += 1
                # csgmv's method takes the ids, then calls PEFT's method of the class below, i.e. this wrapper again,
                # which must then go to PEFT's own method (below) even where csgmv passes adapter_names on to PEFT.
                _INSIDE.add(id(self))
                try:
                    return patched(*args, **kwargs)
                finally:
                    _INSIDE.discard(id(self))
        return original(self, *args, **kwargs)

    wrapper.__peer_original__ = original
    setattr(cls, name, wrapper)


def _all_subclasses(cls):
    seen, todo = [], [cls]
    while todo:
        c = todo.pop()
        if c not in seen:
            seen.append(c)
            todo.extend(c.__subclasses__())
    return seen


def _count_tuner_calls(cls, name: str) -> None:
    """Calls with adapter_names that reach a tuner model directly (not through a PeftModel) are counted: they bypass
    the csgmv wrapper."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, "__peer_original__", None) is not None:
        return

    @functools.wraps(original)
    def wrapper(self, *args, **kwargs):
        if kwargs.get("adapter_names") is not None:
            _LOG["tuner_calls"] += 1
        return original(self, *args, **kwargs)

    wrapper.__peer_original__ = original
    setattr(cls, name, wrapper)


def install_csgmv_wrappers() -> None:
    import peft.peft_model  # noqa: F401  (defines the task subclasses)
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTuner

    for cls in _all_subclasses(PeftModel):
        for name in ("forward", "generate"):
            if name in cls.__dict__:
                _wrap_peft_method(cls, name)
    for cls in _all_subclasses(BaseTuner):
        for name in ("forward", "generate"):
            _count_tuner_calls(cls, name)


# --------------------------------------------------------------------------------------------------------------------
# tiny config-built models in place of hub models
# --------------------------------------------------------------------------------------------------------------------


def _tiny_configs():
    import transformers as tf

    small = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return {
        # The timing test's "more realistic model": OPT-125m's own dimensions, random weights.
        "peft-internal-testing/opt-125m": lambda: tf.OPTConfig(
            vocab_size=50272,
            hidden_size=768,
            ffn_dim=3072,
            num_hidden_layers=12,
            num_attention_heads=12,
            word_embed_proj_dim=768,
            max_position_embeddings=2048,
        ),
        "peft-internal-testing/tiny-random-OPTForCausalLM": lambda: tf.OPTConfig(
            vocab_size=1024,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
        ),
        "peft-internal-testing/tiny-random-GPT2LMHeadModel": lambda: tf.GPT2Config(
            vocab_size=1024,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1023,
            eos_token_id=1023,
        ),
        "hf-internal-testing/tiny-random-gpt2": lambda: tf.GPT2Config(
            vocab_size=1024,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=128,
            bos_token_id=1023,
            eos_token_id=1023,
        ),
        "peft-internal-testing/tiny-random-GPTJForCausalLM": lambda: tf.GPTJConfig(
            vocab_size=1024,
            n_embd=32,
            n_layer=2,
            n_head=4,
            rotary_dim=4,
            n_positions=128,
            bos_token_id=1023,
            eos_token_id=1023,
        ),
        "trl-internal-testing/tiny-random-LlamaForCausalLM": lambda: tf.LlamaConfig(
            vocab_size=1024, num_key_value_heads=2, **small
        ),
        "peft-internal-testing/tiny-dummy-qwen2": lambda: tf.Qwen2Config(
            vocab_size=1024, num_key_value_heads=2, **small
        ),
        "hf-internal-testing/tiny-random-MistralForCausalLM": lambda: tf.MistralConfig(
            vocab_size=1024, num_key_value_heads=2, **small
        ),
        "hf-internal-testing/tiny-random-Gemma3ForCausalLM": lambda: tf.Gemma3TextConfig(
            vocab_size=1024, num_key_value_heads=2, head_dim=8, sliding_window=16, **small
        ),
        "peft-internal-testing/tiny-random-T5ForConditionalGeneration-calibrated": lambda: tf.T5Config(
            vocab_size=1024,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            decoder_start_token_id=0,
        ),
        "peft-internal-testing/tiny-random-BartForConditionalGeneration": lambda: tf.BartConfig(
            vocab_size=1024,
            d_model=32,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=128,
        ),
        "trl-internal-testing/tiny-Llama4ForCausalLM": lambda: tf.Llama4TextConfig(
            vocab_size=1024,
            num_key_value_heads=2,
            head_dim=8,
            intermediate_size_mlp=64,
            num_local_experts=4,
            num_experts_per_tok=1,
            interleave_moe_layer_step=1,
            **small,
        ),
        "trl-internal-testing/tiny-GptOssForCausalLM": lambda: tf.GptOssConfig(
            vocab_size=1024,
            num_key_value_heads=2,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=16,
            **small,
        ),
    }


def install_tiny_models() -> None:
    """``from_pretrained(<hub id>)`` of the Auto model classes, of concrete model classes and of ``AutoConfig`` build
    a tiny random-weight model (weights seeded from the model id, the global RNG untouched) for the ids above."""
    import torch
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    configs = _tiny_configs()

    def tiny(cls, model_id, kwargs):
        config = configs[model_id]()
        _LOG["tiny_models"].append(model_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(zlib.crc32(model_id.encode()))
            if issubclass(cls, _BaseAutoModelClass):
                model = cls.from_config(config)
            else:
                model = cls._from_config(config)
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if isinstance(dtype, torch.dtype):
            model = model.to(dtype)
        return model.eval()

    auto_orig = _BaseAutoModelClass.__dict__["from_pretrained"].__func__

    def auto_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path in configs:
            return tiny(cls, pretrained_model_name_or_path, kwargs)
        return auto_orig(cls, pretrained_model_name_or_path, *args, **kwargs)

    _BaseAutoModelClass.from_pretrained = classmethod(auto_from_pretrained)

    pm_orig = transformers.PreTrainedModel.__dict__["from_pretrained"].__func__

    def pm_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path in configs:
            return tiny(cls, pretrained_model_name_or_path, kwargs)
        return pm_orig(cls, pretrained_model_name_or_path, *args, **kwargs)

    transformers.PreTrainedModel.from_pretrained = classmethod(pm_from_pretrained)

    cfg_orig = transformers.AutoConfig.__dict__["from_pretrained"].__func__

    def cfg_from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        if isinstance(pretrained_model_name_or_path, str) and pretrained_model_name_or_path in configs:
            return configs[pretrained_model_name_or_path]()
        return cfg_orig(cls, pretrained_model_name_or_path, *args, **kwargs)

    transformers.AutoConfig.from_pretrained = classmethod(cfg_from_pretrained)


# --------------------------------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------------------------------


def install_dtype() -> None:
    """``from_pretrained`` of transformers models without a dtype of the test's own loads them in bf16."""
    import torch
    import transformers
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    for owner in (_BaseAutoModelClass, transformers.PreTrainedModel):
        original = owner.__dict__["from_pretrained"].__func__

        def from_pretrained(cls, *args, __original=original, **kwargs):
            if kwargs.get("dtype") is None and kwargs.get("torch_dtype") is None:
                kwargs["dtype"] = torch.bfloat16
            return __original(cls, *args, **kwargs)

        owner.from_pretrained = classmethod(from_pretrained)


def pytest_configure(config):
    config.addinivalue_line("markers", "regression: PEFT regression tests (not run here)")
    if TINY_MODELS:
        install_tiny_models()
    if DTYPE == "bf16":
        install_dtype()
    if MODE == "csgmv":
        install_csgmv_wrappers()
    if RESULTS:
        open(RESULTS, "w").close()


def _selected(item) -> bool:
    file = os.path.basename(str(item.fspath))
    cls = item.cls.__name__ if item.cls is not None else None
    func = getattr(item, "originalname", None) or item.name.split("[")[0]
    for f, c, fn in SELECTION:
        if f == file and (c is None or c == cls) and (fn is None or fn == func):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    keep = [i for i in items if _selected(i)]
    drop = [i for i in items if not _selected(i)]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.fixture(autouse=True)
def _peer_one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _reset_log()


def _exc_summary(excinfo) -> tuple[str, str]:
    if excinfo is None:
        return "", ""
    text = str(excinfo.value)
    return excinfo.typename, text[:2000]


_REPORTS_KEY = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    item.stash.setdefault(_REPORTS_KEY, []).append((rep, call))
    if rep.when == "teardown" and RESULTS:
        with open(RESULTS, "a") as f:
            f.write(json.dumps(_final(item)) + "\n")


def _final(item) -> dict:
    reports = item.stash.get(_REPORTS_KEY, [])
    result, exc_type, exc_msg, skip_reason = "passed", "", "", ""
    for rep, call in reports:
        if rep.skipped:
            if hasattr(rep, "wasxfail"):
                result = "xfailed"
            else:
                result = "skipped"
                skip_reason = str(rep.longrepr[2]) if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
            break
        if rep.failed:
            result = "failed" if rep.when == "call" else f"error({rep.when})"
            exc_type, exc_msg = _exc_summary(call.excinfo)
            break
    return {
        "nodeid": item.nodeid,
        "result": result,
        "exc_type": exc_type,
        "exc_msg": exc_msg,
        "skip_reason": skip_reason,
        "csgmv_enabled": _LOG["enabled"],
        "csgmv_calls": _LOG["csgmv_calls"],
        "enable_errors": list(_LOG["enable_errors"]),
        "enable_warnings": list(_LOG["enable_warnings"]),
        "tuner_calls": _LOG["tuner_calls"],
        "tiny_models": sorted(set(_LOG["tiny_models"])),
        "mode": MODE,
    }
