"""Batch generation over a JSONL file of prompts, each with its own adapter (``peft-csgmv generate``).

Input: one JSON object per line, ``{"prompt": "...", "adapter": "legal", "id": 17}``; ``adapter`` absent, null or
``"__base__"`` means the base model; ``id`` is optional and echoed. Output: one JSON object per input line,
``{"line": 3, "id": 17, "adapter": "legal", "completion": "...", "new_tokens": 42}``, written (and flushed) as soon
as its batch finishes. Rows are grouped by prompt length into batches; one batch mixes adapters freely.

Resuming: lines already in the output (by ``line``) are skipped, so an interrupted run continues where it stopped;
a torn last line from an interruption is cut off first. Bad input lines (not JSON, no prompt, unknown adapter) are
all reported with their line numbers before anything runs; with ``on_error="stop"`` the run stops there, with
``"skip"`` each gets an ``{"line": n, "error": "..."}`` record in the output, so no row is ever dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterable

import torch

BASE = "__base__"


@dataclasses.dataclass
class Row:
    line: int  # 1-based line number in the input
    prompt: str
    adapter: str | None
    id: Any = None
    has_id: bool = False


class InputError(ValueError):
    """Bad input lines; ``errors`` holds ``(line, message)`` pairs."""

    def __init__(self, errors: list[tuple[int, str]]):
        self.errors = errors
        shown = "\n".join(f"  line {n}: {msg}" for n, msg in errors[:20])
        more = f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else ""
        super().__init__(f"{len(errors)} bad input line(s):\n{shown}{more}")


def read_rows(
    path: str, adapters: Iterable[str], prompt_key: str = "prompt", adapter_key: str = "adapter"
) -> tuple[list[Row], list[tuple[int, str]]]:
    """Parse the input; returns the good rows and ``(line, message)`` for every bad one. Blank lines are skipped."""
    known = set(adapters)
    rows, errors = [], []
    with open(path, encoding="utf-8") as f:
        for n, text in enumerate(f, start=1):
            if not text.strip():
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
            rows.append(Row(line=n, prompt=prompt, adapter=adapter, id=obj.get("id"), has_id="id" in obj))
    return rows, errors


def finished_lines(path: str) -> set[int]:
    """Input lines already in the output file. A torn last line (an interrupted write) is cut off the file."""
    if not os.path.exists(path):
        return set()
    done: set[int] = set()
    good_bytes = 0
    with open(path, "rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
                done.add(int(record["line"]))
            except (ValueError, KeyError, TypeError):
                break  # torn or foreign line: everything from here is rewritten
            good_bytes += len(raw)
    if good_bytes != os.path.getsize(path):
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
    return done


def batches_by_length(rows: list[Row], lengths: list[int], batch_size: int) -> list[list[int]]:
    """Indices into ``rows`` grouped into batches of similar prompt length (less padding)."""
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _input_device(model) -> torch.device:
    return model.get_input_embeddings().weight.device


def generate_rows(
    model,
    tokenizer,
    rows: list[Row],
    out_path: str,
    batch_size: int = 16,
    progress: bool = True,
    **generate_kwargs,
) -> dict:
    """Generate a completion for every row (mixed adapters per batch) and append each result to ``out_path`` as soon
    as its batch finishes. ``model`` must be csgmv-enabled. Returns counts and timing."""
    from tqdm.auto import tqdm

    lengths = [len(ids) for ids in tokenizer([r.prompt for r in rows])["input_ids"]] if rows else []
    device = _input_device(model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    new_tokens_total, started = 0, time.perf_counter()
    bar = tqdm(total=len(rows), unit="row", disable=not progress, dynamic_ncols=True)
    with open(out_path, "a", encoding="utf-8") as out:
        for batch in batches_by_length(rows, lengths, batch_size):
            brows = [rows[i] for i in batch]
            enc = tokenizer([r.prompt for r in brows], return_tensors="pt", padding=True, padding_side="left")
            enc = {k: v.to(device) for k, v in enc.items()}
            seqs = model.generate(**enc, adapter_ids=[r.adapter for r in brows], pad_token_id=pad_id, **generate_kwargs)
            new = seqs[:, enc["input_ids"].shape[1] :].cpu()
            for r, ids in zip(brows, new):
                ids = ids[ids != pad_id] if pad_id is not None else ids
                record = {"line": r.line}
                if r.has_id:
                    record["id"] = r.id
                record.update(adapter=r.adapter, completion=tokenizer.decode(ids, skip_special_tokens=True),
                              new_tokens=int(ids.numel()))  # fmt: skip
                new_tokens_total += int(ids.numel())
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
            elapsed = time.perf_counter() - started
            bar.update(len(brows))
            bar.set_postfix(tok_s=f"{new_tokens_total / max(elapsed, 1e-9):.1f}")
    bar.close()
    elapsed = time.perf_counter() - started
    return dict(rows=len(rows), new_tokens=new_tokens_total, seconds=elapsed)


def write_errors(out_path: str, errors: list[tuple[int, str]], skip: set[int]) -> int:
    """Append an error record for each bad line not yet in the output; returns how many were written."""
    written = 0
    with open(out_path, "a", encoding="utf-8") as out:
        for n, msg in errors:
            if n not in skip:
                out.write(json.dumps({"line": n, "error": msg}) + "\n")
                written += 1
    return written


def load_model(
    base: str,
    adapters: dict[str, str],
    dtype: str = "auto",
    device_map: str | None = None,
    device: str | None = None,
    backend: str = "auto",
):
    """Load the base model, its tokenizer and every adapter, and enable csgmv. Returns ``(model, tokenizer)``."""
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
    names = iter(adapters.items())
    name, path = next(names)
    model = PeftModel.from_pretrained(model, path, adapter_name=name, autocast_adapter_dtype=False)
    for name, path in names:
        model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False)
    model.eval()
    return enable_csgmv(model, backend=backend), tokenizer
