"""MoE expert LoRA (``target_parameters`` on transformers' 3D experts) on the compiled path: transformers' static-cache
``generate`` (its compiled decode step) and ``torch.compile(fullgraph=True)`` of the model, with adapter ids, against
stock PEFT one adapter at a time.

On the CPU the compiled path is forced as ``tests/test_static_cache.py`` forces it (``helpers.compile_config``:
``fullgraph=True``, so a graph break fails, and the ``aot_eager`` backend, which runs the ops' fake implementations
while tracing). The experts layers build their plan inside the graph from the router's choice and the call's token
groups (a static buffer rewritten per call), and run their base products and LoRA through the ``peft_csgmv::moe_linear``
/ ``peft_csgmv::moe_lora`` custom ops: new ids reuse the graph. Base rows are interleaved in every id list.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    assert_adapters_matter,
    assert_generations_differ,
    compile_config,
    compiled_ops,
    graphs,
    greedy_kwargs,
    per_adapter,
    stitch,
)
from test_moe import ADAPTERS, _expert_weights, close, moe_peft, names_for, prompts
from test_moe_prototype import _has_3d_experts

from peft_csgmv import adapter_ids_scope, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = [
    pytest.mark.skipif(not _has_3d_experts(), reason="needs transformers' 3D experts and PEFT's target_parameters"),
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


ADAPTERS_NAMES = tuple(ADAPTERS)


def _ids(names):
    return [None if n == BASE else n for n in names]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_static_cache_generate_matches_peft_per_adapter(arch):
    """``generate(..., cache_implementation="static")`` with mixed ids (base rows included): each row's greedy tokens
    are stock PEFT's with that row's adapter alone, and a second id list (other adapters on other rows) reuses the
    compiled decode step: no graph is compiled for it (gpt-oss's sliding-window cache makes transformers compile a few
    decode graphs of its own per call length; the ids add none)."""
    pm = moe_peft(arch)
    ids = prompts(4, 4, seed=1)
    kw = greedy_kwargs(4)
    lists = [names_for(4), [ADAPTERS_NAMES[2], BASE, ADAPTERS_NAMES[0], ADAPTERS_NAMES[1]]]
    expected = [per_adapter(pm, names, lambda: pm.generate(input_ids=ids, **kw)) for names in lists]
    assert_generations_differ(expected[0])
    enable_csgmv(pm, backend="torch")
    compiled = []
    for names, want in zip(lists, expected):
        got = pm.generate(input_ids=ids, adapter_ids=_ids(names), cache_implementation="static",
                          compile_config=compile_config(), **kw)  # fmt: skip
        assert torch.equal(got, stitch(want, names)), f"{arch}, ids {names}: other tokens than stock PEFT's"
        assert active_calls() == 0
        compiled.append(graphs())
    assert compiled[0] >= 1 and compiled[1] == compiled[0], f"graphs after each call: {compiled}: the ids recompiled"


@pytest.mark.parametrize("backend", BACKENDS)
def test_fullgraph_compiled_forward_two_id_lists_one_graph(backend):
    """``torch.compile(fullgraph=True)`` of the transformers model under a call's ids (``adapter_ids_scope``): no graph
    break in the experts layers, logits within the fp32 tolerance of stock PEFT's per-adapter runs for two mixed id
    lists and an all-base one, from one graph."""
    pm = moe_peft("qwen3_moe")
    ids = prompts(6, 5, seed=2)
    lists = [names_for(6), ["a2", "a0", BASE, "a1", "a1", "a2"], [BASE] * 6]
    expected = [stitch(per_adapter(pm, names, lambda: pm(ids).logits), names) for names in lists]
    assert_adapters_matter(per_adapter(pm, lists[0], lambda: pm(ids).logits))
    enable_csgmv(pm, backend=backend)
    compiled = torch.compile(pm.get_base_model(), fullgraph=True, backend="aot_eager", dynamic=False)
    for names, want in zip(lists, expected):
        with torch.no_grad(), adapter_ids_scope(pm, _ids(names)):
            got = compiled(ids).logits
        close(got, want, f"{backend}, ids {names}")
    assert graphs() == 1, f"{graphs()} graphs compiled: the ids changed the graph"


@pytest.mark.parametrize("arch", ["gpt_oss", "mixtral", "olmoe"])
def test_compiled_model_forward_follows_expert_weights(arch):
    """``torch.compile(model)`` (the PeftModel, ids in its forward) over gpt-oss's biased, interleaved experts and
    Mixtral's: stock PEFT's per-adapter logits; an in-place edit of an adapter's expert weights (PEFT's weights are
    views into the stacks) is seen by the next call without a recompile; an adapter added later (a restack) is served
    after the graph traces again."""
    from peft import LoraConfig

    pm = moe_peft(arch, {k: ADAPTERS[k] for k in ("a0", "a1")})
    ids = prompts(3, 4, seed=3)
    enable_csgmv(pm, backend="torch")
    compiled = torch.compile(pm, backend="aot_eager", dynamic=False)

    def check(names, what):
        want = stitch(per_adapter(pm, names, lambda: pm(ids).logits), names)
        with torch.no_grad():
            close(compiled(ids, adapter_ids=_ids(names)).logits, want, f"{arch}: {what}")

    check(["a1", BASE, "a0"], "compiled")
    before = graphs()
    with torch.no_grad():
        for _, b in _expert_weights(pm, "a1"):
            b.mul_(-0.5)
    check(["a0", "a1", BASE], "after an in-place edit")
    assert graphs() == before, "an in-place edit or new ids recompiled"
    torch.manual_seed(40)
    pm.add_adapter("a3", LoraConfig(init_lora_weights=False, r=6, lora_alpha=3, target_modules=[],
                                    target_parameters=ADAPTERS["a0"]["target_parameters"]))  # fmt: skip
    check(["a3", "a1", BASE], "an adapter added")


def test_gathered_expert_products_match_per_expert_products():
    """The base products' form for a CUDA graph's capture (each row's expert weight gathered, nothing read on the
    host) against the product per expert, rows routed to no expert included (zeros)."""
    from peft_csgmv.moe import expert_linear, gathered_linear

    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 8, generator=g), torch.randn(4, 8, 5, generator=g)
    offsets = torch.tensor([3, 3, 7, 9], dtype=torch.int32)  # (expert 1 has no rows; rows 9 and 10 go nowhere)
    want = expert_linear(x, w, None, None, offsets, is_transposed=True)
    got = gathered_linear(x, w, offsets)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[9:], torch.zeros(2, 5))


def test_compiled_graph_holds_the_experts_ops():
    """The compiled model's graph runs each experts layer's two base products and two LoRA (gate/up, down) as csgmv's
    ops (two layers: four each), with stock PEFT's per-adapter logits: the experts layers are in the graph, not run
    eagerly beside it."""
    pm = moe_peft("qwen3_moe")
    ids = prompts(3, 4, seed=4)
    names = ["a1", BASE, "a2"]
    want = stitch(per_adapter(pm, names, lambda: pm(ids).logits), names)
    enable_csgmv(pm, backend="torch")
    logits, seen = compiled_ops(pm, _ids(names), ids, torch.ones_like(ids))
    close(logits, want, "compiled")
    assert seen["moe_linear"] == 4 and seen["moe_lora"] == 4, seen


def test_static_cache_beam_search_matches_peft_per_adapter():
    """Beam search on the static cache: the compiled decode step sees each row's beams (rows × beams tokens), whose
    token groups repeat each id over its beams; each row's tokens are stock PEFT's with its adapter alone."""
    pm = moe_peft("qwen3_moe")
    ids = prompts(3, 4, seed=5)
    names = ["a2", BASE, "a1"]
    kw = greedy_kwargs(3, num_beams=2)
    want = stitch(per_adapter(pm, names, lambda: pm.generate(input_ids=ids, **kw)), names)
    enable_csgmv(pm, backend="torch")
    got = pm.generate(input_ids=ids, adapter_ids=_ids(names), cache_implementation="static",
                      compile_config=compile_config(), **kw)  # fmt: skip
    assert torch.equal(got, want)


def test_static_cache_generate_with_the_host_tier():
    """The compiled path with ``max_resident_adapters=2`` over three adapters: id lists that move adapters in and out
    between calls (the host tier writes the experts stacks' slots in place, which the compiled ops read when they
    run) give stock PEFT's tokens per row, and a list over other adapters of the same shape compiles nothing new."""
    pm = moe_peft("qwen3_moe")
    ids = prompts(3, 4, seed=3)
    kw = greedy_kwargs(4)
    lists = [["a0", BASE, "a1"], ["a2", "a0", BASE], ["a1", "a2", BASE]]
    expected = [per_adapter(pm, names, lambda: pm.generate(input_ids=ids, **kw)) for names in lists]
    assert_generations_differ(expected[0])
    enable_csgmv(pm, backend="torch", max_resident_adapters=2)
    compiled = []
    for names, want in zip(lists, expected):
        got = pm.generate(input_ids=ids, adapter_ids=_ids(names), cache_implementation="static",
                          compile_config=compile_config(), **kw)  # fmt: skip
        assert torch.equal(got, stitch(want, names)), f"ids {names}: other tokens than stock PEFT's"
        compiled.append(graphs())
    assert compiled[2] == compiled[1], f"graphs after each call: {compiled}: moving adapters recompiled"
