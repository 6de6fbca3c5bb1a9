"""Batch generation over a JSONL file of prompts, each with its own adapter (``peft-csgmv generate``).

Input: one JSON object per line, ``{"prompt": "...", "adapter": "legal", "id": 17}``; ``adapter`` absent, null or
``"__base__"`` means the base model; ``id`` is optional and echoed; ``max_new_tokens`` (optional, a positive integer)
is the line's own limit of new tokens in place of the run's (a static batch decodes until its largest, on the static
cache until the next power of two, and cuts each row's completion to its own); blank lines are skipped.

Output: one JSON object per non-blank input line, ``{"line": 3, "id": 17, "adapter": "legal", "completion": "...",
"new_tokens": 42, "input_sha1": "...", "settings_sha1": "..."}``, or ``{"line": 5, "error": "...", "input_sha1":
"..."}`` for a bad line under ``--on-error skip``. ``input_sha1`` is the SHA-1 of the line's request, its prompt and
its adapter, and its own ``max_new_tokens`` where it gives one (:func:`identity.request_sha1`; for a bad line, of the
line's text); ``settings_sha1`` that of the run
settings it was made with (:class:`identity.RunSettings`: base model, dtypes, decoding options, its adapter's files).
``line`` (and ``id``) say where the request sits in the input as it is now: they are rewritten when lines move, and
play no part in resuming. Beside the output, ``OUTPUT.settings.json`` holds the run's settings (identity.py says
why a file of its own).

Batching: by default every row is a request of one continuous-batching manager (transformers' continuous batching,
:func:`generate_rows` with ``continuous=``), each with its row's adapter: each step packs prefill chunks and decode
tokens of many requests and adapters, and requests join as others finish. Static batches (``continuous=None``) are
padded batches of rows of similar prompt length through ``generate()``. Both write the same records; greedy
completions are the same either way (fp32; in half precision rounding can part near ties, as a batch size can).

Order: during a run, each record is appended and flushed as soon as its request finishes (with static batches, batch
by batch; not input order either way; each line of the file is always a complete record). When the run completes,
the file is rewritten in input order. An interrupted run leaves the records of what finished.

Several processes (``accelerate launch --num_processes N -m peft_csgmv generate ...``, or ``torchrun``): every
process reads the input and the output, the first one consolidates what earlier runs left, then each takes every N-th
line still to do and appends its records to its own part file beside the output (``OUTPUT.part-R-of-N``); when all
are done the first one merges the parts into the output, in input order, and removes them. An interrupted run leaves
its parts; the next run, with any number of processes, counts their records as done.

Resuming goes by content (:func:`match_records`). A line is done when the output (or a part file) holds a completion
record with its request's ``input_sha1``, wherever the line sat when the record was written: inserted, deleted, moved
and blank lines shift nothing. Every other line is generated: new lines, edited lines (a record whose request is in
no line any more is dropped) and lines that have an error record (error records are retried on every run). The same
request on k lines needs k records: a record stays with the line it was written for while that line holds the same
request, the others go, in file order, to the remaining lines of that request in input order; records beyond k are
dropped. An output that holds completion records but none for this input belongs to another input: it is refused
(``OutputMismatch``) unless ``overwrite`` is given, which starts it afresh. So is an output with completion records
made with other settings than this run's (the message names what differs, from the settings file), and one whose
completion records carry no ``settings_sha1`` (an earlier format: which settings made them is unknown). Records of an
adapter this run does not load are not checked: no good line of this run can ask for them, so they are dropped. A
torn last line (an interrupted write) is cut off; an output whose lines are not result records is refused.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import glob
import hashlib
import inspect
import json
import math
import os
import tempfile
import time
from typing import Any, Callable, Iterable

import torch

from ._compat import transformers_model
from .attention import varlen_attention
from .identity import BASE, RunSettings, read_settings, request_sha1, settings_path, write_settings


@dataclasses.dataclass
class Row:
    line: int  # 1-based line number in the input
    prompt: str
    adapter: str | None
    id: Any = None
    has_id: bool = False
    sha1: str = ""  # fingerprint of the request: identity.request_sha1(prompt, adapter, max_new_tokens)
    max_new_tokens: int | None = None  # the line's own "max_new_tokens" (None: the run's --max-new-tokens)


MAX_NEW_TOKENS_KEY = "max_new_tokens"  # an input line's own limit of new tokens


class InputError(ValueError):
    """Bad input lines; ``errors`` holds ``(line, message)`` pairs."""

    def __init__(self, errors: list[tuple[int, str]]):
        self.errors = errors
        shown = "\n".join(f"  line {n}: {msg}" for n, msg in errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        super().__init__(f"{len(errors)} bad input line(s):\n{shown}{more}")


class OutputMismatch(ValueError):
    """The output file holds another input's results, or is not a peft-csgmv output at all."""


