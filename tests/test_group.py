"""Sibling groups (on by default; ``PEFT_CSGMV_GROUPS=0`` turns them off): layers that read the same input (a block's
q/k/v, gate/up) run their LoRA in compiled code as one
``peft_csgmv::lora_group`` op, one shrink and one expand launch for all of them (each member adds its part to its own
base product). The group kernels against the
per-layer kernels (Triton, under the interpreter on CPU), and the compiled static-cache path with groups against the
eager path (itself tested against stock PEFT elsewhere), with the op in the graph and no recompiles."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE, ID_LISTS, add_adapters, compile_config, make_batch, tiny_model

from peft_csgmv import enable_csgmv, kernels
from peft_csgmv.kernels.group import expand_group, group_splits, shrink_group
from peft_csgmv.plan import BatchPlan

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


def _model(dtype=torch.float32, lora_bias: bool = False):
    model, targets = tiny_model("llama", dtype=dtype)
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets, lora_bias=lora_bias),
    }
    return add_adapters(model, specs).to(DEVICE)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)], ids=str
)
@pytest.mark.parametrize("view", ["whole", "every_2nd_row", "offset_columns"])
def test_group_kernels_match_the_layer_kernels(dtype, view):
    """shrink_group + expand_group over a block's q/k/v (ranks 4 and 8, a base row) give each member's LoRA as the
    per-layer shrink and expand do (the LoRA alone, zeros on base rows), for ``x`` whole, every 2nd row of a taller
    tensor, or a column slice of a wider one."""
    model = _model(dtype)
    enable_csgmv(model, backend="triton")
    attn = model.base_model.model.model.layers[0].self_attn
    stacks = [attn.q_proj._csgmv_record.stack, attn.k_proj._csgmv_record.stack, attn.v_proj._csgmv_record.stack]
    slots = model._csgmv.slots_for(["a0", None, "a1", "a1", "a0"])
    plan = BatchPlan.build(list(slots), 1, DEVICE)
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(10, 60, generator=g).to(DEVICE, dtype)
    x = {"whole": wide[:5, :48].contiguous(), "every_2nd_row": wide[::2, :48], "offset_columns": wide[:5, 7:55]}[view]
    t = torch.zeros(3, group_splits(plan, 48), 5, max(s.a.shape[1] for s in stacks), device=DEVICE)
    shrink_group(x, [s.a for s in stacks], [s.ranks for s in stacks], plan, t)
    outs = [torch.full((5, s.out_features), 7.0, device=DEVICE) for s in stacks]
    expand_group(t, [s.b for s in stacks], [s.ranks for s in stacks], [s.scalings for s in stacks], plan, outs, dtype)
    for s, out in zip(stacks, outs):
        want = torch.full((5, s.out_features), 7.0, device=DEVICE)
        tt = kernels.shrink(x, s.a, s.ranks, plan)
        kernels.expand(tt, s.b, s.ranks, s.scalings, plan, None, out=want, act_dtype=dtype)
        assert want[0].abs().max() > 0 and not torch.equal(want[0], torch.full_like(want[0], 7.0))
        torch.testing.assert_close(out[[0, 2, 3, 4]], want[[0, 2, 3, 4]], rtol=1e-5, atol=1e-5)


def _graph_capture():
    """A dynamo backend that keeps every graph it is given and runs it as traced (as ``aot_eager`` would run it,
    without AOT autograd: the ops are the layers' own calls)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return compile_config(backend), graphs


def _ops(graphs, name: str) -> int:
    target = getattr(torch.ops.peft_csgmv, name).default
    return sum(1 for gm in graphs for node in gm.graph.nodes if node.target is target)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_static_generate_runs_sibling_groups(backend, monkeypatch):
    """The decode step compiled by transformers' static cache runs each block's q/k/v and gate/up as one group op (2
    blocks: 4 group ops, 4 layers alone: o and down), learned from the eager prefill before the step was traced;
    eager csgmv's tokens for three id lists, one graph. (On CPU every layer runs after its base product; on CUDA the
    layers with base weights of 16 MiB or more run beside it instead, outside groups.)"""
    monkeypatch.delenv("PEFT_CSGMV_GROUPS", raising=False)  # on by default
    model = _model()
    enable_csgmv(model, backend=backend)
    config, graphs = _graph_capture()
    input_ids, mask = make_batch(3, 5)
    outs = []
    for ids in ID_LISTS:
        kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ids, max_new_tokens=4, min_new_tokens=4,
                  do_sample=False)  # fmt: skip
        static = model.generate(cache_implementation="static", compile_config=config, **kw)
        eager = model.generate(**kw)
        assert torch.equal(static, eager), f"ids {ids}: the grouped compiled decode generated other tokens"
        outs.append(static)
    assert len(graphs) == 1, f"{len(graphs)} graphs: the groups or the ids changed the graph"
    assert _ops(graphs, "lora_group") == 4
    assert _ops(graphs, "lora") + _ops(graphs, "lora_linear") == 4, "o and down alone"
    assert not torch.equal(outs[0], outs[1]), "the id lists generate the same tokens: the test proves nothing"
    assert model._csgmv.executor.stash == {}


