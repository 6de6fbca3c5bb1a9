"""Continuous batching whose steps transformers runs as CUDA graphs (``ContinuousBatchingConfig(use_cuda_graph=True)``),
with an adapter per request.

transformers captures one graph per step size and replays it for every later step of that size, whatever requests the
step holds, without running any layer's Python. So a graphed step's LoRA reads everything that changes from step to
step from buffers at fixed addresses, which the driver rewrites before the step, and no layer takes a shortcut for one
step's requests (``Mapping.graphed``).

On the CPU, where transformers captures no graph, ``continuous.GRAPHED_ON_CPU`` runs every step the graphed way,
eagerly: each request's tokens are stock PEFT's run of it alone (fp32, greedy), dense and MoE; the steps of one size
launch the same kernels over the same grids and plan buffers whatever their requests, and those buffers are written
before the forward, never inside it; transformers' warmup (steps without requests, outside any step) runs inside a
step of base tokens. On a GPU, ``use_cuda_graph=True`` itself: every request's tokens are its alone-run's.
"""

from __future__ import annotations

import collections
import types

import pytest
import torch
from helpers import BACKENDS, DEVICE, make
from test_continuous import IDS, PROMPTS, _alone, _configs, three_adapters

from peft_csgmv import continuous, disable_csgmv, enable_csgmv, kernels, layers
from peft_csgmv.continuous import continuous_batching_available
from peft_csgmv.kernels import launch

pytestmark = pytest.mark.skipif(
    not continuous_batching_available(), reason="this transformers has no continuous batching (transformers >= 5)"
)


# The backend of tests whose steps transformers may capture as CUDA graphs: on CUDA the kernels (the torch backend reads
# each step's plan on the host, refused there), on the CPU their reference (faster than the interpreter).
GRAPHED_BACKEND = "triton" if DEVICE.type == "cuda" else "torch"


def _llama(backend: str):
    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend=backend)
    return model