def fingerprint(text: str | bytes) -> str:
    """SHA-1 (hex) of an input line's text, surrounding whitespace stripped (a bad line's ``input_sha1``; a good
    line's is its request's, :func:`identity.request_sha1`)."""
    if isinstance(text, str):
        text = text.encode("utf-8")
    return hashlib.sha1(text.strip()).hexdigest()


@dataclasses.dataclass
class InputFile:
    """A parsed input: good rows, bad lines as ``(line, message)``, and every non-blank line's fingerprint (its
    request's for a good line, its text's for a bad one)."""

    rows: list[Row]
    errors: list[tuple[int, str]]
    sha1: dict[int, str]

    @property
    def lines(self) -> int:
        """Non-blank lines."""
        return len(self.sha1)


def read_input(
    path: str, adapters: Iterable[str], prompt_key: str = "prompt", adapter_key: str = "adapter"
) -> InputFile:
    """Parse the input file (see the module docstring). Blank lines are skipped; every other line becomes a row or
    an error."""
    known = set(adapters)
    rows, errors, sha1 = [], [], {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            sha1[n] = fingerprint(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                errors.append((n, "not valid UTF-8 text"))
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as e:
                errors.append((n, f"not valid JSON ({e.msg})"))
                continue
            if not isinstance(obj, dict):
                errors.append((n, f"expected a JSON object, got {type(obj).__name__}"))
                continue
            prompt = obj.get(prompt_key)
            if not isinstance(prompt, str) or not prompt:
                errors.append((n, f"missing or empty '{prompt_key}' (a non-empty string is required)"))
                continue
            adapter = obj.get(adapter_key)
            if adapter == BASE:
                adapter = None
            if adapter is not None and (not isinstance(adapter, str) or adapter not in known):
                errors.append(
                    (n, f"unknown adapter {adapter!r}; loaded: {', '.join(sorted(known))} (or null for base)")
                )
                continue
            limit = obj.get(MAX_NEW_TOKENS_KEY)
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                errors.append((n, f"'{MAX_NEW_TOKENS_KEY}' must be a positive integer, got {limit!r}"))
                continue
            sha1[n] = request_sha1(prompt, adapter, limit)
            rows.append(Row(line=n, prompt=prompt, adapter=adapter, id=obj.get("id"), has_id="id" in obj, sha1=sha1[n],
                            max_new_tokens=limit))  # fmt: skip
    return InputFile(rows, errors, sha1)


def read_rows(
    path: str, adapters: Iterable[str], prompt_key: str = "prompt", adapter_key: str = "adapter"
) -> tuple[list[Row], list[tuple[int, str]]]:
    """Parse the input; returns the good rows and ``(line, message)`` for every bad one. Blank lines are skipped."""
    parsed = read_input(path, adapters, prompt_key, adapter_key)
    return parsed.rows, parsed.errors


def _no_barrier() -> None:
    pass


class ShardError(ValueError):
    """A data-parallel launch this command cannot run (found before any process touches the output)."""


@dataclasses.dataclass(frozen=True)
class Shard:
    """This process's share of a data-parallel run: process ``rank`` of ``world``, the device it generates on
    (``None``: the command's ``--device``) and a barrier across the processes."""

    rank: int = 0
    world: int = 1
    device: torch.device | None = None
    barrier: Callable[[], None] = _no_barrier

    def take(self, rows: list) -> list:
        """This process's rows: every ``world``-th one from its rank on."""
        return rows[self.rank :: self.world]


def current_shard() -> Shard:
    """The shard of this process: one of several when launched by ``accelerate launch`` or ``torchrun`` with more
    than one process (accelerate's ``PartialState``: each process on its own GPU, or on the CPU where there is none),
    else the whole run."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Shard()
    from accelerate import PartialState
    from accelerate.utils import parse_flag_from_env

    cpu = not torch.cuda.is_available() or parse_flag_from_env("ACCELERATE_USE_CPU")  # ``accelerate launch --cpu``
    if not cpu:
        # Each process takes the GPU of its local rank: more processes on a machine than GPUs fail in the first
        # collective with CUDA's "invalid device ordinal". Say so before anything starts.
        local, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", world)), torch.cuda.device_count()
        if local > gpus:
            raise ShardError(
                f"{local} processes on this machine but {gpus} GPU{'s' if gpus != 1 else ''} visible: each process "
                f"generates on a GPU of its own; launch at most {gpus} per machine, or run them on the CPU "
                "(accelerate launch --cpu)"
            )
    state = PartialState(cpu=cpu)
    return Shard(state.process_index, state.num_processes, state.device, state.wait_for_everyone)


def part_path(out_path: str, rank: int, world: int) -> str:
    """The file process ``rank`` of ``world`` appends its records to."""
    return f"{out_path}.part-{rank}-of-{world}"


def part_paths(out_path: str) -> list[str]:
    """Part files beside ``out_path`` (of this run or of earlier ones, with any number of processes)."""
    return sorted(glob.glob(glob.escape(out_path) + ".part-*-of-*"))


@dataclasses.dataclass
class Resume:
    """What an existing output holds for an input: ``done`` maps line to its completion record, in input order (kept
    as made, its ``line`` and ``id`` those of the line now); ``stale`` counts completion records that no line asks for
    any more (dropped), ``retry`` error records (their lines are tried again); ``rewrite`` says the file must be
    rewritten before appending (records to drop, move or relabel, a torn tail, part files to merge)."""

    done: dict[int, dict]
    stale: int = 0
    retry: int = 0
    rewrite: bool = False


def _read_records(path: str) -> tuple[list[dict], bool]:
    """The records of an existing output, and whether a torn last line (an interrupted write) was left out. A complete
    line that is not a result record raises OutputMismatch."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    tail = lines.pop()  # b"" when the file ends with a newline
    records, torn = [], bool(tail.strip())
    for n, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("line"), int):
            raise OutputMismatch(f"line {n} is not a peft-csgmv result record")
        records.append(record)
    return records, torn


def _relabel(record: dict, row: Row) -> dict:
    """``record`` with the line number and ``id`` of ``row`` (the keys in the order a new record has them)."""
    out: dict[str, Any] = {"line": row.line}
    if row.has_id:
        out["id"] = row.id
    out.update((k, v) for k, v in record.items() if k not in ("line", "id"))
    return out


def match_records(rows: list[Row], records: list[dict]) -> tuple[dict[int, dict], int]:
    """Pair the completion records with the rows whose request they answer (equal ``input_sha1``), each record with
    at most one row: first every record with the row of the line it was written for, where that line holds the same
    request still; then the rest, in file order, with the rows of that request still without one, in input order.
    Returns ``{line: record}`` in input order (records relabeled with their row's line and ``id``) and the number of
    completion records left without a row."""
    completions = [r for r in records if "error" not in r]
    placed: dict[tuple, int] = {}
    by_request: dict[Any, list[int]] = {}
    for i, record in enumerate(completions):
        key = record.get("input_sha1")
        key = key if isinstance(key, str) else None
        placed.setdefault((key, record["line"]), i)
        by_request.setdefault(key, []).append(i)
    taken = [False] * len(completions)
    paired: dict[int, int] = {}
    for row in rows:
        i = placed.get((row.sha1, row.line))
        if i is not None:
            taken[i] = True
            paired[row.line] = i
    left = {key: iter(indices) for key, indices in by_request.items() if key is not None}
    for row in rows:
        if row.line in paired:
            continue
        for i in left.get(row.sha1, ()):
            if not taken[i]:
                taken[i] = True
                paired[row.line] = i
                break
    done = {row.line: _relabel(completions[paired[row.line]], row) for row in rows if row.line in paired}
    return done, len(completions) - len(paired)


def check_settings(out_path: str, records: list[dict], settings: RunSettings) -> None:
    """Raise OutputMismatch, in one line naming what differs, when a completion record of the output was made with
    other settings than ``settings`` (its ``settings_sha1`` is not this run's for its adapter), or carries none.
    Records of an adapter ``settings`` do not hold are not checked (no line of this run asks for them)."""
    completions = [r for r in records if "error" not in r]
    bare = sum(not isinstance(r.get("settings_sha1"), str) for r in completions)
    if bare:
        some = "its" if bare == len(completions) else f"{bare} of its {len(completions)}"
        raise OutputMismatch(
            f"{some} results carry no settings_sha1 (an output of an earlier peft-csgmv): the settings they were made "
            "with are unknown"
        )
    wrong = [
        r
        for r in completions
        if settings.concerns(r.get("adapter")) and r["settings_sha1"] != settings.fingerprint(r.get("adapter"))
    ]
    if not wrong:
        return
    stored = read_settings(out_path)
    if stored is not None and all(
        stored.concerns(r.get("adapter")) and stored.fingerprint(r.get("adapter")) == r["settings_sha1"] for r in wrong
    ):
        ours, theirs = stored.differences(settings, {r["adapter"] for r in wrong if r.get("adapter") is not None})
        if ours or theirs:
            raise OutputMismatch(f"written with {', '.join(ours)}; this run has {', '.join(theirs)}")
    state = "is missing or unreadable" if stored is None else "describes yet other settings"
    some = "its" if len(wrong) == len(completions) else f"{len(wrong)} of its {len(completions)}"
    raise OutputMismatch(
        f"{some} results were made with other settings than this run's (which ones is unknown: its settings file "
        f"{settings_path(out_path)} {state})"
    )


def resume_state(
    out_path: str, parsed: InputFile, overwrite: bool = False, settings: RunSettings | None = None
) -> Resume:
    """Match an existing output, and the part files earlier runs left beside it, against the input (see the module
    docstring). Raises OutputMismatch when they hold only other content's results, results made with other
    ``settings`` (:func:`check_settings`; not checked without ``settings``), or are not peft-csgmv outputs;
    ``overwrite`` starts the output afresh instead. Reads only: nothing is written."""
    parts = part_paths(out_path)
    exists = os.path.exists(out_path)
    if not exists and not parts:
        return Resume(done={})
    if overwrite:
        return Resume(done={}, rewrite=bool(parts) or (exists and os.path.getsize(out_path) > 0))
    records, torn = [], False
    for path in [out_path] * exists + parts:
        held, cut = _read_records(path)
        records += held
        torn = torn or cut
    if settings is not None:
        check_settings(out_path, records, settings)
    done, stale = match_records(parsed.rows, records)
    completions = sum("error" not in r for r in records)
    if completions and not done:
        raise OutputMismatch(f"it holds {completions} results, none for a line of this input (another input's output?)")
    rewrite = torn or bool(parts) or list(done.values()) != records
    return Resume(done=done, stale=stale, retry=len(records) - completions, rewrite=rewrite)


def _rewrite(path: str, records: Iterable[dict]) -> None:
    """Replace ``path`` with ``records`` at once (a temporary file beside it, then a rename)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".peft-csgmv-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def start_output(
    out_path: str, resume: Resume, parsed: InputFile, error_records: bool, settings: RunSettings | None = None
) -> None:
    """Store ``settings`` beside the output (``OUTPUT.settings.json``), make the output hold only the records
    ``resume`` keeps, in input order (earlier runs' part files merged in and removed), then append an error record for
    every bad line when ``error_records``."""
    if settings is not None:
        write_settings(out_path, settings)
    if resume.rewrite:
        _rewrite(out_path, resume.done.values())
        _remove(part_paths(out_path))
    errors = parsed.errors if error_records else []
    with open(out_path, "a", encoding="utf-8") as out:
        out.write(
            "".join(json.dumps({"line": n, "error": msg, "input_sha1": parsed.sha1[n]}) + "\n" for n, msg in errors)
        )


def _remove(paths: Iterable[str]) -> None:
    for path in paths:
        if os.path.exists(path):
            os.unlink(path)


def finish_output(out_path: str, parsed: InputFile) -> None:
    """Rewrite a completed output in input order, one record per input line (:func:`match_records`; a bad line's
    error record), with the part files of this run's processes merged in and removed."""
    parts = part_paths(out_path)
    if not os.path.exists(out_path) and not parts:
        return
    records = _read_records(out_path)[0] if os.path.exists(out_path) else []
    main = list(records)
    for path in parts:
        records += _read_records(path)[0]
    done, _ = match_records(parsed.rows, records)
    errors = {r["line"]: r for r in records if "error" in r and parsed.sha1.get(r["line"]) == r.get("input_sha1")}
    ordered = [done[n] if n in done else errors[n] for n in sorted(parsed.sha1) if n in done or n in errors]
    if ordered != main or not os.path.exists(out_path):
        _rewrite(out_path, ordered)
    _remove(parts)


def batches_by_length(
    rows: list[Row], lengths: list[int], batch_size: int, max_adapters: int | None = None
) -> list[list[int]]:
    """Indices into ``rows`` grouped into batches of similar prompt length (less padding), rows with their own
    ``max_new_tokens`` ordered by it first (a batch decodes until its largest).

    ``max_adapters``: at most that many distinct adapters in a batch (base rows take none), for a model that keeps
    that many on the device (``enable_csgmv``'s ``max_resident_adapters``). Rows are then ordered by
    :func:`prompt_bucket`, adapter and length, so that each batch holds as few adapters as its bucket allows and an
    adapter moves onto the device about once per bucket, not once per batch."""
    if max_adapters is None:
        order = sorted(range(len(rows)), key=lambda i: (rows[i].max_new_tokens or 0, lengths[i]))
        return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    order = sorted(
        range(len(rows)),
        key=lambda i: (rows[i].max_new_tokens or 0, prompt_bucket(lengths[i]), rows[i].adapter is not None,
                       rows[i].adapter or "", lengths[i]),
    )  # fmt: skip
    batches: list[list[int]] = []
    batch: list[int] = []
    held: set[str] = set()
    for i in order:
        adapter = rows[i].adapter
        new_adapter = adapter is not None and adapter not in held
        if batch and (len(batch) == batch_size or (new_adapter and len(held) == max_adapters)):
            batches.append(batch)
            batch, held = [], set()
        batch.append(i)
        if adapter is not None:
            held.add(adapter)
    if batch:
        batches.append(batch)
    return batches


def prompt_bucket(length: int) -> int:
    """The padded prompt length of a batch whose longest prompt has ``length`` tokens, on the static cache: the next
    power of two (16 at least), so that a run's batches share a few shapes, each compiled once."""
    return max(16, 1 << (max(length, 1) - 1).bit_length())


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def _pad_id(tokenizer):
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _record(row: Row, ids: list[int], tokenizer, pad_id, settings: RunSettings | None) -> dict:
    """A row's completion record from its new tokens, at most the row's own ``max_new_tokens`` (a static batch decodes
    until its largest), the pad token left out (it fills a static batch's finished rows, and it is the
    end-of-sequence token where the tokenizer has no pad token of its own)."""
    ids = list(ids)[: row.max_new_tokens] if row.max_new_tokens is not None else list(ids)
    ids = [t for t in ids if t != pad_id] if pad_id is not None else ids
    record: dict[str, Any] = {"line": row.line}
    if row.has_id:
        record["id"] = row.id
    record.update(adapter=row.adapter, completion=tokenizer.decode(ids, skip_special_tokens=True),
                  new_tokens=len(ids), input_sha1=row.sha1)  # fmt: skip
    if settings is not None:
        record["settings_sha1"] = settings.fingerprint(row.adapter)
    return record


def generate_rows(
    model,
    tokenizer,
    rows: list[Row],
    out_path: str,
    batch_size: int = 16,
    progress: bool = True,
    settings: RunSettings | None = None,
    continuous: Continuous | None = None,
    **generate_kwargs,
) -> dict:
    """Generate a completion for every row (mixed adapters) and append each one's record to ``out_path`` as soon as it
    is done (complete lines, flushed). ``model`` must be csgmv-enabled. ``settings``: the run's settings, whose
    fingerprint for each row's adapter its record carries as ``settings_sha1`` (what lets ``peft-csgmv generate``
    resume the output). ``generate_kwargs``: ``max_new_tokens``, ``do_sample`` and the sampling options (static
    batches also take ``cache_implementation`` and whatever else ``generate`` takes). Returns counts and timing.

    ``continuous`` (:class:`Continuous`, its sizing): continuous batching (:func:`generate_continuous`).

    Without it, static batches: rows grouped by prompt length into batches of ``batch_size``, each through
    ``generate()``, its records appended when it finishes; where the model keeps at most N adapters on the device
    (``max_resident_adapters``), no batch holds more than N (:func:`batches_by_length`). With
    ``cache_implementation="static"`` (transformers' static cache, whose decode step it compiles for each batch
    shape) every call has the same shape where it can: prompts are left-padded to :func:`prompt_bucket` of the batch's
    longest, and a short last batch is filled up to ``batch_size`` with copies of its last row (their output is
    dropped), so a run compiles one decode step per prompt bucket it meets, and the batches of a bucket share the
    static cache csgmv keeps for calls of one size (``enable_csgmv``'s ``keep_static_cache``): the compiled step
    records its CUDA graph once per bucket, not once per batch."""
    if continuous is not None:
        return generate_continuous(model, tokenizer, rows, out_path, continuous, progress, settings, **generate_kwargs)
    from tqdm.auto import tqdm

    from .model import csgmv_stats, is_csgmv_enabled

    lengths = [len(ids) for ids in tokenizer([r.prompt for r in rows])["input_ids"]] if rows else []
    device = _input_device(model)
    pad_id = _pad_id(tokenizer)
    static = generate_kwargs.get("cache_implementation") == "static"
    default_limit = generate_kwargs.get("max_new_tokens")
    own_limits = any(r.max_new_tokens is not None for r in rows)
    if own_limits:  # (each row's limit, the run's where the line gives none)
        rows = [r if r.max_new_tokens is not None else dataclasses.replace(r, max_new_tokens=default_limit)
                for r in rows]  # fmt: skip
    new_tokens_total, written, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(rows), unit="row", disable=not progress, dynamic_ncols=True)
    try:
        with open(out_path, "a", encoding="utf-8") as out:
            max_adapters = csgmv_stats(model)["max_resident_adapters"] if is_csgmv_enabled(model) else None
            for batch in batches_by_length(rows, lengths, batch_size, max_adapters):
                brows = [rows[i] for i in batch]
                called = brows + [brows[-1]] * (batch_size - len(brows)) if static else brows
                padding = {"padding": True}
                if static:
                    bucket = prompt_bucket(max(lengths[i] for i in batch))
                    padding = {"padding": "max_length", "max_length": bucket}
                enc = tokenizer([r.prompt for r in called], return_tensors="pt", padding_side="left", **padding)
                # Only what every causal LM's generate takes (a tokenizer may add token_type_ids, which older
                # transformers refuse for models that do not use them).
                input_ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)
                limits = {}
                if own_limits:  # (the static cache's length follows it: a power of two, so a run has a few shapes)
                    largest = max(r.max_new_tokens for r in brows)
                    limits["max_new_tokens"] = prompt_bucket(largest) if static else largest
                seqs = model.generate(
                    input_ids=input_ids,
                    attention_mask=mask,
                    adapter_ids=[r.adapter for r in called],
                    pad_token_id=pad_id,
                    **{**generate_kwargs, **limits},
                )
                new = seqs[: len(brows), input_ids.shape[1] :].cpu()
                records = [_record(r, ids.tolist(), tokenizer, pad_id, settings) for r, ids in zip(brows, new)]
                new_tokens_total += sum(r["new_tokens"] for r in records)
                out.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
                out.flush()
                written += len(brows)
                elapsed = time.perf_counter() - started
                bar.update(len(brows))
                bar.set_postfix(tok_s=f"{new_tokens_total / max(elapsed, 1e-9):.1f}")
    finally:
        bar.close()
    elapsed = time.perf_counter() - started
    return dict(rows=written, new_tokens=new_tokens_total, seconds=elapsed)


