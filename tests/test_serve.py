"""``peft-csgmv serve``, driven over HTTP (httpx) on a tiny random-weight Llama with a character tokenizer and saved
LoRA adapters: completions and chat, streamed and not, against stock PEFT running each request alone (greedy, fp32);
concurrent requests of different adapters; stop sequences and ``n``; every bad request; adapter load / use / unload;
a client leaving mid-stream; ``--max-resident-adapters``; Ctrl-C draining a subprocess server. Without fastapi /
uvicorn or transformers' continuous batching, the server tests skip and ``serve`` fails with one line."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch

from peft_csgmv import serve
from peft_csgmv.cli import main as cli_main
from peft_csgmv.toy import char_tokenizer, tiny_llama, with_adapters

MISSING = serve.missing_support()
needs_serving = pytest.mark.skipif(MISSING is not None, reason=f"serve cannot run here: {MISSING}")

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
EOS = 2
ADAPTERS = {"legal": (4, 10), "chat": (8, 11), "code": (16, 12)}  # name: (rank, seed); code is loaded while serving
SERVED = ("legal", "chat")


def _save_adapter(root: str, name: str, rank: int, seed: int) -> str:
    path = os.path.join(root, "adapters", name)
    with_adapters(tiny_llama(), {name: rank}, seed=seed).save_pretrained(path)
    nested = os.path.join(path, name)  # (PEFT nests a non-default adapter name)
    return nested if os.path.isdir(nested) else path


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    """A saved base model (its end-of-sequence logit always 0: greedy runs never stop early, so lengths are
    max_tokens), its tokenizer with a chat template, and three adapters."""
    root = str(tmp_path_factory.mktemp("serve"))
    base = tiny_llama()
    with torch.no_grad():
        base.lm_head.weight[EOS] = 0
    base_dir = os.path.join(root, "base")
    base.save_pretrained(base_dir)
    tokenizer = char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(base_dir)
    adapters = {name: _save_adapter(root, name, r, seed) for name, (r, seed) in ADAPTERS.items()}
    return base_dir, adapters


@pytest.fixture(scope="module")
def stock(checkout):
    """Stock PEFT (no csgmv) with every adapter, and a function running one request alone through it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, adapters = checkout
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), adapters["legal"], "legal")
    for name in ("chat", "code"):
        model.load_adapter(adapters[name], adapter_name=name)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(base_dir)

    @torch.no_grad()
    def alone(prompt_ids: list[int], adapter: str | None, new_tokens: int) -> str:
        x = torch.tensor([prompt_ids])
        kw = dict(attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if adapter is None:
            with model.disable_adapter():
                out = model.generate(x, eos_token_id=EOS, **kw)
        else:
            model.set_adapter(adapter)
            out = model.generate(x, eos_token_id=EOS, **kw)
        return tokenizer.decode(out[0, len(prompt_ids) :].tolist(), skip_special_tokens=True)

    def ids(text: str) -> list[int]:
        return tokenizer(text)["input_ids"]

    def chat_ids(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    alone.ids, alone.chat_ids = ids, chat_ids
    return alone


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(checkout, *extra) -> list[str]:
    base_dir, adapters = checkout
    args = ["--base", base_dir, "--device", "cpu", "--num-blocks", "4", "--max-batch-tokens", "64", *extra]
    for name in SERVED:
        args += ["--adapter", f"{name}={adapters[name]}"]
    return args


class Server:
    """An in-process server (uvicorn in a thread) and an httpx client to it."""

    def __init__(self, checkout, *extra):
        import httpx
        import uvicorn

        args = serve.build_parser().parse_args(_args(checkout, *extra))
        self.engine = serve.load_engine(args)
        self.base = args.base
        self.port = _free_port()
        config = uvicorn.Config(serve.build_app(self.engine), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60)

    def post(self, path: str, body=None, **kw):
        return self.client.post(path, json=body, **kw) if body is not None else self.client.post(path, **kw)

    def stream(self, path: str, body: dict) -> list:
        """A streamed request's events: each ``data:`` payload parsed (``"[DONE]"`` kept as is)."""
        with self.client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, r.read()
            assert r.headers["content-type"].startswith("text/event-stream")
            return [_event(line) for line in r.iter_lines() if line]

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no request is in flight in the server or in the manager."""
        deadline = time.monotonic() + timeout
        while True:
            scheduler = self.engine.manager.batch_processor.scheduler
            engine = self.engine
            if not (engine.in_flight or engine._routes or scheduler.active_requests or scheduler.waiting_requests):
                return
            assert time.monotonic() < deadline, f"still busy: {self.engine.in_flight}, {list(self.engine._routes)}"
            time.sleep(0.02)

    def close(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()
        assert self.engine.manager is None  # the app's shutdown stopped the engine


def _event(line: str):
    assert line.startswith("data: "), line
    payload = line[len("data: ") :]
    return payload if payload == "[DONE]" else json.loads(payload)


def _stream_text(events: list, chat: bool = False) -> tuple[dict[int, str], dict[int, str]]:
    """The text and finish reason of each choice of a streamed answer (which must end with ``[DONE]``)."""
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    texts, finish = {}, {}
    for event in events[:-1]:
        for choice in event["choices"]:
            i = choice["index"]
            piece = choice["delta"].get("content") if chat else choice["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            if choice["finish_reason"] is not None:
                assert i not in finish, "a choice finished twice"
                finish[i] = choice["finish_reason"]
    return texts, finish


@pytest.fixture(scope="module")
def server(checkout):
    if MISSING is not None:
        pytest.skip(MISSING)
    s = Server(checkout)
    yield s
    s.close()


# ---------------------------------------------------------------------------------------------- the answers ---- #


@needs_serving
def test_models_lists_the_base_and_every_adapter(server, checkout):
    r = server.client.get("/v1/models")
    assert r.status_code == 200
    data = r.json()["data"]
    assert [m["id"] for m in data] == [server.base, "legal", "chat"]
    assert all(m["object"] == "model" and m["max_model_len"] == 512 for m in data)
    assert data[0]["parent"] is None and {m["parent"] for m in data[1:]} == {server.base}
    assert server.client.get("/health").json() == {"status": "ok"}


@needs_serving
@pytest.mark.parametrize("model", ["legal", "chat", "base"])
def test_completion_is_the_request_run_alone(server, stock, model):
    """Non-streamed and streamed completions (greedy) equal stock PEFT's run of the request alone; usage counts."""
    adapter = None if model == "base" else model
    name = server.base if model == "base" else model
    prompt = "the contract says"
    want = stock(stock.ids(prompt), adapter, 12)
    body = dict(model=name, prompt=prompt, max_tokens=12, temperature=0)
    r = server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == name and out["id"].startswith("cmpl-")
    assert out["choices"] == [dict(index=0, text=want, logprobs=None, finish_reason="length")]
    assert out["usage"] == dict(prompt_tokens=len(prompt), completion_tokens=12, total_tokens=len(prompt) + 12)
    events = server.stream("/v1/completions", dict(body, stream=True, stream_options={"include_usage": True}))
    texts, finish = _stream_text(events)
    assert texts == {0: want} and finish == {0: "length"}
    assert events[-2]["choices"] == [] and events[-2]["usage"] == out["usage"]
    assert all(e["usage"] is None for e in events[:-2])


@needs_serving
def test_chat_is_the_request_run_alone(server, stock):
    """Chat through the tokenizer's template, streamed and not: a role chunk first, then the text; max_tokens
    unset runs to the context's end (here cut by max_completion_tokens)."""
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = stock(stock.chat_ids(messages), "chat", 10)
    body = dict(model="chat", messages=messages, max_completion_tokens=10, temperature=0)
    out = server.post("/v1/chat/completions", body).json()
    assert out["object"] == "chat.completion"
    assert out["choices"] == [
        dict(index=0, message={"role": "assistant", "content": want}, logprobs=None, finish_reason="length")
    ]
    assert out["usage"]["prompt_tokens"] == len(stock.chat_ids(messages))
    events = server.stream("/v1/chat/completions", dict(body, stream=True))
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert _stream_text(events, chat=True) == ({0: want}, {0: "length"})
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]}]
    out = server.post("/v1/chat/completions", dict(model="chat", messages=parts, max_tokens=10, temperature=0))
    plain = [{"role": "user", "content": "hi there"}]
    assert out.json()["choices"][0]["message"]["content"] == stock(stock.chat_ids(plain), "chat", 10)


