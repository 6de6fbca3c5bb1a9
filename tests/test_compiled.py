"""The compiled path: transformers' static-cache ``generate`` (which compiles the decode step) and ``torch.compile`` of
a model or a layer, with adapter ids. On CPU, transformers' compiled path is forced with a ``CompileConfig`` whose
``_compile_all_devices`` is set, ``fullgraph=True`` (a graph break fails) and the ``aot_eager`` backend; the LoRA
layers run the ``peft_csgmv::lora`` custom op over static plan buffers, so the ids may change between calls without a
recompile. Each case is compared with the eager csgmv path (itself tested against stock PEFT elsewhere) and, where
cheap, with stock PEFT's per-adapter runs."""

from __future__ import annotations

import re
import threading
import time

import pytest
import torch
import transformers
from helpers import BASE, DEVICE, add_adapters, close, compile_config, make_batch, per_adapter, stitch, tiny_model
from torch._dynamo.utils import counters

from peft_csgmv import adapter_ids_scope, csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]
BACKENDS = ["torch", "triton"]
ID_LISTS = [["a0", None, "a1"], ["a1", "a0", None], ["a0", "a0", "a1"]]


def _model(embedding: bool = True):
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=(["embed_tokens"] if embedding else []) + targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }
    return add_adapters(model, specs).to(DEVICE)


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _static_and_eager(model, input_ids, mask, ids, new_tokens: int = 4):
    """Greedy tokens of ``generate`` with ``ids`` on transformers' static cache (its compiled decode, forced on any
    device) and on the default dynamic cache (eager), ``new_tokens`` each."""
    kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ids, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
    static = model.generate(cache_implementation="static", compile_config=compile_config(), **kw)
    return static, model.generate(**kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_generate_matches_eager_without_recompiles(backend):
    """``generate(..., cache_implementation="static")`` with ids: the decode step compiles once into one graph
    (fullgraph: no break in any layer), gives eager csgmv's tokens, and three different id lists reuse it."""
    model = _model()
    enable_csgmv(model, backend=backend)
    input_ids, mask = make_batch(3, 5)
    outs = []
    for ids in ID_LISTS:
        static, eager = _static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode generated other tokens"
        assert active_calls() == 0
        outs.append(static)
    assert _graphs() == 1, f"{_graphs()} graphs compiled: the ids changed the graph"
    assert not torch.equal(outs[0], outs[1]), "the id lists generate the same tokens: the test proves nothing"


def test_eager_first_call_compiles_its_kernel_variants_ahead(monkeypatch):
    """An eager call's first activation layer of each new plan hands the kernel variants the plan launches to worker
    threads before any of its layers launches (one shrink per input width, one expand per split count and output
    kind): each job runs its kernel, without error and off the main thread, over a plan of the real one's shape
    (tokens, segment count) whose segments are all empty; each description goes once per process (a second call of
    the same shape hands none out); the logits are stock PEFT's."""
    from peft_csgmv import eager_ahead, ops

    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(eager_ahead, "_EAGER_SEEN", set())
    monkeypatch.setattr(eager_ahead, "_eager_pool", None)
    jobs, errors = [], []
    job = eager_ahead._eager_job

    def recorded(kind, stack, a, b, splits, plan, x):
        empty = int(plan.seg_indptr.count_nonzero()) == 0 and plan.num_segments > 0
        jobs.append((kind, stack.in_features, plan.num_segments, empty, threading.current_thread()))
        try:
            job(kind, stack, a, b, splits, plan, x)
        except Exception as e:  # (the library's runner swallows errors: the test records them)
            errors.append(e)
            raise

    monkeypatch.setattr(eager_ahead, "_eager_job", recorded)
    model = _model()
    input_ids, mask = make_batch(3, 5)
    names, ids = ["a0", BASE, "a1"], ["a0", None, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="triton")
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=ids).logits
    close(got, stitch(outs, names), "eager, its kernels compiled ahead")
    assert not errors, errors
    widths = {
        m._csgmv_stack.in_features
        for m in model.modules()
        if hasattr(m, "_csgmv_stack") and not m._csgmv_stack.embedding
    }
    shrinks = [j for j in jobs if j[0] == "shrink"]
    assert sorted(j[1] for j in shrinks) == sorted(widths), jobs
    assert any(j[0] == "expand" for j in jobs), jobs
    assert all(j[3] for j in jobs), "a job ran over a plan with tokens in its segments"
    assert all(j[4] is not threading.main_thread() for j in jobs), "a job ran on the main thread"
    assert len({j[2] for j in jobs}) == 1, "one plan, one segment count"
    handed = len(jobs)
    with torch.no_grad():
        again = model(input_ids, attention_mask=mask, adapter_ids=ids).logits
    assert len(jobs) == handed, "the same shape handed its variants out again"
    assert torch.equal(again, got)