def _tokens(out, n: int) -> list:
    return [out[f"req_{i}"].generated_tokens for i in range(n)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("max_batch_tokens", [64, 8], ids=["whole-prefills", "split-prefills"])
def test_graphed_steps_give_each_request_its_adapter(monkeypatch, backend, max_batch_tokens):
    """Every step the graphed way (plans sized for any step of its size, base tokens in the kernels' segments):
    each request's tokens are its stock PEFT run's, requests without an adapter included, prefills split over steps
    too."""
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model = _llama(backend)
    gen, cbc = _configs(max_batch_tokens=max_batch_tokens)
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS)
    want = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
    assert len({tuple(w) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
    assert _tokens(out, len(PROMPTS)) == want
    graphed = [key for key in model._csgmv.executor.plans.packed if "graphed" in key]
    assert graphed, "no step took the graphed plans"
    disable_csgmv(model)


class _Steps:
    """Per step (keyed by its token count): the launches its forward made, the plan buffers it wrote inside its
    forward, and each step's mapping."""

    def __init__(self, model, monkeypatch) -> None:
        from peft_csgmv import mapping as mapping_module
        from peft_csgmv import moe as moe_module
        from peft_csgmv import plan as plan_module
        from peft_csgmv import slots as slots_module
        from peft_csgmv import tier as tier_module

        self.model, self.in_forward = model, False
        self.launches: list = []
        self.steps: list[tuple] = []  # (tokens, token slots, launch signatures, buffers written inside the forward)
        self.written_inside: list = []
        base = model.get_base_model()
        base.register_forward_pre_hook(lambda *_: self._begin())
        base.register_forward_hook(lambda *_: self._end())
        own_call = launch.Launcher.__call__

        def recorded(launcher, grid, args, constexprs, options=()):
            if self.in_forward:
                self.launches.append(_signature(launcher, grid, args, constexprs, options))
            return own_call(launcher, grid, args, constexprs, options)

        monkeypatch.setattr(launch.Launcher, "__call__", recorded)
        # (every launch through the launcher, where it is recorded: a layer's launches bound on a plan's second use
        # would bypass it on CUDA)
        monkeypatch.setattr(kernels.BoundLayer, "direct", False)
        # Every way csgmv writes a device buffer from the host: plans, token groups, slot vectors, pages' tables.
        for module in (mapping_module, plan_module, slots_module, tier_module, moe_module):
            for name in ("write_buffer", "upload"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, self._watched(name, getattr(module, name)))
        own_pages_upload = tier_module.DevicePages.upload
        monkeypatch.setattr(tier_module.DevicePages, "upload", self._watched("pages", own_pages_upload))

    def _watched(self, name, own):
        def watched(*args, **kwargs):
            if self.in_forward:
                self.written_inside.append(name)
            return own(*args, **kwargs)

        return watched

    def _begin(self) -> None:
        self.in_forward, self.launches, self.written_inside = True, [], []

    def _end(self) -> None:
        self.in_forward = False
        mapping = self.model._csgmv.executor.mapping
        assert mapping is not None and mapping.graphed, "a step ran without a graphed mapping"
        self.steps.append((len(mapping.token_slots), mapping.token_slots, self.launches, self.written_inside))


def _signature(launcher, grid, args, constexprs, options) -> tuple:
    """What a captured launch fixes: the kernel, its grid, its integer arguments and constexprs, each float tensor's
    layout (weights and activations), and each integer tensor's address (plans, per-slot vectors): a replay reads
    whatever those addresses then hold."""
    parts = []
    for a in args:
        if isinstance(a, torch.Tensor):
            floating = a.is_floating_point()
            parts.append((a.dtype, tuple(a.shape), a.stride(), None if floating else a.data_ptr()))
        else:
            parts.append(a)
    return launcher.kernel.fn.__name__, tuple(grid), tuple(parts), tuple(constexprs.items()), tuple(options)


def test_graphed_steps_of_one_size_launch_the_same_whatever_their_requests(monkeypatch):
    """Two batches of the same prompt lengths, one with mixed adapters and one all on the base model: their steps of
    each size launch the same kernels over the same grids, integer arguments and plan buffers (a graph captured by
    either is right for the other), and every buffer those launches read is written before the forward, never inside
    it (a write captured in a graph would be replayed from its old host copy)."""
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model = _llama("triton")
    steps = _Steps(model, monkeypatch)
    gen, cbc = _configs(new_tokens=3, max_batch_tokens=16)
    for ids in (IDS, [None] * len(PROMPTS), ["a1", "a0", None, "a1", "a0"]):
        model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
    by_size: dict = collections.defaultdict(list)
    for size, slots, launches, written in steps.steps:
        assert not written, f"a step of {size} tokens wrote {written} inside its forward"
        by_size[size].append((slots, launches))
    compared = 0
    for size, runs in by_size.items():
        first_slots, first = runs[0]
        assert first, f"a step of {size} tokens launched no kernel"
        for slots, launches in runs[1:]:
            assert launches == first, f"steps of {size} tokens launched differently: {first_slots} / {slots}"
            compared += slots != first_slots
    assert compared >= 3, "too few steps of one size with other requests: the test would prove little"
    disable_csgmv(model)


def test_graphed_steps_with_the_host_tier_move_adapters_before_the_forward(monkeypatch):
    """``max_resident_adapters=2`` over three adapters, every step the graphed way: adapters move in and out of the
    slots between steps, each step's slot vectors and plan are written before its forward and never inside it (a
    replayed step runs no layer's Python), and every request's tokens are its stock PEFT run's."""
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model, prompts, ids = three_adapters()
    want = [_alone(model, p, a, 5) for p, a in zip(prompts, ids)]
    assert len({tuple(w) for w in want}) > 3, "the adapters change nothing: the test would prove nothing"
    enable_csgmv(model, backend="triton", max_resident_adapters=2)
    steps = _Steps(model, monkeypatch)
    gen, cbc = _configs(max_batch_tokens=16)
    out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
    assert _tokens(out, len(prompts)) == want
    for size, slots, _, written in steps.steps:
        assert not written, f"a step of {size} tokens ({slots}) wrote {written} inside its forward"
    assert len({frozenset(slots) for _, slots, _, _ in steps.steps}) > 2, "the steps' adapters never changed"
    disable_csgmv(model)


@pytest.mark.parametrize("targets", ["attention-and-experts", "experts-only"])
def test_graphed_moe_steps_give_each_request_its_expert_adapter(monkeypatch, targets):
    """Expert LoRA, every step the graphed way: the experts layers build their plans from token groups at a fixed
    address per step size, which the driver rewrites before each step (a layer wrote them inside the forward only the
    first time a size came), also where no kernel layer has a stack (adapters on the experts only); a step without
    adapter tokens runs the LoRA path too. Each request's tokens are its stock PEFT run's, over a batch with adapters,
    one without, and the first again (whose steps must not read the second's groups)."""
    from test_moe import ADAPTERS, EXPERTS, moe_peft, prompts
    from test_moe_prototype import _has_3d_experts

    if not _has_3d_experts():
        pytest.skip("needs transformers' 3D experts and PEFT's target_parameters")
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    adapters = ADAPTERS
    if targets == "experts-only":
        adapters = {"a0": ADAPTERS["a0"], "a1": dict(r=6, lora_alpha=12, target_modules=[], target_parameters=EXPERTS)}
    pm = moe_peft("qwen3_moe", adapters)
    pm.get_base_model().generation_config.eos_token_id = None
    rows = prompts(4, 6, seed=2).tolist()
    rows[1], rows[3] = rows[1][:3], rows[3][:5]  # (uneven prompts)
    ids = ["a0", None, "a1", "a1"]
    want = [_alone(pm, r, a, 4) for r, a in zip(rows, ids)]
    assert len({tuple(w) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
    enable_csgmv(pm, backend="torch")
    steps = _Steps(pm, monkeypatch)
    lora_steps = []
    own_lora = layers.moe_lora_forward
    monkeypatch.setattr(layers, "moe_lora_forward", lambda *a, **k: lora_steps.append(1) or own_lora(*a, **k))
    gen, cbc = _configs(new_tokens=4, max_batch_tokens=8)
    for batch_ids in (ids, [None] * 4, ids):
        lora_steps.clear()
        out = pm.generate_batch(rows, generation_config=gen, continuous_batching_config=cbc, adapter_ids=batch_ids)
        assert lora_steps, f"{batch_ids}: the experts layers skipped their LoRA (a graph would skip it for good)"
    assert _tokens(out, 4) == want
    assert pm._csgmv.executor.plans.groups, "the experts layers read no fixed token groups"
    seen = set()
    for size, _, _, written in steps.steps:
        if size in seen:
            assert not written, f"a later step of {size} tokens wrote {written} inside its forward"
        seen.add(size)
    disable_csgmv(pm)


def test_warmup_outside_a_step_runs_inside_a_step_of_base_tokens(monkeypatch):
    """transformers' warmup captures graphs of steps without requests by calling the batch processor's forward
    outside any step: csgmv runs it inside a graphed step of base tokens of the warmup's size (so its layers are in the
    graphs later steps replay), closed after: a LoRA layer run in it gives its base layer's output, where outside a
    step it gives the active adapter's (PEFT's)."""
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model = _llama("triton")
    gen, cbc = _configs()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    router = manager._csgmv_router
    processor = types.SimpleNamespace(inputs_and_outputs=types.SimpleNamespace(graphs=None, compute_stream=None))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9, 10]], device=DEVICE)
    q_proj = model.get_base_model().model.layers[0].self_attn.q_proj
    hidden = torch.randn(1, ids.shape[1], q_proj.in_features, generator=torch.Generator().manual_seed(0))
    hidden = hidden.to(DEVICE)
    seen = {}

    def own(base, batch_data):
        seen["mapping"] = model._csgmv.executor.mapping
        return q_proj(hidden)

    with torch.no_grad():
        out = continuous._compute_batch(router, processor, own, model.get_base_model(), {"input_ids": ids})
        base, active = q_proj.base_layer(hidden), q_proj(hidden)
    mapping = seen["mapping"]
    assert mapping is not None and mapping.graphed and mapping.token_slots == (-1,) * ids.shape[1]
    assert not model._csgmv.executor.active
    assert not torch.allclose(active, base, rtol=1e-3, atol=1e-3), "the adapter changes nothing: it would prove nothing"
    torch.testing.assert_close(out, base, rtol=1e-5, atol=1e-5)
    disable_csgmv(model)


def test_graphs_captured_under_other_stacks_are_dropped(monkeypatch):
    """Before a graphed step, transformers' graphs are dropped (captured again at their next step) when they were
    captured under other stacks or plans: csgmv's first step, a restack (an adapter added: the route epoch), the plans
    cleared, another slot count; not otherwise."""
    from peft import LoraConfig

    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model = _llama("torch")
    gen, cbc = _configs()
    router = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)._csgmv_router
    old = object()
    processor = types.SimpleNamespace(inputs_and_outputs=types.SimpleNamespace(graphs=old, compute_stream=None))
    state = model._csgmv

    def fresh() -> bool:
        before = processor.inputs_and_outputs.graphs
        router.fresh_graphs(processor, state)
        return processor.inputs_and_outputs.graphs is not before

    assert fresh() and not fresh() and not fresh()
    model.add_adapter("a2", LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"]))
    state.sync(model)  # (what a call does first: the new adapter restacks)
    assert fresh() and not fresh()
    state.executor.clear_plans()
    assert fresh() and not fresh()
    disable_csgmv(model)


def test_graphs_where_the_configuration_asks_for_them():
    """CUDA graphs where ``use_cuda_graph`` asks for them (True, or a pair with one True) or, left unset, where a
    padding interval is given (as transformers reads it); else off (transformers' own default would turn them on
    with flash attention)."""
    from transformers import ContinuousBatchingConfig

    def resolved(**kw):
        return continuous._eager_config(ContinuousBatchingConfig(**kw)).use_cuda_graph

    assert resolved() is False and resolved(use_cuda_graph=False) is False
    assert resolved(use_cuda_graph=True) is True and resolved(use_cuda_graph=(False, True)) == (False, True)
    assert resolved(use_cuda_graph=(False, False)) is False
    assert resolved(q_padding_interval_size=64) is None  # (transformers then turns them on)
    assert resolved(q_padding_interval_size=64, use_cuda_graph=False) is False
    assert continuous._eager_config(ContinuousBatchingConfig(use_cuda_graph=True), graphs=False).use_cuda_graph is False


def test_no_graphs_for_a_model_on_the_cpu():
    """A model on the CPU gets no CUDA graphs, asked for or not, whether or not the machine has CUDA (transformers
    5.17 captured empty graphs for it there and replayed them: wrong tokens); its steps run eagerly, each request's
    tokens its stock PEFT run's."""
    from transformers import ContinuousBatchingConfig

    model = make("llama").to("cpu")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="torch")
    gen, _ = _configs()
    # (each request alone first: transformers 5.17's manager leaves the model's attention paged for plain forwards)
    alone = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
    graphs = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, use_cuda_graph=True)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=graphs)
    config = manager.continuous_batching_config
    assert config.use_cuda_graph in (False, (False, False)) and not manager._csgmv_router.graphs_asked
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=graphs, adapter_ids=IDS)
    assert _tokens(out, len(PROMPTS)) == alone
    disable_csgmv(model)


