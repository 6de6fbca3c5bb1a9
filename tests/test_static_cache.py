"""transformers' static-cache ``generate`` (``cache_implementation="static"``, which compiles the decode step) with
adapter ids. On CPU, transformers' compiled path is forced with a ``CompileConfig`` whose ``_compile_all_devices`` is
set, ``fullgraph=True`` (a graph break fails) and the ``aot_eager`` backend (``helpers.compile_config``); the LoRA
layers run the ``peft_csgmv::lora`` custom op over static plan buffers, so the ids may change between calls without a
recompile. Each case is compared with the eager csgmv path (itself tested against stock PEFT elsewhere): one graph for
any ids, the static cache csgmv keeps for the next call, beams and sampling, the host tier, ``disable_csgmv`` after a
compiled call."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    ID_LISTS,
    add_adapters,
    close,
    compile_config,
    graphs,
    make,
    make_batch,
    per_adapter,
    static_and_eager,
    stitch,
    tiny_model,
)

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_generate_matches_eager_without_recompiles(backend):
    """``generate(..., cache_implementation="static")`` with ids: the decode step compiles once into one graph
    (fullgraph: no break in any layer), gives eager csgmv's tokens, and three different id lists reuse it."""
    model = make(embedding=True)
    enable_csgmv(model, backend=backend)
    input_ids, mask = make_batch(3, 5)
    outs = []
    for ids in ID_LISTS:
        static, eager = static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode generated other tokens"
        assert active_calls() == 0
        outs.append(static)
    assert graphs() == 1, f"{graphs()} graphs compiled: the ids changed the graph"
    assert not torch.equal(outs[0], outs[1]), "the id lists generate the same tokens: the test proves nothing"


def test_static_generate_with_a_kept_cache_matches_eager_without_recompiles():
    """A caller who keeps one ``StaticCache`` and passes it to every ``generate`` (reset between calls: its tensors keep
    their addresses, so on CUDA the compiled step's graph replays instead of being recorded again; docs/benchmarks.md)
    gets eager csgmv's tokens for each id list, from one compiled graph."""
    from transformers import StaticCache

    from peft_csgmv._compat import cache_kwarg

    model = make(embedding=True)
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
    assert graphs() == 1, f"{graphs()} graphs compiled: the kept cache or the ids changed the graph"
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
    model = make(embedding=True)
    enable_csgmv(model)
    base = model.get_base_model()
    made = static_caches
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS:
        static, eager = static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode over the kept cache generated other tokens"
        assert "_prepare_static_cache" not in base.__dict__
    assert len(made) == 1, f"{len(made)} static caches for three calls of one size: not kept"
    assert graphs() == 1
    kept = csgmv_stats(model)["static_cache_bytes"]
    assert kept > 0

    # Another batch size: a new cache of that size, kept in place of the first.
    static, eager = static_and_eager(model, input_ids[:2], mask[:2], ["a1", "a0"])
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
    static, eager = static_and_eager(model, input_ids[:2], mask[:2], ["a1", "a0"])
    assert torch.equal(static, eager) and len(made) == 4


def test_kept_cache_across_beams_sampling_and_greedy():
    """Calls that expand the batch differently (beams, ``num_return_sequences``) and plain greedy ones, interleaved,
    over the kept cache: each gives what it gives with a new cache per call (``keep_static_cache=False``)."""
    calls = [dict(num_beams=2), dict(do_sample=True, num_return_sequences=2, top_k=5), {}, dict(num_beams=2), {}]

    def run(keep: bool):
        torch._dynamo.reset()
        model = make(embedding=True)
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
    model = make(embedding=True)
    enable_csgmv(model, keep_static_cache=False)
    made = static_caches
    input_ids, mask = make_batch(3, 5)
    for ids in ID_LISTS[:2]:
        static, eager = static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager)
    assert len(made) == 2 and csgmv_stats(model)["static_cache_bytes"] == 0
    enable_csgmv(model)  # switched back on without a restack
    static_and_eager(model, input_ids, mask, ID_LISTS[2])
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
        static, eager = static_and_eager(model, input_ids, mask, ids)
        assert torch.equal(static, eager), f"ids {ids}: the compiled decode generated other tokens"
    assert graphs() == 1, f"{graphs()} graphs compiled: moving adapters changed the graph"


@pytest.mark.parametrize(
    "kw",
    [dict(num_beams=2, do_sample=False), dict(do_sample=True, num_return_sequences=2, top_k=5)],
    ids=["beams", "sampling-returns"],
)
def test_static_cache_beams_and_sampling(kw):
    """Beams and ``num_return_sequences`` on the static path: the rows each id covers are repeated there too."""
    model = make(embedding=True)
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


def test_disable_after_compile_restores_stock_peft():
    model = make(embedding=True)
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