@pytest.mark.parametrize("layout", ["default", "beside"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_kernels_compiled_ahead_while_tracing(backend, layout, monkeypatch):
    """While the decode step is traced, each op variant the trace meets (its arguments' description) goes once to a
    worker thread, which runs the op over scratch arguments of that description without error (the Triton variants
    then compiled before the graph runs; switched on for the test's device, the CPU included); the ops with a base
    product (``beside``: every layer and group beside its base products) run their LoRA launches alone there, the base
    weights taken by shape; the graph's first real op call waits for the workers; the tokens are eager's."""
    from peft_csgmv import ops

    if layout == "beside":
        monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
        monkeypatch.setenv("PEFT_CSGMV_GROUPS", "beside")
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    events, errors = [], []
    run_ahead, stack_at = ops._run_ahead, ops._stack_at

    def slow_run_ahead(impl, descriptions, names, elsewhere=False):
        def checked(*args, **kwargs):
            try:
                return impl(*args, **kwargs)
            except Exception as e:  # (the library's runner swallows errors: the test records them)
                errors.append(e)
                raise

        time.sleep(1.0)  # (a job still running when the graph first runs, unless its op call waits)
        run_ahead(checked, descriptions, names, elsewhere)
        events.append(("ahead", impl.__name__))

    def main_stack_at(handle, version):
        if threading.current_thread() is threading.main_thread():
            events.append(("real",))
        return stack_at(handle, version)

    monkeypatch.setattr(ops, "_run_ahead", slow_run_ahead)
    monkeypatch.setattr(ops, "_stack_at", main_stack_at)
    model = _model()
    enable_csgmv(model, backend=backend)
    input_ids, mask = make_batch(3, 5)
    static, eager = _static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    assert not errors, errors
    ahead = [i for i, e in enumerate(events) if e[0] == "ahead"]
    real = [i for i, e in enumerate(events) if e[0] == "real"]
    assert len(ahead) == len(ops._ahead_seen) >= 2, events
    assert real and min(real) > max(ahead), f"an op ran before the kernels compiled ahead were done: {events}"
    ran = {events[i][1] for i in ahead}
    if layout == "beside":
        assert {"_lora_linear_ahead", "_lora_group_linear_ahead"} <= ran, ran
    assert not ops._ahead_jobs
    ops._ahead_pool.shutdown()
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "0")
    torch._dynamo.reset()
    ops._ahead_seen.clear()
    _static_and_eager(model, input_ids, mask, ID_LISTS[1])
    assert not ops._ahead_seen, "PEFT_CSGMV_COMPILE_AHEAD=0 still compiled ahead"


def test_static_generate_with_a_kept_cache_matches_eager_without_recompiles():
    """A caller who keeps one ``StaticCache`` and passes it to every ``generate`` (reset between calls: its tensors keep
    their addresses, so on CUDA the compiled step's graph replays instead of being recorded again; docs/benchmarks.md)
    gets eager csgmv's tokens for each id list, from one compiled graph."""
    from transformers import StaticCache

    from peft_csgmv._compat import cache_kwarg

    model = _model()
    enable_csgmv(model)
    input_ids, mask = make_batch(3, 5)
    new_tokens = 4
    cache = StaticCache(config=model.config, max_cache_len=input_ids.shape[1] + new_tokens - 1)
    outs = []
    for ids in ID_LISTS:
        cache.reset()
        kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ids, max_new_tokens=new_tokens,
                  min_new_tokens=new_tokens, do_sample=False)  # fmt: skip
        kept = model.generate(compile_config=compile_config(), **{cache_kwarg(model): cache}, **kw)
        eager = model.generate(**kw)
        assert torch.equal(kept, eager), f"ids {ids}: the compiled decode over the kept cache generated other tokens"
        outs.append(kept)
    assert _graphs() == 1, f"{_graphs()} graphs compiled: the kept cache or the ids changed the graph"
    assert not torch.equal(outs[0], outs[1]), "the id lists generate the same tokens: the test proves nothing"


_FRESH_PER_CALL = pytest.mark.skipif(
    not hasattr(transformers.GenerationMixin, "_prepare_static_cache"),
    reason="this transformers keeps its own static cache across generate calls (_get_cache)",
)


@_FRESH_PER_CALL
def test_static_generate_keeps_its_cache_for_the_next_call(static_caches):
    """transformers makes a new static cache per ``generate`` (at new addresses: on CUDA the compiled step's graph is
    then recorded again per call); csgmv's calls with ids keep the last one for the next call of the same size, reset:
    eager csgmv's tokens for three id lists over one cache and one graph; another batch size gets a new one (the old
    one dropped), as does a call after one whose output carried the cache (``return_dict_in_generate``: the caller's
    now) and after a call that failed; nothing of the lending is left on the transformers model between calls."""
    model = _model()
    enable_csgmv(model)
    base = model.get_base_model()
    made = static_caches
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS:
        static, eager = _static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode over the kept cache generated other tokens"
        assert "_prepare_static_cache" not in base.__dict__
    assert len(made) == 1, f"{len(made)} static caches for three calls of one size: not kept"
    assert _graphs() == 1
    kept = csgmv_stats(model)["static_cache_bytes"]
    assert kept > 0

    # Another batch size: a new cache of that size, kept in place of the first.
    static, eager = _static_and_eager(model, input_ids[:2], mask[:2], ["a1", "a0"])
    assert torch.equal(static, eager) and len(made) == 2
    assert 0 < csgmv_stats(model)["static_cache_bytes"] < kept

    # The output carries the cache: the caller's, not reset under it by the next call.
    kw = dict(input_ids=input_ids[:2], attention_mask=mask[:2], adapter_ids=["a1", "a0"], max_new_tokens=4,
              min_new_tokens=4, do_sample=False, cache_implementation="static",
              compile_config=compile_config())  # fmt: skip
    out = model.generate(return_dict_in_generate=True, **kw)
    given = out.cache if hasattr(out, "cache") else out.past_key_values
    assert given is made[1] and len(made) == 2, "the kept cache of that size was not used"
    assert csgmv_stats(model)["static_cache_bytes"] == 0
    keys = given.layers[0].keys.clone()
    model.generate(**kw)
    assert len(made) == 3 and torch.equal(given.layers[0].keys, keys)

    # A call that fails after the cache is made: not kept (its state is whatever the failure left).
    class Fail(transformers.StoppingCriteria):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        model.generate(stopping_criteria=[Fail()], **kw)  # over the kept cache made[2]
    assert len(made) == 3 and csgmv_stats(model)["static_cache_bytes"] == 0
    assert "_prepare_static_cache" not in base.__dict__
    static, eager = _static_and_eager(model, input_ids[:2], mask[:2], ["a1", "a0"])
    assert torch.equal(static, eager) and len(made) == 4


def test_kept_cache_across_beams_sampling_and_greedy():
    """Calls that expand the batch differently (beams, ``num_return_sequences``) and plain greedy ones, interleaved,
    over the kept cache: each gives what it gives with a new cache per call (``keep_static_cache=False``)."""
    calls = [dict(num_beams=2), dict(do_sample=True, num_return_sequences=2, top_k=5), {}, dict(num_beams=2), {}]

    def run(keep: bool):
        torch._dynamo.reset()
        model = _model()
        enable_csgmv(model, keep_static_cache=keep)
        input_ids, mask = make_batch(3, 5)
        outs = []
        for kw in calls:
            torch.manual_seed(3)
            outs.append(model.generate(
                input_ids=input_ids, attention_mask=mask, adapter_ids=["a1", None, "a0"], max_new_tokens=3,
                min_new_tokens=3, cache_implementation="static", compile_config=compile_config(), **kw,
            ))  # fmt: skip
        return outs

    for i, (kept, fresh) in enumerate(zip(run(True), run(False))):
        assert torch.equal(kept, fresh), f"call {i} ({calls[i]}): the kept cache changed its tokens"


