"""Continuous batching with an adapter per request (transformers' ``generate_batch`` and its manager): each request's
tokens equal stock PEFT running that request alone with its adapter (fp32, greedy)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
from helpers import BACKENDS, BASE, DEVICE, make

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.continuous import continuous_batching_available

pytestmark = pytest.mark.skipif(
    not continuous_batching_available(), reason="this transformers has no continuous batching (transformers >= 5)"
)

PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 10, 11], [1, 20, 21, 22, 23, 24, 25, 26, 27], [1, 3, 4], [2, 9, 9, 8, 7]]
IDS = ["a0", None, "a1", "a0", "a1"]


def _configs(new_tokens: int = 5, max_batch_tokens: int = 64, **extra):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    extra.setdefault("do_sample", False)
    gen = GenerationConfig(max_new_tokens=new_tokens, eos_token_id=-1, pad_token_id=0, **extra)
    # (sized: unsized, the cache takes a share of the machine's memory)
    return gen, ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=max_batch_tokens)


@torch.no_grad()
def _alone(model, prompt, adapter, new_tokens: int) -> list[int]:
    """The request run alone through stock PEFT (csgmv's wrappers see no ids: PEFT's own generate)."""
    x = torch.tensor([prompt], device=model.get_base_model().device)
    kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    kw["eos_token_id"] = None  # (no stop: every request runs its whole length)
    if adapter is None:
        with model.disable_adapter():
            out = model.generate(input_ids=x, **kw)
    else:
        previous = model.active_adapter
        model.set_adapter(adapter)
        try:
            out = model.generate(input_ids=x, **kw)
        finally:
            model.set_adapter(previous)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(params=BACKENDS)
def enabled(request):
    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend=request.param)
    yield model
    disable_csgmv(model)


@pytest.mark.parametrize("max_batch_tokens", [64, 8], ids=["whole-prefills", "split-prefills"])
def test_generate_batch_gives_each_request_its_adapter(enabled, max_batch_tokens):
    """``generate_batch(..., adapter_ids=...)``: every request's tokens are its own stock PEFT run's, prefills split
    over steps included (a step of 8 tokens mixes prefill chunks and decode tokens of several adapters)."""
    model = enabled
    gen, cbc = _configs(max_batch_tokens=max_batch_tokens)
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS)
    got = [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
    want = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
    assert len({tuple(w) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
    assert got == want
    assert csgmv_stats(model)["unforeseen_plans"] == 0


def test_manager_requests_take_an_adapter(enabled):
    """The manager's ``add_request(..., adapter_id=)`` (per-request ``max_new_tokens``, streamed) and
    ``add_requests(..., adapter_ids=)``: each request's tokens are its alone-run's; an unknown adapter is refused in
    the caller's thread before anything is queued, and the running requests are not disturbed."""
    model = enabled
    gen, cbc = _configs()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    try:
        lengths = [3, 6, 4]
        asked = {}
        for i, (prompt, adapter, n) in enumerate(zip(PROMPTS, IDS, lengths)):
            rid = manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n, adapter_id=adapter, streaming=True)
            asked[rid] = (prompt, adapter, n)
        with pytest.raises(ValueError, match="non-existing adapter"):
            manager.add_request(PROMPTS[0], request_id="bad", adapter_id="nope")
        more = manager.add_requests(PROMPTS[3:], max_new_tokens=5, adapter_ids=IDS[3:])
        asked.update({rid: (p, a, 5) for rid, p, a in zip(more, PROMPTS[3:], IDS[3:])})
        got = {}
        while len(got) < len(asked):
            result = manager.get_result(timeout=10)
            assert result is not None, f"no result after 10 s; got {sorted(got)}"
            assert result.request_id != "bad"
            if result.is_finished():
                got[result.request_id] = result.generated_tokens
        cancelled = manager.add_request(PROMPTS[2], request_id="gone", max_new_tokens=400, adapter_id="a1")
        manager.cancel_request(cancelled)
        deadline = time.monotonic() + 10
        router = manager._csgmv_router
        while "gone" in router.adapters and time.monotonic() < deadline:
            time.sleep(0.01)
        assert router.adapters == {}, "finished and cancelled requests leave no entry behind"
    finally:
        manager.stop(block=True)
    for rid, (prompt, adapter, n) in asked.items():
        assert got[rid] == _alone(model, prompt, adapter, n), rid


