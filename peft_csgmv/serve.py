"""``peft-csgmv serve``: an OpenAI-compatible HTTP server on transformers' continuous batching, each request with its
own adapter (``"model": "legal"``; the base model's name runs without adapter). Endpoints, flags and what is supported
or refused: docs/serve.md.

Threads (see :class:`Engine`): uvicorn's event loop parses and tokenizes each request; a submitter thread makes the
manager's calls in order (``add_request``, which takes the model's call lock that a running step holds, then
``cancel_request`` and adapter unloads); the manager's thread runs the model steps; a dispatcher thread reads the
manager's results and passes them to each request's asyncio queue through ``loop.call_soon_threadsafe``. Adapter loads
run in a worker thread (``asyncio.to_thread``). The event loop never waits for a model step.
"""

import argparse
import asyncio
import contextlib
import functools
import importlib.util
import inspect
import json
import logging
import os
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

import torch

from . import attention

logger = logging.getLogger("peft_csgmv.serve")

# The KV cache's blocks on a CPU, where transformers would otherwise reserve 60% of the RAM for it (on CUDA:
# transformers' own sizing, from the free device memory); a step's tokens on a CPU: batch.CPU_MAX_BATCH_TOKENS.
CPU_NUM_BLOCKS = 16
# OpenAI's limits: at most 4 stop sequences, n up to 128, temperature in [0, 2].
MAX_STOPS = 4
MAX_N = 128


def missing_support() -> str | None:
    """Why this environment cannot serve, in one line; ``None`` when it can."""
    missing = [name for name in ("fastapi", "uvicorn") if importlib.util.find_spec(name) is None]
    if missing:
        return f"needs {' and '.join(missing)}: pip install 'peft-csgmv[serve]'"
    import transformers

    try:
        from transformers import ContinuousBatchingConfig
        from transformers.generation.continuous_batching import ContinuousBatchingManager
    except ImportError:
        return (
            f"needs transformers' continuous batching (transformers >= 5), found transformers "
            f"{transformers.__version__}: pip install -U transformers"
        )
    config = ContinuousBatchingConfig()
    lacking = [
        name for name in ("num_blocks", "max_batch_tokens", "per_request_processors") if not hasattr(config, name)
    ]
    lacking += [
        name for name in ("add_request", "cancel_request", "get_result") if not hasattr(ContinuousBatchingManager, name)
    ]
    if lacking:
        return (
            f"transformers {transformers.__version__}'s continuous batching lacks {', '.join(lacking)}: "
            "pip install -U transformers"
        )
    return None


# ------------------------------------------------------------------------------------------------------ errors ---- #