@_FRESH_PER_CALL
def test_static_generate_without_keeping_the_cache(static_caches):
    """``keep_static_cache=False``: transformers' own behaviour, a new cache per call, none held between calls."""
    model = _model()
    enable_csgmv(model, keep_static_cache=False)
    made = static_caches
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS[:2]:
        static, eager = _static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager)
    assert len(made) == 2 and csgmv_stats(model)["static_cache_bytes"] == 0
    enable_csgmv(model)  # switched back on without a restack
    _static_and_eager(model, input_ids, mask, ID_LISTS[2])
    assert csgmv_stats(model)["static_cache_bytes"] > 0
    with pytest.raises(ValueError, match="keep_static_cache"):
        enable_csgmv(model, keep_static_cache="no")
    assert csgmv_stats(model)["static_cache_bytes"] > 0, "a refused call changed the model's state"


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_through_the_host_tier_without_recompiles(backend):
    """With the host tier (2 slots for 4 adapters of ranks 4 to 16, so every call moves adapters in and out): the
    compiled decode step stays one graph (a layer's launch shape follows the ranks of every adapter it holds, not the
    residents'), and each call gives eager csgmv's tokens."""
    model, targets = tiny_model("llama")
    specs = {f"a{i}": dict(r=4 * (i + 1), lora_alpha=8, target_modules=targets) for i in range(4)}
    model = add_adapters(model, specs).to(DEVICE)
    enable_csgmv(model, backend=backend, max_resident_adapters=2)
    input_ids, mask = make_batch(3, 5)
    for ids in (["a0", None, "a1"], ["a2", "a3", None], ["a1", "a3", "a1"], ["a0", "a2", "a0"]):
        static, eager = _static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode generated other tokens"
    assert _graphs() == 1, f"{_graphs()} graphs compiled: moving adapters changed the graph"


@pytest.mark.parametrize(
    "kw",
    [dict(num_beams=2, do_sample=False), dict(do_sample=True, num_return_sequences=2, top_k=5)],
    ids=["beams", "sampling-returns"],
)
def test_static_cache_beams_and_sampling(kw):
    """Beams and ``num_return_sequences`` on the static path: the rows each id covers are repeated there too."""
    model = _model()
    enable_csgmv(model, backend="torch")
    input_ids, mask = make_batch(3, 5)
    ids = ["a1", None, "a0"]
    common = dict(max_new_tokens=3, min_new_tokens=3, **kw)
    torch.manual_seed(7)
    static = model.generate(
        input_ids=input_ids, attention_mask=mask, adapter_ids=ids, cache_implementation="static",
        compile_config=compile_config(), **common,
    )  # fmt: skip
    torch.manual_seed(7)
    eager = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=ids, **common)
    assert torch.equal(static, eager)


def test_torch_compile_model_forward():
    """``torch.compile(model)`` (the PeftModel) with ids in forward: the model's forward is one graph for any ids of
    the batch shape (the wrapper's validation runs eagerly, outside it), with stock PEFT's per-adapter logits."""
    model = _model()
    enable_csgmv(model, backend="torch")
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS:
        names = [BASE if i is None else i for i in ids]
        outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        with torch.no_grad():
            got = compiled(input_ids, attention_mask=mask, adapter_ids=ids).logits
        close(got, stitch(outs, names), f"compiled model, ids {ids}")
    assert _graphs() == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_layer_fullgraph(backend):
    """``torch.compile(fullgraph=True)`` of one patched layer's forward: no graph break, eager's output, and no
    recompile when the ids change."""
    model = _model(embedding=False)
    enable_csgmv(model, backend=backend)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=False)
    x = torch.randn(3, 4, layer.in_features, device=DEVICE)
    for ids in ID_LISTS:
        with torch.no_grad(), adapter_ids_scope(model, ids):
            got, want = compiled(x), layer(x)
        close(got, want, f"compiled layer, ids {ids}")
    with torch.no_grad():
        close(compiled(x), layer(x), "compiled layer outside a call: stock PEFT (the active adapter)")
    assert _graphs() == 2  # inside a call, and outside one


def _graph_inputs(fn) -> list[int]:
    """How many tensors each graph dynamo compiles while ``fn`` runs takes as inputs."""
    seen = []

    def backend(gm, example_inputs):
        seen.append(len(example_inputs))
        return gm.forward

    fn(lambda m: torch.compile(m, backend=backend, dynamic=False, fullgraph=True))
    return seen


def test_compiled_graph_takes_the_plan_not_the_stacks():
    """A compiled csgmv model's graph takes the base model's tensors plus the plan's three buffers: the stacks are
    read by handle when the op runs, so graph inputs (each one checked and passed on every call of the graph) do not
    grow with the LoRA layers (14 here, 112 in a 1B Llama)."""
    model = _model()
    input_ids, mask = make_batch(3, 5)

    def base_run(compile_):
        with torch.no_grad(), model.disable_adapter():
            compile_(model.base_model.model)(input_ids, attention_mask=mask)

    def csgmv_run(compile_):
        compiled = compile_(model.base_model.model)
        with torch.no_grad(), adapter_ids_scope(model, ["a0", None, "a1"]):
            compiled(input_ids, attention_mask=mask)

    (base,) = _graph_inputs(base_run)
    enable_csgmv(model, backend="torch")
    torch._dynamo.reset()
    (csgmv,) = _graph_inputs(csgmv_run)
    assert csgmv == base + 3, f"base model graph: {base} inputs, csgmv: {csgmv}"


@pytest.mark.parametrize("groups", ["off", "on", "beside"])
def test_compiled_step_checks_no_python_guard_per_layer(groups, monkeypatch):
    """Every step of a compiled model first runs dynamo's guard check, on the host, while the GPU waits. The patched
    modules add only C++ guards to it (type, dict entries, constants), none of dynamo's Python guards, which cost ~1-3
    µs each: not ``module is module.forward.__self__`` (an instance-level bound forward) nor ``layer_i._csgmv_exec is
    layer_j._csgmv_exec`` (one executor object held by every layer), one of each per LoRA layer at every step; nor,
    with sibling groups, ``leader's sibling is module`` (a group's first member holds the others' stack handles, not
    the modules; a group beside its base products reads the members' weights, and each member checks that the weight
    is its own: C++ guards too)."""
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    monkeypatch.setenv("PEFT_CSGMV_GROUPS", {"off": "0", "on": "1", "beside": "beside"}[groups])
    if groups == "beside":  # groups beside their base products: the leader reads the members' weights
        monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    model = _model()
    enable_csgmv(model, backend="torch")
    input_ids, mask = make_batch(3, 5)
    logger, lines = logging.getLogger("torch._dynamo.guards.__guards"), Lines()
    torch._logging.set_logs(guards=True)
    logger.addHandler(lines)
    try:
        model.generate(
            input_ids=input_ids, attention_mask=mask, adapter_ids=ID_LISTS[0], max_new_tokens=2,
            cache_implementation="static", compile_config=compile_config(),
        )  # fmt: skip
    finally:
        logger.removeHandler(lines)
        torch._logging.set_logs()
    guards = [g.strip() for text in lines.lines for g in text.split("\n")]
    on_layers = re.compile(r"[.'\[]_csgmv_")  # a patched module's attribute (not the module peft_csgmv)
    assert any(on_layers.search(g) for g in guards), "the patched layers' guards were not logged"
    python = [g for g in guards if "LAMBDA_GUARD" in g and (on_layers.search(g) or ".forward.__self__" in g)]
    assert not python, f"{len(python)} Python guards on patched modules, e.g. {python[0]}"
    if groups != "off":  # (groups after their base products: read by each layer's route, which the epoch guards)
        read = "_csgmv_siblings" if groups == "beside" else "ROUTE_EPOCH"
        assert any(read in g for g in guards), f"no guard on {read}: no sibling group was traced"