def test_returned_sequences_take_their_request_adapter(enabled):
    """``num_return_sequences``: each returned sequence (transformers forks the request) runs its request's adapter
    (top-k 1 sampling: the greedy tokens)."""
    model = enabled
    gen, cbc = _configs(num_return_sequences=2, do_sample=True, top_k=1)
    out = model.generate_batch(PROMPTS[:3], generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS[:3])
    for i, (prompt, adapter) in enumerate(zip(PROMPTS[:3], IDS[:3])):
        want = _alone(model, prompt, adapter, 5)
        sequences = [v.generated_tokens for k, v in out.items() if k.split("__child#")[0] == f"req_{i}"]
        assert sequences and all(s == want for s in sequences), (i, sequences, want)


def test_refusals_change_nothing():
    """A bad ``adapter_ids`` (unknown name, wrong length) is refused before any request runs; without ids,
    ``generate_batch`` is transformers' own on the active adapter, as stock PEFT runs it; ``disable_csgmv`` gives the
    base model its own ``init_continuous_batching`` back."""
    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="torch")
    gen, cbc = _configs()
    with pytest.raises(ValueError, match="non-existing adapter"):
        model.generate_batch(
            PROMPTS[:2], generation_config=gen, continuous_batching_config=cbc, adapter_ids=["a0", "x"]
        )
    with pytest.raises(ValueError, match="2 inputs"):
        model.generate_batch(PROMPTS[:2], generation_config=gen, continuous_batching_config=cbc, adapter_ids=["a0"])
    stock = model.generate_batch(PROMPTS[:2], generation_config=gen, continuous_batching_config=cbc)
    active = model.active_adapter
    assert [stock[f"req_{i}"].generated_tokens for i in range(2)] == [_alone(model, p, active, 5) for p in PROMPTS[:2]]
    base = model.get_base_model()
    assert "init_continuous_batching" in base.__dict__
    disable_csgmv(model)
    assert "init_continuous_batching" not in base.__dict__ and "_csgmv_peft_model" not in base.__dict__


def test_asynchronous_batching_off_cuda_is_refused_as_stock_peft_refuses_it():
    """A configuration asking for asynchronous batching keeps it (per-request adapters run under it on a GPU:
    ``test_continuous_graphs.py::test_gpu_asynchronous_batching_gives_each_request_its_adapter``); off CUDA,
    transformers refuses it, and an enabled model's ``generate_batch`` raises stock PEFT's error, with ids or
    without."""
    from transformers import ContinuousBatchingConfig

    from peft_csgmv.continuous import _eager_config

    asynchronous = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, use_async_batching=True)
    assert _eager_config(asynchronous).use_async_batching is True
    assert _eager_config(ContinuousBatchingConfig()).use_async_batching is None, "transformers' own choice"
    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    gen, _ = _configs()
    with pytest.raises(Exception) as stock_error:
        model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=asynchronous)
    enable_csgmv(model, backend="torch")
    try:
        for ids in (None, IDS):
            with pytest.raises(type(stock_error.value), match=str(stock_error.value)[:40]):
                model.generate_batch(
                    PROMPTS, generation_config=gen, continuous_batching_config=asynchronous, adapter_ids=ids
                )
    finally:
        disable_csgmv(model)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_forwards_give_each_request_its_adapter(arch, backend):
    """Compiled continuous-batching forwards (``varlen_compile_config`` and ``decode_compile_config``; shapes left
    dynamic, which csgmv compiles fixed, one graph per padded step size): each request gets its own adapter, the tokens
    of stock PEFT running it alone, MoE expert LoRA included; the layers read a packed step's static plan (no eager
    fallback); a request added without an adapter runs the active one, as stock PEFT runs it."""
    from transformers import CompileConfig, ContinuousBatchingConfig

    if arch == "llama":
        model = make("llama")
    else:
        from test_moe import EXPERTS, moe_peft

        specs = {
            "a0": dict(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS),
            "a1": dict(r=8, lora_alpha=4, target_modules=["v_proj"], target_parameters=EXPERTS),
        }
        model = moe_peft(arch, specs)
    model.get_base_model().generation_config.eos_token_id = None
    gen, _ = _configs()
    compile_config = CompileConfig(fullgraph=False, backend="aot_eager", dynamic=True)
    compile_config._compile_all_devices = True
    compiled = ContinuousBatchingConfig(
        num_blocks=32, max_batch_tokens=64, varlen_compile_config=compile_config, decode_compile_config=compile_config
    )
    enable_csgmv(model, backend=backend)
    try:
        got = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=compiled, adapter_ids=IDS)
        want = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
        assert [got[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] == want
        assert len({tuple(w) for w in want}) > 2, "the adapters generate the same tokens: the test proves nothing"
        statics = model._csgmv.executor.statics
        assert statics and all(s.n == 0 for s in statics), "the compiled layers read no packed step's static plan"
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=compiled)
        manager.start()
        try:
            rid = manager.add_request(PROMPTS[2], max_new_tokens=5)  # (no adapter_id: the active adapter)
            result = manager.get_result(request_id=rid, timeout=120)
        finally:
            manager.stop(block=True)
        assert result.generated_tokens == _alone(model, PROMPTS[2], model.active_adapter, 5)
    finally:
        disable_csgmv(model)


