"""Continuous batching with an adapter per request: transformers' continuous batching as a driver of the mapping.

transformers (5 and later) packs every scheduled request's tokens (prefill chunks and decode tokens alike) back to
back into one row per step and runs the model on it from a background thread. On an enabled model:

* ``model.generate_batch(inputs, generation_config, adapter_ids=[...])`` gives input ``i`` adapter ``adapter_ids[i]``
  (``None``: the base model) and returns what transformers returns;
* the manager of ``model.init_continuous_batching(...)`` takes ``add_request(..., adapter_id="legal")`` and
  ``add_requests(inputs, ..., adapter_ids=[...])`` (``None``: the base model); a request added without one runs
  the model's active adapter, as stock PEFT's manager runs every request.

Each request's adapter is checked when it is added, in the caller's thread (an unknown adapter raises there, before
the request is queued). Each step, the driver (:class:`Router`, wrapping the batch processor's generation step) takes
the model's call lock, brings the step's adapters into slots, fills one :class:`~peft_csgmv.mapping.Mapping` of
packed tokens (each request's tokens map to its adapter's slot, padding to none), prepares its plan, and opens it on
the executor for the step's thread; the layers read it as they read any call's.

With the host tier (``max_resident_adapters=N``), a step starts waiting requests only while the running requests'
adapters and theirs number at most N (:meth:`Router.admit`), those whose adapters already hold a slot first (unless
a request has waited :data:`PATIENCE` steps: then its place in line counts again); the step brings its adapters into
slots as a call does. On a GPU, while requests run, the adapters of waiting requests are brought in ahead instead, on
a copy-in stream beside the running steps, and their requests start once the copies are done.

A step's preparation (the mapping's plan, the adapters' copies in) runs on the stream transformers runs the step's
forward on (:func:`compute_stream`), so it comes before the step's kernels in stream order.

What runs: synchronous or asynchronous batching, as the configuration asks (asynchronously, transformers prepares a step
while the one before runs on the device, each on its own pair of input and output buffers; a step's mapping, plan and
adapters' copies in are queued on the compute stream after the step before, from host memory of their own, so the step
before reads what it was given), eager steps unless the configuration asks for CUDA graphs (``use_cuda_graph=True`` or a
pair; left unset, off; off for a model on the CPU, where there is no graph to capture) or compiled forwards (a
``varlen_compile_config`` / ``decode_compile_config``, a ``default_compile_level``). Under graphs transformers captures
a step of each size once and replays it for every later step of that size without running any layer's Python; compiled,
each padded step size is one graph (compiled with fixed shapes: :func:`_fixed_shape_compiles`), whose layers read their
plans from the executor's static plans of that size (:class:`~peft_csgmv.mapping.StaticPlan` of a packed step, rewritten
as each step opens, as compiled ``generate`` reads its own). Either way each step's mapping is
:attr:`~peft_csgmv.mapping.Mapping.graphed`: padded to the step's padded size, every step csgmv's (requests without an
adapter take the active one's slot), its plans and MoE token groups at fixed addresses rewritten before the step, sized
for any step of its size; graphs captured under other stacks or plans are dropped before a step
(:meth:`Router.fresh_graphs`), and transformers' warmup runs inside a step of base tokens (:func:`_compute_batch`).
Refused with graphs: accelerate-offloaded layers, the torch backend on CUDA. Adapters whose modules run PEFT's own path
somewhere, aLoRA adapters and LoRA on the output embedding cannot be given per request (PEFT's mixed-batch path is per
row, and a packed step has one): such a request is refused when it is added. A step with no request that was given an
adapter is transformers' own step, as stock PEFT runs it (eager steps; graphed, csgmv's)."""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Sequence

from . import slots as _slots
from ._compat import transformers_model
from .mapping import Mapping
from .patching import WeakMethod
from .sync import BASE, BASE_NAMES, PEFT_DORA_ERROR, outside_inference_mode
from .tier import on_stream

CHILD = "__child#"  # transformers' id of a request's extra returned sequence: f"{parent}{CHILD}{i}"
# A request added without ``adapter_id`` (or ``adapter_ids``): stock PEFT's, the model's active adapter.
STOCK = object()
# With the host tier, waiting requests whose adapters hold a slot start before those whose adapters would have to be
# brought in, but no request waits longer than this many steps for that preference (it then starts in its turn).
PATIENCE = 16
# Whether adapters are brought in ahead (Router.admit) on the CPU too, where their copies are done at once (tests); on
# a GPU they always are.
AHEAD_ON_CPU = False
# Whether every step runs as under CUDA graphs (Mapping.graphed) on the CPU too, where transformers captures none: the
# layers then read the graphed steps' fixed buffers eagerly (tests); on a GPU, steps are graphed where transformers'
# continuous batching runs CUDA graphs.
GRAPHED_ON_CPU = False