@pytest.mark.parametrize("compiled", [False, True])
def test_a_layer_switched_off_runs_its_base_layer(compiled):
    """PEFT's per-layer switch (``layer.enable_adapters(False)``) holds in csgmv calls as in stock PEFT's runs: that
    layer gives its base layer's output for every row, eagerly and in compiled code (where the switch is a guard:
    turning it off recompiles instead of reusing the graph traced with the layer on)."""
    model = _model(embedding=False)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    input_ids, mask = make_batch(3, 5)
    ids = ["a0", None, "a1"]

    def stock_off():
        layer.enable_adapters(False)  # per_adapter's disable_adapter() turns every layer back on when it ends
        return model(input_ids, attention_mask=mask).logits

    with torch.no_grad():
        off = stitch(per_adapter(model, ids, stock_off), ids)
        layer.enable_adapters(True)
        on = stitch(per_adapter(model, ids, lambda: model(input_ids, attention_mask=mask).logits), ids)
    assert (off - on).abs().max() > 1e-3, "the layer's adapters do not change the output"
    enable_csgmv(model, backend="torch")
    run = torch.compile(model, backend="aot_eager", dynamic=False) if compiled else model
    with torch.no_grad():
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, on, "layer on")
        layer.enable_adapters(False)
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, off, "layer off")
        layer.enable_adapters(True)
        close(run(input_ids, attention_mask=mask, adapter_ids=ids).logits, on, "layer on again")


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_follows_stack_changes(backend):
    """Under ``torch.compile``: an in-place edit of an adapter's weights is seen by the next call with no recompile
    (the op reads the stack's memory); an adapter of a larger rank (a new launch shape) recompiles once, and gives
    stock PEFT's result."""
    model = _model(embedding=False)
    enable_csgmv(model, backend=backend)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    input_ids, mask = make_batch(3, 5)
    ids = ["a0", None, "a1"]

    def check(ids, what):
        names = [BASE if i is None else i for i in ids]
        outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        with torch.no_grad():
            got = compiled(input_ids, attention_mask=mask, adapter_ids=ids).logits
        close(got, stitch(outs, names), what)

    check(ids, "compiled")
    with torch.no_grad():
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["a1"].weight.mul_(3.0)
    check(ids, "after an in-place edit")
    assert _graphs() == 1
    from peft import LoraConfig

    wide = LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model.add_adapter("wide", wide)
    model.to(DEVICE)
    check(["wide", "a0", None], "an adapter of a larger rank")
    assert _graphs() == 2


def test_compiled_routes_and_the_epoch_that_guards_them():
    """Compiled code decides each kernel layer's path once per trace (``layers.compiled_route``, run outside the graph):
    a group's first member runs the group's op, a later member takes its part, a lone layer runs the LoRA after its
    base product, an embedding takes the general path. The graph guards ``slots.ROUTE_EPOCH`` in place of what the
    route read, so the epoch must advance with each such change: groups learned, a backend switched, a stack's launch
    shape (an adapter of a larger rank), the adapters PEFT's path serves in a layer. Hooks are read by the route,
    unguarded, as torch.compile reads a module's own."""
    from peft import LoraConfig

    from peft_csgmv import layers, slots
    from peft_csgmv.executor import executor_of

    model = _model()
    enable_csgmv(model, backend="torch")
    attn = model.base_model.model.model.layers[0].self_attn
    q, k, v, o = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    embed = model.base_model.model.model.embed_tokens
    ex = executor_of(q._csgmv_exec)
    input_ids, mask = make_batch(3, 5)

    device = torch.empty(0, device=DEVICE).device  # (as compiled code passes it: "cuda:0", not "cuda")

    def route(layer, shape=(3, 1, 48)):
        return layers.compiled_route(layer._csgmv_key, slots.ROUTE_EPOCH, 3, torch.Size(shape), device)

    assert route(q)[0] == "lora", "before any eager call there are no groups"
    epoch = slots.ROUTE_EPOCH
    model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=ID_LISTS[0], max_new_tokens=1)
    assert slots.ROUTE_EPOCH > epoch, "learning the groups did not advance the epoch"
    lead, second, third = route(q), route(k), route(v)
    assert lead[0] == "group" and lead[2] == tuple(m._csgmv_stack.handle for m in (q, k, v)), lead
    assert lead[3] == tuple(m._csgmv_stack.version for m in (q, k, v)), lead
    assert second == ("member", lead[6][1], k._csgmv_stack.handle) and third[:2] == ("member", lead[6][2])
    assert lead[6][1:] == (k._csgmv_member, v._csgmv_member), "the group's stash keys are not its members'"
    assert route(o)[0] == "lora" and route(o)[2:4] == (o._csgmv_stack.handle, o._csgmv_stack.version)
    assert route(embed, (3, 1)) is None, "an embedding takes the general path"
    assert route(q, (3, 600, 48)) is None, "a prefill-sized input is no group member: the general path"
    # what the graph does not guard, read when it is traced: hooks (as torch.compile reads a module's own), and the
    # adapters PEFT's path serves in the layer (a change advances the epoch)
    handle = o.base_layer.register_forward_pre_hook(lambda module, args: None)
    assert route(o) is None, "a hooked base layer must take the general path (which calls it as a module)"
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    assert route(o) is None, "a global module hook must take the general path"
    handle.remove()
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    try:
        assert route(o) is None, "with dynamo guarding hooks, the general path reads (and guards) them"
    finally:
        torch._dynamo.config.skip_nnmodule_hook_guards = True
    epoch = slots.ROUTE_EPOCH
    slots.set_peft_rows(o, {"a1"})
    assert route(o) is None and slots.ROUTE_EPOCH > epoch, "a layer with PEFT-path adapters kept its kernel route"
    slots.set_peft_rows(o, ())
    assert route(o)[0] == "lora"
    epoch = slots.ROUTE_EPOCH
    ex.set_backend("torch")
    assert slots.ROUTE_EPOCH > epoch, "a backend switch did not advance the epoch"
    epoch, version = slots.ROUTE_EPOCH, q._csgmv_stack.version
    model.add_adapter("wide", LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    model.to(DEVICE)
    model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=["wide", "a0", None], max_new_tokens=1)
    assert q._csgmv_stack.version > version and slots.ROUTE_EPOCH > epoch, "a new launch shape left the epoch"
    assert route(q)[3][0] == q._csgmv_stack.version


