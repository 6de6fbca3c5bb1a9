"""Where the first static-cache ``generate`` spends its time: the base model against peft_csgmv, each row in a process
of its own with empty compile caches (inductor's and Triton's), so no row inherits another's compiled kernels.

    python benchmarks/compile_time.py --model 1b --rounds 2 --out results/compile_1b.json

Per row: the first ``generate(..., cache_implementation="static")`` (transformers compiles the decode step, inductor
and CUDA graphs), the median of ``--repeats`` more, and the first call's share by phase: dynamo (tracing),
``call_user_compiler`` (AOT autograd and inductor, which compiles its own Triton kernels in worker processes), the
compiles of peft_csgmv's own Triton kernels (``@triton.jit`` kernels compiled at their first launch in the process:
counted and timed by kernel; compiles on the library's compile-ahead threads, which run beside tracing, are listed
and summed apart as "ahead"), and the rest (the first eager prefill, CUDA-graph capture, the first steps). Rows
alternate (base, csgmv, base, csgmv, ...) over ``--rounds``; ``--rows base,peft,csgmv`` adds stock PEFT with one
adapter active (no ids), ``csgmv-noahead`` csgmv with compiling ahead off (``PEFT_CSGMV_COMPILE_AHEAD=0``: every
kernel compiles on the main thread), ``csgmv-threads`` csgmv compiling ahead on a thread of its own process, beside
dynamo's tracing (``=1``; by default a worker process compiles them, and the main thread loads them from Triton's
on-disk cache: "own Triton" then counts those loads); ``--warm`` runs each row once more
over the caches its first process left (a user's second run). ``COMPILE_TIME_KEYS=1`` prints Triton's key of each
kernel compiled (its arguments' types and alignments), which says why a kernel compiled twice. The table is printed
last; its "tracing" column is dynamo's own share (``bytecode_tracing``: stepping through the Python of every layer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(args) -> dict:
    import torch
    import triton.runtime.jit as jit

    from peft_csgmv import enable_csgmv
    from peft_csgmv.bench import add_adapters, build_model, clock_up, device_and_dtype

    compiles: dict[str, list[float]] = {}
    what: list[str] = []
    do_compile = jit.JITFunction._do_compile

    def timed(self, key, signature, device, constexprs, options, *a, **k):
        t0 = time.perf_counter()
        main = threading.current_thread() is threading.main_thread()
        try:
            return do_compile(self, key, signature, device, constexprs, options, *a, **k)
        finally:
            name = self.fn.__name__ if main else f"{self.fn.__name__} (ahead)"
            compiles.setdefault(name, []).append(time.perf_counter() - t0)
            values = [v for v in constexprs.values() if isinstance(v, (int, str))]
            capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
            what.append(
                f"{name} {values} warps {getattr(options, 'num_warps', '?')}"
                + (" (in a CUDA graph's capture)" if capturing else "")
                + (f" key {key}" if os.environ.get("COMPILE_TIME_KEYS") else "")
            )

    jit.JITFunction._do_compile = timed
    device, dtype = device_and_dtype(args.device)
    model = build_model(args.model, device, dtype)
    g = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
              cache_implementation="static")  # fmt: skip
    target = model
    t_enable = 0.0
    if args.row != "base":
        target = add_adapters(model, args.adapters, [args.rank], device)
    if args.row == "peft":  # stock PEFT, one adapter active for every row
        target.set_adapter("a0")
    if args.row.startswith("csgmv"):
        t0 = time.perf_counter()
        enable_csgmv(target)
        t_enable = time.perf_counter() - t0
        kw["adapter_ids"] = [f"a{i % args.adapters}" for i in range(args.batch)]
    # Triton kernels the library compiled before the first generate (none expected): not the first call's.
    before = {k: len(v) for k, v in compiles.items()}
    from torch._dynamo.utils import compile_times

    times = []
    with torch.no_grad():
        for i in range(args.repeats + 1):
            clock_up(device)
            sync(device)
            t0 = time.perf_counter()
            target.generate(**kw)
            sync(device)
            times.append(time.perf_counter() - t0)
            if i == 0:
                phases = compile_times(repr="csv", aggregate=True)
    names, values = phases
    phase = dict(zip(names, [float(v) if v not in ("", None) else 0.0 for v in values]))
    ours = {k: sum(v[before.get(k, 0) :]) for k, v in compiles.items() if len(v) > before.get(k, 0)}
    counts = {k: len(v) - before.get(k, 0) for k, v in compiles.items() if len(v) > before.get(k, 0)}
    return dict(
        row=args.row, first_s=times[0], median_s=statistics.median(times[1:]), enable_s=t_enable,
        dynamo_s=phase.get("_compile.compile_inner", 0.0),
        tracing_s=phase.get("bytecode_tracing", 0.0),
        user_compiler_s=phase.get("OutputGraph.call_user_compiler", 0.0),
        triton_s=sum(v for k, v in ours.items() if "(ahead)" not in k),
        triton_n=sum(v for k, v in counts.items() if "(ahead)" not in k),
        ahead_s=sum(v for k, v in ours.items() if "(ahead)" in k),
        ahead_n=sum(v for k, v in counts.items() if "(ahead)" in k),
        triton_by_kernel=ours, triton_counts=counts,
        triton_compiled=what, phases=phase,
    )  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--rows", default="base,csgmv")
    p.add_argument(
        "--warm",
        action="store_true",
        help="each row twice over one cache folder: the second process finds the first's compiled artifacts (as a "
        "user's second run does); both are reported",
    )
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None)
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child's row
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        with open(args.result, "w") as f:
            json.dump(child(args), f)
        return 0
    from common import row_runs

    results = []
    for r in range(args.rounds):
        for row in args.rows.split(","):
            argv = ["--model", args.model, "--adapters", str(args.adapters), "--rank", str(args.rank),
                    "--batch", str(args.batch), "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
                    "--repeats", str(args.repeats)] + (["--device", args.device] if args.device else [])  # fmt: skip
            runs = ("empty", "warm") if args.warm else ("empty",)
            for caches, res in zip(runs, row_runs(__file__, row, argv, len(runs))):
                res.update(round=r, caches=caches)
                results.append(res)
                rest = res["first_s"] - res["median_s"] - res["dynamo_s"] - res["triton_s"]
                print(
                    f"{args.model} {row:<6} round {r}, {caches} caches: first {res['first_s']:.1f} s, median "
                    f"{res['median_s']:.2f} s, dynamo {res['dynamo_s']:.1f} (tracing {res['tracing_s']:.1f}) "
                    f"(inductor {res['user_compiler_s']:.1f}), own Triton {res['triton_s']:.1f} s "
                    f"/ {res['triton_n']} kernels (ahead, on threads: {res['ahead_s']:.1f} s / "
                    f"{res['ahead_n']}), rest {rest:.1f}",
                    flush=True,
                )
                for line in res["triton_compiled"]:
                    print("    " + line)
    print()
    print("| model | row | round | caches | first call s | compile s (first − median) | dynamo s | of which tracing s "
          "| of which inductor s | own Triton s (kernels) | ahead s (kernels) | rest s |")  # fmt: skip
    print("|" + "---|" * 12)
    for res in results:
        c = res["first_s"] - res["median_s"]
        rest = c - res["dynamo_s"] - res["triton_s"]
        print(
            f"| {args.model} | {res['row']} | {res['round']} | {res['caches']} | {res['first_s']:.1f} | {c:.1f} | "
            f"{res['dynamo_s']:.1f} | {res['tracing_s']:.1f} | {res['user_compiler_s']:.1f} | "
            f"{res['triton_s']:.1f} ({res['triton_n']}) | "
            f"{res['ahead_s']:.1f} ({res['ahead_n']}) | {rest:.1f} |"
        )
    if args.out:
        from peft_csgmv.bench import device_and_dtype, run_meta, write_results

        write_results(args.out, run_meta(device_and_dtype(args.device)[0], args=vars(args)), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
