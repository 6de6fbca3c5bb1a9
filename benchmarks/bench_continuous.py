"""Continuous batching with an adapter per request: throughput of transformers' ``generate_batch`` on a workload of
uneven prompts and answers, the base model against csgmv with many adapters, in one run.

    python benchmarks/bench_continuous.py --model 1b --requests 256 --out results/continuous_1b.json

Random weights from a transformers LlamaConfig (no hub), bf16 on CUDA. The workload (seeded): ``--requests`` prompts
of ``--prompt-min``..``--prompt-max`` random tokens, each with its own ``max_new_tokens`` in
``--new-min``..``--new-max`` (no stop token: every request runs its whole length; the manager's per-request
``max_new_tokens``). Rows, each over the same requests, in this order:

* base model (no LoRA), transformers' continuous batching as csgmv runs it (no CUDA graphs, synchronous batching);
* ``base-graphs``: the base model with transformers' CUDA graphs (``use_cuda_graph=True``), synchronous batching;
* base model, transformers' defaults (CUDA graphs and asynchronous batching where transformers turns them on);
* stock PEFT, one adapter for every request (the same configuration as the first row);
* csgmv, each request's adapter one of ``--adapters`` (round robin), the same configuration as the first row;
* ``csgmv-graphs``: csgmv with transformers' CUDA graphs, as the ``base-graphs`` row (its ratio is to that row);
* ``base-async`` and ``csgmv-async``: as the two rows above with asynchronous batching too (``use_async_batching=True``:
  each step prepared while the one before runs);
* ``base-varlen`` and ``csgmv-varlen``: CUDA graphs, synchronous, attention per request by torch's own flash kernel
  (``peft_csgmv.attention.varlen_attention``, in place of SDPA's dense mask over every running request's cache) and no
  cap of requests per step (``--max-requests`` is for the dense mask);
* ``tier``: the same as csgmv with ``max_resident_adapters=--max-resident-adapters`` (the host tier: the other adapters
  wait in host memory; a step starts a request only while its adapters fit).

Past 32 adapters, adapters 32.. are copies of the first 32 (built module by module: PEFT's ``add_adapter`` per
adapter costs O(N²) for a thousand); each is an adapter of its own to csgmv and the tier.

tok/s counts generated tokens over the wall time from the first request added to the last result (manager start,
warmup and stop excluded; one untimed pass over a few requests first). On CUDA each row also gives the peak GPU memory
the process's allocator reserved over its run (the paged cache, which transformers sizes to a share of the free
memory, the steps' buffers and CUDA graphs' pool): how close the row came to running out. The table is printed
last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time

import torch

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.attention import varlen_attention
from peft_csgmv.bench import TARGETS, add_adapters, build_model, device_and_dtype, run_meta, write_results

from common import clone_adapter, lora_layers


def workload(args, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    return [
        (
            [rng.randrange(3, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))],
            rng.randint(args.new_min, args.new_max),
        )
        for _ in range(args.requests)
    ]


def run(model, requests, adapters, gen, cbc) -> tuple[float, int, float | None]:
    """Seconds from the first request added to the last result, the tokens generated, and on CUDA the peak of GPU
    memory the process's allocator reserved over the run (GiB: the paged cache, the steps' buffers and CUDA graphs'
    pool; ``None`` elsewhere)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cbc)
    manager.start()
    try:
        start = time.perf_counter()
        ids = []
        for i, (prompt, new) in enumerate(requests):
            extra = {} if adapters is None else {"adapter_id": adapters[i % len(adapters)]}
            ids.append(manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=new, **extra))
        tokens, done = 0, 0
        while done < len(ids):
            result = manager.get_result(timeout=60)
            if result is None:
                raise RuntimeError("no result for 60 s")
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"{result.request_id}: {result.error}")
                done += 1
                tokens += len(result.generated_tokens)
        peak = None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_reserved() / 2**30
        return time.perf_counter() - start, tokens, peak
    finally:
        manager.stop(block=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="a built-in Llama size of peft_csgmv.bench (tiny, 1b, 8b)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=1024)
    p.add_argument("--new-min", type=int, default=16)
    p.add_argument("--new-max", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=None, help="the manager's token budget per step")
    p.add_argument("--num-blocks", type=int, default=None, help="the paged cache's blocks (default: transformers')")
    p.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="the manager's requests per step (max_requests_per_batch; default: transformers'). The batch command "
        "caps it at 128 where attention takes a dense mask (SDPA), which transformers' own sizing runs out of GPU "
        "memory without on the 1B layout at 1024 requests (H100)",
    )
    p.add_argument("--max-resident-adapters", type=int, default=64, help="the tier row's max_resident_adapters")
    p.add_argument(
        "--rows",
        default="base,base-default,peft,csgmv",
        help="of base, base-graphs, base-async, base-default, base-varlen, peft, csgmv, csgmv-graphs, csgmv-async, "
        "csgmv-varlen, tier",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also each row's run under torch.profiler (host and GPU), its busiest ops printed after its figure (the "
        "profiled run is slower: its time is not in the table)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from transformers import ContinuousBatchingConfig, GenerationConfig

    device, dtype = device_and_dtype(args.device)
    model = build_model(args.model, device, dtype)
    requests = workload(args, model.config.vocab_size)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=args.new_max)
    given = (("max_batch_tokens", args.max_batch_tokens), ("num_blocks", args.num_blocks))
    sizes = {k: v for k, v in given + (("max_requests_per_batch", args.max_requests),) if v}
    eager = dict(use_cuda_graph=False, use_async_batching=False, **sizes)
    graphs = dict(eager, use_cuda_graph=True)
    overlapped = dict(graphs, use_async_batching=True)
    varlen = {k: v for k, v in graphs.items() if k != "max_requests_per_batch"}  # (the cap is for the dense mask)
    rows = args.rows.split(",")
    results = []

    def record(name, seconds, tokens, peak, target=None, adapters=None, config=None):
        loops = {id(graphs): "graphs", id(overlapped): "async", id(eager): "eager", id(varlen): "varlen"}
        loop = loops.get(id(config), "default")
        results.append(dict(row=name, seconds=seconds, tokens=tokens, tok_s=tokens / seconds, loop=loop, peak_gib=peak))
        held = f", peak {peak:.1f} GiB reserved" if peak is not None else ""
        print(f"{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.0f} tok/s{held}", flush=True)
        if args.profile and target is not None:
            profiled(name, target, adapters, config)

    def profiled(name, target, adapters, config) -> None:
        """The row's run again under torch.profiler (every thread: the manager's runs the steps): its ops by host
        time and by device time."""
        from torch._C._profiler import _ExperimentalConfig
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        # (the manager's own thread runs the steps; host syncs shown where CUDA has them)
        config_all = _ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
        with profile(activities=activities, experimental_config=config_all) as prof:
            seconds, tokens, _ = run(target, requests, adapters, gen, ContinuousBatchingConfig(**config))
        events = prof.key_averages()
        print(f"-- {name}, profiled: {tokens} tokens in {seconds:.1f} s", flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
        if device.type == "cuda":
            print(events.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60))

    warm = requests[: min(8, len(requests))]
    titles = {"base": "no CUDA graphs, sync", "base-graphs": "CUDA graphs, sync", "base-async": "CUDA graphs, async"}
    titles["base-default"] = "transformers defaults"
    titles["base-varlen"] = "CUDA graphs, sync, attention per request"

    def scope(target, config):
        return varlen_attention(target) if config is varlen else contextlib.nullcontext()

    for name, config in (("base", eager), ("base-graphs", graphs), ("base-async", overlapped), ("base-default", sizes),
                         ("base-varlen", varlen)):  # fmt: skip
        if name in rows:
            with scope(model, config):
                run(model, warm, None, gen, ContinuousBatchingConfig(**config))
                timed = run(model, requests, None, gen, ContinuousBatchingConfig(**config))
                record(f"base model ({titles[name]})", *timed, model, None, config)  # (its profile in the scope)
    peft_model = add_adapters(model, min(args.adapters, 32), [args.rank], device, targets=TARGETS)
    layers = lora_layers(peft_model)
    for i in range(32, args.adapters):
        clone_adapter(peft_model, f"a{i % 32}", f"a{i}", layers)
    if "peft" in rows:
        run(peft_model, warm, None, gen, ContinuousBatchingConfig(**eager))
        timed = run(peft_model, requests, None, gen, ContinuousBatchingConfig(**eager))
        record("stock PEFT, one adapter", *timed, config=eager)
    names = [f"a{i}" for i in range(args.adapters)]
    for row, limit, config in (
        ("csgmv", None, eager), ("csgmv-graphs", None, graphs), ("csgmv-async", None, overlapped),
        ("csgmv-varlen", None, varlen), ("tier", args.max_resident_adapters, eager),
    ):  # fmt: skip
        if row not in rows:
            continue
        start = time.perf_counter()
        enable_csgmv(peft_model, max_resident_adapters=limit)
        print(f"{row}: enable_csgmv took {time.perf_counter() - start:.1f} s", flush=True)
        label = f"csgmv, {args.adapters} adapters" + (f", max_resident_adapters={limit}" if limit else "")
        label += ", CUDA graphs" if config is graphs else ", CUDA graphs, async" if config is overlapped else ""
        label += ", CUDA graphs, attention per request" if config is varlen else ""
        with scope(peft_model, config):
            run(peft_model, warm, names, gen, ContinuousBatchingConfig(**config))
            timed = run(peft_model, requests, names, gen, ContinuousBatchingConfig(**config))
            record(label, *timed, peft_model, names, config)
        disable_csgmv(peft_model)

    bases = {r["loop"]: r["tok_s"] for r in results if r["row"].startswith("base model")}
    print(f"\n| {args.model}, {args.requests} requests, prompts {args.prompt_min}-{args.prompt_max}, "
          f"new {args.new_min}-{args.new_max} | tok/s | × base (same loop) | peak GiB reserved |")  # fmt: skip
    print("|---|---|---|---|")
    for r in results:
        base = bases.get(r["loop"])
        ratio = f"{r['tok_s'] / base:.2f}" if base else "-"
        peak = f"{r['peak_gib']:.1f}" if r["peak_gib"] is not None else "-"
        print(f"| {r['row']} | {r['tok_s']:.0f} | {ratio} | {peak} |")
    tok_s = {r["row"].split(",")[-1].strip().split("=")[0]: r["tok_s"] for r in results if r["loop"] == "eager"}
    if "max_resident_adapters" in tok_s and f"{args.adapters} adapters" in tok_s:
        ratio = tok_s["max_resident_adapters"] / tok_s[f"{args.adapters} adapters"]
        print(f"\nhost tier ({args.max_resident_adapters} resident) against all {args.adapters} resident: {ratio:.2f}x")
    if args.out:
        write_results(args.out, run_meta(device, args=vars(args)), rows=results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