def test_compiled_fused_decode_one_launch_per_layer(monkeypatch):
    """``PEFT_CSGMV_FUSED_DECODE=1``: in compiled code, each LoRA layer of a decode-sized call is one fused launch
    (the expand computing the A product itself, no shrink launch), with stock PEFT's per-adapter logits."""
    import collections

    import peft_csgmv.kernels as kernels
    from peft_csgmv import csgmv_stats

    monkeypatch.setenv("PEFT_CSGMV_FUSED_DECODE", "1")
    model = _model(embedding=False)
    input_ids, mask = make_batch(3, 5)
    names = ["a0", BASE, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="triton")
    launches = collections.Counter()
    shrink, expand = kernels.shrink, kernels.expand

    def counted_shrink(*args, **kwargs):
        launches["shrink"] += 1
        return shrink(*args, **kwargs)

    def counted_expand(*args, **kwargs):
        launches["fused" if kwargs.get("x") is not None else "expand"] += 1
        return expand(*args, **kwargs)

    monkeypatch.setattr(kernels, "shrink", counted_shrink)
    monkeypatch.setattr(kernels, "expand", counted_expand)
    compiled = torch.compile(model, backend="aot_eager", dynamic=False, fullgraph=False)
    with torch.no_grad():
        got = compiled(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits
    close(got, stitch(outs, names), "fused, compiled")
    assert launches == {"fused": csgmv_stats(model)["kernel_layers"]}, launches


def _compiled_ops(model, ids, input_ids, mask):
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_linear_layers_run_beside_their_base_product(backend, monkeypatch):
    """In compiled code a plain Linear layer's base product and LoRA are one ``peft_csgmv::lora_linear`` (on CUDA the
    LoRA beside the base product) and its output ``y + delta``: stock PEFT's per-adapter logits, bit for bit the
    numbers of the base product followed by the ``lora`` op (``PEFT_CSGMV_BESIDE=0``; the first is the default on CUDA,
    ``PEFT_CSGMV_BESIDE=1`` turns it on for every device; ``PEFT_CSGMV_BESIDE_MIN_MIB`` keeps smaller base weights
    after). The embedding, and a layer whose base has a forward hook (which must run), keep the ``lora`` op."""
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    model = _model()
    input_ids, mask = make_batch(3, 5)
    names = ["a0", BASE, "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend=backend)
    linear = csgmv_stats(model)["kernel_layers"] - 1  # all but embed_tokens
    beside, ops = _compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    close(beside, stitch(outs, names), "compiled, beside")
    assert ops == {"lora_linear": linear, "lora": 1}, ops

    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "0")
    enable_csgmv(model, backend=backend)
    after, ops = _compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    assert ops == {"lora": linear + 1}, ops
    assert torch.equal(beside, after), "the LoRA beside the base product gave other numbers"

    # a floor on the base weight's bytes (16 MiB by default on CUDA, set here): only the MLP's 80×48 weights
    # (15360 bytes) beside
    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    monkeypatch.setenv("PEFT_CSGMV_BESIDE_MIN_MIB", str(12000 / 2**20))
    enable_csgmv(model, backend=backend)
    some, ops = _compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    assert ops == {"lora_linear": 6, "lora": linear + 1 - 6}, ops
    assert torch.equal(some, beside)
    monkeypatch.delenv("PEFT_CSGMV_BESIDE_MIN_MIB")

    disable_csgmv(model)
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    enable_csgmv(model, backend=backend)
    calls = []
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    handle = q.base_layer.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    try:
        hooked, ops = _compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    finally:
        handle.remove()
    assert ops == {"lora_linear": linear - 1, "lora": 2}, ops
    assert calls, "the base layer's forward hook did not run"
    assert torch.equal(hooked, beside)

    # accelerate's device_map hooks replace the base layer's forward on the instance (moving inputs and weights to
    # where they must be): it must run, so that layer keeps the lora op
    from accelerate.hooks import ModelHook, add_hook_to_module, remove_hook_from_module

    seen = []

    class Record(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            seen.append(args[0].shape)
            return args, kwargs

    v = model.base_model.model.model.layers[1].self_attn.v_proj
    add_hook_to_module(v.base_layer, Record())
    try:
        hooked, ops = _compiled_ops(model, ["a0", None, "a1"], input_ids, mask)
    finally:
        remove_hook_from_module(v.base_layer)
    assert ops == {"lora_linear": linear - 1, "lora": 2}, ops
    assert seen, "accelerate's hook on the base layer did not run"
    assert torch.equal(hooked, beside)


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "opt"])
def test_static_cache_beside_across_architectures(arch, monkeypatch):
    """The LoRA beside the base product (the default on CUDA, forced here) through transformers' static-cache decode on
    other layouts: Qwen2's biased projections with a ``lora_bias`` adapter, GPT-2's ``Conv1D`` (no ``nn.Linear``: the
    ``lora`` op), OPT's flattened MLP tokens. fp32: eager csgmv's tokens, one graph for two id lists, and stock PEFT's
    per-adapter logits from the compiled forward."""
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    base, targets = tiny_model(arch)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }
    if arch == "qwen2":
        specs["a1"]["lora_bias"] = True
    model = add_adapters(base, specs).to(DEVICE)
    input_ids, mask = make_batch(3, 5)
    names = ["a1", BASE, "a0"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, backend="torch")
    logits, ops = _compiled_ops(model, ["a1", None, "a0"], input_ids, mask)
    close(logits, stitch(outs, names), f"{arch}, compiled forward")
    beside = sum(1 for layer in model.modules() if type(getattr(layer, "base_layer", None)) is torch.nn.Linear)
    assert ops.get("lora_linear", 0) == beside and ops.get("lora", 0) == csgmv_stats(model)["kernel_layers"] - beside
    graphs = _graphs()
    for ids in (["a1", None, "a0"], ["a0", "a1", "a1"]):
        static, eager = _static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"{arch}, ids {ids}: the compiled decode generated other tokens"
    assert _graphs() - graphs == 1, f"{_graphs() - graphs} graphs compiled"