# -- continuous batching ----------------------------------------------------------------------------------------------

CPU_MAX_BATCH_TOKENS = 256  # a step's tokens on a CPU, where transformers' 8192 only makes the step's buffers large
# Requests per step at most on a GPU where transformers' paged attention runs on SDPA or eager attention (no flash
# attention kernels): there each step attends with one dense mask over every running request's cached tokens, so a
# step's attention grows with the square of the requests running (transformers' default allows 1024). With that
# default, one H100 run (1B layout, 64 new tokens) gave 1687 tok/s over 512 rows and 1184 over 2048: with every
# request running at once, steps of about 0.3 s and 0.9 s, where the model's own work is tens of milliseconds. This
# cap keeps a step's mask at about 1/16 of the 512-row run's; the cap itself is not yet measured (bench_cli.py runs
# `uncapped` beside it).
DENSE_MASK_MAX_REQUESTS = 128
PAGE_SIZE = 256  # tokens per block of transformers' paged cache (its default ``page_size``)


class SizingError(ValueError):
    """The continuous-batching cache cannot hold a request (the message names the input line and the flag)."""


class GenerationFailed(RuntimeError):
    """Continuous batching failed a request, or its manager stopped (the message names the input line)."""


@dataclasses.dataclass(frozen=True)
class Continuous:
    """How continuous batching is sized (``None``: the default), the command's flags of the same names.

    ``max_batch_tokens``: tokens per step at most (default: transformers' on a GPU, :data:`CPU_MAX_BATCH_TOKENS` on
    a CPU). ``num_blocks``: blocks of :data:`PAGE_SIZE` tokens in the paged KV cache; ``cache_memory``: instead, the
    share of the device's free memory for the cache and the step's buffers (default: on a GPU transformers' share; on
    a CPU, where transformers would take most of the free RAM, the blocks of the longest requests one step can hold,
    ``max_batch_tokens`` or ``max_requests`` of them, at their full length). ``max_requests``: requests per step at
    most (default: transformers'). ``seed``: the random seed of sampling. ``cuda_graphs``: each step as transformers'
    CUDA graph, captured once per step size (:mod:`peft_csgmv.continuous`; default: eager steps).
    ``varlen_attention``: attention per request by torch's flash kernel instead of SDPA's dense mask, for the run
    (:func:`peft_csgmv.attention.varlen_attention`; no cap of requests per step then). Prefix sharing is off (see
    :meth:`config`)."""

    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    cache_memory: float | None = None
    max_requests: int | None = None
    seed: int | None = None
    cuda_graphs: bool = False
    varlen_attention: bool = False

    def config(self, device: torch.device, needs: list[int], model=None):
        """transformers' ``ContinuousBatchingConfig`` for requests of ``needs`` tokens each (prompt and new tokens),
        on ``device``, for ``model`` (where given: on a GPU without flash attention, at most
        :data:`DENSE_MASK_MAX_REQUESTS` requests per step unless ``max_requests`` says otherwise)."""
        from transformers import ContinuousBatchingConfig

        known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        max_batch_tokens = self.max_batch_tokens
        if max_batch_tokens is None and device.type == "cpu":
            max_batch_tokens = CPU_MAX_BATCH_TOKENS
        num_blocks = self.num_blocks
        if num_blocks is None and self.cache_memory is None and device.type == "cpu" and needs:
            held = min(len(needs), max_batch_tokens, self.max_requests or len(needs))
            num_blocks = sum(sorted((math.ceil(n / PAGE_SIZE) for n in needs), reverse=True)[:held])
        max_requests = self.max_requests
        dense = model is not None and not self.varlen_attention and dense_mask_attention(model)
        if max_requests is None and device.type == "cuda" and dense:
            max_requests = DENSE_MASK_MAX_REQUESTS
        wanted = dict(
            num_blocks=num_blocks,
            max_batch_tokens=max_batch_tokens,
            max_memory_percent=self.cache_memory,
            max_requests_per_batch=max_requests,
            seed=self.seed,
            use_cuda_graph=True if self.cuda_graphs else None,
            page_size=PAGE_SIZE,
            # No prefix sharing: transformers keys a cached block by its tokens alone, and would hand a request the
            # blocks of an earlier one with the same prompt computed under another adapter (LoRA on k / v).
            allow_block_sharing=False,
            # (no tensor parallelism here: each process of a data-parallel run has a manager of its own)
            disable_nccl_graph_mixing=False,
        )
        return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if v is not None and k in known})