@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor needs a C++ compiler on the CPU")
def test_a_default_compile_level_gives_each_request_its_adapter():
    """``default_compile_level=1``: transformers compiles both paths with inductor and dynamic shapes, which csgmv
    compiles fixed; each request gets its own adapter, the tokens of stock PEFT running it alone."""
    from transformers import ContinuousBatchingConfig

    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    gen, _ = _configs()
    leveled = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, default_compile_level=1)
    enable_csgmv(model, backend="torch")
    try:
        got = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=leveled, adapter_ids=IDS)
        assert model._csgmv.executor.statics, "no compiled layer read a packed step's static plan"
        want = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
        assert [got[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))] == want
    finally:
        disable_csgmv(model)


def test_fixed_shape_compiles_hold_a_graph_per_padded_size():
    """transformers pads compiled steps to more sizes than dynamo's limit of recompiles per function (8 by default),
    past which a full-graph compile fails (as ``default_compile_level=1`` did on a GPU): csgmv's fixed-shape compiled
    forwards run with the limit raised to ``FIXED_SHAPE_GRAPHS``, during their calls only."""
    import torch._dynamo

    from peft_csgmv.continuous import FIXED_SHAPE_GRAPHS, _SizedCompile

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"

    def step(x):
        return x * 2 + 1

    sizes = [torch.ones(n) for n in range(1, 6)]
    with config.patch(**{name: 2}):  # (config.patch: monkeypatch's undo would delete the setting)
        torch._dynamo.reset()
        plain = torch.compile(step, dynamic=False, fullgraph=True, backend="eager")
        with pytest.raises(Exception, match="(?i)fullgraph|limit"):
            for x in sizes:
                plain(x)
        torch._dynamo.reset()
        sized = _SizedCompile(torch.compile(step, dynamic=False, fullgraph=True, backend="eager"))
        for x in sizes:
            torch.testing.assert_close(sized(x), x * 2 + 1)
        assert getattr(config, name) == 2 < FIXED_SHAPE_GRAPHS
    torch._dynamo.reset()


def test_compiled_forwards_refused_on_an_offloaded_model():
    """Compiled code reads each layer's stack where it lives: a model whose layers accelerate offloads gets no
    compiled continuous batching with adapters (a ``ValueError`` as the manager is made, nothing started)."""
    from accelerate import cpu_offload
    from transformers import CompileConfig, ContinuousBatchingConfig

    model = cpu_offload(make("llama"), execution_device="cpu")
    enable_csgmv(model)
    gen, _ = _configs()
    compiled = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, decode_compile_config=CompileConfig())
    try:
        with pytest.raises(ValueError, match="compiled forwards here: layers offloaded by accelerate"):
            model.init_continuous_batching(generation_config=gen, continuous_batching_config=compiled)
    finally:
        disable_csgmv(model)