def continuous_batching_available() -> bool:
    """Whether this transformers has the continuous-batching API csgmv drives (transformers 5 or later)."""
    try:
        from transformers import ContinuousBatchingConfig  # noqa: F401
        from transformers.generation.continuous_batching import ContinuousBatchingManager  # noqa: F401
    except ImportError:
        return False
    return True


def _require() -> None:
    if not continuous_batching_available():
        import transformers

        raise NotImplementedError(
            f"per-request adapters under continuous batching need transformers 5 or later (ContinuousBatchingConfig); "
            f"this is {transformers.__version__}"
        )


def _eager_config(config, graphs: bool = True):
    """A copy of ``config`` (a ``ContinuousBatchingConfig``, or ``None``: transformers' defaults) with CUDA graphs
    only where asked for (``use_cuda_graph``: True or a pair) and ``graphs`` allows them, and prompt blocks not shared
    between requests (their adapters may differ). Asynchronous batching stays as asked (left unset, transformers
    decides from the graphs it runs)."""
    import copy

    from transformers import ContinuousBatchingConfig

    config = ContinuousBatchingConfig() if config is None else copy.copy(config)
    if hasattr(config, "allow_block_sharing"):
        # transformers shares a cached prompt block between requests by its tokens alone: a request with another
        # adapter would read keys and values computed under the first one's.
        config.allow_block_sharing = False
    if hasattr(config, "use_cuda_graph") and not (graphs and _asks_graphs(config)):
        # (transformers' default turns them on where the attention needs no mask, flash attention: csgmv only where
        # asked for, as a request without adapter_id then runs through csgmv, checked as it is added)
        config.use_cuda_graph = False
    return config


def _asks_graphs(config) -> bool:
    """Whether ``config`` asks for CUDA graphs: ``use_cuda_graph`` True or a pair with one True, or, left unset, a
    padding interval given (transformers takes those as asking for graphs)."""
    graphs = getattr(config, "use_cuda_graph", None)
    if graphs is None:
        return any(getattr(config, name, None) for name in ("q_padding_interval_size", "kv_padding_interval_size"))
    return graphs is True or (isinstance(graphs, tuple) and any(graphs))


# transformers' model runner: its compiled forwards and the configurations they were compiled with (transformers 5.2x)
_COMPILED = (("_compiled_varlen", "varlen_compile_config"), ("_compiled_decode", "decode_compile_config"))


def _asks_compile(config) -> bool:
    """Whether ``config`` asks for compiled forwards (a compile configuration, or a default compile level)."""
    given = any(getattr(config, name, None) is not None for _, name in _COMPILED)
    return given or (getattr(config, "default_compile_level", 0) or 0) > 0


def _graphs_refusal(state) -> str | None:
    """Why this enabled model's continuous batching cannot run CUDA graphs (``None``: it can)."""
    if state.offloaded:
        return "layers offloaded by accelerate move their weights on every forward, which a CUDA graph cannot replay"
    for device in state.devices:
        if device.type == "cuda" and not state.executor.triton_on(device):
            return "the torch backend reads each step's plan on the host; CUDA graphs need the Triton kernels"
    return None


def graphs_refusal(model) -> str | None:
    """Why continuous batching on this model cannot run CUDA graphs, in a line (``None``: it can): not enabled, not
    on CUDA, layers accelerate offloads, the torch backend."""
    state = model.__dict__.get("_csgmv")
    if state is None:
        return "csgmv is not enabled on the model"
    if not _on_cuda(transformers_model(model)):
        return "the model is not on a CUDA device"
    return _graphs_refusal(state)


def _on_cuda(base_model) -> bool:
    """Whether a base model is on a CUDA device (a model elsewhere has no CUDA graph to capture)."""
    return getattr(getattr(base_model, "device", None), "type", None) == "cuda"


def graph_slots(state) -> int:
    """The slots a graphed step's tokens may use: the host tier's resident ones, else the registry's."""
    return state.max_resident or state.registry.capacity