def dense_mask_attention(model) -> bool:
    """Whether transformers' paged attention for ``model`` builds a dense mask over the step's cached tokens (its
    SDPA and eager implementations do; flash attention kernels take the requests' lengths instead)."""
    base = transformers_model(model)
    impl = str(getattr(base.config, "_attn_implementation", None) or "sdpa")
    return impl.split("|")[-1] in ("sdpa", "eager")


def _generation_config(model, tokenizer, **generate_kwargs):
    """The generation config ``model.generate(pad_token_id=..., **generate_kwargs)`` would run: the model's own,
    transformers' defaults for what it leaves unset, then the arguments."""
    base = transformers_model(model)
    kwargs = dict(generate_kwargs, pad_token_id=_pad_id(tokenizer))
    try:
        gen, _ = base._prepare_generation_config(None, **kwargs)
    except Exception:  # noqa: BLE001 - a transformers whose private helper differs: the model's config and the arguments
        gen = copy.deepcopy(base.generation_config)
        gen.update(**kwargs)
    return gen


def continuous_obstacle(model, tokenizer, adapters: Iterable[str | None] = (), **generate_kwargs) -> str | None:
    """Why continuous batching cannot run ``model.generate(**generate_kwargs)``'s decoding for this model's requests
    of ``adapters`` (``None``: it can): an adapter csgmv cannot give per request under continuous batching (aLoRA,
    LoRA on the output embedding, adapters on PEFT's own path: :func:`peft_csgmv.continuous.refusal`), the model
    spread over several devices (its paged cache lives on one), or a generation config (the model's, with the
    arguments) asking for what continuous batching lacks: beam search, several sequences per prompt, a repetition
    penalty, minimum lengths, stop strings, a time limit, or any logits processor transformers does not mark as
    supported by continuous batching."""
    from .continuous import refusal

    state = model.__dict__.get("_csgmv")
    names = sorted({a for a in adapters if a is not None and a != BASE})
    if state is not None and names:
        with state.executor.lock:
            state.sync(model)
            for name in names:
                why = refusal(model, state, name)
                if why is not None:
                    return why
    base = transformers_model(model)
    devices = {str(d) for d in (getattr(base, "hf_device_map", None) or {}).values()}
    if len(devices) > 1:
        spread = f"the model is spread over {len(devices)} devices (--device-map)"
        return f"{spread}; continuous batching keeps its cache on one"
    gen = _generation_config(model, tokenizer, **generate_kwargs)
    asked = []
    plain = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "min_length": 0,
             "min_new_tokens": 0, "stop_strings": None, "max_time": None}  # fmt: skip
    for name, default in plain.items():
        value = getattr(gen, name, None)
        if value is not None and value != default:
            asked.append(f"{name}={value}")
    try:
        processors = base._get_logits_processor(gen, input_ids_seq_length=1, device=_input_device(model))
    except Exception:  # noqa: BLE001 - processors that need what this check lacks: the fields above decide
        processors = []
    covered = {"RepetitionPenaltyLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor"}
    for processor in processors:
        name = type(processor).__name__
        if getattr(processor, "supports_continuous_batching", None) is not True and name not in covered:
            asked.append(name)
    if asked:
        return f"the model's generation config asks for {', '.join(asked)}, which continuous batching does not do"
    return None