def test_calls_beside_a_running_manager_keep_their_ids():
    """A forward with ``adapter_ids`` from the caller's thread while the manager's thread runs steps with other
    adapters: each gets its own adapters (the model's call lock orders them)."""
    from helpers import make_batch, per_adapter, stitch

    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="torch")
    gen, cbc = _configs(new_tokens=40)
    input_ids, mask = make_batch(3, 5)
    names = ["a1", BASE, "a0"]
    want = stitch(per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits), names)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    try:
        rids = manager.add_requests(PROMPTS, max_new_tokens=40, adapter_ids=IDS)
        with torch.no_grad():
            try:  # (stock: no ids)
                model(input_ids, attention_mask=mask)
            except ValueError as exc:
                if "paged" not in str(exc):
                    raise
                pytest.skip(f"this transformers runs no plain forward beside its manager, stock or not: {exc}")
            for _ in range(5):
                got = model(input_ids, attention_mask=mask, adapter_ids=["a1", None, "a0"]).logits
                assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
        done = {}
        while len(done) < len(rids):
            result = manager.get_result(timeout=10)
            assert result is not None
            if result.is_finished():
                done[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True)
        disable_csgmv(model)
    assert done[rids[2]] == _alone(model, PROMPTS[2], IDS[2], 40)


def three_adapters() -> tuple:
    """A tiny Llama on DEVICE with adapters a0..a2 (ranks 4, 6, 8) on every linear layer, seven prompts over them and
    the base: ``(model, prompts, ids)``."""
    from helpers import add_adapters, tiny_model

    model, targets = tiny_model("llama")
    specs = {f"a{i}": dict(r=4 + 2 * i, lora_alpha=8, target_modules=targets) for i in range(3)}
    model = add_adapters(model, specs).to(DEVICE)
    model.get_base_model().generation_config.eos_token_id = None
    prompts = PROMPTS + [[1, 7, 7, 7], [3, 4, 5, 6, 7, 8]]
    return model, prompts, ["a0", "a1", "a2", None, "a2", "a0", "a1"]


def test_host_tier_starts_only_requests_whose_adapters_fit():
    """``max_resident_adapters=2`` with requests over three adapters and the base: a step never needs more than two
    adapters in slots (requests wait for running ones to finish), and every request's tokens are its alone-run's."""
    model, prompts, ids = three_adapters()
    gen, cbc = _configs()
    got, want = _tiered_batch(model, prompts, ids, gen, cbc, 5)
    assert got == want


def test_host_tier_starts_requests_of_resident_adapters_first(monkeypatch):
    """``max_resident_adapters=2`` (a0 and a1 in the slots), requests of a2 and a3 first in line, then a0's and a1's,
    and a step budget of a few tokens: the requests whose adapters hold a slot start first, so fewer adapters are
    brought in than in arrival order (``PATIENCE = 0``: no preference), and every request's tokens are its
    alone-run's either way."""
    from helpers import add_adapters, tiny_model

    from peft_csgmv import continuous
    from peft_csgmv.tier import HostTier

    model, targets = tiny_model("llama")
    model = add_adapters(model, {f"a{i}": dict(r=4, lora_alpha=8, target_modules=targets) for i in range(4)})
    model.get_base_model().generation_config.eos_token_id = None
    gen, cbc = _configs(new_tokens=3, max_batch_tokens=8)
    ids = ["a2", "a3"] + ["a0", "a1"] * 4 + ["a2", "a3"]  # (a0 and a1 hold the two slots from the start)
    prompts = [[3 + i, 5, 7 + i % 3, 9] for i in range(len(ids))]
    brought = []
    real = HostTier.bring_in
    monkeypatch.setattr(
        HostTier, "bring_in", lambda self, name, *a, **k: (brought.append(name), real(self, name, *a, **k))[1]
    )
    moves, outputs, default = {}, {}, continuous.PATIENCE
    for patience in (default, 0):
        monkeypatch.setattr(continuous, "PATIENCE", patience)
        enable_csgmv(model, backend="torch", max_resident_adapters=2)
        brought.clear()
        try:
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
            outputs[patience] = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
            moves[patience] = len(brought)
        finally:
            disable_csgmv(model)
    want = [_alone(model, p, a, 3) for p, a in zip(prompts, ids)]
    assert len({tuple(w) for w in want}) > 4, "the adapters change nothing: the test would prove nothing"
    assert outputs[default] == want and outputs[0] == want
    assert moves[default] < moves[0], moves