def _graphs_on(processor) -> bool:
    """Whether transformers runs (some of) this batch processor's steps as CUDA graphs, or compiled (a compiled
    forward, as a graph, reads each step's plans from fixed buffers, of the step's padded size)."""
    runner = getattr(processor, "model_runner", None)
    graphs = getattr(runner, "use_cuda_graph_varlen", False) or getattr(runner, "use_cuda_graph_decode", False)
    return bool(graphs or any(getattr(runner, attr, None) is not None for attr, _ in _COMPILED))


def _fixed_shape_compiles(runner) -> None:
    """transformers' compiled forwards of this model runner, compiled with fixed shapes (``dynamic=False``) where
    their configuration leaves shapes dynamic (``default_compile_level`` 1 and 2 do): csgmv's layers read each step's
    plan from buffers of the step's padded size, one graph per padded size (transformers pads compiled steps to a few
    sizes), where a graph of symbolic size would have none to read."""
    import torch

    for attr, name in _COMPILED:
        config = getattr(getattr(runner, "cb_config", None), name, None)
        if getattr(runner, attr, None) is None or config is None or getattr(config, "dynamic", None) is False:
            continue
        options = config.to_dict()
        options["dynamic"] = False
        setattr(runner, attr, _SizedCompile(torch.compile(runner._forward_process_and_sample, **options)))


# The graphs one fixed-shape compiled forward may hold (one per padded step size): transformers pads varlen steps to
# multiples of its query and key/value intervals and decode steps to powers of two, more sizes than dynamo's default
# limit of recompiles per function (8), past which a full-graph compile fails.
FIXED_SHAPE_GRAPHS = 256


class _SizedCompile:
    """A compiled forward called with dynamo's limit of recompiles per function raised to :data:`FIXED_SHAPE_GRAPHS`
    for the call (one graph per padded step size: :func:`_fixed_shape_compiles`)."""

    def __init__(self, compiled) -> None:
        import torch._dynamo

        self.compiled = compiled
        self.config = config = torch._dynamo.config
        self.limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"  # (torch < 2.6)

    def __call__(self, *args, **kwargs):
        config, name = self.config, self.limit
        with config.patch(**{name: max(getattr(config, name), FIXED_SHAPE_GRAPHS)}):
            return self.compiled(*args, **kwargs)


def _step_io(processor):
    """The inputs and outputs of the step being run: the batch processor's, or with asynchronous batching its current
    pair's host side (the pair the step was prepared in and runs on)."""
    io = processor.inputs_and_outputs
    pairs = getattr(io, "io_pairs", None)
    return io if pairs is None else pairs[io.current_pair].host_io


def _drop_graphs(processor) -> None:
    """Forget the CUDA graphs transformers captured for this batch processor (they read stacks or buffers that are
    gone, or were captured without csgmv's layers): the next step of each size captures its graph again. With
    asynchronous batching, each of its two pairs of buffers holds graphs of its own: both are dropped."""
    io = getattr(processor, "inputs_and_outputs", None)
    pairs = getattr(io, "io_pairs", None)
    holders = [io] if pairs is None else [pair.device_io for pair in pairs]
    holders = [h for h in holders if getattr(h, "graphs", None) is not None]
    if not holders:
        return
    stream = getattr(io, "compute_stream", None)
    if stream is not None:
        stream.synchronize()  # (a replay still running reads what the graphs hold)
    for holder in holders:
        holder.graphs = type(holder.graphs)()  # (the old buffer resets its graphs as it goes)