def test_graphs_refusal_says_why_a_model_cannot_replay_graphs():
    """``continuous.graphs_refusal``, which the batch command and the server consult before taking CUDA graphs by
    default: a model csgmv does not run, or one off CUDA, cannot replay them."""
    from peft_csgmv.cli import _graphs, build_parser

    model = make("llama").to("cpu")
    assert continuous.graphs_refusal(model) == "csgmv is not enabled on the model"
    enable_csgmv(model, backend="torch")
    assert continuous.graphs_refusal(model) == "the model is not on a CUDA device"
    flags = ["generate", "--base", "b", "--adapter", "a=p", "--input", "i", "--output", "o"]
    assert not _graphs(build_parser()[0].parse_args(flags), model)
    disable_csgmv(model)


def test_graphs_are_refused_where_they_cannot_replay():
    """CUDA graphs are refused, before anything runs, with layers offloaded by accelerate (their weights move on
    every forward) and with the torch backend on CUDA (it reads each step's plan on the host)."""
    state = types.SimpleNamespace(offloaded=[object()], devices=(), executor=None)
    assert "offloaded" in continuous._graphs_refusal(state)
    executor = types.SimpleNamespace(triton_on=lambda device: False)
    state = types.SimpleNamespace(offloaded=[], devices=(torch.device("cuda", 0),), executor=executor)
    assert "torch backend" in continuous._graphs_refusal(state)
    state = types.SimpleNamespace(offloaded=[], devices=(torch.device("cpu"),), executor=executor)
    assert continuous._graphs_refusal(state) is None