def _tiered_batch(model, prompts, ids, gen, cbc, new_tokens: int) -> tuple[list, list]:
    """``generate_batch`` over ``prompts`` / ``ids`` with ``max_resident_adapters=2`` (never more resident), and the
    alone-runs: ``(got, want)``."""
    enable_csgmv(model, backend="torch", max_resident_adapters=2)
    try:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
        got = [out[f"req_{i}"].generated_tokens for i in range(len(prompts))]
        assert len(csgmv_stats(model)["resident"]) <= 2
    finally:
        disable_csgmv(model)
    want = [_alone(model, p, a, new_tokens) for p, a in zip(prompts, ids)]
    assert len({tuple(w) for w in want}) > 3, "the adapters change nothing: the test would prove nothing"
    return got, want


def _ahead_run(monkeypatch, ids, slow_queries: int = 0):
    """``generate_batch`` over ``ids`` with ``max_resident_adapters=2`` and adapters brought in ahead (on the CPU,
    as a GPU does): each bring-in as ``(name, ahead)``, the adapters of each step, and the tokens, beside the
    alone-runs. ``slow_queries``: an adapter brought in ahead reads as not ready for that many admission rounds (a
    copy still on its way), and no step may use it before unless it has nothing else to run."""
    from helpers import add_adapters, tiny_model

    from peft_csgmv import continuous
    from peft_csgmv.tier import HostTier

    model, targets = tiny_model("llama")
    model = add_adapters(model, {f"a{i}": dict(r=4, lora_alpha=8, target_modules=targets) for i in range(4)})
    model.get_base_model().generation_config.eos_token_id = None
    monkeypatch.setattr(continuous, "AHEAD_ON_CPU", True)
    monkeypatch.setattr(continuous, "PATIENCE", 1000)
    brought, steps, copying = [], [], {}
    real_bring_in, real_ahead, real_open = HostTier.bring_in, HostTier.bring_in_ahead, continuous.open_step

    def bring_in(self, name, slot, dora_scale, dora_refused, ahead=False):
        brought.append((name, ahead))
        return real_bring_in(self, name, slot, dora_scale, dora_refused, ahead)

    def bring_in_ahead(self, *args, **kwargs):
        names = real_ahead(self, *args, **kwargs)
        copying.update(dict.fromkeys(names, slow_queries))
        return names

    def ready(self, name):
        left = copying.get(name, 0)
        copying[name] = max(0, left - 1)
        return left == 0

    def open_step(model, state, scheduled, names, pad_to=None):
        used = {n for n in names if n is not None}
        # (only a step that had nothing else to run starts a request whose adapter is on its way: it then waits for
        # the copy on the device)
        if any(copying.get(n, 0) for n in used):
            assert len(used) == 1 and None not in names, f"a busy step used an adapter on its way: {used}, {copying}"
        steps.append(used)
        return real_open(model, state, scheduled, names, pad_to)

    monkeypatch.setattr(HostTier, "bring_in", bring_in)
    monkeypatch.setattr(HostTier, "bring_in_ahead", bring_in_ahead)
    monkeypatch.setattr(HostTier, "ready", ready)
    monkeypatch.setattr(continuous, "open_step", open_step)
    gen, cbc = _configs(new_tokens=4, max_batch_tokens=8)
    prompts = [[3 + i, 5, 7 + i % 3, 9] for i in range(len(ids))]
    got, want = _tiered_batch(model, prompts, ids, gen, cbc, 4)
    return brought, steps, got, want


def test_host_tier_brings_waiting_requests_adapters_in_ahead(monkeypatch):
    """``max_resident_adapters=2``, four adapters, a step budget that runs about two requests at a time: while
    requests run, a waiting request whose adapter has no slot does not start; its adapter is brought in ahead (on a
    GPU: copied on a stream of its own beside the running steps) and the request starts in a later step. Every
    request's tokens are its alone-run's."""
    ids = ["a0", "a1", "a2", "a3", "a0", "a2", "a1", "a3"]
    brought, steps, got, want = _ahead_run(monkeypatch, ids)
    assert got == want
    assert any(ahead for _, ahead in brought), brought
    assert all(len(used) <= 2 for used in steps)