class Router:
    """One manager's requests → adapters, and the driver of its steps (see the module docstring)."""

    def __init__(self, manager, model) -> None:
        self.manager = manager
        self.model_ref = weakref.ref(model)  # the PeftModel (its state, its adapters)
        self.adapters: dict[str, str | None] = {}  # request id -> adapter name (None: the base model)
        self.rounds = 0  # admission rounds (steps) with the host tier
        self.since: dict[str, int] = {}  # waiting request id -> the round it was first a candidate in
        self.graphed = False  # whether the steps run as CUDA graphs (set when the batch processor is made)
        self.graphs_asked = False  # whether its configuration asks for graphs or compiled forwards (set when made)
        self.graph_key = None  # (route epoch, plans' generation, slots) the processor's graphs were captured under
        state = manager.__dict__
        own = {name: getattr(manager, name) for name in ("add_request", "add_requests", "_create_batch_processor")}
        state["_csgmv_router"] = self
        state["add_request"] = functools.partial(_add_request, self, own["add_request"])
        state["add_requests"] = functools.partial(_add_requests, self)
        state["_create_batch_processor"] = functools.partial(_create_batch_processor, self, own)
        processor = getattr(manager, "batch_processor", None)
        if processor is not None:
            self.wrap(processor)

    # -- requests (the caller's thread) -----------------------------------------------------------------------------

    def check(self, adapter_id) -> str | None:
        """The adapter a request asks for, checked before it is queued: ``None`` for the base model."""
        if adapter_id is None or adapter_id in BASE_NAMES:
            return None
        if not isinstance(adapter_id, str):
            raise TypeError(f"`adapter_id` must be an adapter name (str) or None, got {adapter_id!r}")
        model = self.model_ref()
        if "_csgmv" not in model.__dict__:
            raise RuntimeError("csgmv was disabled on this model: its continuous-batching manager takes no adapter_id")
        check_adapters(model, [adapter_id])
        return adapter_id

    def check_stock(self) -> None:
        """Under CUDA graphs, a request added without ``adapter_id`` runs the model's active adapter through csgmv's
        kernels (every graphed step is csgmv's): one csgmv cannot give per request is refused as it is added."""
        if not self.graphs_asked:
            return
        model = self.model_ref()
        state = None if model is None else model.__dict__.get("_csgmv")
        if state is not None:
            with state.executor.lock:
                name = stock_adapter(model, state)
            if name is not None:
                check_adapters(model, [name])

    def name_of(self, request_id: str):
        """The adapter of a scheduled request (a returned sequence's: its parent's); :data:`STOCK` for a request
        added without one."""
        try:
            return self.adapters[request_id]
        except KeyError:
            parent = request_id.split(CHILD, 1)[0]
            if parent in self.adapters:
                name = self.adapters[request_id] = self.adapters[parent]
                return name
            return STOCK

    # -- steps (the generation thread) ------------------------------------------------------------------------------

    def wrap(self, processor) -> None:
        if "_csgmv_step" in processor.__dict__:
            return
        own_step = processor._generation_step
        processor.__dict__["_csgmv_step"] = own_step
        processor.__dict__["_generation_step"] = functools.partial(_generation_step, self, processor, own_step)
        runner = getattr(processor, "model_runner", None)
        _fixed_shape_compiles(runner)
        self.graphed = GRAPHED_ON_CPU or _graphs_on(processor)
        if self.graphed and runner is not None and hasattr(runner, "compute_batch"):
            # transformers' warmup captures graphs of steps without requests, outside a step: csgmv's layers must be
            # in them (every later step of their size replays them)
            own = runner.compute_batch
            runner.__dict__["compute_batch"] = functools.partial(_compute_batch, self, processor, own)
        scheduler = getattr(processor, "scheduler", None)
        finish = getattr(scheduler, "finish_request", None)
        if finish is not None:
            scheduler.__dict__["finish_request"] = functools.partial(_finish_request, self, finish)
        cancelled = getattr(scheduler, "clear_cancelled_requests", None)
        if cancelled is not None:
            scheduler.__dict__["clear_cancelled_requests"] = functools.partial(_clear_cancelled, self, cancelled)
        waiting = getattr(scheduler, "_get_waiting_candidates", None)
        if waiting is not None:
            scheduler.__dict__["_get_waiting_candidates"] = functools.partial(
                _waiting, self, processor, scheduler, waiting
            )

    def admit(self, scheduler, candidates: list, processor=None) -> list:
        """With the host tier (``max_resident_adapters=N``): the waiting requests a step may start, so that the
        adapters of the running requests and of those it starts are at most N (a step needs all of its adapters in
        slots at once); the others wait for running requests to finish. The order (transformers' scheduler gives the
        step's token budget in it): first the requests that need no adapter brought in (the base model, an adapter
        that holds a slot) and those that have waited :data:`PATIENCE` rounds, then the others, each group in its
        arrival order. A request whose adapter does not fit holds no place, and its adapter is the next admitted as
        soon as one fits.

        On a GPU, while requests run, a waiting request whose adapter is not in a slot does not start: its adapter is
        brought in ahead (:meth:`~peft_csgmv.sync.CsgmvState.bring_in_ahead`, copied on a stream of its own beside
        the running steps, into slots the running requests do not use), and the request starts in a later step, once
        the copy is done (or once it has waited :data:`PATIENCE` rounds: that step then waits for the copy on the
        device). With nothing running, such a request starts at once and its step brings its adapter in."""
        model = self.model_ref()
        state = None if model is None else model.__dict__.get("_csgmv")
        if state is None or state.max_resident is None:
            return candidates
        stock = None

        def name(request_id):
            nonlocal stock
            found = self.name_of(request_id)
            if found is STOCK:
                stock = stock_adapter(model, state) if stock is None else stock
                return stock
            return found

        running = list(scheduler.active_requests)
        allowed = {name(rid) for rid in running} - {None}
        with state.executor.lock:  # (another thread's call may be moving adapters)
            resident = {n for n in state.registry.index if state.tier.ready(n)}
            arriving = set(state.tier.ahead) - resident  # (brought in ahead, copies still on their way)
        ahead = AHEAD_ON_CPU or any(device.type == "cuda" for device in state.devices)
        self.rounds += 1
        first, later = [], []
        for candidate in candidates:
            adapter = name(candidate.request_id)
            waited = self.rounds - self.since.setdefault(candidate.request_id, self.rounds)
            ready = adapter is None or adapter in allowed or adapter in resident or waited >= PATIENCE
            (first if ready else later).append((candidate, adapter))
        admitted, wanted = [], []
        late = {id(candidate) for candidate, _ in later}
        for candidate, adapter in first + later:
            if adapter is not None and adapter not in allowed:
                if ahead and adapter not in resident and (running or admitted) and id(candidate) in late:
                    wanted.append(adapter)  # (it starts once its adapter is in: brought in ahead below)
                    continue
                if len(allowed) >= state.max_resident:
                    continue
                allowed.add(adapter)
            admitted.append(candidate)
        room = state.max_resident - len(allowed | arriving)
        wanted = [a for a in dict.fromkeys(wanted) if a not in arriving][: max(0, room)]
        if wanted:
            with state.executor.lock, on_stream(compute_stream(processor)):
                state.bring_in_ahead(wanted, keep=allowed | arriving)
        return admitted

    def step(self, processor, own_step, model) -> None:
        """One step: its mapping filled and opened, the step run, the mapping closed (under the model's lock)."""
        peft_model = self.model_ref()
        state = None if peft_model is None else peft_model.__dict__.get("_csgmv")
        io = _step_io(processor)
        scheduled = list(io.requests_in_batch)
        names = [self.name_of(fs.state.request_id) for fs in scheduled]
        graphed = self.graphed and state is not None
        if state is None and self.graph_key is not None:
            _drop_graphs(processor)  # (captured with csgmv's layers, which are gone)
            self.graph_key = None
        if not graphed and all(name is STOCK for name in names):
            # No request with an adapter given: stock PEFT's step, its active adapter. (Graphed, every step is
            # csgmv's: a graph captured here would be replayed by steps with adapters, and the other way round.)
            return own_step(model)
        if state is None:  # (never the active adapter in place of a request's own)
            raise RuntimeError("csgmv was disabled on this model while requests given an adapter_id were running")
        pad_to = io.num_q_tokens if graphed else None
        self.run_in_step(processor, peft_model, state, scheduled, names, pad_to, functools.partial(own_step, model))

    def run_in_step(self, processor, peft_model, state, scheduled, names, pad_to: int | None, run):
        """Under the model's call lock: the step's mapping filled and opened (:func:`open_step`; ``pad_to``: a graphed
        step's padded size, its stale graphs dropped), ``run()``, the mapping closed; what ``run`` returns."""
        with state.executor.lock:
            if STOCK in names:  # (beside requests with an adapter given: the model's active adapter, as PEFT's)
                active = stock_adapter(peft_model, state)
                names = [active if name is STOCK else name for name in names]
            # (on the step's compute stream: the plans' uploads and the adapters' copies in come before its kernels
            # in stream order, and wait for what they must, where the default stream would race them)
            with on_stream(compute_stream(processor)):
                open_step(peft_model, state, scheduled, names, pad_to)
                if pad_to is not None:
                    self.fresh_graphs(processor, state)
            executor = state.executor
            try:
                out = run()
            except BaseException:
                executor.end(failed=True)
                raise
            executor.end()
            if getattr(processor, "use_async_batching", False):
                # (the step's kernels may still run while the next step is prepared)
                executor.leave_in_flight(compute_stream(processor))
            return out

    def fresh_graphs(self, processor, state) -> None:
        """Graphs captured under other stacks or plans than the step's (a restack, a backend switched, the plans
        cleared; or none of csgmv's yet) are dropped before the step: transformers captures them again."""
        key = (_slots.ROUTE_EPOCH, state.executor.plans.generation, graph_slots(state))
        if key != self.graph_key:
            _drop_graphs(processor)
            self.graph_key = key


