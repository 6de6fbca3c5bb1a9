"""Calls from several threads on one enabled model: each call gets its own ids' results (never another call's), and a
stock call (no ids) made while another thread's call with ids is in progress is stock PEFT's."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import BACKENDS, BASE, DEVICE, close, make, make_batch, per_adapter, stitch

from peft_csgmv import enable_csgmv

ROUNDS = 6


def _run_threads(jobs):
    """Run each ``job()`` ``ROUNDS`` times on a thread of its own, all started together; returns each job's outputs
    (or raises the first exception a thread met)."""
    barrier = threading.Barrier(len(jobs))
    results, errors = [[] for _ in jobs], []

    def worker(i, job):
        try:
            barrier.wait()
            for _ in range(ROUNDS):
                results[i].append(job())
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_threads_get_their_own_ids(backend):
    """Two threads call one model with different ids at the same time, over and over, and a third makes stock calls
    with the active adapter: each gets the result of its own ids, equal to stock PEFT's single-adapter runs."""
    model = make()
    ids, mask = make_batch(3, 7)
    mixes = [["a0", BASE, "a1"], ["a1", "a0", "a0"]]
    expected = []
    for names in mixes:
        outs = per_adapter(model, names, lambda: model(input_ids=ids, attention_mask=mask).logits)
        expected.append(stitch(outs, names))
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask).logits  # the active adapter, a0
    enable_csgmv(model, backend=backend)

    def mixed(names):
        return lambda: model(input_ids=ids, attention_mask=mask, adapter_ids=names).logits

    def plain():
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask).logits

    results = _run_threads([mixed(mixes[0]), mixed(mixes[1]), plain])
    for i, want in enumerate([*expected, stock]):
        for k, got in enumerate(results[i]):
            close(got, want, f"thread {i}, call {k}")


def test_threads_generate_their_own_ids():
    """Two threads generate with different ids at once: each gets the tokens of its own single-threaded call."""
    model = make()
    enable_csgmv(model, backend="torch")
    ids, mask = make_batch(2, 5)
    mixes = [["a0", "a1"], ["a1", BASE]]
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
    expected = [model.generate(input_ids=ids, attention_mask=mask, adapter_ids=m, **kw) for m in mixes]
    assert not torch.equal(expected[0], expected[1])
    results = _run_threads(
        [lambda m=m: model.generate(input_ids=ids, attention_mask=mask, adapter_ids=m, **kw) for m in mixes]
    )
    for i, want in enumerate(expected):
        for got in results[i]:
            assert torch.equal(got, want), f"thread {i} got another call's tokens"


def test_layer_called_from_another_thread_during_a_call_is_stock():
    """While one thread's call with ids is open (``adapter_ids_scope``), a LoRA layer called directly from another
    thread runs PEFT's own forward with the active adapter, not the open call's ids; the call's own thread still
    gets its ids."""
    from peft_csgmv import adapter_ids_scope

    model = make()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 3, layer.in_features, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        stock = layer(x)  # the active adapter (a0) on both rows
        model.set_adapter("a1")
        want_ids = layer(x)
        model.set_adapter("a0")
    assert (stock - want_ids).abs().max() > 1e-3
    enable_csgmv(model, backend="torch")
    got = {}
    with torch.no_grad(), adapter_ids_scope(model, ["a1", "a1"]):
        thread = threading.Thread(target=lambda: got.setdefault("other", layer(x)))
        thread.start()
        thread.join()
        got["own"] = layer(x)
    close(got["other"], stock, "another thread's direct call")
    close(got["own"], want_ids, "the call's own thread")
