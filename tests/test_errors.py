"""Errors: every one is raised before any kernel runs, says what is wrong (PEFT's wording where PEFT has one), and
leaves the model usable: no call context is left behind and the next valid call gives the right output."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from helpers import add_adapters, assert_close, tiny_model

from peft_csgmv import enable_csgmv, is_csgmv_enabled
from peft_csgmv.executor import active_calls
from peft_csgmv.patching import is_patched

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ["__base__", "a0", "a1", "a0"]


def make_batch(rows=4, seq=5):
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, 97, (rows, seq), generator=g)
    mask = torch.ones_like(input_ids)
    mask[1, :2] = 0  # some left padding
    return input_ids.to(DEVICE), mask.to(DEVICE)


class Setup:
    """An enabled llama PeftModel with adapters a0, a1 (plus ``extra``), a batch, and PEFT's own mixed-batch logits
    for ``NAMES``, taken before enable_csgmv."""

    def __init__(self, extra: dict | None = None, backend: str = "torch"):
        model, targets = tiny_model("llama")
        specs = {
            "a0": dict(r=4, lora_alpha=8, target_modules=targets),
            "a1": dict(r=8, lora_alpha=4, target_modules=targets),
            **(extra or {}),
        }
        self.model = add_adapters(model, specs).to(DEVICE)
        self.input_ids, self.mask = make_batch()
        with torch.no_grad():
            self.expected = self.model(self.input_ids, attention_mask=self.mask, adapter_names=NAMES).logits
            self.expected_gen = self.generate(adapter_names=NAMES)  # stock PEFT: not enabled yet
            with self.model.disable_adapter():
                base = self.model(self.input_ids, attention_mask=self.mask).logits
        assert (self.expected[1:] - base[1:]).abs().max() > 1e-2  # the adapters matter
        enable_csgmv(self.model, backend=backend)

    def __call__(self, **kw):
        return self.model(self.input_ids, attention_mask=self.mask, **kw)

    def generate(self, **kw):
        return self.model.generate(
            input_ids=self.input_ids,
            attention_mask=self.mask,
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            **kw,
        )

    def assert_usable(self, kernel_calls):
        """Nothing ran and nothing is left behind; the next valid call is right."""
        assert kernel_calls == [], "a kernel ran before the error"
        assert active_calls() == 0, "the call context leaked"
        out = self(adapter_ids=NAMES).logits
        assert kernel_calls, "the valid call after the error did not use the kernels"
        assert active_calls() == 0
        assert torch.isfinite(out).all()
        assert_close(out, self.expected, what="valid call after the error")


@pytest.fixture
def setup():
    return Setup()


# --------------------------------------------------------------------------------------------------------------------
# per-call errors
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["adapter_ids", "adapter_names"])
def test_unknown_adapter(setup, kernel_calls, arg):
    with pytest.raises(ValueError, match=r"Trying to infer with non-existing adapter\(s\): nope, typo"):
        setup(**{arg: ["a0", "nope", None, "typo"]})
    setup.assert_usable(kernel_calls)


@pytest.mark.parametrize("arg", ["adapter_ids", "adapter_names"])
@pytest.mark.parametrize("n_ids", [3, 5, 8])
def test_length_not_matching_batch(setup, kernel_calls, arg, n_ids):
    """The batch (4 rows) is not a whole multiple of len(ids); the message names the argument as it was given."""
    ids = (["a0", "a1", None] * 3)[:n_ids]
    msg = f"Length of `{arg}` should be the same as the number of inputs, but got {n_ids} and 4 respectively."
    with pytest.raises(ValueError, match=re.escape(msg)):
        setup(**{arg: ids})
    setup.assert_usable(kernel_calls)


def test_length_checked_in_generate(setup, kernel_calls):
    with pytest.raises(ValueError, match=r"Length of `adapter_names` should be the same .* got 3 and 4 respectively\."):
        setup.generate(adapter_names=["a0", "a1", None])
    setup.assert_usable(kernel_calls)


def test_merged_adapter(setup, kernel_calls):
    setup.model.merge_adapter()
    msg = r"Cannot pass `adapter_ids` when there are merged adapters, please call `unmerge_adapter` first\."
    with pytest.raises(ValueError, match=msg):
        setup(adapter_ids=NAMES)
    with pytest.raises(ValueError, match=msg.replace("adapter_ids", "adapter_names")):
        setup.generate(adapter_names=NAMES)
    assert active_calls() == 0
    setup.model.unmerge_adapter()
    setup.assert_usable(kernel_calls)


@pytest.mark.parametrize("arg", ["adapter_ids", "adapter_names"])
def test_training_mode(setup, kernel_calls, arg):
    setup.model.train()
    with pytest.raises(ValueError, match=rf"Cannot pass `{arg}` when the model is in training mode\."):
        setup(**{arg: NAMES})
    setup.model.eval()
    setup.assert_usable(kernel_calls)


def test_both_spellings_given(setup, kernel_calls):
    with pytest.raises(ValueError, match=r"Pass either `adapter_ids` or `adapter_names`, not both\."):
        setup(adapter_ids=NAMES, adapter_names=NAMES)
    with pytest.raises(ValueError, match=r"not both"):
        setup.generate(adapter_ids=NAMES, adapter_names=NAMES)
    setup.assert_usable(kernel_calls)


@pytest.mark.parametrize("ids", ["a0", b"a0", {"a0": 1}, 7], ids=["str", "bytes", "dict", "int"])
def test_ids_not_a_list(setup, kernel_calls, ids):
    with pytest.raises(TypeError, match=r"Got adapter_ids of type .*, expected a list of str\."):
        setup(adapter_ids=ids)
    setup.assert_usable(kernel_calls)


@pytest.mark.parametrize("bad", [0, 1.5, b"a0", ["a0"]], ids=["int", "float", "bytes", "list"])
def test_non_str_entry(setup, kernel_calls, bad):
    with pytest.raises(TypeError, match=r"`adapter_names` must hold adapter names \(str\) or None"):
        setup(adapter_names=["a0", bad, None, "a1"])
    setup.assert_usable(kernel_calls)


@pytest.mark.parametrize("empty", [[], ()], ids=["list", "tuple"])
def test_empty_ids(setup, kernel_calls, empty):
    with pytest.raises(ValueError, match=r"`adapter_ids` is empty"):
        setup(adapter_ids=empty)
    setup.assert_usable(kernel_calls)


def test_errors_inside_generate_leave_no_state(setup, kernel_calls):
    """Errors from validation, and errors raised by transformers / the model while the ids are active."""
    with pytest.raises(ValueError, match="non-existing adapter"):
        setup.generate(adapter_ids=["a0", "zzz", None, "a1"])
    assert active_calls() == 0 and kernel_calls == []

    # Raised by transformers inside generate, after the ids were published to the layers.
    with pytest.raises(ValueError, match="bogus_kwarg"):
        setup.generate(adapter_ids=NAMES, bogus_kwarg=1)
    assert active_calls() == 0

    # Raised by a later decoder layer, after the first layer's LoRA kernels ran with the ids active.
    def boom(module, args):
        raise RuntimeError("boom in layer 1")

    handle = setup.model.base_model.model.model.layers[1].register_forward_pre_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom in layer 1"):
            setup.generate(adapter_ids=NAMES)
        assert kernel_calls, "the error was meant to come after some kernels ran"
    finally:
        handle.remove()
    assert active_calls() == 0

    # No PEFT hooks were left on any module, and generate is right afterwards.
    assert all(not m._forward_pre_hooks for m in setup.model.modules())
    kernel_calls.clear()
    setup.assert_usable(kernel_calls)
    assert torch.equal(setup.generate(adapter_ids=NAMES), setup.expected_gen)


# --------------------------------------------------------------------------------------------------------------------
# enable-time errors (modules and adapters PEFT itself refuses in mixed batches: tests/test_drop_in.py)
# --------------------------------------------------------------------------------------------------------------------


def assert_untouched(model):
    assert not is_csgmv_enabled(model)
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__
    assert not any(is_patched(m) for m in model.modules())


def test_not_a_peft_model():
    model, _ = tiny_model("llama")
    with pytest.raises(TypeError, match=r"enable_csgmv expects a peft\.PeftModel, got LlamaForCausalLM"):
        enable_csgmv(model)
    assert not is_csgmv_enabled(model)


@pytest.mark.parametrize("backend", ["cuda", "Triton", None])
def test_bad_backend(backend):
    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, target_modules=targets)})
    with pytest.raises(ValueError, match=r"backend must be one of auto, triton, torch"):
        enable_csgmv(model, backend=backend)
    assert_untouched(model)


def test_adapter_names_take_peft_length_rule(kernel_calls):
    """PEFT's spelling takes PEFT's length rule, with PEFT's error, before anything runs: a list that only divides the
    batch (forward), and returned sequences without beams (generate: PEFT repeats names for beams only). Stock PEFT
    raises the same in each case; ``adapter_ids`` keeps its own rule (each id covers consecutive rows), and beams with
    one name per prompt run."""
    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, target_modules=targets), "a1": dict(r=8, target_modules=targets)})
    model = model.to(DEVICE)
    input_ids, mask = make_batch()
    sample = dict(max_new_tokens=2, do_sample=True, num_return_sequences=2)
    cases = [
        (lambda m, **kw: m(input_ids, attention_mask=mask, **kw), ["a0", "a1"], "got 2 and 4"),
        (lambda m, **kw: m.generate(input_ids=input_ids, attention_mask=mask, **sample, **kw), NAMES, "got 4 and 8"),
    ]
    stock = []
    for call, names, _ in cases:
        # (on a copy: PEFT leaves its adapter_names hooks on the layers where its call raised inside a layer)
        with pytest.raises(ValueError, match="Length of `adapter_names`") as info, torch.no_grad():
            call(copy.deepcopy(model), adapter_names=names)
        stock.append(str(info.value))
    enable_csgmv(model, backend="torch")
    for (call, names, counts), message in zip(cases, stock):
        with pytest.raises(ValueError, match=re.escape(counts)) as info:
            call(model, adapter_names=names)
        assert str(info.value) == message
        assert kernel_calls == [] and active_calls() == 0
    with torch.no_grad():
        model(input_ids, attention_mask=mask, adapter_ids=["a0", "a1"])  # adapter_ids: each id covers two rows
    beams = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=2, num_beams=2,
                           adapter_names=NAMES)  # fmt: skip
    assert beams.shape[0] == 4