def check_adapters(model, names) -> None:
    """Raise the first :func:`refusal` among ``names`` (adapter names; base names and ``None`` pass), after a sync,
    under the model's call lock: before any request is queued."""
    state = model._csgmv
    with state.executor.lock:
        state.sync(model)
        for name in dict.fromkeys(n for n in names if n is not None and n not in BASE_NAMES):
            why = refusal(model, state, name)
            if why is not None:
                raise ValueError(why)


def stock_adapter(model, state) -> str | None:
    """The adapter a request added without one runs (stock PEFT's step: the active adapter; ``None`` under
    ``disable_adapter()``)."""
    if not model.has_active_enabled_adapter:
        return None
    active = [name for name in model.active_adapters if name in model.peft_config]
    if len(active) != 1:
        raise ValueError(
            f"requests without adapter_id run the model's active adapter, and {len(active)} are active: give each "
            "request its adapter_id"
        )
    return active[0]


def refusal(model, state, name: str) -> str | None:
    """Why adapter ``name`` cannot be given to a request of a packed step (``None``: it can); decided once per name
    after each sync that changed something (``state.refusals``)."""
    try:
        return state.refusals[name]
    except KeyError:
        why = state.refusals[name] = _refusal(model, state, name)
        return why


def _refusal(model, state, name: str) -> str | None:
    if state.peft_only is not None:
        return f"per-request adapters need LoRA adapters on the kernels ({state.peft_only})"
    if name not in state.known:
        known = ", ".join(sorted(state.known)) or "(none)"
        return f"Trying to infer with non-existing adapter(s): {name}. Loaded adapters: {known}; use None for the base."
    if name in state.dora_refused:
        return PEFT_DORA_ERROR.format(arg="adapter_id")
    if name in state.alora:
        return f"adapter {name!r} is an aLoRA adapter: it cannot be given per request under continuous batching"
    peft_path = [n for n, m in state.peft_path.items() if name in m._csgmv_record.adapters]
    peft_path += [n for n, layer in state.layers.items() if name in (layer._csgmv_record.peft_rows or ())]
    peft_path += [n for n, wrapper in state.experts.items() if name in wrapper._csgmv_record.peft_rows]
    if peft_path:
        return (
            f"adapter {name!r} runs PEFT's own path in {', '.join(peft_path[:4])}: it cannot be given per request "
            "under continuous batching (PEFT's mixed-batch path is per row)"
        )
    head = model.get_base_model().get_output_embeddings()
    if head is not None and name in getattr(head, "lora_A", {}):
        return f"adapter {name!r} has LoRA on the output embedding: it cannot be given per request yet"
    return None