@pytest.mark.parametrize("layout", ["rows-step2", "last-columns", "offset", "transposed-sliced"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_linear_takes_strided_inputs(backend, layout):
    """``peft_csgmv::lora_linear`` on a view of ``x`` (every 2nd row, the last columns of a wider tensor, at a storage
    offset, transposed and sliced): the base product and the LoRA alone of the same values given contiguously, ``x``'s
    parent untouched; ``y + delta`` is the base product followed by the ``lora`` op, bit for bit."""
    from test_strides import view_2d

    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model = _model(embedding=False)
    enable_csgmv(model, backend=backend)
    layer = model.base_model.model.model.layers[1].mlp.down_proj
    stack, base = layer._csgmv_stack, layer.base_layer
    static = StaticPlan(4, 4, 2, DEVICE)
    static.fill((1, -1, 0, 1))
    x, parent = view_2d(lambda shape: torch.randn(shape, device=DEVICE), 8, layer.in_features, layout)
    x_dense, parent0 = x.contiguous(), parent.clone()
    args = (static.permutation, static.seg_indptr, static.seg_slot, stack.handle, stack.version, static.chunk)
    triton = backend == "triton"
    with torch.no_grad():
        y, delta = ops.lora_linear(x, base.weight, base.bias, *args, triton)
        y_dense, delta_dense = ops.lora_linear(x_dense, base.weight, base.bias, *args, triton)
        want = ops.lora(x_dense, torch.nn.functional.linear(x_dense, base.weight, base.bias), *args[:3], None,
                        *args[3:], triton)  # fmt: skip
    assert torch.equal(parent, parent0), "lora_linear wrote x"
    close(y, y_dense, f"base product of a {layout} view")
    close(delta, delta_dense, f"the LoRA of a {layout} view")
    assert delta.abs().sum() > 0 and not delta[2:4].any(), "the LoRA is zero on the base row's tokens only"
    assert torch.equal((y_dense + delta_dense).to(y.dtype), want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_take_a_layers_input_with_its_leading_dimensions(backend):
    """The ops take a layer's input and output as the layer sees them, ``(rows, tokens, features)`` (token ids
    ``(rows, tokens)`` for an embedding), strided views included (the last token of every 2nd row, ``[::2, -1:]``; a
    middle token at an offset, ``[:, 1:2]``), so a compiled graph holds no reshape around them: each output has the
    input's leading dimensions and, bit for bit, the values of the same op over the flattened contiguous tensors."""
    from peft_csgmv import ops
    from peft_csgmv.mapping import StaticPlan

    model = _model()
    enable_csgmv(model, backend=backend)
    inner = model.base_model.model.model
    q, k, v = (getattr(inner.layers[1].self_attn, n) for n in ("q_proj", "k_proj", "v_proj"))
    embed = inner.embed_tokens
    static = StaticPlan(4, 4, 1, DEVICE)
    static.fill((1, -1, 0, 1))
    plan, triton = (static.permutation, static.seg_indptr, static.seg_slot), backend == "triton"
    stacks = [m._csgmv_stack for m in (q, k, v)]
    handles, versions = [s.handle for s in stacks], [s.version for s in stacks]
    weights, biases = [m.base_layer.weight for m in (q, k, v)], [m.base_layer.bias for m in (q, k, v)]
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(8, 3, q.in_features, generator=g).to(DEVICE)
    ids_wide = torch.randint(1, 90, (8, 3), generator=g).to(DEVICE)
    y_wide = torch.randn(8, 3, q.out_features, generator=g).to(DEVICE)
    e_wide = torch.randn(8, 3, embed.base_layer.embedding_dim, generator=g).to(DEVICE)

    def flat(t):
        return t.reshape(-1, t.shape[-1]).contiguous()

    def same(got, want, lead, what):
        assert got.shape == (*lead, want.shape[-1]), f"{what}: shape {tuple(got.shape)}"
        assert torch.equal(got.reshape(-1, want.shape[-1]), want), f"{what}: other values than over flat tensors"

    with torch.no_grad():
        for pick in (lambda t: t[::2, -1:], lambda t: t[:4, 1:2]):
            x, y, ids, e = pick(wide), pick(y_wide), pick(ids_wide), pick(e_wide)
            assert not x.is_contiguous() and not ids.is_contiguous()
            lead = x.shape[:-1]
            s = stacks[0]
            got = ops.lora(x, y, *plan, None, s.handle, s.version, static.chunk, triton)
            same(got, ops.lora(flat(x), flat(y), *plan, None, s.handle, s.version, static.chunk, triton), lead, "lora")
            es = embed._csgmv_stack
            got = ops.lora(ids, e, *plan, None, es.handle, es.version, static.chunk, triton)
            want = ops.lora(ids.reshape(-1).contiguous(), flat(e), *plan, None, es.handle, es.version, static.chunk,
                            triton)  # fmt: skip
            same(got, want, ids.shape, "lora over token ids")
            got = ops.lora_linear(x, weights[0], biases[0], *plan, s.handle, s.version, static.chunk, triton)
            want = ops.lora_linear(flat(x), weights[0], biases[0], *plan, s.handle, s.version, static.chunk, triton)
            for a, b, what in zip(got, want, ("lora_linear's base product", "lora_linear's delta")):
                same(a, b, lead, what)
            got = ops.lora_group(x, *plan, handles, versions, static.chunk, triton)
            want = ops.lora_group(flat(x), *plan, handles, versions, static.chunk, triton)
            assert len(got) == 3 and got[0].abs().sum() > 0
            for a, b in zip(got, want):
                same(a, b, lead, "lora_group")
            got = ops.lora_group_linear(x, weights, biases, *plan, handles, versions, static.chunk, triton)
            want = ops.lora_group_linear(flat(x), weights, biases, *plan, handles, versions, static.chunk, triton)
            assert len(got) == 6
            for a, b in zip(got, want):
                same(a, b, lead, "lora_group_linear")


def test_lora_linear_launches_without_pdl_beside_the_base(monkeypatch):
    """The LoRA's launches beside the base product go without programmatic dependent launch (across the CUDA graph's
    fork and join it idled the GPU), where every other launch on the device takes it; and the default on CUDA is the
    LoRA beside the base product (``PEFT_CSGMV_BESIDE`` unset), on other devices after it."""
    from peft_csgmv import ops
    from peft_csgmv.executor import Executor
    from peft_csgmv.kernels import launch
    from peft_csgmv.mapping import StaticPlan

    model = _model(embedding=False)
    enable_csgmv(model, backend="triton")
    layer = model.base_model.model.model.layers[0].mlp.up_proj
    stack, base = layer._csgmv_stack, layer.base_layer
    static = StaticPlan(2, 2, 1, DEVICE)
    static.fill((0, 1))
    seen = []

    def shrink(x, a, ranks, plan, t=None):  # records the launch's choice; launches nothing
        seen.append(("shrink", launch.with_pdl(x.device, ())[0]))
        return torch.zeros(1, x.shape[0], 16) if t is None else t

    def expand(t, *args, out, **kwargs):
        seen.append(("expand", launch.with_pdl(out.device, ())[0]))
        return out

    monkeypatch.setattr(launch, "pdl", lambda device: True)
    monkeypatch.setattr(ops.kernels, "shrink", shrink)
    monkeypatch.setattr(ops.kernels, "expand", expand)
    x = torch.randn(2, layer.in_features, device=DEVICE)
    with torch.no_grad():
        ops.lora_linear(x, base.weight, base.bias, static.permutation, static.seg_indptr, static.seg_slot,
                        stack.handle, stack.version, static.chunk, True)  # fmt: skip
        assert seen == [("shrink", False), ("expand", False)], seen
        ops.lora(x, base(x), static.permutation, static.seg_indptr, static.seg_slot, None, stack.handle,
                 stack.version, static.chunk, True)  # fmt: skip
    assert seen[2:] == [("shrink", True), ("expand", True)], seen
    monkeypatch.undo()

    monkeypatch.delenv("PEFT_CSGMV_BESIDE", raising=False)
    monkeypatch.delenv("PEFT_CSGMV_BESIDE_MIN_MIB", raising=False)
    ex = Executor("triton", lambda layer: None)
    assert ex.beside_on(torch.device("cuda", 0)) and not ex.beside_on(torch.device("cpu"))
    assert ex.beside_min_bytes == 16 * 2**20, "by default only base weights of 16 MiB or more run beside"
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "0")
    assert not Executor("triton", lambda layer: None).beside_on(torch.device("cuda", 0))
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    forced = Executor("triton", lambda layer: None)
    assert forced.beside_on(torch.device("cpu")) and forced.beside_min_bytes == 0
    monkeypatch.setenv("PEFT_CSGMV_BESIDE_MIN_MIB", "2")
    assert Executor("triton", lambda layer: None).beside_min_bytes == 2 * 2**20


def test_compiled_code_walks_no_adapter_it_does_not_read():
    """dynamo marks every parameter under each module it meets as a static input, walking that module's tree, unless
    the module has a ``named_parameters`` of its own. The modules above csgmv's layers get one (their class's, as an
    instance attribute: the same results for every caller): a compiled static-cache call then marks the base weights
    its graph reads and none of the adapters' PEFT weights (a walk marks them all), with eager's tokens;
    ``disable_csgmv`` takes the attributes back."""
    model = _model()
    params = [(n, id(p)) for n, p in model.named_parameters()]
    buffers = [(n, id(b)) for n, b in model.named_buffers()]
    enable_csgmv(model, backend="torch")
    spared = [m for m in model.modules() if "named_parameters" in m.__dict__]
    assert model in spared and model.get_base_model().model.layers[0] in spared
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert [(n, id(b)) for n, b in model.named_buffers()] == buffers
    assert len(list(model.parameters())) == len(params) and list(model.state_dict()) == [n for n, _ in params]
    input_ids, mask = make_batch(3, 5)
    static, eager = _static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    marked = {n for n, p in model.named_parameters() if hasattr(p, "_dynamo_static_input_type")}
    assert any(n.endswith("q_proj.base_layer.weight") for n in marked), "the graph's own weights were not marked"
    assert not [n for n in marked if ".lora_" in n], "dynamo walked the adapters' weights"
    disable_csgmv(model)
    assert not [m for m in model.modules() if {"named_parameters", "named_buffers"} & m.__dict__.keys()]
    assert [(n, id(p)) for n, p in model.named_parameters()] == params


def test_disable_after_compile_restores_stock_peft():
    model = _model()
    enable_csgmv(model, backend="torch")
    input_ids, mask = make_batch(3, 5)
    model.generate(
        input_ids=input_ids, attention_mask=mask, adapter_ids=ID_LISTS[0], max_new_tokens=2,
        cache_implementation="static", compile_config=compile_config(),
    )  # fmt: skip
    disable_csgmv(model)
    names = [BASE, "a0", "a1"]
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_names=names).logits
    close(got, stitch(outs, names), "stock PEFT after disable")


@pytest.mark.gpu
def test_bf16_compiled_logits_within_peft_own_compile_difference():
    """bf16 on the GPU: csgmv's compiled forward (inductor) differs from its eager one by no more than PEFT's own
    compiled forward differs from PEFT's eager one (twice that, for margin), for each row's adapter."""
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=8, lora_alpha=16, target_modules=targets),
        "a1": dict(r=16, lora_alpha=16, target_modules=targets),
    }
    pm = add_adapters(model.to("cuda"), specs).to(torch.bfloat16)
    input_ids, mask = (t.to("cuda") for t in make_batch(4, 9))
    names = ["a0", BASE, "a1", "a0"]
    with torch.no_grad():
        pm.set_adapter("a0")
        peft_eager = pm(input_ids, attention_mask=mask).logits.float()
        peft_compiled = torch.compile(pm, dynamic=False)(input_ids, attention_mask=mask).logits.float()
        peft_gap = (peft_compiled - peft_eager).abs().max().item()
        torch._dynamo.reset()
        enable_csgmv(pm)
        eager = pm(input_ids, attention_mask=mask, adapter_ids=names).logits.float()
        compiled = torch.compile(pm, dynamic=False)(input_ids, attention_mask=mask, adapter_ids=names).logits.float()
    gap = (compiled - eager).abs().max().item()
    assert gap <= 2 * max(peft_gap, 1e-2), f"csgmv compiled vs eager {gap:.3g}, PEFT's own {peft_gap:.3g}"