def test_requests_without_an_adapter_run_the_active_one_through_csgmv(monkeypatch):
    """Graphed, every step is csgmv's: requests added without ``adapter_id`` run the model's active adapter in the
    kernels (stock PEFT's tokens), and where csgmv cannot give the active adapter per request (LoRA on the output
    embedding) such a request is refused as it is added, in the caller's thread, before anything is queued."""
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    model = _llama(GRAPHED_BACKEND)
    gen, cbc = _configs()
    graphs = type(cbc)(num_blocks=32, max_batch_tokens=64, use_cuda_graph=True)
    out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=graphs)
    active = model.active_adapter
    assert _tokens(out, len(PROMPTS)) == [_alone(model, p, active, 5) for p in PROMPTS]
    disable_csgmv(model)

    specs = {"a0": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"])}
    model = make("llama", specs)
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend=GRAPHED_BACKEND)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=graphs)
    with pytest.raises(ValueError, match="output embedding"):
        manager.add_request(PROMPTS[0], max_new_tokens=3)
    with pytest.raises(ValueError, match="output embedding"):
        manager.add_requests(PROMPTS, max_new_tokens=3)
    assert not manager.input_queue.qsize()
    plain = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    assert plain.add_request(PROMPTS[0], max_new_tokens=3) is not None  # (eager: stock PEFT's own step runs it)
    disable_csgmv(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gpu_cuda_graphs_give_each_request_its_adapter(arch):
    """On a GPU with ``use_cuda_graph=True`` (transformers captures a graph per step size, warmup included, and
    replays it): every request's tokens are its stock PEFT run's alone (fp32, greedy), over three batches whose steps
    of one size hold other requests, then again after an adapter is added (a restack: the graphs are captured again)."""
    from peft import LoraConfig
    from transformers import ContinuousBatchingConfig

    if arch == "llama":
        model = make("llama")
        rows, ids_list = PROMPTS, [IDS, [None] * len(PROMPTS), ["a1", "a0", None, "a1", "a0"]]
    else:
        from test_moe import moe_peft, prompts

        model = moe_peft("qwen3_moe")
        rows = prompts(4, 6, seed=2).tolist()
        ids_list = [["a0", None, "a1", "a1"], [None] * 4, ["a1", "a1", "a0", None]]
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="triton")
    gen, _ = _configs()
    cbc = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=64, use_cuda_graph=True)

    def check(ids):
        out = model.generate_batch(rows, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
        want = [_alone(model, r, a, 5) for r, a in zip(rows, ids)]
        assert _tokens(out, len(rows)) == want, ids

    for ids in ids_list:
        check(ids)
    torch.manual_seed(5)
    target = ["q_proj", "v_proj"]
    model.add_adapter("a9", LoraConfig(r=6, lora_alpha=12, init_lora_weights=False, target_modules=target))
    check(["a9", "a0", None, "a9"][: len(rows)] + ["a1"] * max(0, len(rows) - 4))
    disable_csgmv(model)


def test_asynchronous_batching_drops_both_pairs_graphs_and_steps_read_the_current_pair():
    """With asynchronous batching transformers keeps two pairs of buffers, each with graphs of its own: stale graphs
    are dropped in both; a step reads its requests from the pair it was prepared in (the current one)."""
    pairs = [
        types.SimpleNamespace(host_io=types.SimpleNamespace(requests_in_batch=[i]), device_io=types.SimpleNamespace())
        for i in range(2)
    ]
    for pair in pairs:
        pair.device_io.graphs = collections.OrderedDict(old=object())
    io = types.SimpleNamespace(io_pairs=pairs, current_pair=1, compute_stream=None)
    processor = types.SimpleNamespace(inputs_and_outputs=io)
    assert continuous._step_io(processor).requests_in_batch == [1]
    io.current_pair = 0
    assert continuous._step_io(processor).requests_in_batch == [0]
    continuous._drop_graphs(processor)
    assert all(type(p.device_io.graphs) is collections.OrderedDict and not p.device_io.graphs for p in pairs)
    single = types.SimpleNamespace(requests_in_batch=[7], graphs=collections.OrderedDict(old=1), compute_stream=None)
    processor = types.SimpleNamespace(inputs_and_outputs=single)
    assert continuous._step_io(processor) is single
    continuous._drop_graphs(processor)
    assert not single.graphs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("graphs", [False, True], ids=["eager-steps", "cuda-graphs"])
@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_gpu_asynchronous_batching_gives_each_request_its_adapter(arch, graphs):
    """On a GPU with ``use_async_batching=True`` (transformers prepares each step while the one before runs, each on
    its own pair of buffers, graphs per pair): every request's tokens are its stock PEFT run's alone (fp32, greedy),
    prefills split over steps, through ``generate_batch`` and the manager, then again after an adapter is added (a
    restack while the manager runs)."""
    from peft import LoraConfig
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingAsyncIOs

    if arch == "llama":
        model = make("llama")
        rows, ids = PROMPTS, IDS
    else:
        from test_moe import moe_peft, prompts

        model = moe_peft("qwen3_moe")
        rows, ids = prompts(4, 6, seed=2).tolist(), ["a0", None, "a1", "a1"]
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model, backend="triton")
    gen, _ = _configs()
    cbc = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=16, use_async_batching=True, use_cuda_graph=graphs)
    try:
        out = model.generate_batch(rows, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
        want = [_alone(model, r, a, 5) for r, a in zip(rows, ids)]
        assert len({tuple(w) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
        assert _tokens(out, len(rows)) == want
        manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
        manager.start()
        try:
            late = list(reversed(ids))
            got = {}
            for i, (row, name) in enumerate(zip(rows, late)):
                got[manager.add_request(row, request_id=f"m{i}", max_new_tokens=5, adapter_id=name)] = (row, name)
            results = {rid: manager.get_result(request_id=rid, timeout=120) for rid in got}
            assert isinstance(manager.batch_processor.inputs_and_outputs, ContinuousBatchingAsyncIOs)
            torch.manual_seed(5)
            target = ["q_proj", "v_proj"]
            model.add_adapter("a9", LoraConfig(r=6, lora_alpha=12, init_lora_weights=False, target_modules=target))
            added = {manager.add_request(row, request_id=f"n{i}", max_new_tokens=5, adapter_id="a9"): (row, "a9")
                     for i, row in enumerate(rows[:2])}  # fmt: skip
            results.update({rid: manager.get_result(request_id=rid, timeout=120) for rid in added})
            got.update(added)
        finally:
            manager.stop(block=True)
        for rid, (row, name) in got.items():
            assert results[rid].generated_tokens == _alone(model, row, name, 5), (rid, name)
    finally:
        disable_csgmv(model)


def test_work_an_asynchronous_step_left_in_flight_is_waited_for_off_its_stream():
    """An asynchronous step's kernels may still run when its host part ends: a call opened on another stream, and a
    sync that changes stacks, wait for them first; the next step, queued on the same stream, does not wait."""
    from peft import LoraConfig

    model = _llama("torch")
    executor = model._csgmv.executor
    waits = []

    class Event:
        def synchronize(self):
            waits.append(1)

    stream = torch.cuda.current_stream() if torch.cuda.is_available() else object()
    executor.in_flight = (stream, Event())
    executor.settle(stream)
    assert not waits and executor.in_flight is not None, "the same stream is ordered after it"
    executor.settle(object())
    assert waits == [1] and executor.in_flight is None
    executor.in_flight = (object(), Event())
    model._csgmv.sync(model)
    assert waits == [1], "nothing changed: nothing to wait for"
    model.add_adapter("a9", LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=["q_proj"]))
    model._csgmv.sync(model)
    assert waits == [1, 1] and executor.in_flight is None
    disable_csgmv(model)