@outside_inference_mode
def open_step(model, state, scheduled: Sequence, names: list, pad_to: int | None = None) -> None:
    """Fill the step's mapping (its adapters made resident first) and open it on the executor, its plan prepared.
    ``pad_to``: a step transformers runs as a CUDA graph, of this many tokens (its requests' and padding, base tokens):
    its mapping is :attr:`~peft_csgmv.mapping.Mapping.graphed`."""
    state.sync(model)
    for name in dict.fromkeys(n for n in names if n is not None):
        why = refusal(model, state, name)  # (an adapter deleted or changed while its requests waited)
        if why is not None:
            raise ValueError(why)
    out: list = []
    slots = state.slots_for([BASE if n is None else n for n in names], out)
    tokens: list[int] = []
    for fs, slot in zip(scheduled, slots):
        tokens += [slot] * fs.query_length
    if pad_to is not None and pad_to > len(tokens):
        tokens += [-1] * (pad_to - len(tokens))
    state.restack_rescaled()
    state.follow_weights()
    executor = state.executor
    mapping = Mapping(
        row_slots=(),
        names=tuple(BASE if n is None else n for n in names),
        arg_name="adapter_id",
        copies_out=out,
        token_slots=tuple(tokens),
        graphed=pad_to is not None,
        graph_slots=graph_slots(state),
    )
    executor.begin(mapping)
    try:
        for device in state.devices:
            mapping.prepare(1, len(tokens), device)
        if mapping.graphed:
            mapping.prepare_groups()
    except BaseException:
        executor.end(failed=True)
        raise