def generate_continuous(
    model,
    tokenizer,
    rows: list[Row],
    out_path: str,
    continuous: Continuous,
    progress: bool = True,
    settings: RunSettings | None = None,
    **generate_kwargs,
) -> dict:
    """:func:`generate_rows` by continuous batching: every row a request of one manager
    (``model.init_continuous_batching``), with its row's adapter and ``max_new_tokens``, all queued before the manager
    starts (so that a run's schedule, and with a seed its samples, do not depend on thread timing); each record is
    appended and flushed as its request finishes. A request the cache cannot hold (given ``num_blocks``) raises
    :class:`SizingError` before anything runs; a failed request stops the run with :class:`GenerationFailed`, the
    finished ones written. Ctrl-C (or any exception) stops the manager at once."""
    from tqdm.auto import tqdm

    prompts = tokenizer([r.prompt for r in rows])["input_ids"] if rows else []
    max_new_tokens = int(generate_kwargs.get("max_new_tokens") or 0)
    limits = [r.max_new_tokens or max_new_tokens for r in rows]  # (a line's own, else the run's)
    needs = [len(p) + limit for p, limit in zip(prompts, limits)]
    if continuous.num_blocks is not None and needs:
        longest = max(range(len(rows)), key=lambda i: needs[i])
        if needs[longest] > continuous.num_blocks * PAGE_SIZE:
            raise SizingError(
                f"--num-blocks {continuous.num_blocks}: the cache holds {continuous.num_blocks * PAGE_SIZE} tokens, "
                f"input line {rows[longest].line} needs {needs[longest]} (its prompt and "
                f"{'its max_new_tokens' if rows[longest].max_new_tokens else '--max-new-tokens'})"
            )
    pad_id = _pad_id(tokenizer)
    gen = _generation_config(model, tokenizer, **generate_kwargs)
    if gen.eos_token_id is None:
        gen.eos_token_id = -1  # (no end-of-sequence token: every request runs max_new_tokens, as generate() does)
    config = continuous.config(_input_device(model), needs, model)
    new_tokens_total, written, started = 0, 0, time.perf_counter()
    bar = tqdm(total=len(rows), unit="row", disable=not progress, dynamic_ncols=True)
    manager, running = None, False
    waiting: dict[str, Row] = {}
    scope = varlen_attention(model) if continuous.varlen_attention else contextlib.nullcontext()
    with scope:  # (the model's own attention back when the run ends)
        try:
            if not rows:
                return dict(rows=0, new_tokens=0, seconds=0.0)
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
            for i, (row, prompt, limit) in enumerate(zip(rows, prompts, limits)):
                request_id = f"row{i}"
                waiting[request_id] = row
                manager.add_request(prompt, request_id=request_id, max_new_tokens=limit, adapter_id=row.adapter)
            manager.start()
            running = True
            with open(out_path, "a", encoding="utf-8") as out:
                while waiting:
                    result = manager.get_result(timeout=1.0)
                    if result is None:
                        if not manager.is_running():
                            line = next(iter(waiting.values())).line
                            stopped = f"continuous batching stopped before input line {line} was generated"
                            raise GenerationFailed(stopped)
                        continue
                    if not result.is_finished() or result.request_id not in waiting:
                        continue
                    row = waiting.pop(result.request_id)
                    if result.error is not None:
                        raise GenerationFailed(f"continuous batching failed on input line {row.line}: {result.error}")
                    record = _record(row, result.generated_tokens, tokenizer, pad_id, settings)
                    out.write(json.dumps(record, ensure_ascii=False) + "\n")
                    out.flush()
                    written += 1
                    new_tokens_total += record["new_tokens"]
                    bar.update(1)
                    elapsed = time.perf_counter() - started
                    bar.set_postfix(tok_s=f"{new_tokens_total / max(elapsed, 1e-9):.1f}", refresh=False)
        finally:
            if running:
                manager.stop(block=True, hard_stop=bool(waiting))
            bar.close()
    return dict(rows=written, new_tokens=new_tokens_total, seconds=time.perf_counter() - started)