class ApiError(Exception):
    """An error answered as OpenAI's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, kind: str = ""):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


# ------------------------------------------------------------------------------------------ request parsing ---- #

# Fields each endpoint takes, and those it accepts only at their default (anything else there is refused by name).
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "user"}
_COMPLETION_FIELDS = _COMMON | {"prompt"}
_CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens"}
_DEFAULT_ONLY = {
    "echo": (False,),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "suffix": (None, ""),
    "best_of": (None, 1),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "logit_bias": (None, {}),
    "seed": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None,),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
}
_SHARED_DEFAULT_ONLY = {"logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "seed"}
_COMPLETION_DEFAULT_ONLY = _SHARED_DEFAULT_ONLY | {"echo", "suffix", "best_of"}
_CHAT_DEFAULT_ONLY = _SHARED_DEFAULT_ONLY | {"top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                                             "functions", "function_call", "response_format"}  # fmt: skip
_WHY = {"seed": "requests share one random generator in continuous batching"}


@dataclass
class Job:
    """One API request, parsed: its prompts (token ids; several for a completions batch), the adapter (``None``:
    the base model) and how to generate."""

    model: str
    adapter: str | None
    prompts: list[list[int]]
    max_tokens: int | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_default(value, defaults: tuple) -> bool:
    """``value`` is one of ``defaults``, type for type where it matters (``0`` is no ``False``, ``True`` no ``1``)."""
    for default in defaults:
        if default is None or isinstance(default, bool):
            if value is default:
                return True
        elif value == default and not isinstance(value, bool):
            return True
    return False


def _check_fields(body: dict, allowed: set[str], default_only: set[str]) -> None:
    for name, value in body.items():
        if name in default_only:
            if not _is_default(value, _DEFAULT_ONLY[name]):
                why = f" ({_WHY[name]})" if name in _WHY else ""
                raise _bad(f"{name}={json.dumps(value)} is not supported here{why}; leave it out", name, "unsupported")
        elif name not in allowed:
            raise _bad(f"Unrecognized request argument supplied: {name}", name, "unsupported")


def _common(body: dict, job: Job, max_tokens_field: str) -> None:
    """The fields both endpoints share (after ``model`` and the prompt)."""
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("stream must be true or false", "stream")
    job.stream = bool(stream)
    options = body.get("stream_options")
    if options is not None:
        if not job.stream:
            raise _bad("stream_options is only allowed when stream is true", "stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _bad('stream_options takes only {"include_usage": true|false}', "stream_options")
        include = options.get("include_usage", False)
        if not isinstance(include, bool):
            raise _bad("stream_options.include_usage must be true or false", "stream_options")
        job.include_usage = include
    max_tokens = body.get(max_tokens_field)
    if max_tokens is not None:
        if not _is_int(max_tokens):
            raise _bad(f"{max_tokens_field} must be an integer", max_tokens_field)
        if max_tokens < 1:
            raise _bad(f"{max_tokens_field} must be at least 1, got {max_tokens}", max_tokens_field)
    job.max_tokens = max_tokens
    temperature = body.get("temperature")
    if temperature is not None:
        if not _is_number(temperature) or not 0 <= temperature <= 2:
            raise _bad(f"temperature must be a number from 0 to 2, got {json.dumps(temperature)}", "temperature")
        job.temperature = float(temperature)
    top_p = body.get("top_p")
    if top_p is not None:
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise _bad(f"top_p must be a number above 0 and at most 1, got {json.dumps(top_p)}", "top_p")
        job.top_p = float(top_p)
    n = body.get("n")
    if n is not None:
        if not _is_int(n) or not 1 <= n <= MAX_N:
            raise _bad(f"n must be an integer from 1 to {MAX_N}, got {json.dumps(n)}", "n")
        job.n = n
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise _bad("stop must be a non-empty string or a list of them", "stop")
        if len(stops) > MAX_STOPS:
            raise _bad(f"stop takes at most {MAX_STOPS} sequences, got {len(stops)}", "stop")
        job.stops = stops


def _message_text(content, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise _bad(f"messages[{index}].content: only text parts are supported, got {kind!r}", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"messages[{index}].content must be a string or a list of text parts", "messages")


# ------------------------------------------------------------------------------------------------- decoding ---- #


class ChoiceText:
    """The text of one choice as its tokens arrive: incremental detokenization (a window over the last tokens, the
    prompt's last ones at first, so a token's leading space shows; text ending in an incomplete character waits for
    the next token), stop sequences (text from the first one on is dropped; text that may start one is held back until
    it is known not to), and the finish reason."""

    def __init__(self, tokenizer, prompt_ids: list[int], stops: list[str], eos_ids: set[int]):
        self.tokenizer, self.stops, self.eos_ids = tokenizer, stops, eos_ids
        self.ids = list(prompt_ids[-6:])
        self.prefix, self.read = 0, len(self.ids)
        self.text = ""  # decoded so far
        self.sent = 0  # characters of ``text`` handed out
        self.tokens = 0  # generated tokens taken in
        self.finish_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _add_token(self, token: int) -> None:
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)

    def _flush(self) -> None:
        """At the end: what the window holds back (an incomplete character) comes out as it decodes."""
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before):
            self.text += after[len(before) :]
        self.prefix = self.read = len(self.ids)

    def feed(self, generated: list[int], finished: bool) -> str:
        """Take the generated tokens so far (all of them; those already taken are skipped) and whether the request
        finished; return the new text to hand out. Sets :attr:`finish_reason` when the choice is done (``"stop"``: a
        stop sequence or an end-of-sequence token; ``"length"``: ``max_tokens``)."""
        if self.finish_reason is not None:
            return ""
        for token in generated[self.tokens :]:
            self.tokens += 1
            if token in self.eos_ids:
                self.finish_reason = "stop"
                break
            self._add_token(token)
            if self.stops and self._cut_at_stop():
                return self._take(len(self.text))
        if finished and self.finish_reason is None:
            self.finish_reason = "length"
        if self.finish_reason is not None:
            self._flush()
            if self.stops:
                self._cut_at_stop()
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def _cut_at_stop(self) -> bool:
        """Where the text holds a stop sequence: cut it there, finish with ``"stop"``."""
        longest = max(len(s) for s in self.stops)
        start = max(0, self.sent - longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        self.finish_reason = "stop"
        return True

    def _held_back(self) -> int:
        """Characters at the end of the text that may be the start of a stop sequence."""
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.text) - self.sent), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return hold

    def _take(self, upto: int) -> str:
        upto = max(upto, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out


# ------------------------------------------------------------------------------------------------------ engine ---- #


@dataclass
class _Route:
    """Where a manager request's results go: its API request's queue (on ``loop``), as choice ``index``."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    index: int


class EngineGone(Exception):
    """The continuous batching manager stopped or died: the request cannot finish."""


def _cache_tokens(manager, cb_config) -> int | None:
    """How many tokens the manager's KV cache holds (a request longer than that could never be scheduled)."""
    processor = getattr(manager, "batch_processor", None)
    cache = getattr(processor, "cache", None)
    if cache is None:
        return None
    per_block = getattr(cb_config, "page_size", None) or getattr(cb_config, "block_size", None)
    num_blocks = getattr(cache, "num_blocks", None)
    if per_block and num_blocks:
        return int(per_block) * int(num_blocks)
    tokens = getattr(cache, "max_tokens_read", None)
    return int(tokens) if tokens else None