def _add_request(router: Router, own, input_ids, request_id: str | None = None, *args, adapter_id=STOCK, **kwargs):
    if adapter_id is STOCK:
        router.check_stock()
        return own(input_ids, request_id, *args, **kwargs)
    name = router.check(adapter_id)
    if request_id is None:
        manager = router.manager
        with manager._request_lock:
            request_id = f"req_{manager._request_counter}"
            manager._request_counter += 1
    router.adapters[request_id] = name  # (before the request is queued: a step may schedule it at once)
    try:
        out = own(input_ids, request_id, *args, **kwargs)
    except BaseException:
        router.adapters.pop(request_id, None)
        raise
    if out is None:  # (not queued: the manager refused it)
        router.adapters.pop(request_id, None)
    return out


def _add_requests(
    router: Router,
    inputs: list,
    max_new_tokens: int | None = None,
    streaming: bool = False,
    record_timestamps: bool = False,
    adapter_ids: Sequence[str | None] | None = None,
    **kwargs: Any,
) -> list[str]:
    """transformers' ``add_requests`` (ids ``req_<n>`` in input order; inputs queued sorted by prompt where the cache
    shares prefixes), each input with its adapter (``adapter_ids``, or those ``generate_batch`` was given)."""
    manager = router.manager
    if adapter_ids is None:  # (generate_batch's, for the add_requests it makes on this thread)
        model = router.model_ref()
        state = None if model is None else model.__dict__.get("_csgmv")
        adapter_ids = None if state is None else state.batch_ids.pop(threading.get_ident(), None)
    if adapter_ids is not None and len(adapter_ids) != len(inputs):
        raise ValueError(f"`adapter_ids` has {len(adapter_ids)} entries for {len(inputs)} inputs")
    names = [STOCK] * len(inputs) if adapter_ids is None else [router.check(a) for a in adapter_ids]
    if adapter_ids is None:
        router.check_stock()
    with manager._request_lock:
        start = manager._request_counter
        manager._request_counter += len(inputs)
    request_ids = [f"req_{i}" for i in range(start, start + len(inputs))]
    order = list(range(len(inputs)))
    if getattr(manager, "_use_prefix_sharing", False):
        order.sort(key=lambda i: inputs[i], reverse=True)
    eos = manager.generation_config.eos_token_id
    eos = manager.model.config.eos_token_id if eos is None else eos
    eos = -1 if eos is None else eos
    for i in order:
        manager.add_request(
            input_ids=inputs[i],
            request_id=request_ids[i],
            max_new_tokens=max_new_tokens,
            streaming=streaming,
            record_timestamps=record_timestamps,
            eos_token_id=eos,
            adapter_id=names[i],
            **kwargs,
        )
    return request_ids


def _create_batch_processor(router: Router, own: dict):
    processor = own["_create_batch_processor"]()
    router.wrap(processor)
    return processor


def _generation_step(router: Router, processor, own_step, model) -> None:
    router.step(processor, own_step, model)


def _compute_batch(router: Router, processor, own, model, batch_data, *args, **kwargs):
    """The batch processor's forward (graphed steps): inside a step as it is; outside one (transformers' warmup,
    which captures graphs of steps without requests) inside a step of base tokens, so that csgmv's layers are in the
    graphs it captures."""
    peft_model = router.model_ref()
    state = None if peft_model is None else peft_model.__dict__.get("_csgmv")
    executor = None if state is None else state.executor
    if executor is None or (executor.active and executor.owner == threading.get_ident()):
        return own(model, batch_data, *args, **kwargs)
    num_tokens = batch_data["input_ids"].shape[-1]
    run = functools.partial(own, model, batch_data, *args, **kwargs)
    return router.run_in_step(processor, peft_model, state, [], [], num_tokens, run)


def _waiting(router: Router, processor, scheduler, own):
    return router.admit(scheduler, own(), processor)


def compute_stream(processor):
    """The stream transformers runs a step's forward on (its batch processor's compute stream: a stream of its own
    on CUDA, not ordered with the default stream), or ``None``."""
    return getattr(getattr(processor, "inputs_and_outputs", None), "compute_stream", None)


