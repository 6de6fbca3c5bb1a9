"""What a compiled csgmv step checks and reads: its graph takes the plan's buffers, not the stacks; the patched modules
add no Python guard per layer (with or without sibling groups); each layer's route is decided once per trace and
guarded by ``slots.ROUTE_EPOCH``, which advances with everything the route read; dynamo walks none of the adapters'
PEFT weights."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    DEVICE,
    ID_LISTS,
    compile_config,
    make,
    make_batch,
    static_and_eager,
)

from peft_csgmv import adapter_ids_scope, disable_csgmv, enable_csgmv

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
    pytest.mark.usefixtures("fresh_dynamo"),
]


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
    model = make(embedding=True)
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
    model = make(embedding=True)
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
        read = ".siblings" if groups == "beside" else "ROUTE_EPOCH"
        assert any(read in g for g in guards), f"no guard on {read}: no sibling group was traced"


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

    model = make(embedding=True)
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
    assert lead[0] == "group" and lead[2] == tuple(m._csgmv_record.stack.handle for m in (q, k, v)), lead
    assert lead[3] == tuple(m._csgmv_record.stack.version for m in (q, k, v)), lead
    assert second == ("member", lead[6][1], k._csgmv_record.stack.handle) and third[:2] == ("member", lead[6][2])
    members = (k._csgmv_record.member, v._csgmv_record.member)
    assert lead[6][1:] == members, "the group's stash keys are not its members'"
    assert route(o)[0] == "lora" and route(o)[2:4] == (o._csgmv_record.stack.handle, o._csgmv_record.stack.version)
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
    epoch, version = slots.ROUTE_EPOCH, q._csgmv_record.stack.version
    model.add_adapter("wide", LoraConfig(r=16, lora_alpha=8, target_modules=["q_proj"], init_lora_weights=False))
    model.to(DEVICE)
    model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=["wide", "a0", None], max_new_tokens=1)
    assert q._csgmv_record.stack.version > version and slots.ROUTE_EPOCH > epoch, "a new launch shape left the epoch"
    assert route(q)[3][0] == q._csgmv_record.stack.version


def test_compiled_code_walks_no_adapter_it_does_not_read():
    """dynamo marks every parameter under each module it meets as a static input, walking that module's tree, unless
    the module has a ``named_parameters`` of its own. The modules above csgmv's layers get one (their class's, as an
    instance attribute: the same results for every caller): a compiled static-cache call then marks the base weights
    its graph reads and none of the adapters' PEFT weights (a walk marks them all), with eager's tokens;
    ``disable_csgmv`` takes the attributes back."""
    model = make(embedding=True)
    params = [(n, id(p)) for n, p in model.named_parameters()]
    buffers = [(n, id(b)) for n, b in model.named_buffers()]
    enable_csgmv(model, backend="torch")
    spared = [m for m in model.modules() if "named_parameters" in m.__dict__]
    assert model in spared and model.get_base_model().model.layers[0] in spared
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert [(n, id(b)) for n, b in model.named_buffers()] == buffers
    assert len(list(model.parameters())) == len(params) and list(model.state_dict()) == [n for n, _ in params]
    input_ids, mask = make_batch(3, 5)
    static, eager = static_and_eager(model, input_ids, mask, ID_LISTS[0])
    assert torch.equal(static, eager)
    marked = {n for n, p in model.named_parameters() if hasattr(p, "_dynamo_static_input_type")}
    assert any(n.endswith("q_proj.base_layer.weight") for n in marked), "the graph's own weights were not marked"
    assert not [n for n in marked if ".lora_" in n], "dynamo walked the adapters' weights"
    disable_csgmv(model)
    assert not [m for m in model.modules() if {"named_parameters", "named_buffers"} & m.__dict__.keys()]
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
