"""``peft-csgmv serve`` under many concurrent streaming clients against ``generate_batch`` on the same requests, in one
run: throughput, time to first token and per-token latency (p50, p99), and whether every response is complete and
the same as ``generate_batch``'s.

    python benchmarks/bench_serve.py --model 1b --requests 256 --clients 64 --out results/serve_1b.json

A checkout saved to a temporary folder (a built-in Llama layout's random bf16 weights, a character tokenizer, 32
LoRA adapters r=16 on all 7 projections) and a seeded workload of ``--requests`` prompts of ``--words`` random words,
each with one of the adapters (in turn) and its own ``max_tokens`` in ``--new-min``..``--new-max``. Decoding is greedy
in both rows (the server's ``temperature: 0`` is top-k 1 over transformers' per-request processors; ``generate_batch``
runs the same settings). Every row's steps run as CUDA graphs on CUDA (the server's default; ``--no-cuda-graphs``:
eager steps everywhere), and every row attends as the server chooses (``peft_csgmv.attention.command_choice``: per
request where it can run; ``--no-varlen-attention``: SDPA's everywhere).

1. ``generate_batch``: the checkout loaded as the server loads it (``peft_csgmv.batch.load_model``, csgmv enabled), with
   the server's continuous-batching sizing, twice: all requests given at once, then fed as the clients feed the server
   (``--clients`` requests in flight, the next added as one ends: the same concurrency without HTTP, so the server's
   own cost shows apart from the concurrency); tok/s = generated tokens over its wall time. The model is then freed.
2. The server: ``python -m peft_csgmv serve`` in a process of its own, ``--clients`` asynchronous clients (httpx)
   taking the requests from one queue, each streaming ``/v1/completions`` (``"model"``: the request's adapter) and
   starting its next request as one ends. tok/s = completion tokens (from each stream's usage) over the time from the
   first request sent to the last response ended; time to first token = from a request sent to its first text; per
   token = (last text - first text) / (tokens - 1).

The table is printed last; the JSON holds the GPU name, versions and date. On a CPU, ``--model tiny`` runs in a minute
or two (its times say nothing of a GPU's).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

from peft_csgmv.bench import run_meta, write_results

from common import save_checkout

VOCAB = ["the", "contract", "says", "hello", "model", "adapter", "prompt", "batch", "token", "tenant"]


def workload(args) -> list[dict]:
    rng = random.Random(args.seed)
    low, high = (int(n) for n in args.words.split(","))
    return [
        dict(
            prompt=" ".join(rng.choice(VOCAB) for _ in range(rng.randint(low, high))),
            adapter=f"a{i % args.adapters}",
            max_tokens=rng.randint(args.new_min, args.new_max),
        )
        for i in range(args.requests)
    ]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))] if values else float("nan")


def batch_rows(
    base: str,
    adapters: dict[str, str],
    requests: list[dict],
    device: str,
    dtype: str,
    clients: int,
    graphs: bool,
    varlen: bool | None,
) -> list[tuple[dict, list]]:
    """``generate_batch`` with the server's sizing and greedy decoding, twice on one loaded model: every request given
    at once, then fed as the clients feed the server (the first ``clients`` requests, then one more as each ends), so
    that the server's own cost shows apart from how many requests it has in flight; attending as the server does
    (``varlen``: its --[no-]varlen-attention)."""
    import contextlib

    from transformers import GenerationConfig

    from peft_csgmv import attention, serve
    from peft_csgmv.batch import Continuous, _input_device, load_model

    model, tokenizer = load_model(base, adapters, dtype, None, device)
    on_cpu = torch.device(device).type == "cpu"
    varlen, note = attention.command_choice(varlen, model)
    print(f"attention: {'per request' if varlen else 'SDPA'}" + (f" ({note})" if note else ""), flush=True)
    blocks = serve.CPU_NUM_BLOCKS if on_cpu else None
    sizing = Continuous(num_blocks=blocks, cuda_graphs=graphs, varlen_attention=varlen)
    inputs = [tokenizer(r["prompt"])["input_ids"] for r in requests]
    longest = max(r["max_tokens"] for r in requests)
    gen = GenerationConfig(do_sample=True, top_k=1, temperature=1.0, max_new_tokens=longest,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    config = sizing.config(_input_device(model), [len(p) + r["max_tokens"] for p, r in zip(inputs, requests)])
    out = []
    scope = attention.varlen_attention(model) if varlen else contextlib.nullcontext()
    with scope:  # (the model's own attention back after both rows)
        for label, in_flight in (("generate_batch (all requests at once)", len(requests)),
                                 (f"generate_batch, at most {clients} requests in flight (fed as the clients do)",
                                  clients)):  # fmt: skip
            manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
            manager.start()
            texts: list = [None] * len(requests)
            try:
                for i, (ids, r) in enumerate(zip(inputs[:4], requests[:4])):  # (warm-up, untimed)
                    manager.add_request(ids, request_id=f"warm{i}", max_new_tokens=4, adapter_id=r["adapter"])
                for _ in range(min(4, len(requests))):
                    manager.get_result(timeout=600)
                start = time.perf_counter()
                fed = 0

                def feed(upto: int, manager=manager) -> None:
                    nonlocal fed
                    while fed < min(upto, len(requests)):
                        r = requests[fed]
                        manager.add_request(inputs[fed], request_id=f"r{fed}", max_new_tokens=r["max_tokens"],
                                            adapter_id=r["adapter"])  # fmt: skip
                        fed += 1

                feed(in_flight)
                tokens, done = 0, 0
                while done < len(requests):
                    result = manager.get_result(timeout=600)
                    if result is None:
                        raise RuntimeError("generate_batch: no result for 600 s")
                    if not result.is_finished() or not result.request_id.startswith("r"):
                        continue
                    if result.error is not None:
                        raise RuntimeError(f"{result.request_id}: {result.error}")
                    done += 1
                    feed(done + in_flight)
                    tokens += len(result.generated_tokens)
                    texts[int(result.request_id[1:])] = tokenizer.decode(
                        result.generated_tokens, skip_special_tokens=True
                    )
                seconds = time.perf_counter() - start
            finally:
                manager.stop(block=True)
            out.append((dict(row=label, tokens=tokens, seconds=seconds), texts))
            del manager
    del model
    gc.collect()  # (the server sizes its cache from the free memory: this process's model and cache go first)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


async def drive(url: str, requests: list[dict], clients: int) -> tuple[list[dict], float]:
    """Every request streamed by ``clients`` concurrent clients; one record per request, and the wall time."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for i, r in enumerate(requests):
        queue.put_nowait((i, r))
    records: list = [None] * len(requests)

    async def client(http: httpx.AsyncClient) -> None:
        while True:
            try:
                i, r = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            body = dict(model=r["adapter"], prompt=r["prompt"], max_tokens=r["max_tokens"], temperature=0,
                        stream=True, stream_options={"include_usage": True})  # fmt: skip
            sent, first, last, text, usage = time.perf_counter(), None, None, [], None
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    raise RuntimeError(f"request {i}: HTTP {response.status_code}: {await response.aread()}")
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        if choice.get("text"):
                            now = time.perf_counter()
                            first = first if first is not None else now
                            last = now
                            text.append(choice["text"])
            tokens = usage["completion_tokens"] if usage else 0
            per_token = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
            ttft = None if first is None else first - sent
            records[i] = dict(text="".join(text), tokens=tokens, ttft=ttft, per_token=per_token)

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return records, time.perf_counter() - start


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, server: subprocess.Popen, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready within {timeout:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="a built-in Llama layout of peft_csgmv.bench (tiny, 1b, 8b)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--adapters", type=int, default=32, help="the requests' adapters, in turn (at most 32)")
    p.add_argument("--words", default="5,160", help="words per prompt: LOW,HIGH (about 6 tokens a word)")
    p.add_argument("--new-min", type=int, default=16)
    p.add_argument("--new-max", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")
    p.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every row's steps as CUDA graphs (default: on CUDA, as the server's default)",
    )
    p.add_argument(
        "--varlen-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="every row's attention per request, or SDPA's (default: as the server's default)",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    graphs = args.cuda_graphs if args.cuda_graphs is not None else torch.device(device).type == "cuda"
    dtype = "bf16" if torch.device(device).type == "cuda" else "fp32"
    requests = workload(args)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        base, adapters = save_checkout(folder, args.model, "cuda:0" if device == "cuda" else device)
        adapters = {name: adapters[name] for name in sorted({r["adapter"] for r in requests})}
        batches = batch_rows(base, adapters, requests, device, dtype, args.clients, graphs, args.varlen_attention)
        for row, texts in batches:
            rows.append(row)
            print(f"{row['row']}: {row['tokens']} tokens in {row['seconds']:.1f} s", flush=True)
        batch_texts = batches[0][1]
        rows[1]["same_as_batch"] = sum(a == b for a, b in zip(batches[1][1], batch_texts)) / len(requests)

        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "peft_csgmv", "serve", "--base", base, "--port", str(port), "--device", device,
                   "--dtype", dtype, "--log-level", "warning",
                   "--cuda-graphs" if graphs else "--no-cuda-graphs"]  # fmt: skip
        if args.varlen_attention is not None:
            command.append("--varlen-attention" if args.varlen_attention else "--no-varlen-attention")
        for name, path in adapters.items():
            command += ["--adapter", f"{name}={path}"]
        server = subprocess.Popen(command, env=dict(os.environ))
        try:
            wait_ready(url, server)
            asyncio.run(drive(url, requests[:4], 4))  # (warm-up, untimed)
            records, seconds = asyncio.run(drive(url, requests, args.clients))
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    complete = sum(r is not None and r["tokens"] > 0 for r in records)
    same = sum(r is not None and r["text"] == t for r, t in zip(records, batch_texts))
    ttft = [r["ttft"] * 1e3 for r in records if r and r["ttft"] is not None]
    per_token = [r["per_token"] * 1e3 for r in records if r and r["per_token"] is not None]
    rows.append(dict(row=f"serve, {args.clients} streaming clients", tokens=sum(r["tokens"] for r in records if r),
                     seconds=seconds, complete=complete, same_as_batch=same / len(requests),
                     ttft_ms_p50=percentile(ttft, 0.5), ttft_ms_p99=percentile(ttft, 0.99),
                     per_token_ms_p50=percentile(per_token, 0.5),
                     per_token_ms_p99=percentile(per_token, 0.99)))  # fmt: skip
    for row in rows:
        row["tok_s"] = row["tokens"] / row["seconds"]

    print()
    print(
        f"| {args.model}, {args.requests} requests, {args.adapters} adapters, new {args.new_min}-{args.new_max} | "
        "tok/s | × generate_batch | × generate_batch fed alike | TTFT p50 / p99 ms | per token p50 / p99 ms | complete "
        "| same as generate_batch |"
    )
    print("|---|---|---|---|---|---|---|---|")
    first, alike = rows[0]["tok_s"], rows[1]["tok_s"]
    for r in rows:
        lat = (f"{r['ttft_ms_p50']:.0f} / {r['ttft_ms_p99']:.0f} | {r['per_token_ms_p50']:.1f} / "
               f"{r['per_token_ms_p99']:.1f} | {r['complete']} of {args.requests}"
               if "complete" in r else "- | - | -")  # fmt: skip
        same = f"{r['same_as_batch'] * 100:.1f}%" if "same_as_batch" in r else "-"
        ratios = f"{r['tok_s'] / first:.2f} | {r['tok_s'] / alike:.2f}"
        print(f"| {r['row']} | {r['tok_s']:.0f} | {ratios} | {lat} | {same} |")
    if args.out:
        write_results(args.out, run_meta(torch.device(device), args=vars(args)), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
