"""``generate`` with ids reads transformers' stop flag one step late on CUDA (``enable_csgmv``'s ``defer_stop_check``):
which calls do, and what transformers' ``DeferredStopCheck.is_supported`` answers inside and outside them. The loop
itself (transformers' own) cannot run on the CPU (it records CUDA events): the ``gpu`` test below runs it against the
undeferred loop."""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import transformers
from helpers import add_adapters, make, make_batch, tiny_model

from peft_csgmv import _compat, disable_csgmv, enable_csgmv
from peft_csgmv._compat import deferred_stop_check

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
CUDA = torch.device("cuda")  # a device object only: nothing runs there
AVAILABLE = _compat._install_deferred_stop_check()  # this transformers has the check (5.17 and 5.24 do)
if AVAILABLE:
    from transformers.generation.utils import DeferredStopCheck


class _Cache:
    def __init__(self, croppable: bool) -> None:
        self.is_croppable = croppable


def _supported(**kwargs) -> bool:
    args = dict(device=CUDA, cache=None, cache_is_returned=False, is_assistant=False) | kwargs
    return DeferredStopCheck.is_supported(**args)


@pytest.mark.skipif(not AVAILABLE, reason="this transformers has no DeferredStopCheck")
def test_transformers_defers_on_cuda_only_inside_the_block():
    """Outside the block transformers' own answers (no on CUDA, yes on Apple GPUs); inside it yes on CUDA, with
    transformers' conditions: not for an assistant model, and a cache returned to the caller must be croppable. The
    switch belongs to the block's context: a thread started inside it, a nested ``deferred_stop_check(False)`` and
    everything after the block (an exception included) see transformers' answers."""
    assert not _supported()
    assert _supported(device=torch.device("mps"))
    with deferred_stop_check():
        assert _supported()
        assert _supported(device=torch.device("mps"))
        assert not _supported(is_assistant=True)
        assert not _supported(cache=_Cache(False), cache_is_returned=True)
        assert _supported(cache=_Cache(True), cache_is_returned=True)
        assert _supported(cache=_Cache(False), cache_is_returned=False)
        assert DeferredStopCheck.is_supported(CUDA, None, False, False)  # as transformers calls it: by position
        with deferred_stop_check(False):
            assert not _supported()
        assert _supported()
        seen = []
        thread = threading.Thread(target=lambda: seen.append(_supported()))
        thread.start()
        thread.join()
        assert seen == [False], "the switch leaked into another thread"
    assert not _supported()
    with pytest.raises(RuntimeError, match="inside"):
        with deferred_stop_check():
            raise RuntimeError("inside")
    assert not _supported()
    assert _compat._install_deferred_stop_check()
    wrapped = inspect.getattr_static(DeferredStopCheck, "is_supported").__func__.__wrapped__
    assert not hasattr(wrapped, "__wrapped__"), "installed twice: the patch wraps itself"