def _clear_cancelled(router: Router, own, *args, **kwargs):
    states = own(*args, **kwargs)
    for state in states or ():
        router.adapters.pop(state.request_id, None)
        router.since.pop(state.request_id, None)
    return states


def _finish_request(router: Router, own, request_id, *args, **kwargs):
    out = own(request_id, *args, **kwargs)
    router.adapters.pop(request_id, None)
    router.since.pop(request_id, None)
    return out


# -- the model's methods --------------------------------------------------------------------------------------------


def init_continuous_batching(base_model, *args, **kwargs):
    """The base model's ``init_continuous_batching`` on an enabled model: transformers' manager, with CUDA graphs only
    where asked for, whose requests take an adapter (:class:`Router`)."""
    own = type(base_model).init_continuous_batching.__get__(base_model)
    ref = base_model.__dict__.get("_csgmv_peft_model")
    model = None if ref is None else ref()
    if model is None or "_csgmv" not in model.__dict__ or not continuous_batching_available():
        return own(*args, **kwargs)  # (an older transformers' continuous batching: stock, without adapters)
    names = ("generation_config", "continuous_batching_config", "workload_hints")
    bound = dict(zip(names, args))
    bound.update(kwargs)
    given = bound.get("continuous_batching_config")
    asked = _asks_graphs(given)  # (None: transformers' defaults, which ask for none)
    # A model off CUDA has no graph to capture: graphs off there (transformers 5.17 captured empty ones for a model on
    # the CPU of a CUDA machine, and replayed them).
    on_cuda = _on_cuda(base_model)
    if asked and on_cuda:
        why = _graphs_refusal(model._csgmv)
        if why is not None:
            raise ValueError(f"csgmv cannot run continuous batching with CUDA graphs here: {why}")
    compiled = _asks_compile(given)
    if compiled and model._csgmv.offloaded:
        # (compiled code reads each layer's stack where it lives, an offloaded one in host memory: its layers would
        # run PEFT's path, which serves a packed step no adapter)
        raise ValueError(
            "csgmv cannot run continuous batching with compiled forwards here: layers offloaded by accelerate move "
            "their weights on every forward, which compiled code does not follow"
        )
    bound["continuous_batching_config"] = _eager_config(given, graphs=on_cuda)
    manager = own(**bound)
    router = manager.__dict__.get("_csgmv_router") or Router(manager, model)
    router.graphs_asked = (asked and (on_cuda or GRAPHED_ON_CPU)) or compiled
    return manager


def generate_batch(model, inputs, generation_config=None, *args, adapter_ids: Sequence[str | None] | None = None, **kw):
    """transformers' ``generate_batch`` on the base model, input ``i`` with adapter ``adapter_ids[i]``."""
    base = model.get_base_model()
    if adapter_ids is None:
        return base.generate_batch(inputs, generation_config, *args, **kw)
    _require()
    if isinstance(adapter_ids, str) or not isinstance(adapter_ids, (list, tuple)):
        raise TypeError(f"Got adapter_ids of type {type(adapter_ids)}, expected a list of str.")
    if len(adapter_ids) != len(inputs):
        raise ValueError(f"`adapter_ids` has {len(adapter_ids)} entries for {len(inputs)} inputs")
    state = model._csgmv
    check_adapters(model, adapter_ids)
    thread = threading.get_ident()
    state.batch_ids[thread] = list(adapter_ids)
    try:
        return base.generate_batch(inputs, generation_config, *args, **kw)
    finally:
        state.batch_ids.pop(thread, None)


def patch_base_model(model) -> None:
    """Give ``model``'s base model csgmv's ``init_continuous_batching`` (on the instance, through a weak reference:
    no cycle; :func:`unpatch_base_model` undoes it), where this transformers has continuous batching."""
    base = model.get_base_model()
    if not hasattr(type(base), "init_continuous_batching") or "init_continuous_batching" in base.__dict__:
        return
    base.__dict__["_csgmv_peft_model"] = weakref.ref(model)
    base.__dict__["init_continuous_batching"] = WeakMethod(init_continuous_batching, base)


def unpatch_base_model(model) -> None:
    base = model.get_base_model()
    patched = base.__dict__.get("init_continuous_batching")
    if getattr(patched, "__func__", None) is init_continuous_batching:
        del base.__dict__["init_continuous_batching"]
    base.__dict__.pop("_csgmv_peft_model", None)