@needs_serving
def test_concurrent_requests_of_different_adapters(server, stock):
    """Requests of two adapters and the base model at once, streamed and not, each of its own length: each
    equals its alone-run (they share the manager's steps)."""
    cases = [("legal", "hello there", 30), (None, "good day", 22), ("chat", "the contract says", 26),
             ("legal", "ok", 18), ("chat", "no", 34), (None, "what now?", 28)]  # fmt: skip
    want = [stock(stock.ids(p), a, n) for a, p, n in cases]
    assert len(set(want)) == len(want), "the adapters change nothing: the test would prove nothing"

    def run(i):
        adapter, prompt, n = cases[i]
        body = dict(model=adapter or server.base, prompt=prompt, max_tokens=n, temperature=0)
        if i % 2:
            return _stream_text(server.stream("/v1/completions", dict(body, stream=True)))[0][0]
        return server.post("/v1/completions", body).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        got = list(pool.map(run, range(len(cases))))
    assert got == want
    server.wait_idle()


@needs_serving
def test_stop_sequences_and_n(server, stock):
    """``stop`` cuts the text before the first stop sequence (finish_reason stop), streamed or not, also where a
    stop sequence spans tokens; ``n`` and a list of prompts give one choice each, indexed as OpenAI does."""
    full = stock(stock.ids("hello there"), "legal", 30)
    stop = full[9:12]
    cut = full[: full.index(stop)]
    body = dict(model="legal", prompt="hello there", max_tokens=30, temperature=0, stop=["\u00e9t\u00e9", stop])
    out = server.post("/v1/completions", body).json()
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == full.index(stop) + len(stop)
    assert _stream_text(server.stream("/v1/completions", dict(body, stream=True))) == ({0: cut}, {0: "stop"})

    prompts = ["hello there", "ok"]
    out = server.post("/v1/completions", dict(model="chat", prompt=prompts, n=2, max_tokens=8, temperature=0)).json()
    want = [stock(stock.ids(p), "chat", 8) for p in prompts]
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    assert [c["text"] for c in out["choices"]] == [want[0], want[0], want[1], want[1]]
    assert out["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)  # (once per prompt, whatever n)
    body = dict(model="chat", prompt=prompts[0], n=3, max_tokens=8, temperature=0, stream=True)
    texts, finish = _stream_text(server.stream("/v1/completions", body))
    assert texts == {i: want[0] for i in range(3)} and finish == {i: "length" for i in range(3)}
    ids = stock.ids("ok")
    out = server.post("/v1/completions", dict(model="chat", prompt=ids, max_tokens=8, temperature=0)).json()
    assert out["choices"][0]["text"] == want[1]


@needs_serving
def test_sampling(server):
    """temperature and top_p: sampled completions, each ending at max_tokens or at an end-of-sequence token (the
    test model's has logit 0, and may be drawn). Sampling keeps every token through top-k over the output layer's
    width, never a larger k (transformers 5.17's per-request top-k indexes past the logits with one)."""
    engine = server.engine
    job = types.SimpleNamespace(temperature=1.2, top_p=0.9)
    assert engine._sampling(job)["top_k"] == engine.model.get_output_embeddings().out_features
    body = dict(model="legal", prompt="hello", max_tokens=20, temperature=1.2, top_p=0.9, n=2)
    out = server.post("/v1/completions", body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert all(c["finish_reason"] in ("length", "stop") for c in out["choices"])
    assert 2 <= out["usage"]["completion_tokens"] <= 40
    if all(c["finish_reason"] == "length" for c in out["choices"]):
        assert out["usage"]["completion_tokens"] == 40


# ------------------------------------------------------------------------------------------ bad requests ---- #

LONG = "x" * 600  # 600 tokens: beyond the model's 512

BAD = [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", {"prompt": "hi"}, 400, "model"),
    ("/v1/completions", {"model": "legal"}, 400, "prompt"),
    ("/v1/completions", {"model": "legal", "prompt": LONG}, 400, "prompt"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "max_tokens": 511}, 400, "max_tokens"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "max_tokens": "9"}, 400, "max_tokens"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "temperature": 2.5}, 400, "temperature"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "logprobs": 2}, 400, "logprobs"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "echo": True}, 400, "echo"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "seed": 1}, 400, "seed"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "frobnicate": 1}, 400, "frobnicate"),
    ("/v1/completions", {"model": "legal", "prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("/v1/completions", {"model": "legal", "prompt": [5, 100000]}, 400, "prompt"),
    ("/v1/completions", {"model": "legal", "prompt": ""}, 400, "prompt"),
    ("/v1/chat/completions", {"model": "chat"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "chat", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "chat", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400,
     "tools"),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
]  # fmt: skip


@needs_serving
def test_bad_requests_get_openai_errors_and_disturb_nothing(server, stock):
    """Each bad request: a 4xx with OpenAI's error JSON naming the field, while a streamed request runs on,
    unchanged."""
    want = stock(stock.ids("hello there"), "legal", 120)
    body = dict(model="legal", prompt="hello there", max_tokens=120, temperature=0, stream=True)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.stream, "/v1/completions", body)
        for path, payload, status, param in BAD:
            if isinstance(payload, bytes):
                r = server.post(path, content=payload, headers={"content-type": "application/json"})
            else:
                r = server.post(path, payload)
            assert r.status_code == status, (payload, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
            assert error["type"] == "invalid_request_error" and error["param"] == param, (payload, error)
        assert _stream_text(running.result()) == ({0: want}, {0: "length"})
    r = server.client.get("/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such endpoint: GET /v1/nowhere"
    assert server.client.get("/v1/completions").status_code == 405
    server.wait_idle()


# -------------------------------------------------------------------------------------------- adapters ---- #


@needs_serving
def test_load_use_and_unload_an_adapter(server, stock, checkout):
    """/v1/load_lora_adapter serves a new adapter at once (its answers are stock PEFT's); unloading it while a
    request runs is refused (409); after, its name is unknown again. Loading a taken name or a missing folder, and
    unloading an unknown adapter or the last one, are refused. The model's active adapter can go and come back."""
    _, adapters = checkout
    r = server.post("/v1/load_lora_adapter", {"lora_name": "code", "lora_path": adapters["code"]})
    assert r.status_code == 200 and "code" in r.text
    assert "code" in [m["id"] for m in server.client.get("/v1/models").json()["data"]]
    want = stock(stock.ids("hello there"), "code", 15)
    out = server.post("/v1/completions", dict(model="code", prompt="hello there", max_tokens=15, temperature=0))
    assert out.json()["choices"][0]["text"] == want
    bad = [({"lora_name": "code", "lora_path": adapters["code"]}, 400, "adapter_exists"),
           ({"lora_name": "legal", "lora_path": adapters["code"]}, 400, "adapter_exists"),
           ({"lora_name": "other", "lora_path": "/no/such/folder"}, 404, "not_found"),
           ({"lora_name": "other"}, 400, None), ({"lora_path": adapters["code"]}, 400, None)]  # fmt: skip
    for body, status, code in bad:
        r = server.post("/v1/load_lora_adapter", body)
        assert r.status_code == status and r.json()["error"]["code"] == code, (body, r.text)

    if not hasattr(server.engine.manager, "pause"):  # (a manager that cannot pause: no unloading, said as such)
        r = server.post("/v1/unload_lora_adapter", {"lora_name": "code"})
        assert r.status_code == 501 and r.json()["error"]["code"] == "unsupported", r.text
        assert "code" in [m["id"] for m in server.client.get("/v1/models").json()["data"]]
        return
    body = dict(model="code", prompt="hello there", max_tokens=300, temperature=0, stream=True)
    with server.client.stream("POST", "/v1/completions", json=body) as running:
        lines = running.iter_lines()
        assert _event(next(lines))["choices"][0]["text"]
        r = server.post("/v1/unload_lora_adapter", {"lora_name": "code"})
        assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_in_use", r.text
        rest = [_event(line) for line in lines if line]
    assert rest[-1] == "[DONE]"
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "code"})
    assert r.status_code == 200, r.text
    r = server.post("/v1/completions", dict(model="code", prompt="hi"))
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "code"})
    assert r.status_code == 404
    assert [m["id"] for m in server.client.get("/v1/models").json()["data"]] == [server.base, "legal", "chat"]

    # The model's active adapter (PEFT's first), unloaded and loaded again; the last one cannot go (409).
    assert server.post("/v1/unload_lora_adapter", {"lora_name": "legal"}).status_code == 200
    r = server.post("/v1/unload_lora_adapter", {"lora_name": "chat"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "last_adapter"
    for model in ("chat", None):
        body = dict(model=model or server.base, prompt="hello there", max_tokens=15, temperature=0)
        text = server.post("/v1/completions", body).json()["choices"][0]["text"]
        assert text == stock(stock.ids("hello there"), model, 15)
    r = server.post("/v1/load_lora_adapter", {"lora_name": "legal", "lora_path": adapters["legal"]})
    assert r.status_code == 200
    out = server.post("/v1/completions", dict(model="legal", prompt="hello there", max_tokens=15, temperature=0))
    assert out.json()["choices"][0]["text"] == stock(stock.ids("hello there"), "legal", 15)


@needs_serving
def test_a_client_leaving_frees_its_request(server, stock, monkeypatch):
    """A client that closes a stream, or gives up on a non-streamed answer, has its request cancelled in the
    manager, which then holds no request; a request beside them goes on, unchanged."""
    import httpx

    manager = server.engine.manager
    cancelled = []

    def cancel_request(request_id):
        cancelled.append(request_id)
        type(manager).cancel_request(manager, request_id)

    monkeypatch.setattr(manager, "cancel_request", cancel_request, raising=False)
    body = dict(model="legal", prompt="hello there", max_tokens=480, temperature=0)
    other = dict(model="chat", prompt="ok", max_tokens=60, temperature=0)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(server.stream, "/v1/completions", dict(other, stream=True))
        with server.client.stream("POST", "/v1/completions", json=dict(body, stream=True)) as r:
            assert _event(next(r.iter_lines()))["choices"]
        with pytest.raises(httpx.ReadTimeout):
            server.client.post("/v1/completions", json=body, timeout=0.3)
        server.wait_idle()
        assert _stream_text(running.result())[0] == {0: stock(stock.ids("ok"), "chat", 60)}
    assert len(cancelled) == 2, cancelled


@needs_serving
def test_max_resident_adapters_gates_requests(checkout, stock):
    """With --max-resident-adapters 1, requests of two adapters at once take turns (a step never needs both
    slots): each is still its alone-run."""
    server = Server(checkout, "--max-resident-adapters", "1")
    try:
        cases = [("legal", "hello there", 20), ("chat", "good day", 20), ("legal", "ok", 12), (None, "no", 9),
                 ("chat", "what now?", 16)]  # fmt: skip
        assert _at_once(server, cases) == [stock(stock.ids(p), a, n) for a, p, n in cases]
        assert server.engine.dead is None
    finally:
        server.close()


def _at_once(server, cases) -> list[str]:
    """The greedy completion texts of ``cases`` ``(adapter or None, prompt, max_tokens)``, all requested at once."""

    def run(case):
        adapter, prompt, n = case
        body = dict(model=adapter or server.base, prompt=prompt, max_tokens=n, temperature=0)
        return server.post("/v1/completions", body).json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        return list(pool.map(run, cases))


@needs_serving
def test_cuda_graphs_serve_each_request_its_adapter(checkout, stock, monkeypatch):
    """--cuda-graphs: every model step the graphed way (on the CPU, ``continuous.GRAPHED_ON_CPU``: plans and groups
    at fixed addresses rewritten before each step), requests of two adapters and the base at once: each is its
    alone-run."""
    from peft_csgmv import continuous

    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    server = Server(checkout, "--cuda-graphs")
    try:
        assert server.engine.cuda_graphs
        cases = [("legal", "hello there", 14), ("chat", "good day", 10), (None, "no", 9), ("chat", "what now?", 12)]
        assert _at_once(server, cases) == [stock(stock.ids(p), a, n) for a, p, n in cases]
        router = server.engine.manager._csgmv_router
        assert router.graphed and router.graph_key is not None, "no step ran the graphed way"
        assert server.engine.dead is None
    finally:
        server.close()


@needs_serving
def test_varlen_attention_serves_each_request_its_adapter(checkout, stock, monkeypatch):
    """--varlen-attention (its kernel stood in for by the float64 reference of tests/test_attention.py, which the GPU
    tests hold the kernel to): requests of two adapters and the base at once are each their alone-run, transformers
    passes each request's lengths (no dense mask), and stopping the server gives the model its own attention back."""
    from test_attention import reference

    from peft_csgmv import attention

    calls = []
    monkeypatch.setattr(attention, "refusal", lambda model: None)
    monkeypatch.setattr(attention, "flash_varlen", lambda *a: (calls.append(1), reference(*a))[1])
    server = Server(checkout, "--varlen-attention")
    config = server.engine.model.get_base_model().config
    try:
        assert server.engine.varlen_attention
        assert config._attn_implementation == attention.implementation_name()
        cases = [("legal", "hello there", 14), ("chat", "good day", 10), (None, "no", 9), ("chat", "what now?", 12)]
        assert _at_once(server, cases) == [stock(stock.ids(p), a, n) for a, p, n in cases]
        assert calls and server.engine.dead is None
    finally:
        server.close()
    assert config._attn_implementation == "sdpa"


# ------------------------------------------------------------------------------------------ the command ---- #


@needs_serving
def test_ctrl_c_drains_and_exits(checkout, stock, tmp_path):
    """The command in a subprocess: Ctrl-C while a stream runs lets it finish whole, then the server exits (130)
    with one line and no traceback."""
    import httpx

    port = _free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "peft_csgmv", "serve", *_args(checkout), "--port", str(port), "--log-level", "info"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, open(tmp_path / "serve.log").read()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)
        body = dict(model="chat", prompt="hello there", max_tokens=200, temperature=0, stream=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = _event(next(lines))
            proc.send_signal(signal.SIGINT)
            events = [first] + [_event(line) for line in lines if line]
        assert _stream_text(events) == ({0: stock(stock.ids("hello there"), "chat", 200)}, {0: "length"})
        assert proc.wait(timeout=30) == 130
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = open(tmp_path / "serve.log").read()
    assert "Traceback" not in text, text
    assert "peft-csgmv serve: stopped: the requests in flight finished" in text


def test_serve_without_support_fails_in_one_line(checkout, monkeypatch, capsys):
    """Where serving cannot run (transformers without continuous batching, no fastapi / uvicorn): one line, exit
    2, before anything loads. Bad arguments: one line each."""
    if MISSING is None:
        monkeypatch.setattr(serve, "missing_support", lambda: "needs fastapi: pip install 'peft-csgmv[serve]'")
    assert cli_main(["serve", *_args(checkout)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("peft-csgmv serve: error: ") and "pip install" in err[0], err
    if MISSING is None:
        monkeypatch.undo()
        base_dir, adapters = checkout
        args = ["serve", "--base", base_dir + "-missing", "--adapter", f"a={adapters['legal']}",
                "--adapter", f"a={adapters['chat']}", "--adapter", f"b.c={adapters['chat']}"]  # fmt: skip
        assert cli_main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 3 and all(line.startswith("peft-csgmv serve: error: ") for line in err), err


# ------------------------------------------------------------------------------------------- the text ---- #


def test_choice_text_streams_stops_and_finishes():
    """The incremental text of a choice: stop sequences held back until known, cut at the first; the end of
    sequence finishes with stop, max_tokens with length."""
    tok = char_tokenizer()
    ids = tok("abcdef")["input_ids"]
    choice = serve.ChoiceText(tok, tok("xy")["input_ids"], ["cd", "zz"], {EOS})
    pieces = [choice.feed(ids[:k], False) for k in range(1, 4)]
    assert pieces == ["a", "b", ""] and choice.finish_reason is None  # "c" may start "cd": held back
    assert choice.feed(ids[:4], False) == "" and choice.finish_reason == "stop" and choice.tokens == 4
    assert choice.text == "ab"

    choice = serve.ChoiceText(tok, [], ["cx"], {EOS})
    assert choice.feed(ids[:3], False) == "ab"
    assert choice.feed(ids[:3] + [EOS], True) == "c" and choice.finish_reason == "stop" and choice.tokens == 4
    choice = serve.ChoiceText(tok, [], [], {EOS})
    assert choice.feed(ids, True) == "abcdef" and choice.finish_reason == "length"