def test_groups_off_and_members_that_cannot_join(monkeypatch):
    """With ``PEFT_CSGMV_GROUPS=0`` every layer runs on its own and nothing is learned. And a group whose member
    cannot run in the group's op (here a ``lora_bias`` adapter, which the group kernels do not serve) runs layer by
    layer: eager's tokens."""
    monkeypatch.setenv("PEFT_CSGMV_GROUPS", "0")
    model = _model()
    enable_csgmv(model, backend="torch")
    config, graphs = _graph_capture()
    input_ids, mask = make_batch(3, 5)
    kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ID_LISTS[0], max_new_tokens=3, do_sample=False)
    assert torch.equal(model.generate(cache_implementation="static", compile_config=config, **kw), model.generate(**kw))
    assert _ops(graphs, "lora_group") == 0
    assert model.base_model.model.model.layers[0].self_attn.q_proj._csgmv_record.siblings is None
    torch._dynamo.reset()

    monkeypatch.setenv("PEFT_CSGMV_GROUPS", "1")
    model = _model(lora_bias=True)
    enable_csgmv(model, backend="torch")
    config, graphs = _graph_capture()
    assert torch.equal(model.generate(cache_implementation="static", compile_config=config, **kw), model.generate(**kw))
    assert _ops(graphs, "lora_group") == 0
    assert model.base_model.model.model.layers[0].self_attn.q_proj._csgmv_record.siblings is not None, "groups learned"


def test_a_failed_first_call_learns_no_groups(monkeypatch):
    """The eager call that would learn the groups fails (a stopping criterion that raises after the prefill, when the
    prefill's runs are already marked): the model is left with no group attributes and nothing learned; the next
    call learns them, and a forward inside ``adapter_ids_scope`` that raises does the same."""
    import transformers

    from peft_csgmv import adapter_ids_scope

    monkeypatch.delenv("PEFT_CSGMV_GROUPS", raising=False)
    model = _model()
    enable_csgmv(model, backend="torch")
    ex = model._csgmv.executor
    layers = list(model._csgmv.layers.values())

    def marked():
        return [layer for layer in layers if (r := layer._csgmv_record).siblings is not None or r.member is not None]

    class Fail(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            assert marked(), "the prefill marked no runs: the test proves nothing"
            raise RuntimeError("stop here")

    input_ids, mask = make_batch(3, 5)
    kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=ID_LISTS[0], max_new_tokens=3, do_sample=False)
    with pytest.raises(RuntimeError, match="stop here"):
        model.generate(stopping_criteria=transformers.StoppingCriteriaList([Fail()]), **kw)
    assert marked() == [] and not ex.groups_learned and ex.mapping is None

    with pytest.raises(RuntimeError, match="inside the scope"):
        with adapter_ids_scope(model, ID_LISTS[0]):
            model.base_model.model(input_ids=input_ids, attention_mask=mask)
            assert marked()
            raise RuntimeError("inside the scope")
    assert marked() == [] and not ex.groups_learned

    model.generate(**kw)
    assert ex.groups_learned and len(marked()) == 10, "q/k/v and gate/up of both blocks"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_groups_beside_their_base_products(backend, monkeypatch):
    """With ``PEFT_CSGMV_GROUPS=beside``, where the executor runs LoRA beside base products (the default on CUDA for
    base weights of 16 MiB or more, ``PEFT_CSGMV_BESIDE=1`` forces it here), a group whose members' base weights reach
    the floor together runs as one ``peft_csgmv::lora_group_linear`` (the members' base products and the group's LoRA,
    which on CUDA runs beside them): eager's tokens for three id lists, one graph. With a floor between the q/k/v and
    gate/up groups' bytes (18432 and 30720 here), q/k/v run as ``lora_group`` after their base products and gate/up
    beside them; by default (``PEFT_CSGMV_GROUPS=1``) the layers that run beside stay out of groups. A member whose
    base weight is replaced by another parameter after the groups were learned (the group's leader holds the old one)
    makes the next call learn the groups again: eager's tokens with the new weight."""
    monkeypatch.setenv("PEFT_CSGMV_GROUPS", "beside")
    monkeypatch.setenv("PEFT_CSGMV_BESIDE", "1")
    input_ids, mask = make_batch(3, 5)
    kw = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False)

    def run(model, id_lists):
        config, graphs = _graph_capture()
        outs = []
        for ids in id_lists:
            static = model.generate(cache_implementation="static", compile_config=config, adapter_ids=ids, **kw)
            eager = model.generate(adapter_ids=ids, **kw)
            assert torch.equal(static, eager), f"ids {ids}: the grouped compiled decode generated other tokens"
            outs.append(static)
        ops = {n: _ops(graphs, n) for n in ("lora", "lora_linear", "lora_group", "lora_group_linear")}
        return outs, graphs, {n: c for n, c in ops.items() if c}

    model = _model()
    enable_csgmv(model, backend=backend)
    outs, graphs, ops = run(model, ID_LISTS)
    assert len(graphs) == 1, f"{len(graphs)} graphs: the groups or the ids changed the graph"
    assert ops == {"lora_group_linear": 4, "lora_linear": 4}, ops
    assert not torch.equal(outs[0], outs[1]), "the id lists generate the same tokens: the test proves nothing"
    assert model._csgmv.executor.stash == {}

    k = model.base_model.model.model.layers[1].self_attn.k_proj.base_layer
    k.weight = torch.nn.Parameter(torch.randn_like(k.weight))
    changed, _, _ = run(model, ID_LISTS[:1])
    assert not torch.equal(changed[0], outs[0]), "a new k weight generates the same tokens: the test proves nothing"
    torch._dynamo.reset()

    monkeypatch.setenv("PEFT_CSGMV_BESIDE_MIN_MIB", str(20000 / 2**20))
    model = _model()
    enable_csgmv(model, backend=backend)
    _, _, ops = run(model, ID_LISTS[:2])
    assert ops == {"lora_group": 2, "lora_group_linear": 2, "lora": 4}, ops
    torch._dynamo.reset()

    monkeypatch.delenv("PEFT_CSGMV_BESIDE_MIN_MIB")
    monkeypatch.delenv("PEFT_CSGMV_GROUPS")
    model = _model()
    enable_csgmv(model, backend=backend)
    _, _, ops = run(model, ID_LISTS[:2])
    assert ops == {"lora_linear": 14}, ops
