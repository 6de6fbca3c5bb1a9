"""The call: one ``forward`` / ``generate`` of an enabled model, from its ids to its end.

:func:`run` is what the model's ``forward`` and ``generate`` do: take the model's call lock (calls from several threads
run one at a time, each with its own ids), open the call (:func:`open_call`: sync the adapters, :func:`validate` the
whole call before anything moves, compute PEFT's aLoRA offsets, make the adapters resident, and hand the executor the
call's mapping of rows to slots), run PEFT's own method, and close the call whatever happens. A call without ids is
stock PEFT's, under the same lock.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
from transformers import GenerationConfig

from ._compat import deferred_stop_check
from .eager_ahead import compile_ahead_eager, kernel_stacks
from .executor import Executor
from .mapping import Mapping
from .sync import BASE, BASE_NAMES, PEFT_DORA_ERROR, CsgmvState, adapters_in, outside_inference_mode
from .tier import wait_for_copies


def _check_ids(ids, arg: str) -> None:
    if isinstance(ids, str) or not isinstance(ids, (list, tuple)):
        raise TypeError(f"Got {arg} of type {type(ids)}, expected a list of str.")
    bad = [i for i in ids if i is not None and not isinstance(i, str)]
    if bad:
        raise TypeError(f"`{arg}` must hold adapter names (str) or None for base rows; got {bad[0]!r}")
    if len(ids) == 0:
        raise ValueError(f"`{arg}` is empty; give one adapter name (or None / '__base__') per input row")


def validate(
    state: CsgmvState, model, ids: Sequence[str | None], arg: str, args: tuple, kwargs: dict, generate: bool = False
) -> None:
    """Validate ``ids`` for a call with these inputs, after :meth:`sync`; raises before anything runs or moves. The
    checks and messages are PEFT's (``adapter_names`` reads as ``arg``). PEFT's spelling takes PEFT's length rule:
    one name per input row (``generate`` repeats them for beams, as PEFT does, and refuses returned sequences
    without beams, as PEFT's layers do); ``adapter_ids`` may also have a length that divides the batch, each id
    then covering that many consecutive rows."""
    _check_ids(ids, arg)
    batch_size = _check_inputs(args, kwargs, arg)
    if model.training:
        raise ValueError(f"Cannot pass `{arg}` when the model is in training mode.")
    unknown = {i for i in ids if i not in BASE_NAMES and i not in state.known}
    if unknown:
        raise ValueError(
            f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}. "
            f"Loaded adapters: {', '.join(sorted(state.known)) or '(none)'}; use None or '__base__' for base rows."
        )
    rows = batch_size
    if arg == "adapter_names" and generate and batch_size == len(ids):
        beams = _generation_setting(model, args, kwargs, "num_beams") or 1
        returned = _generation_setting(model, args, kwargs, "num_return_sequences") or 1
        if beams <= 1 and returned > 1:  # (PEFT repeats names for beams only; its layers then see more rows)
            rows = batch_size * returned
    if rows is not None and (rows % len(ids) != 0 or (arg == "adapter_names" and rows != len(ids))):
        raise ValueError(
            f"Length of `{arg}` should be the same as the number of inputs, but got {len(ids)} and {rows} respectively."
        )
    if any(
        getattr(m, "merged", False)
        for m in (*state.layers.values(), *state.peft_path.values(), *state.experts.values())
    ):
        raise ValueError(f"Cannot pass `{arg}` when there are merged adapters, please call `unmerge_adapter` first.")
    if not state.dora_refused.isdisjoint(ids):
        raise ValueError(PEFT_DORA_ERROR.format(arg=arg))
    state._check_residency(adapters_in(ids), arg)


_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "decoder_input_ids")


def _main_input(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, bool]:
    """The call's batched input and whether it holds tokens (ids or embeddings: dim 1 is the sequence)."""
    for key in _TOKEN_INPUTS:
        value = kwargs.get(key)
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return value, True
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1:
        return args[0], not args[0].dtype.is_floating_point
    return None, False


def _check_inputs(args: tuple, kwargs: dict, arg: str) -> int | None:
    """The batch size of the call (``None`` when it has no batched tensor input); refuses an empty batch or sequence
    before anything runs."""
    value, tokens = _main_input(args, kwargs)
    if value is None:
        return None
    if value.shape[0] == 0:
        raise ValueError(f"`{arg}` was given with an input of 0 rows; pass at least one row")
    if tokens and value.dim() >= 2 and value.shape[1] == 0:
        raise ValueError(f"`{arg}` was given with inputs of 0 tokens per row; pass at least one token per row")
    return value.shape[0]


def _pop_ids(kwargs: dict) -> tuple[Sequence[str | None] | None, str]:
    ids = kwargs.pop("adapter_ids", None)
    names = kwargs.pop("adapter_names", None)
    if ids is not None and names is not None:
        raise ValueError("Pass either `adapter_ids` or `adapter_names`, not both.")
    if names is not None:
        return names, "adapter_names"
    return ids, "adapter_ids"


def _alora_offsets(model, names: tuple[str, ...], args: tuple, kwargs: dict, generate: bool):
    """The aLoRA offsets PEFT computes for this call (``PeftModelForCausalLM`` does, when an aLoRA adapter is in the
    batch), or the ones the caller passed; ``None`` when there are none. PEFT's own helpers, so the offsets are
    PEFT's."""
    offsets = kwargs.pop("alora_offsets", None)
    if offsets is not None:
        return offsets
    from peft import PeftModelForCausalLM

    if not isinstance(model, PeftModelForCausalLM):
        return None
    try:
        from peft.tuners.lora.variants import get_alora_offsets_for_forward, get_alora_offsets_for_generate
    except ImportError:  # a PEFT without aLoRA
        return None
    kw = dict(kwargs, adapter_names=list(names))
    if generate:
        kw = get_alora_offsets_for_generate(model, *args, **kw)
    else:
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        kw.pop("input_ids", None)
        inputs_embeds = kw.pop("inputs_embeds", None)
        kw = get_alora_offsets_for_forward(model, input_ids, inputs_embeds, **kw)
    offsets = kw.get("alora_offsets")
    if offsets is not None and generate and isinstance(kwargs.get("num_beams"), int) and kwargs["num_beams"] > 1:
        raise ValueError("Beam search not yet supported for aLoRA.")
    return offsets


def _row_keep(state: CsgmvState, names: tuple[str, ...], offsets, arg: str) -> tuple[int | None, ...] | None:
    """Per row of a call: ``None`` where its adapter applies to every token, else how many of its last tokens it
    applies to: an aLoRA adapter's rows, from PEFT's offsets (0 where PEFT found no invocation, or computed none: PEFT
    then runs those rows as base rows). ``None`` when the call has no aLoRA row (one set check: the aLoRA adapters are
    known since the last sync)."""
    if state.alora.isdisjoint(names):
        return None
    alora = [name in state.alora for name in names]
    if offsets is not None and len(offsets) != len(names):
        raise ValueError(f"`alora_offsets` holds {len(offsets)} entries for the {len(names)} entries of `{arg}`")
    return tuple(
        (0 if offsets is None or offsets[i] is None else int(offsets[i])) if is_alora else None
        for i, is_alora in enumerate(alora)
    )


@torch.compiler.disable
@outside_inference_mode
def open_call(model, args: tuple, kwargs: dict, generate: bool) -> Executor | None:
    """Validate the ids of one call (popped from ``kwargs``) and open it on the model's executor, which the caller
    closes with :func:`_close_call` whatever happens; ``None`` when the call has no ids for the kernels (no ids, under
    ``disable_adapter()``, or a model PEFT's path serves whole: then ``kwargs`` carries PEFT's ``adapter_names``).
    Host work: never traced by torch.compile."""
    state: CsgmvState = model._csgmv
    ids, arg = _pop_ids(kwargs)
    if ids is None or not model.has_active_enabled_adapter:
        # No ids, or under ``disable_adapter()``: PEFT ignores adapter_names there, and so do we. With the host tier,
        # PEFT's own forward needs the active adapters' weights on the device.
        if state.max_resident is not None and model.has_active_enabled_adapter:
            state.sync(model)
            active = [n for n in model.active_adapters if n in model.peft_config]
            state._check_residency(active, "active adapters")
            wait_for_copies(state.make_resident(active))
        return None
    state.sync(model)
    if state.peft_only is not None:
        # Nothing for the kernels: PEFT's own path, whole (its results, its errors).
        kwargs["adapter_names"] = (
            [BASE if i is None else i for i in ids] if isinstance(ids, (list, tuple)) and arg == "adapter_ids" else ids
        )
        return None
    validate(state, model, ids, arg, args, kwargs, generate)
    names = tuple(BASE if i in BASE_NAMES else i for i in ids)
    offsets = _alora_offsets(model, names, args, kwargs, generate)  # may raise PEFT's own error: before any move
    keep = _row_keep(state, names, offsets, arg)
    out: list = []
    row_slots = state.slots_for(ids, out)
    try:
        state.restack_rescaled()
        state.follow_weights()
        executor = state.executor
        executor.check_groups()
        mapping = Mapping(
            row_slots=row_slots, names=names, arg_name=arg, alora_offsets=offsets, row_keep=keep, copies_out=out
        )
        executor.begin(mapping)
    except BaseException:
        wait_for_copies(out)
        raise
    try:
        prepare_plans(model, executor, mapping, args, kwargs, generate)
    except BaseException:
        executor.end(failed=True)
        raise
    return executor


def step_shapes(model, args: tuple, kwargs: dict, generate: bool) -> list[tuple[int, int]]:
    """The layer inputs (rows × tokens per row) a call's steps will have, as far as its arguments tell: a
    ``forward`` of a ``rows × tokens`` input, its last layer on ``logits_to_keep`` tokens; a ``generate``'s prefill
    and decode steps on its rows repeated for beams or returned sequences (as transformers expands them), its prefill's
    last layer on one token. Other shapes (a model that reshapes its activations its own way, assisted decoding,
    chunked prefill) are prepared when a layer first reads them (:meth:`Mapping.plan`)."""
    value, tokens = _main_input(args, kwargs)
    if value is None:
        return []
    rows = value.shape[0]
    length = value.shape[1] if tokens and value.dim() >= 2 else 1
    if not generate:
        keep = kwargs.get("logits_to_keep")
        shapes = [(rows, length)]
        if isinstance(keep, int) and 0 < keep < length:
            shapes.append((rows, keep))
        return shapes
    beams = _generation_setting(model, args, kwargs, "num_beams") or 1
    returned = _generation_setting(model, args, kwargs, "num_return_sequences") or 1
    rows *= beams if beams > 1 else returned
    return [(rows, length), (rows, 1)]


def prepare_plans(model, executor: Executor, mapping: Mapping, args: tuple, kwargs: dict, generate: bool) -> None:
    """The driver's work before a call's layers run: the plan of each of its steps' shapes (:func:`step_shapes`) on
    every device the stacks are on, and, on CUDA with the Triton kernels, a new plan's kernel variants compiled ahead
    side by side (:func:`~peft_csgmv.eager_ahead.compile_ahead_eager`, with the model's activation dtype)."""
    state: CsgmvState = model._csgmv
    shapes = [s for s in step_shapes(model, args, kwargs, generate) if s[0] % len(mapping.row_slots) == 0]
    for device in state.devices:
        for rows, tokens_per_row in shapes:
            run = mapping.prepare(rows, tokens_per_row, device)
            if not run.ahead and not run.plan.is_empty:
                run.ahead = True
                if executor.triton_on(device):
                    dtype = getattr(model.get_base_model(), "dtype", torch.float32)
                    compile_ahead_eager(kernel_stacks(executor, state.layers.values(), device), run.plan, dtype, device)


@torch.compiler.disable
def _close_call(executor: Executor, failed: bool = False) -> None:
    executor.end(failed)


@contextlib.contextmanager
def _closing(executor: Executor) -> Iterator[None]:
    """Close the call opened on ``executor`` when the block ends (as failed, where the block raised)."""
    try:
        yield
    except BaseException:
        _close_call(executor, failed=True)
        raise
    _close_call(executor)


def _defers_stop_check(model, args: tuple, kwargs: dict) -> bool:
    """Whether this ``generate`` call with ids reads transformers' stop flag one step late (``enable_csgmv``'s
    ``defer_stop_check``: by default for calls that do not sample, whose results and random state stay exactly
    transformers'; ``True`` for sampling calls too). Whether it samples: its ``do_sample``, else that of the
    generation config it passes (by keyword or by position), else the model's."""
    policy = model._csgmv.defer_stop_check
    if policy is not None:
        return policy
    return not _generation_setting(model, args, kwargs, "do_sample")


def _generation_setting(model, args: tuple, kwargs: dict, name: str):
    """A ``generate`` call's setting ``name``: its keyword, else that of the generation config it passes (by keyword
    or by position), else the model's (``None`` where none says)."""
    if name in kwargs:
        return kwargs[name]
    config = kwargs.get("generation_config")
    if config is None:
        config = next((a for a in args if isinstance(a, GenerationConfig)), None)
    if config is None:
        config = getattr(model.get_base_model(), "generation_config", None)
    return getattr(config, name, None)


@torch.compiler.disable
def _acquire(model) -> threading.RLock:
    """Take the model's call lock (see :attr:`~peft_csgmv.executor.Executor.lock`): a call from another thread waits
    here until the call in progress has ended. Re-entrant: a model called again inside a call, on its thread."""
    lock = model._csgmv.executor.lock
    lock.acquire()
    return lock


@torch.compiler.disable
def _release(lock: threading.RLock) -> None:
    lock.release()


def run(model, method, args: tuple, kwargs: dict, generate: bool):
    # Every call, with ids or not, holds the model's lock to its end: the layers read the call in progress from the
    # model's state, so calls from several threads run one at a time, each with its own ids.
    lock = _acquire(model)
    try:
        executor = open_call(model, args, kwargs, generate)
        if executor is None:
            return method(model, *args, **kwargs)
        kept = model._csgmv.static_cache if generate else None
        defer = generate and _defers_stop_check(model, args, kwargs)
        with _closing(executor):
            with torch.no_grad(), kept.lend(model.get_base_model()) if kept is not None else contextlib.nullcontext():
                with deferred_stop_check(defer):
                    out = method(model, *args, **kwargs)
            if kept is not None:
                kept.returned(out)
        return out
    finally:
        _release(lock)


@contextlib.contextmanager
def adapter_ids_scope(model, adapter_ids: Sequence[str | None]) -> Iterator[None]:
    """Apply ``adapter_ids`` to every patched layer called inside the block, as a call of the model with those ids
    does (validated the same way; for calling layers directly: benchmarks, tests, a compiled layer). The block holds
    the model's call lock: another thread's call waits until it ends."""
    with model._csgmv.executor.lock:
        executor = open_call(model, (), {"adapter_ids": adapter_ids}, generate=False)
        with _closing(executor) if executor is not None else contextlib.nullcontext():
            yield