def test_compiled_ahead_in_the_worker_process_by_default(monkeypatch):
    """With ``PEFT_CSGMV_COMPILE_AHEAD`` unset (the default), each compile-ahead job runs its op with the launches
    recorded, not run, and hands the records to the compile worker (``kernels.ahead.compile_elsewhere``, here a
    stand-in) from its thread, before the graph's first real op call; each record names a kernel the worker can import
    and carries the op's pointers as dtypes and addresses; the tokens are eager's."""
    import importlib
    import pkgutil

    import peft_csgmv.kernels as kernel_package
    from peft_csgmv import ops
    from peft_csgmv.kernels.launch import Launcher, Pointer

    for info in pkgutil.iter_modules(kernel_package.__path__):  # (variants earlier tests compiled are not recorded)
        for value in vars(importlib.import_module(f"{kernel_package.__name__}.{info.name}")).values():
            if isinstance(value, Launcher):
                monkeypatch.setattr(value, "compiled", {})
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "AHEAD_DEVICES", (DEVICE.type,))
    monkeypatch.setattr(ops, "interpreting", lambda: False)  # (on the CPU the kernels run in Triton's interpreter)
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    events = []

    def handed(records):
        events.append(("handed", threading.current_thread() is threading.main_thread(), list(records)))
        return []

    def main_stack_at(handle, version):
        if threading.current_thread() is threading.main_thread():
            events.append(("real",))
        return stack_at(handle, version)

    stack_at = ops._stack_at
    monkeypatch.setattr(ops, "compile_elsewhere", handed)
    monkeypatch.setattr(ops, "_stack_at", main_stack_at)
    model = _model()
    enable_csgmv(model, backend="triton")
    input_ids, mask = make_batch(3, 5)
    static, eager = _static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    handed_at = [i for i, e in enumerate(events) if e[0] == "handed"]
    real = [i for i, e in enumerate(events) if e[0] == "real"]
    assert handed_at and real and min(real) > max(handed_at), [e[:2] for e in events]
    assert not any(events[i][1] for i in handed_at), "records handed to the worker from the main thread"
    records = [r for i in handed_at for r in events[i][2]]
    names = set()
    for module, name, _, grid, args, _, _ in records:
        assert hasattr(importlib.import_module(module), name), (module, name)
        assert isinstance(args[0], Pointer) and isinstance(args[0].dtype, torch.dtype) and len(grid) == 3
        names.add(name)
    assert {"_shrink_kernel", "_expand_kernel"} <= names or {"_shrink_group_kernel", "_expand_group_kernel"} <= names