class _Spy(transformers.StoppingCriteria):
    """Records, at every step of the loop, whether the call runs with the stop check deferred."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append(_compat._DEFER_STOP.get())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _deferred(model, *args, **kwargs) -> bool:
    """Whether a 3-token ``generate`` of ``model`` with ``args`` (after the prompt) and ``kwargs`` ran with its stop
    check deferred (every step)."""
    spy = _Spy()
    input_ids, mask = make_batch(3, 5)
    model.generate(input_ids, *args, attention_mask=mask, max_new_tokens=3, stopping_criteria=[spy], **kwargs)
    assert len(set(spy.seen)) == 1 and len(spy.seen) >= 3, spy.seen
    assert not _compat._DEFER_STOP.get(), "the switch outlived the call"
    return spy.seen[0]


def test_which_generate_calls_defer_their_stop_check():
    """By default calls with ids that do not sample (greedy, beams) defer; sampling calls do not (an EOS stop would
    draw one more step's samples, moving the random state away from transformers'); ``defer_stop_check=True`` adds
    them, ``False`` turns it off. Calls without ids are PEFT's, as they were. A refused ``enable_csgmv`` leaves the
    choice as it was. Where transformers has no deferred check, nothing defers."""
    model = make()
    ids = ["a0", None, "a1"]
    sample = dict(do_sample=True, top_k=5)
    enable_csgmv(model)
    assert _deferred(model, adapter_ids=ids, do_sample=False) is AVAILABLE
    assert _deferred(model, adapter_ids=ids) is AVAILABLE  # the model's generation config: greedy
    assert _deferred(model, adapter_ids=ids, num_beams=2, do_sample=False) is AVAILABLE
    assert _deferred(model, adapter_ids=ids, **sample) is False
    assert _deferred(model, adapter_ids=ids, generation_config=transformers.GenerationConfig(**sample)) is False
    assert _deferred(model, transformers.GenerationConfig(**sample), adapter_ids=ids) is False  # by position
    assert _deferred(model) is False  # no ids: PEFT's own call
    assert _deferred(model, adapter_names=["a0", "__base__", "a1"]) is AVAILABLE  # PEFT's spelling, on the kernels
    enable_csgmv(model, defer_stop_check=True)
    assert _deferred(model, adapter_ids=ids, **sample) is AVAILABLE
    assert _deferred(model, adapter_ids=ids) is AVAILABLE
    assert _deferred(model) is False
    enable_csgmv(model, defer_stop_check=False)
    assert _deferred(model, adapter_ids=ids) is False
    assert _deferred(model, adapter_ids=ids, **sample) is False
    with pytest.raises(ValueError, match="defer_stop_check"):
        enable_csgmv(model, defer_stop_check="yes")
    assert _deferred(model, adapter_ids=ids) is False, "a refused enable_csgmv changed the choice"
    enable_csgmv(model)
    assert _deferred(model, adapter_ids=ids) is AVAILABLE


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_deferred_stop_check_gives_the_undeferred_sequences(cache, monkeypatch):
    """``defer_stop_check`` (on by default for calls that do not sample): transformers' deferred loop on CUDA gives the
    sequences of its undeferred loop, in fp32, where every row stops on an EOS token before ``max_new_tokens`` (the
    deferred loop runs one more step and takes it back), greedy and sampled (the same seed), over the dynamic cache
    and the static cache's compiled steps. The deferred loop really ran: transformers built its DeferredStopCheck."""
    from transformers.generation import utils as generation

    from peft_csgmv import _compat

    if not _compat._install_deferred_stop_check():
        pytest.skip("this transformers has no DeferredStopCheck")
    built = []
    original_init = generation.DeferredStopCheck.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(generation.DeferredStopCheck, "__init__", counting_init)
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets),
        "b": dict(r=16, lora_alpha=8, target_modules=targets),
    }
    pm = add_adapters(model.to("cuda"), specs)
    names = ["a", "__base__", "b", "a", "b"]
    input_ids = torch.randint(3, 97, (len(names), 10), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), adapter_ids=names, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    enable_csgmv(pm)
    try:
        for sample in (False, True):
            extra = dict(do_sample=True, top_k=20) if sample else dict(do_sample=False)

            def run(defer: bool, **more):
                enable_csgmv(pm, defer_stop_check=defer)
                torch.manual_seed(7)
                with torch.no_grad():
                    return pm.generate(**kw, **extra, **more)

            # The same logits processors as below (no minimum length), with an EOS token the rows do not reach.
            free = run(False, max_new_tokens=8, eos_token_id=model.config.vocab_size - 1)
            # Each row's third new token is an EOS token: every row stops by the third step.
            eos = sorted(set(free[:, input_ids.shape[1] + 2].tolist()))
            before = len(built)
            undeferred = run(False, max_new_tokens=8, eos_token_id=eos)
            assert len(built) == before
            deferred = run(True, max_new_tokens=8, eos_token_id=eos)
            assert len(built) == before + 1, "the deferred loop did not run"
            assert undeferred.shape[1] < input_ids.shape[1] + 8, "no early stop: the test proves nothing"
            assert torch.equal(deferred, undeferred), f"sample={sample}: the deferred loop changed the sequences"
    finally:
        disable_csgmv(pm)
