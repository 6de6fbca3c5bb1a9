"""Tile sweep for the shrink and expand kernels over the real layer shapes (GPU time by CUDA-graph replay).

    python benchmarks/tune_kernels.py --out results/tune.json [--budget-s 240]

For each case (in → out, rank, tokens, distinct adapters) every shrink config (BLOCK_K, num_warps, num_stages,
split-K) and every expand config (BLOCK_N, num_warps, on the shrink output of the library's own split) is timed
alone; the table printed last gives the time of the library's current choice ("now"), the best config found and its
time. The JSON holds every timing, so the tile tables in ``peft_csgmv/kernels`` can be derived from it. Prefill
cases run first; the sweep stops at ``--budget-s``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch

from peft_csgmv import BatchPlan
from peft_csgmv.bench import run_meta, write_results
from peft_csgmv.kernels import expand, shrink

from common import SHAPES, graph_time_us, row_slots


def cases(quick: bool):
    shapes = SHAPES[:2] if quick else SHAPES
    for r in [16] if quick else [16, 64]:
        for tokens, rows, distinct in [(8192, 32, 32), (8192, 32, 1), (8192, 128, 128), (512, 32, 32), (32, 32, 32),
                                       (32, 32, 1)]:  # fmt: skip
            for k, n in shapes:
                yield dict(in_f=k, out_f=n, rank=r, tokens=tokens, rows=rows, distinct=distinct, chunk=None)
    if not quick:
        # Short runs (128 adapters over 8192 tokens: runs of 64; 32 over 512: runs of 16), which the plan's chunk
        # follows (64 and 16), again in 128-row tiles: the measure of what following the runs gains.
        for r in [16, 64]:
            for tokens, rows, distinct, chunk in [(8192, 128, 128, 128), (512, 32, 32, 128)]:
                for k, n in shapes:
                    yield dict(in_f=k, out_f=n, rank=r, tokens=tokens, rows=rows, distinct=distinct, chunk=chunk)


def shrink_configs(chunk: int):
    if chunk >= 64:
        space = itertools.product([32, 64, 128], [4, 8], [2, 3, 4], [1, 2, 4])
    else:
        space = itertools.product([64, 128, 256], [2, 4], [2, 3], [1, 2, 4, 8, 16])
    for bk, w, st, sk in space:
        yield dict(block_k=bk, num_warps=w, num_stages=st), sk


def expand_configs(chunk: int):
    for bn, w in itertools.product([32, 64, 128, 256], [4, 8] if chunk >= 64 else [2, 4]):
        yield dict(block_n=bn, num_warps=w)


def time_case(c: dict, dtype, gen) -> dict:
    k, n, r = c["in_f"], c["out_f"], c["rank"]
    slots = row_slots(c["rows"], c["distinct"], "uniform", gen)
    num_slots = max(c["distinct"], 1)
    dev = "cuda"
    a = torch.randn(num_slots, r, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(num_slots, n, r, device=dev, dtype=dtype) / r**0.5
    ranks = torch.full((num_slots,), r, dtype=torch.int32, device=dev)
    scal = torch.ones(num_slots, dtype=torch.float32, device=dev)
    plan = BatchPlan.build(slots, c["tokens"] // c["rows"], dev, chunk_size=c["chunk"])
    x = torch.randn(plan.num_tokens, k, device=dev, dtype=dtype)
    y = torch.randn(plan.num_tokens, n, device=dev, dtype=dtype)
    t = torch.zeros(16, plan.num_tokens, r, device=dev, dtype=torch.float32)
    out = dict(c, segments=plan.num_segments, chunk=plan.chunk_size)  # the chunk in use
    # "now": the library's own choice (split_k="auto" and the tile tables), as the patched layers launch it.
    t_now = shrink(x, a, ranks, plan, t)
    out["shrink_default"] = graph_time_us(lambda: shrink(x, a, ranks, plan, t))
    out["expand_default"] = graph_time_us(lambda: expand(t_now, b, ranks, scal, plan, y))
    out["shrink"] = []
    for cfg, sk in shrink_configs(plan.chunk_size):
        try:
            us = graph_time_us(lambda: shrink(x, a, ranks, plan, t, split_k=sk, config=cfg), iters=10, replays=5)
        except Exception as e:  # out of shared memory and the like
            us = None
            print(f"  shrink {cfg} split {sk}: {type(e).__name__}", flush=True)
        out["shrink"].append(dict(cfg, split_k=sk, us=us))
    out["expand"] = []
    for cfg in expand_configs(plan.chunk_size):
        try:
            us = graph_time_us(lambda: expand(t_now, b, ranks, scal, plan, y, config=cfg), iters=10, replays=5)
        except Exception as e:
            us = None
            print(f"  expand {cfg}: {type(e).__name__}", flush=True)
        out["expand"].append(dict(cfg, us=us))
    return out


def best(entries):
    ok = [e for e in entries if e["us"] is not None]
    return min(ok, key=lambda e: e["us"]) if ok else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--budget-s", type=float, default=240.0)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    t0 = time.perf_counter()
    results = []

    def save():
        if args.out:
            write_results(args.out, run_meta(torch.device("cuda")), indent=None, cases=results)

    for c in cases(args.quick):
        if time.perf_counter() - t0 > args.budget_s:
            print("budget spent; stopping", flush=True)
            break
        r = time_case(c, torch.bfloat16, gen)
        results.append(r)
        bs, be = best(r["shrink"]), best(r["expand"])
        print(
            f"{r['in_f']:>5}→{r['out_f']:<5} r{r['rank']:<3} T{r['tokens']:<5} d{r['distinct']:<3} "
            f"seg {r['segments']:<3} "
            f"shrink {r['shrink_default']:6.1f} → {bs['us']:6.1f} {bs}  expand {r['expand_default']:6.1f} → "
            f"{be['us']:6.1f} {be}",
            flush=True,
        )
        save()
    print("\n| in→out | rank | tokens | distinct | shrink now µs | best µs | best config | expand now µs | best µs "
          "| best config |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        bs, be = best(r["shrink"]), best(r["expand"])
        cs = f"BK{bs['block_k']} w{bs['num_warps']} s{bs['num_stages']} split{bs['split_k']}"
        ce = f"BN{be['block_n']} w{be['num_warps']}"
        print(
            f"| {r['in_f']}→{r['out_f']} | {r['rank']} | {r['tokens']} | {r['distinct']} | {r['shrink_default']:.1f} | "
            f"{bs['us']:.1f} | {cs} | {r['expand_default']:.1f} | {be['us']:.1f} | {ce} |"
        )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