def _drop_unused_inputs(model, tokenizer) -> None:
    """Keep the tokenizer from returning inputs the model's forward does not take (``token_type_ids`` for most
    causal LMs), which transformers' ``generate`` refuses."""
    base = transformers_model(model)
    try:
        params = inspect.signature(type(base).forward).parameters
    except (TypeError, ValueError):
        return
    names = list(getattr(tokenizer, "model_input_names", []))
    if "token_type_ids" in names and "token_type_ids" not in params:
        tokenizer.model_input_names = [n for n in names if n != "token_type_ids"]


def load_model(
    base: str,
    adapters: dict[str, str],
    dtype: str = "auto",
    device_map: str | None = None,
    device: str | None = None,
    backend: str = "auto",
    adapter_dtype: str = "fp32",
    max_resident_adapters: int | None = None,
):
    """Load the base model, its tokenizer and every adapter, and enable csgmv. Returns ``(model, tokenizer)``.

    ``adapter_dtype``: ``"fp32"`` keeps the adapters in float32 on a bf16 / fp16 model, as PEFT does by default
    (``autocast_adapter_dtype=True``: PEFT's numerics); ``"model"`` gives them the base model's dtype
    (``autocast_adapter_dtype=False``: half their bytes, faster). ``max_resident_adapters``: at most that many
    adapters on the device, the others in host memory (``enable_csgmv``'s option, enabled after the first adapter,
    so that each one loaded beyond N leaves the device as it is loaded)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .model import enable_csgmv

    if not adapters:
        raise ValueError("give at least one --adapter NAME=PATH")
    dtypes = {"auto": "auto", "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    kwargs: dict = {"dtype": dtypes[dtype]}
    if device_map:
        kwargs["device_map"] = device_map
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if not device_map:
        model.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    _drop_unused_inputs(model, tokenizer)
    if adapter_dtype not in ("fp32", "model"):
        raise ValueError(f"adapter_dtype must be 'fp32' or 'model'; got {adapter_dtype!r}")
    autocast = adapter_dtype == "fp32"
    names = iter(adapters.items())
    name, path = next(names)
    model = PeftModel.from_pretrained(model, path, adapter_name=name, autocast_adapter_dtype=autocast)
    model.eval()
    tier = max_resident_adapters is not None
    if tier:  # from the first adapter on: those loaded beyond N leave the device as they are loaded (synced there)
        enable_csgmv(model, backend=backend, max_resident_adapters=max_resident_adapters)
    for name, path in names:
        model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=autocast)
    model.eval()
    return (model if tier else enable_csgmv(model, backend=backend)), tokenizer