class Engine:
    """The model, its tokenizer and the continuous batching manager that runs them, with the bookkeeping the server
    needs: which names it serves, which requests are in flight (per adapter), and the longest request it takes.

    Requests are submitted and cancelled from the event loop, and handed to the submitter thread, which makes the
    manager's calls in order (``add_request`` takes the model's call lock, which a running step holds: the event loop
    must not wait for it); the dispatcher thread hands the manager's results to each request's queue."""

    def __init__(
        self,
        model,
        tokenizer,
        base_name: str,
        adapters: dict[str, str],
        *,
        base_path: str | None = None,
        num_blocks: int | None = None,
        max_batch_tokens: int | None = None,
        cuda_graphs: bool = False,
        varlen_attention: bool = False,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.base_name = base_name
        self.base_path = base_path or base_name
        self.base_names = {base_name, self.base_path}
        self.adapters = dict(adapters)  # served adapter name -> path it was loaded from
        self.num_blocks, self.max_batch_tokens = num_blocks, max_batch_tokens
        self.cuda_graphs = cuda_graphs  # each step as transformers' CUDA graph (batch.Continuous)
        self.varlen_attention = varlen_attention  # attention per request while serving (peft_csgmv.attention)
        self._scope = contextlib.ExitStack()  # what start() changed on the model, undone by stop()
        self.created = int(time.time())
        config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
        self.vocab_size = int(config.get_text_config().vocab_size)
        # How many logits a step gives per token (the output layer's width: at least the vocabulary): top-k over all
        # of them keeps every token (transformers 5.17 indexes past the end with a larger k).
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        self.num_logits = max(int(getattr(head, "out_features", 0) or 0), self.vocab_size)
        self.max_model_len = int(getattr(config.get_text_config(), "max_position_embeddings", 0) or 0) or None
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = list(eos) if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else [])
        if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
            eos.append(tokenizer.eos_token_id)
        self.eos_ids = [int(e) for e in eos]
        self.manager = None
        self._ops: queue.SimpleQueue = queue.SimpleQueue()  # manager calls, in order (see _submitter)
        self._submitter: threading.Thread | None = None
        self._routes: dict[str, _Route] = {}
        self._lock = threading.Lock()  # guards _routes (the dispatcher thread reads it)
        self.in_flight: dict[str | None, int] = {}  # manager requests per adapter (None: base), event-loop side
        self._changing: set[str] = set()  # adapter names being loaded or unloaded
        self._dispatcher: threading.Thread | None = None
        self.dead: str | None = None  # why the manager stopped for good

    # --------------------------------------------------------------------------------------- start and stop ---- #

    def start(self, timeout: float = 120.0) -> None:
        """Start the manager (its cache sized by the flags) and the dispatcher; return once the manager's cache
        exists (its size caps the longest request)."""
        if self.manager is not None:
            return
        from transformers import GenerationConfig

        from .batch import Continuous, _input_device

        for name in self.adapters:
            why = self.refusal(name)
            if why is not None:
                raise ValueError(f"adapter {name!r} cannot be served: {why}")

        # Every request sets its own temperature, top-k and top-p (per-request processors, which exist only where the
        # config's values make transformers build those processors; the values here are placeholders). Greedy is
        # top_k=1.
        generation_config = GenerationConfig(
            do_sample=True, temperature=0.5, top_k=2, top_p=0.5, eos_token_id=self.eos_ids or None,
            pad_token_id=self.tokenizer.pad_token_id, max_new_tokens=16,
        )  # fmt: skip
        sizing = Continuous(
            max_batch_tokens=self.max_batch_tokens, num_blocks=self.num_blocks, cuda_graphs=self.cuda_graphs,
            varlen_attention=self.varlen_attention,
        )  # fmt: skip
        cb_config = sizing.config(_input_device(self.model), [], self.model)  # (the batch command's sizing)
        cb_config.per_request_processors = True
        if self.varlen_attention:
            self._scope.enter_context(attention.varlen_attention(self.model))
        try:
            manager = self.model.init_continuous_batching(
                generation_config=generation_config, continuous_batching_config=cb_config
            )
            if "adapter_id" not in inspect.signature(manager.add_request).parameters:
                raise RuntimeError("this model's continuous batching manager takes no adapter_id: enable csgmv first")
            supported = getattr(getattr(manager, "logit_processor", None), "supported_keys", None)
            lacking = sorted({"temperature", "top_k", "top_p"} - set(supported or ()))
            if supported is not None and lacking:
                raise RuntimeError(
                    f"this transformers' continuous batching cannot set {', '.join(lacking)} per request: "
                    "pip install -U transformers"
                )
            manager.start()
        except BaseException:
            self._scope.close()  # (the model's own attention back)
            raise
        self.manager = manager
        deadline = time.monotonic() + timeout
        while getattr(manager, "batch_processor", None) is None:
            if not manager.is_running():
                raise RuntimeError(f"continuous batching failed to start: {self._fatal_error(manager) or 'it stopped'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"continuous batching did not start within {timeout:.0f} s")
            time.sleep(0.01)
        tokens = _cache_tokens(manager, getattr(manager, "continuous_batching_config", cb_config))
        if tokens is not None:
            self.max_model_len = min(self.max_model_len or tokens, tokens)
        self._dispatcher = threading.Thread(target=self._dispatch, name="peft-csgmv-serve-results", daemon=True)
        self._dispatcher.start()
        self._submitter = threading.Thread(target=self._submit_loop, name="peft-csgmv-serve-submit", daemon=True)
        self._submitter.start()

    def stop(self, timeout: float | None = 30.0, hard: bool = False) -> None:
        """Stop the manager once its requests are done (``timeout``: wait no longer; ``hard``: fail them now) and the
        dispatcher."""
        manager, self.manager = self.manager, None
        if manager is None:
            return
        try:
            if manager.is_running():
                kwargs = (
                    {"hard_stop": True} if hard and "hard_stop" in inspect.signature(manager.stop).parameters else {}
                )
                manager.stop(block=True, timeout=timeout, **kwargs)
        finally:
            self._ops.put(None)
            for thread in (self._dispatcher, self._submitter):
                if thread is not None:
                    thread.join(timeout=5)
            with contextlib.suppress(Exception):
                manager.destroy()
            self._scope.close()  # (the model's own attention back)
            self._fail_all("the server is stopping")

    @staticmethod
    def _fatal_error(manager):
        status = getattr(manager, "background_thread_status", None)
        return getattr(status, "fatal_error", None)

    def _dispatch(self) -> None:
        """The dispatcher thread: every result of the manager to its request's queue, several at a time (one
        ``call_soon_threadsafe`` per loop and batch); ends when the manager stops, failing what is left."""
        manager = self.manager
        while True:
            output = manager.get_result(timeout=0.2)
            if output is None:
                fatal = self._fatal_error(manager)
                if fatal is not None or not manager.is_running():
                    reason = f"continuous batching died: {fatal}" if fatal is not None else "the server is stopping"
                    if fatal is not None:
                        logger.error(reason)
                    self.dead = reason
                    self._fail_all(reason)
                    return
                continue
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            while output is not None:
                with self._lock:
                    route = self._routes.get(output.request_id)
                    if route is not None and output.is_finished():
                        del self._routes[output.request_id]
                if route is not None:  # None: cancelled
                    batches.setdefault(route.loop, []).append((route.queue, (route.index, output)))
                output = manager.get_result(timeout=0)
            for loop, items in batches.items():
                with contextlib.suppress(RuntimeError):  # a closed loop: its requests are gone
                    loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            with contextlib.suppress(RuntimeError):
                route.loop.call_soon_threadsafe(route.queue.put_nowait, (route.index, EngineGone(reason)))

    # ---------------------------------------------------------------------------------------------- names ---- #

    def resolve(self, name) -> str | None:
        """The adapter a request's ``model`` names (``None``: the base model); 404 for a name not served."""
        if not isinstance(name, str) or not name:
            raise _bad("model is required: the base model's name or an adapter's (GET /v1/models lists them)", "model")
        if name in self.adapters:
            return name
        if name in self.base_names:
            return None
        raise ApiError(
            404, f"The model `{name}` does not exist (GET /v1/models lists the names served)", "model",
            "model_not_found", kind="invalid_request_error",
        )  # fmt: skip

    def models(self) -> list[dict]:
        entry = dict(object="model", created=self.created, owned_by="peft-csgmv", max_model_len=self.max_model_len)
        out = [dict(entry, id=self.base_name, root=self.base_path, parent=None)]
        out += [dict(entry, id=name, root=path, parent=self.base_name) for name, path in self.adapters.items()]
        return out

    # ------------------------------------------------------------------------------------ prompts and lengths ---- #

    def completion_prompts(self, prompt) -> list[list[int]]:
        """``prompt`` of /v1/completions as token ids: a string, a list of strings, a list of token ids, or a list of
        such lists."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            prompts = prompt
        else:
            raise _bad(
                "prompt must be a string, a list of strings, a list of token ids or a list of such lists", "prompt"
            )
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids = self.tokenizer(p)["input_ids"]
            else:
                if not p or not all(_is_int(t) and 0 <= t < self.vocab_size for t in p):
                    raise _bad(f"token ids in prompt must be integers from 0 to {self.vocab_size - 1}", "prompt")
                ids = list(p)
            if not ids:
                raise _bad("prompt is empty (no tokens)", "prompt")
            out.append(list(ids))
        return out

    def chat_prompt(self, messages) -> list[int]:
        """``messages`` of /v1/chat/completions through the tokenizer's chat template, as token ids."""
        if not isinstance(messages, list) or not messages:
            raise _bad("messages must be a non-empty list of {role, content} objects", "messages")
        rendered = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a role and a content", "messages")
            if "content" not in message and message["role"] != "assistant":
                raise _bad(f"messages[{i}] has no content", "messages")
            rendered.append(dict(message, content=_message_text(message.get("content"), i)))
        if not getattr(self.tokenizer, "chat_template", None):
            raise _bad("this model's tokenizer has no chat template: use /v1/completions", "messages")
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - the template's own complaint (a role it refuses, ...), to the client
            raise _bad(f"the chat template refused these messages: {e}", "messages")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise _bad("the messages render to no tokens", "messages")
        return list(ids)

    def check_lengths(self, job: Job, prompt_param: str, max_tokens_param: str, default_max_tokens: int | None):
        """Fill in ``job.max_tokens`` (``default_max_tokens``, or what the context leaves) and refuse a prompt the
        model cannot take, or one that leaves no room for ``max_tokens``."""
        limit = self.max_model_len
        longest = max(len(p) for p in job.prompts)
        if limit is not None and longest >= limit:
            raise _bad(
                f"This model's maximum context length is {limit} tokens. However, your prompt is {longest} tokens "
                "(leaving no room for a completion).", prompt_param, "context_length_exceeded",
            )  # fmt: skip
        if job.max_tokens is None:
            job.max_tokens = default_max_tokens or (limit - longest if limit is not None else 16)
        if limit is not None and longest + job.max_tokens > limit:
            raise _bad(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{longest + job.max_tokens} tokens ({longest} in the prompt, {job.max_tokens} for the completion). "
                f"Please reduce the prompt or {max_tokens_param}.", max_tokens_param, "context_length_exceeded",
            )  # fmt: skip

    # ------------------------------------------------------------------------------------- requests in flight ---- #

    def _sampling(self, job: Job) -> dict:
        if job.temperature == 0:  # greedy: only the likeliest token is left to draw
            return {"temperature": 1.0, "top_p": 1.0, "top_k": 1}
        return {"temperature": job.temperature, "top_p": job.top_p, "top_k": self.num_logits}  # (all tokens)

    def hold(self, adapter: str | None, count: int) -> None:
        """Count ``count`` manager requests of ``adapter`` in flight (an adapter with requests in flight is not
        unloaded); :meth:`release` uncounts them."""
        self.in_flight[adapter] = self.in_flight.get(adapter, 0) + count

    def release(self, adapter: str | None, count: int) -> None:
        self.in_flight[adapter] -= count
        if not self.in_flight[adapter]:
            del self.in_flight[adapter]

    def check_serving(self) -> None:
        if self.manager is None or self.dead:
            raise ApiError(503, self.dead or "the server is not serving (starting or stopping)", code="unavailable")

    def submit(self, job: Job, results: asyncio.Queue) -> tuple[list[tuple[str, int, list[int]]], asyncio.Future]:
        """Add the job's manager requests (one per prompt and ``n``), their results to ``results`` as ``(choice
        index, output)``. Returns ``(request id, choice index, prompt ids)`` for each, and a future that is done once
        the manager took them all (its exception: why it did not). The manager's ``add_request`` runs on the
        submitter thread: it takes the model's call lock, which a running step holds."""
        self.check_serving()
        if job.adapter is not None and job.adapter not in self.adapters:  # (unloaded since the request was read)
            raise ApiError(404, f"The model `{job.model}` does not exist", "model", "model_not_found")
        loop = asyncio.get_running_loop()
        tag = uuid.uuid4().hex[:16]
        # Token by token where the server reads them as they come (streams, stop sequences).
        kwargs = dict(max_new_tokens=job.max_tokens, streaming=job.stream or bool(job.stops), adapter_id=job.adapter)
        kwargs.update(self._sampling(job))
        if self.eos_ids:
            kwargs["eos_token_id"] = self.eos_ids
        submitted = []
        for p, prompt in enumerate(job.prompts):
            for k in range(job.n):
                index = p * job.n + k
                submitted.append((f"{tag}-{index}", index, prompt))
        with self._lock:
            for request_id, index, _ in submitted:
                self._routes[request_id] = _Route(loop, results, index)
        done = loop.create_future()
        manager = self.manager

        def add() -> None:
            error = None
            try:
                for request_id, _, prompt in submitted:
                    if manager.add_request(prompt, request_id=request_id, **kwargs) is None:
                        error = ApiError(503, self.dead or "the server is stopping", code="unavailable")
                        break
            except Exception as e:  # noqa: BLE001 - handed to the request's handler
                error = e
            loop.call_soon_threadsafe(_settle, done, error)

        self._ops.put(add)
        return submitted, done

    def cancel(self, request_ids) -> None:
        """Drop these requests: the manager frees their cache at its next step; late results are discarded. (On the
        submitter thread, after their ``add_request``.)"""
        with self._lock:
            known = [rid for rid in request_ids if self._routes.pop(rid, None) is not None]
        manager = self.manager
        if known and manager is not None:
            self._ops.put(lambda: [manager.cancel_request(rid) for rid in known])

    async def _on_submitter(self, fn):
        """Run ``fn`` on the submitter thread, after the manager calls queued before it; its result."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def op():
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - handed to the awaiting handler
                result, error = None, e
            loop.call_soon_threadsafe(_settle, done, error, result)

        self._ops.put(op)
        return await done

    def _submit_loop(self) -> None:
        while True:
            op = self._ops.get()
            if op is None:
                return
            try:
                op()
            except Exception:  # noqa: BLE001 - a cancel of a manager that stopped: nothing left to cancel
                logger.debug("a manager call failed", exc_info=True)

    # ------------------------------------------------------------------------------------------- adapters ---- #

    def refusal(self, name: str) -> str | None:
        """Why csgmv's continuous batching cannot give requests adapter ``name`` (``None``: it can)."""
        from .continuous import refusal

        state = self.model.__dict__.get("_csgmv")
        if state is None:
            return "csgmv is not enabled on the model"
        with state.executor.lock:
            state.sync(self.model)
            return refusal(self.model, state, name)

    def _model_lock(self):
        state = self.model.__dict__.get("_csgmv")
        return state.executor.lock if state is not None else contextlib.nullcontext()

    def _paused(self):
        """The manager's pause: its loop parked between steps, after it took the cancellations queued so far, which
        it applies before it schedules again. Where this transformers has no pause, none (only a failed load, whose
        adapter no request has, gets here then)."""
        manager = self.manager
        if manager is not None and hasattr(manager, "pause") and manager.is_running():
            return manager.pause()
        return contextlib.nullcontext()

    async def load_adapter(self, name, path) -> None:
        """Load adapter ``name`` from ``path`` (PEFT's ``load_adapter``, under the model's call lock: between two
        model steps) and serve it."""
        from .cli import _hub_id_shaped

        if not isinstance(name, str) or not name:
            raise _bad("lora_name is required: the name requests will give as model", "lora_name")
        if not isinstance(path, str) or not path:
            raise _bad("lora_path is required: the adapter's folder (or hub id)", "lora_path")
        if name in self.adapters or name in self.base_names or name in self._changing:
            raise _bad(f"The lora adapter '{name}' has already been loaded.", "lora_name", "adapter_exists")
        if "." in name or name == "__base__":
            raise _bad(f"lora_name {name!r} is not a usable adapter name", "lora_name")
        if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise ApiError(
                404, f"Cannot load adapter {name!r}: no adapter_config.json in {path}", "lora_path", "not_found"
            )
        if not os.path.exists(path) and not _hub_id_shaped(path):
            raise ApiError(404, f"Cannot load adapter {name!r}: no such folder: {path}", "lora_path", "not_found")
        self._changing.add(name)
        try:
            await asyncio.to_thread(self._load, name, path)
        except (ValueError, OSError, TypeError, KeyError) as e:
            raise _bad(f"Cannot load adapter {name!r} from {path}: {type(e).__name__}: {e}", "lora_path")
        finally:
            self._changing.discard(name)
        self.adapters[name] = path

    def _load(self, name: str, path: str) -> None:
        try:
            self.model.load_adapter(path, adapter_name=name)
            self.model.eval()
            why = self.refusal(name)
            if why is not None:
                raise ValueError(f"adapter {name!r} cannot be served: {why}")
        except BaseException:
            if name in getattr(self.model, "peft_config", {}):  # (no request has it: none was given it)
                with self._paused(), self._model_lock():
                    self.model.delete_adapter(name)
            raise

    async def unload_adapter(self, name) -> None:
        """Stop serving adapter ``name`` and delete it from the model; refused (409) while requests of it are in
        flight, and for the last adapter."""
        if not isinstance(name, str) or not name:
            raise _bad("lora_name is required", "lora_name")
        if name not in self.adapters:
            if name in self.base_names:
                raise _bad(f"{name!r} is the base model, not an adapter", "lora_name")
            raise ApiError(404, f"The lora adapter '{name}' is not loaded.", "lora_name", "model_not_found")
        if not hasattr(self.manager, "pause"):
            import transformers

            raise ApiError(
                501, f"unloading needs a continuous batching manager that can pause between steps (pause()); "
                f"transformers {transformers.__version__}'s cannot: pip install -U transformers", "lora_name",
                "unsupported",
            )  # fmt: skip
        busy = self.in_flight.get(name, 0)
        if busy:
            raise ApiError(
                409, f"The lora adapter '{name}' has {busy} request(s) in flight: unload it once they finish.",
                "lora_name", "adapter_in_use",
            )  # fmt: skip
        if len(self.adapters) == 1:
            raise ApiError(
                409, f"The lora adapter '{name}' is the last one loaded: load another before unloading it.",
                "lora_name", "last_adapter",
            )  # fmt: skip
        path = self.adapters.pop(name)  # no new request names it from here on
        self._changing.add(name)
        try:
            # On the submitter thread: after the cancels of this adapter's last requests (a client that left), which
            # the manager's loop then takes before it pauses, and applies before it schedules again.
            await self._on_submitter(functools.partial(self._unload, name))
        except BaseException:
            self.adapters[name] = path
            raise
        finally:
            self._changing.discard(name)

    def _unload(self, name: str) -> None:
        with self._paused(), self._model_lock():
            self.model.delete_adapter(name)


def _settle(future: asyncio.Future, error: BaseException | None, result=None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _put_all(items) -> None:
    for results, item in items:
        results.put_nowait(item)


# ------------------------------------------------------------------------------------------------ responses ---- #


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return dict(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                total_tokens=prompt_tokens + completion_tokens)  # fmt: skip


class _Run:
    """One API request's manager requests, from submission to their end: results come through :attr:`queue`; on
    leaving the block, whatever has not finished is cancelled in the manager."""

    def __init__(self, engine: Engine, job: Job):
        self.engine, self.job = engine, job
        self.queue: asyncio.Queue = asyncio.Queue()  # (choice index, output or exception)
        self.choices: list[ChoiceText] = []
        self.open: dict[int, str] = {}  # choice index -> request id, until its end
        self.prompt_tokens = sum(len(p) for p in job.prompts)

    async def __aenter__(self):
        count = len(self.job.prompts) * self.job.n
        self.engine.hold(self.job.adapter, count)
        try:
            submitted, added = self.engine.submit(self.job, self.queue)
        except BaseException:
            self.engine.release(self.job.adapter, count)
            raise
        eos = set(self.engine.eos_ids)
        for request_id, index, prompt in submitted:
            self.choices.append(ChoiceText(self.engine.tokenizer, prompt, self.job.stops, eos))
            self.open[index] = request_id
        try:
            await added
        except BaseException as e:
            self._close()
            if isinstance(e, ValueError):  # the manager refused the adapter (csgmv's check)
                raise _bad(str(e), "model") from e
            raise
        return self

    def _close(self) -> None:
        # Nothing awaited here: it also runs while the request's task is being cancelled (a client that left).
        try:
            self.engine.cancel(list(self.open.values()))
            self.open.clear()
        finally:
            self.engine.release(self.job.adapter, len(self.job.prompts) * self.job.n)

    async def __aexit__(self, *exc):
        self._close()

    async def events(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """``(choice index, new text, finish reason or None)`` as results arrive, until every choice is done. Results
        that queued up while the client was being written to are taken together: each choice's newest only (a
        result holds every token generated so far), so a stream that fell behind catches up in one event."""
        while self.open:
            pending = [await self.queue.get()]
            while not self.queue.empty():
                pending.append(self.queue.get_nowait())
            newest: dict[int, object] = {}
            for index, output in pending:
                if not _failed(newest.get(index)):  # (a failure ends its choice: what follows it is not read)
                    newest[index] = output
            for index, output in newest.items():
                if index not in self.open:
                    continue
                if isinstance(output, Exception):
                    raise ApiError(503, str(output), code="unavailable")
                if output.error is not None:
                    raise ApiError(500, f"generation failed: {output.error}", code="generation_failed")
                choice = self.choices[index]
                text = choice.feed(list(output.generated_tokens), output.is_finished())
                if choice.finish_reason is not None:
                    request_id = self.open.pop(index)
                    if not output.is_finished():  # a stop sequence: the manager need not go on
                        self.engine.cancel([request_id])
                if text or choice.finish_reason is not None:
                    yield index, text, choice.finish_reason

    @property
    def completion_tokens(self) -> int:
        return sum(c.tokens for c in self.choices)


def _failed(output) -> bool:
    """Whether a queued result is a failure (an exception, or an output with an error)."""
    return isinstance(output, Exception) or getattr(output, "error", None) is not None


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _until_disconnect(request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect(run: _Run, request) -> bool:
    """Run every choice to its end; ``False`` when the client left first (``run``'s exit then cancels them)."""

    async def drain():
        async for _ in run.events():
            pass

    collecting = asyncio.ensure_future(drain())
    watching = asyncio.ensure_future(_until_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        if not collecting.done():
            collecting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await collecting
    if collecting.cancelled():
        return False
    collecting.result()
    return True


# ------------------------------------------------------------------------------------------------------- app ---- #


def build_app(engine: Engine):
    """The FastAPI app serving ``engine`` (started on the app's startup if not yet, stopped on its shutdown)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await asyncio.to_thread(engine.start)
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="peft-csgmv", lifespan=lifespan)

    @app.exception_handler(ApiError)
    async def api_error(request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
        return JSONResponse(body, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def server_error(request, exc: Exception):
        logger.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(ApiError(500, f"{type(exc).__name__}: {exc}").body(), status_code=500)

    async def json_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise _bad(f"the body is not valid JSON: {e}", code="invalid_json")
        if not isinstance(body, dict):
            raise _bad("the body must be a JSON object", code="invalid_json")
        return body

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": engine.models()}

    @app.get("/health")
    async def health():
        engine.check_serving()
        return {"status": "ok"}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        body = await json_body(request)
        _check_fields(body, {"lora_name", "lora_path"}, set())
        await engine.load_adapter(body.get("lora_name"), body.get("lora_path"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        body = await json_body(request)
        _check_fields(body, {"lora_name", "lora_int_id"}, set())
        await engine.unload_adapter(body.get("lora_name"))
        return PlainTextResponse(f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await json_body(request)
        _check_fields(body, _COMPLETION_FIELDS, _COMPLETION_DEFAULT_ONLY)
        adapter = engine.resolve(body.get("model"))
        if "prompt" not in body:
            raise _bad("prompt is required", "prompt")
        job = Job(model=body["model"], adapter=adapter, prompts=engine.completion_prompts(body["prompt"]))
        _common(body, job, "max_tokens")
        engine.check_lengths(job, "prompt", "max_tokens", default_max_tokens=16)  # OpenAI's default
        return await _respond(job, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await json_body(request)
        _check_fields(body, _CHAT_FIELDS, _CHAT_DEFAULT_ONLY)
        adapter = engine.resolve(body.get("model"))
        if "messages" not in body:
            raise _bad("messages is required", "messages")
        job = Job(model=body["model"], adapter=adapter, prompts=[engine.chat_prompt(body["messages"])])
        field_name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        _common(body, job, field_name)
        engine.check_lengths(job, "messages", field_name, default_max_tokens=None)  # what the context leaves
        return await _respond(job, request, chat=True)

    async def _respond(job: Job, request, chat: bool):
        created = int(time.time())
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        engine.check_serving()
        if job.stream:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # (no proxy buffering)
            return StreamingResponse(_stream(job, rid, created, chat), media_type="text/event-stream", headers=headers)
        async with _Run(engine, job) as run:
            if not await _collect(run, request):
                return Response(status_code=499)  # the client left: nobody reads this
        choices = []
        for index, choice in enumerate(run.choices):
            if chat:
                message = {"role": "assistant", "content": choice.text}
                choices.append(dict(index=index, message=message, logprobs=None, finish_reason=choice.finish_reason))
            else:
                choices.append(dict(index=index, text=choice.text, logprobs=None, finish_reason=choice.finish_reason))
        return {
            "id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": job.model, "choices": choices, "usage": _usage(run.prompt_tokens, run.completion_tokens),
        }  # fmt: skip

    async def _stream(job: Job, rid: str, created: int, chat: bool):
        """The server-sent events of a streamed request. The requests are submitted when the stream starts, so a
        client gone before then leaves nothing running; one that leaves during it cancels them (Starlette cancels
        this generator, and the run's exit cancels the requests)."""
        head = dict(id=rid, object="chat.completion.chunk" if chat else "text_completion", created=created,
                    model=job.model)  # fmt: skip
        extra = {"usage": None} if job.include_usage else {}

        def chunk(index: int, text: str | None, finish: str | None, role: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = dict(index=index, delta=delta, logprobs=None, finish_reason=finish)
            else:
                choice = dict(index=index, text=text or "", logprobs=None, finish_reason=finish)
            return _sse(dict(head, choices=[choice], **extra))

        try:
            async with _Run(engine, job) as run:
                if chat:
                    for index in range(len(run.choices)):
                        yield chunk(index, None, None, role=True)
                async for index, text, finish in run.events():
                    if text:
                        yield chunk(index, text, None)
                    if finish is not None:
                        yield chunk(index, None, finish)
            if job.include_usage:
                yield _sse(dict(head, choices=[], usage=_usage(run.prompt_tokens, run.completion_tokens)))
        except ApiError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    return app


# ---------------------------------------------------------------------------------------------------- command ---- #

DESCRIPTION = """\
An OpenAI-compatible HTTP server on transformers' continuous batching: each request runs its own adapter, requests of
different adapters share the model's steps.

endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true streams server-sent events), GET /v1/models,
           POST /v1/load_lora_adapter {"lora_name", "lora_path"}, POST /v1/unload_lora_adapter {"lora_name"},
           GET /health.
model:     "model": "legal" runs the adapter loaded as legal; the base model's name (--served-model-name, by default
           the --base value) runs without adapter.
supported: max_tokens, temperature (0: greedy), top_p, n, stop (up to 4 strings), stream, stream_options.include_usage;
           other fields are refused with a 400 naming the field. Unloading an adapter with requests in flight: 409.
stopping:  Ctrl-C stops taking connections, lets the requests in flight finish, then exits; a second Ctrl-C exits at
           once.
memory:    on a CPU the KV cache holds --num-blocks x 256 tokens (transformers would take 60% of the RAM); on CUDA it
           is sized from the free memory unless --num-blocks is given. A request's prompt and max_tokens together
           must fit both the model's context and the cache. See docs/serve.md."""


def build_parser() -> argparse.ArgumentParser:
    from .batch import CPU_MAX_BATCH_TOKENS, PAGE_SIZE
    from .cli import _adapter_arg, _HelpFormatter, _number

    p = argparse.ArgumentParser(prog="peft-csgmv serve", description=DESCRIPTION, formatter_class=_HelpFormatter)
    p.add_argument("--base", required=True, help="base model: a local folder or a hub id (required)")
    p.add_argument(
        "--adapter", action="append", type=_adapter_arg, required=True, metavar="NAME=PATH",
        help="a LoRA adapter to serve as NAME, from a local folder or a hub id; repeat for more (required)",
    )  # fmt: skip
    p.add_argument("--served-model-name", default=None, help="the base model's name in requests (default: --base)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_number(int, 0, 65535, what="a port from 0 to 65535"), default=8000, help="port")
    p.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if there is one)")
    p.add_argument(
        "--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
        help="dtype the base model is loaded in; auto: the checkpoint's own",
    )  # fmt: skip
    positive = _number(int, 1, what="1 or more")
    p.add_argument(
        "--max-resident-adapters", type=positive, default=None, metavar="N",
        help="keep at most N adapters on the device, the others in host memory; a request waits while the running "
        "requests' adapters and its own would be more than N (default: every adapter on the device)",
    )  # fmt: skip
    p.add_argument(
        "--num-blocks", type=positive, default=None,
        help=f"KV cache blocks of {PAGE_SIZE} tokens (default: {CPU_NUM_BLOCKS} on a CPU; from free memory on CUDA)",
    )  # fmt: skip
    p.add_argument(
        "--max-batch-tokens", type=positive, default=None,
        help=f"tokens per model step at most (default: {CPU_MAX_BATCH_TOKENS} on a CPU; transformers' choice on CUDA)",
    )  # fmt: skip
    p.add_argument(
        "--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
        help="run each model step as transformers' CUDA graph, captured once per step size and replayed (default: on "
        "a CUDA device; on the CPU steps stay eager); --no-cuda-graphs: eager steps",
    )  # fmt: skip
    p.add_argument(
        "--varlen-attention", action=argparse.BooleanOptionalAction, default=None,
        help="attend per request with torch's own flash kernel (CUDA, bf16/fp16, a model transformers runs with flash "
        "attention; for where the flash-attn package is missing) instead of SDPA's one dense mask over every running "
        "request's cache, and lift the cap of requests per step that mask needs (default: "
        f"{attention.command_default()}); --no-varlen-attention: SDPA's",
    )  # fmt: skip
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info", help="uvicorn's")
    return p


def _check_args(args) -> list[str]:
    from .cli import _device_problem, _folder_problem

    problems = []
    names = [name for name, _ in args.adapter]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"--adapter {name}=...: the name {name!r} is given {names.count(name)} times")
    base_name = args.served_model_name or args.base
    for name in names:
        if name in (base_name, args.base, "__base__"):
            problems.append(f"--adapter {name}=...: {name!r} names the base model; choose another name")
        elif "." in name:
            problems.append(f"--adapter {name}=...: adapter names cannot hold a '.'")
    problem = _folder_problem(f"--base {args.base}", args.base, "config.json", "model")
    if problem:
        problems.append(problem)
    for name, path in args.adapter:
        problem = _folder_problem(f"--adapter {name}={path}", path, "adapter_config.json", "adapter")
        if problem:
            problems.append(problem)
    if args.device:
        problem = _device_problem(args.device)
        if problem:
            problems.append(problem)
    return problems


def load_engine(args) -> Engine:
    """Load the model, its tokenizer and the adapters as ``args`` say (see batch.load_model), enable csgmv."""
    from .batch import load_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load_model(
        args.base, dict(args.adapter), args.dtype, None, device, max_resident_adapters=args.max_resident_adapters
    )
    on_cpu = torch.device(device).type == "cpu"
    graphs = args.cuda_graphs
    if graphs is None:  # (on CUDA where the model can replay them)
        from .continuous import graphs_refusal

        graphs = graphs_refusal(model) is None
    num_blocks = args.num_blocks if args.num_blocks is not None else (CPU_NUM_BLOCKS if on_cpu else None)
    base_name = args.served_model_name or args.base
    varlen, varlen_note = attention.command_choice(args.varlen_attention, model)
    if varlen_note is not None:
        print(varlen_note, file=sys.stderr)
    return Engine(
        model, tokenizer, base_name, dict(args.adapter), base_path=args.base, num_blocks=num_blocks,
        max_batch_tokens=args.max_batch_tokens,  # (None: batch.Continuous's default)
        cuda_graphs=graphs, varlen_attention=varlen,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """``peft-csgmv serve``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    prog = parser.prog

    def fail(problems: list[str]) -> int:
        for problem in problems:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        return 2

    why = missing_support()
    if why:
        return fail([why])
    problems = _check_args(args)
    if problems:
        return fail(problems)
    from .cli import check_hub_args

    problems = check_hub_args(args)
    if problems:
        return fail(problems)
    import uvicorn

    engine = load_engine(args)
    try:
        engine.start()
    except (ValueError, RuntimeError) as e:
        return fail([str(e)])

    class Server(uvicorn.Server):
        interrupted = False  # (a Ctrl-C came: uvicorn raises it again once shut down, but not always where we see it)

        def handle_exit(self, sig, frame) -> None:
            self.interrupted = self.interrupted or sig == signal.SIGINT
            super().handle_exit(sig, frame)

    config = uvicorn.Config(build_app(engine), host=args.host, port=args.port, log_level=args.log_level)
    server = Server(config)
    names = ", ".join(engine.adapters)
    print(f"{prog}: serving {engine.base_name} and its adapters {names} (max {engine.max_model_len} tokens a request)",
          file=sys.stderr)  # fmt: skip
    interrupted = False
    try:
        server.run()
    except KeyboardInterrupt:  # (uvicorn raises the Ctrl-C again once it has shut down)
        interrupted = True
    finally:
        engine.stop(timeout=5, hard=True)  # (after a second Ctrl-C, requests may still run)
    if server.force_exit:
        print(f"{prog}: stopped without waiting for the requests in flight", file=sys.stderr)
    else:
        print(f"{prog}: stopped: the requests in flight finished", file=sys.stderr)
    return 130 if interrupted or server.interrupted else 0