def test_a_request_waits_while_its_adapter_is_on_its_way(monkeypatch):
    """An adapter brought in ahead whose copy is still on its way (here: reads as not ready for three rounds) is used
    by no step that has other requests to run; its requests start once it is ready (or in a step that would otherwise
    have nothing to do), the running ones go on meanwhile, and every request's tokens are its alone-run's."""
    ids = ["a0", "a1", "a2", "a3", "a1", "a2"]
    brought, steps, got, want = _ahead_run(monkeypatch, ids, slow_queries=3)
    assert got == want
    assert any(ahead for _, ahead in brought), brought


def test_a_step_is_prepared_on_the_stream_its_forward_runs_on(enabled, monkeypatch):
    """transformers runs a step's forward on its batch processor's compute stream (on CUDA a stream of its own, not
    ordered with the default one): the step's plan and its adapters' copies in are made on that stream (here a
    stand-in, read from the processor), so that they come before the step's kernels."""
    from peft_csgmv import continuous

    model = enabled
    inside, prepared = [], []
    real_open, real_stream = continuous.open_step, continuous.compute_stream

    class OnStream:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            inside.append(self.stream)

        def __exit__(self, *exc):
            inside.pop()

    on_cpu = next(model.parameters()).device.type == "cpu"

    def stream_of(processor):
        # (the CPU has no compute stream, CUDA a real one: a stand-in takes its place)
        assert (real_stream(processor) is None) == on_cpu
        return ("compute stream of", id(processor))

    def open_step(*args):
        prepared.append(inside[-1] if inside else None)
        return real_open(*args)

    monkeypatch.setattr(continuous, "compute_stream", stream_of)
    monkeypatch.setattr(continuous, "on_stream", OnStream)
    monkeypatch.setattr(continuous, "open_step", open_step)
    gen, cbc = _configs()
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS)
    assert len(out) == len(PROMPTS) and prepared
    assert all(stream is not None and stream[0] == "compute stream of" for stream in prepared), prepared


def test_a_prompt_cached_under_one_adapter_is_not_reused_under_another(enabled):
    """Two requests with the same 600-token prompt (more than one cache block) and different adapters, one after the
    other: the second's tokens are its own alone-run's (transformers shares cached prompt blocks by their tokens
    alone; an enabled model's manager shares none)."""
    model = enabled
    gen, _ = _configs()
    from transformers import ContinuousBatchingConfig

    cbc = ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=1024)
    prompt = torch.randint(
        3, model.get_base_model().config.vocab_size, (600,), generator=torch.Generator().manual_seed(0)
    )
    prompt = prompt.tolist()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    got = {}
    try:
        for rid, adapter in (("first", "a0"), ("second", "a1")):
            manager.add_request(prompt, request_id=rid, max_new_tokens=5, adapter_id=adapter)
            while rid not in got:
                result = manager.get_result(timeout=30)
                assert result is not None
                if result.is_finished():
                    got[result.request_id] = result.generated_tokens
    finally:
        manager.stop(block=True)
    assert got["first"] == _alone(model, prompt, "a0", 5)
    assert got["second"] == _alone(model, prompt, "a1", 5)


def test_disabling_while_requests_run_never_gives_them_another_adapter():
    """``disable_csgmv`` while a manager runs requests given adapters: it waits for the step in progress, and every
    request either finished before with its own tokens or fails loudly; none goes on with the model's active adapter
    in place of its own."""
    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="torch")
    gen, cbc = _configs(new_tokens=200)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    results = {}
    try:
        rids = manager.add_requests(PROMPTS, max_new_tokens=200, adapter_ids=["a1"] * len(PROMPTS), streaming=True)
        first = manager.get_result(timeout=10)  # (a step ran: its first tokens streamed)
        assert first is not None and not first.is_finished()
        disable_csgmv(model)
        while len(results) < len(rids):
            result = manager.get_result(timeout=10)
            assert result is not None, "a request neither finished nor failed"
            if result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True)
    failed = [r for r in results.values() if r.error is not None]
    assert failed, "every request finished before the model was disabled: the test proves nothing"
    for rid, result in results.items():
        if result.error is None:
            assert result.generated_tokens == _alone(model, PROMPTS[rids.index(rid)], "a1", 200), rid