_WORKER_SCRIPT = """
import json, os, sys, threading
sys.path[:0] = [sys.argv[1], os.path.dirname(sys.argv[1])]
import torch, triton.compiler.compiler as cc
from test_compiled import ID_LISTS, _model, _static_and_eager, make_batch
from peft_csgmv import enable_csgmv, ops

made, handed, errors = [], [], []
make_ir, compile_elsewhere = cc.ASTSource.make_ir, ops.compile_elsewhere

def counted(self, *args, **kwargs):  # (after the first hand-off: the eager prefill's own compiles come before)
    made.append((self.fn.__name__, threading.current_thread() is threading.main_thread(), bool(handed)))
    return make_ir(self, *args, **kwargs)

def noted(records):
    handed.extend(r[1] for r in records)
    errors.extend(compile_elsewhere(records))
    return []

cc.ASTSource.make_ir, ops.compile_elsewhere = counted, noted
model = _model().to("cuda")
enable_csgmv(model)
input_ids, mask = (t.to("cuda") for t in make_batch(3, 5))
static, eager = _static_and_eager(model, input_ids, mask, ID_LISTS[0])
print(json.dumps(dict(same=torch.equal(static, eager), made=made, handed=handed, errors=errors)))
"""


@pytest.mark.gpu
def test_static_decode_kernels_compile_in_the_worker_process_on_cuda(tmp_path):
    """On CUDA by default, in a process of its own with an empty Triton cache: the static path's decode kernels
    compile in the compile worker (each record it is handed compiles there without error), and the main process
    generates Triton code for none of them itself (``ASTSource.make_ir``, which runs only where a compile misses the
    on-disk cache, does not run on its main thread for a kernel handed to the worker, once the hand-offs began: the
    eager prefill's own compiles come before); the tokens are eager csgmv's (fp32)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_WORKER_SCRIPT)
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PEFT_CSGMV_COMPILE_AHEAD="")
    run = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["same"], "the compiled decode generated other tokens"
    assert got["handed"], "no kernel handed to the compile worker"
    assert not got["errors"], got["errors"]
    again = [name for name, main, after in got["made"] if main and after and name in got["handed"]]
    assert not again, f"handed to the worker, then compiled in the main process: {again} ({got})"


@pytest.mark.gpu
def test_static_decode_kernels_compile_ahead_on_cuda(monkeypatch):
    """On CUDA, where compiling ahead is on by default: the static path's decode kernels compile on the ops' worker
    thread while the step is traced, and the main thread compiles none of those again (Triton's in-process caches of
    the library's kernels and their launchers' emptied first); the tokens are eager csgmv's (fp32)."""
    import importlib
    import pkgutil

    import triton.runtime.jit as jit

    import peft_csgmv.kernels as kernel_package
    from peft_csgmv import ops
    from peft_csgmv.kernels.launch import Launcher

    for info in pkgutil.iter_modules(kernel_package.__path__):
        module = importlib.import_module(f"{kernel_package.__name__}.{info.name}")
        for value in vars(module).values():
            if isinstance(value, jit.JITFunction):
                value.device_caches.clear()
            elif isinstance(value, Launcher):  # (its compiled kernels by exact arguments, from earlier tests)
                value.compiled.clear()
    monkeypatch.setenv("PEFT_CSGMV_COMPILE_AHEAD", "1")  # (the suite turns it off: conftest.py)
    monkeypatch.setattr(ops, "_ahead_seen", set())
    monkeypatch.setattr(ops, "_ahead_pool", None)
    compiled = []
    do_compile = jit.JITFunction._do_compile

    def recorded(self, key, *args, **kwargs):
        compiled.append((self.fn.__name__, str(key), threading.current_thread() is threading.main_thread()))
        return do_compile(self, key, *args, **kwargs)

    monkeypatch.setattr(jit.JITFunction, "_do_compile", recorded)
    model = _model().to("cuda")
    enable_csgmv(model)
    input_ids, mask = (t.to("cuda") for t in make_batch(3, 5))
    static, eager = _static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    ahead = {(name, key) for name, key, main in compiled if not main}
    again = [(name, key) for name, key, main in compiled if main and (name, key) in ahead]
    assert ahead, f"no kernel compiled ahead: {compiled}"
    assert not again, f"compiled ahead, then again on the main thread: {again}"
