"""Kernel benchmark over real layer shapes: shrink + expand of one LoRA layer.

    python benchmarks/bench_kernels.py --out results/kernels.json

For each (in → out, rank, tokens, distinct adapters, distribution) it reports
* GPU µs: one layer's shrink + expand, median over CUDA-graph replays (launch gaps removed);
* host µs: eager host time per layer (two launches through the library's launch path, no sync);
* GB/s achieved and the ratio to the memory floor: x, y (read + write) and each used adapter's A and B read once,
  over the measured device copy rate (``--copy-gbs``, default 4300 GB/s on the H200);
* fused GPU µs, where a layer may run fused (``kernels.fused_fits``: decode-sized plans, inputs up to 4096 wide): the
  same layer as one launch, the expand computing the A product itself (``PEFT_CSGMV_FUSED_DECODE``);
  ``--fused-sweep`` also times every fused tile config there and reports the best.
Then the per-layer cost of the whole patched module (base Linear alone, PEFT one adapter, csgmv) and the plan build
time. The tables are printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from peft_csgmv import BatchPlan
from peft_csgmv.bench import run_meta, write_results
from peft_csgmv.executor import PlanRun
from peft_csgmv.kernels import BoundLayer, expand, fused_fits, shrink, shrink_splits
from peft_csgmv.slots import LoraStack

from common import SHAPES, graph_time_us, row_slots


def host_time_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
        torch.cuda.synchronize()
    return statistics.median(samples)


FUSED_CONFIGS = [
    dict(block_n=bn, block_k=bk, num_warps=w, num_stages=3)
    for bn in (64, 128, 256)
    for bk in (64, 128, 256)
    for w in (2, 4)
]


def bench_case(k, n, rank, tokens, rows, distinct, dist, dtype, copy_gbs, gen, fused_sweep=False):
    slots = row_slots(rows, distinct, dist, gen)
    num_slots = max(distinct, 1)
    dev = "cuda"
    # The layout the patched layers use: every slot at its own rank in one flat buffer (slots.LoraStack).
    need = num_slots * LoraStack.slot_elements(rank, k, n)
    stack = LoraStack(k, n, num_slots, dtype, torch.device(dev), reserve=need)
    for s in range(num_slots):
        a_s = torch.randn(rank, k, device=dev, dtype=dtype) / k**0.5
        stack.set_slot(s, a_s, torch.randn(n, rank, device=dev, dtype=dtype) / rank**0.5, 1.0)
    stack.refresh()
    a, b, ranks, scal = stack.a, stack.b, stack.ranks, stack.scalings
    plan = BatchPlan.build(slots, tokens // rows, dev)
    x = torch.randn(plan.num_tokens, k, device=dev, dtype=dtype)
    y = torch.randn(plan.num_tokens, n, device=dev, dtype=dtype)
    t = PlanRun(plan).workspace(rank, shrink_splits(plan, k))  # as the patched layers do

    def layer():
        shrink(x, a, ranks, plan, t)
        expand(t, b, ranks, scal, plan, y)

    gpu_us = graph_time_us(layer)
    host_us = host_time_us(layer)
    fused_us, best = float("nan"), None
    if fused_fits(plan.num_tokens, k):
        fused_us = graph_time_us(lambda: expand(None, b, ranks, scal, plan, y, x=x, a=a))
        if fused_sweep:
            timed = [(graph_time_us(lambda c=c: expand(None, b, ranks, scal, plan, y, x=x, a=a, config=c)), c)
                     for c in FUSED_CONFIGS]  # fmt: skip
            best = min(timed, key=lambda tc: tc[0])
    bound = BoundLayer.bind(x, y, t, stack, plan)
    bound_host_us = host_time_us(lambda: bound(x, y)) if bound is not None else float("nan")
    used = len(set(slots))
    elt = x.element_size()
    nbytes = plan.num_tokens * (k + 2 * n) * elt + used * rank * (k + n) * elt
    floor_us = nbytes / (copy_gbs * 1e3)
    return dict(in_f=k, out_f=n, rank=rank, tokens=plan.num_tokens, distinct=distinct, used=used, dist=dist,
                gpu_us=gpu_us, host_us=host_us, bound_host_us=bound_host_us, splits=shrink_splits(plan, k),
                fused_gpu_us=fused_us, fused_best_us=best[0] if best else float("nan"),
                fused_best_config=best[1] if best else None,
                gbs=nbytes / gpu_us / 1e3, floor_us=floor_us,
                vs_floor=gpu_us / floor_us, segments=plan.num_segments)  # fmt: skip


def bench_modules(dtype, gen) -> list[dict]:
    """Host and GPU time per layer of the whole module: base nn.Linear, PEFT lora.Linear with one adapter, csgmv."""
    from peft import LoraConfig, get_peft_model

    from peft_csgmv import adapter_ids_scope

    rows = []
    for k, n in [(2048, 2048), (4096, 14336)]:

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(k, n, bias=False)

            def forward(self, x):
                return self.proj(x)

        base = M().to("cuda", dtype)
        x = torch.randn(32, 1, k, device="cuda", dtype=dtype)
        entry = dict(in_f=k, out_f=n, tokens=32)
        with torch.no_grad():
            entry["base_host_us"] = host_time_us(lambda: base.proj(x))
            pm = get_peft_model(
                base,
                LoraConfig(r=16, target_modules=["proj"], init_lora_weights=False),
                adapter_name="a0",
                autocast_adapter_dtype=False,
            )
            for i in range(1, 32):
                pm.add_adapter(f"a{i}", LoraConfig(r=16, target_modules=["proj"], init_lora_weights=False))
            pm.to(dtype).eval()
            layer = pm.base_model.model.proj
            entry["peft_one_host_us"] = host_time_us(lambda: layer(x))
            from peft_csgmv import disable_csgmv, enable_csgmv

            enable_csgmv(pm)
            try:
                with adapter_ids_scope(pm, [f"a{i}" for i in range(32)]):
                    entry["csgmv_host_us"] = host_time_us(lambda: layer(x))
                    entry["csgmv_gpu_us"] = graph_time_us(lambda: layer(x))
            finally:
                disable_csgmv(pm)
        rows.append(entry)
    return rows


def bench_plan() -> list[dict]:
    out = []
    for rows, tpr in [(32, 1), (32, 256)]:
        slots = list(range(rows))
        BatchPlan.build(slots, tpr, "cuda")
        torch.cuda.synchronize()
        samples = []
        for _ in range(50):
            t0 = time.perf_counter()
            BatchPlan.build(slots, tpr, "cuda")
            samples.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        out.append(dict(rows=rows, tokens_per_row=tpr, build_us=statistics.median(samples)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None)
    p.add_argument("--copy-gbs", type=float, default=4300.0)
    p.add_argument("--quick", action="store_true", help="a few cases only")
    p.add_argument("--ranks", default=None, help="comma-separated ranks (default 8,16,64,128 decode; 16,64 prefill)")
    p.add_argument("--fused-sweep", action="store_true", help="time every fused tile config where a layer runs fused")
    args = p.parse_args(argv)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    cases = []
    shapes = SHAPES[:2] if args.quick else SHAPES
    for k, n in shapes:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
        for rank in [16] if args.quick else ranks or [8, 16, 64, 128]:
            for distinct in [1, 8, 32]:
                cases.append((k, n, rank, 32, 32, distinct, "uniform"))
        for tokens in [512, 8192]:
            for rank in [16] if args.quick else ranks or [16, 64]:
                for distinct, dist in [(1, "uniform"), (32, "uniform"), (128, "uniform"), (32, "zipf")]:
                    rows = max(distinct, 32) if tokens >= 4096 else 32
                    cases.append((k, n, rank, tokens, min(rows, tokens), distinct, dist))
    results = []
    for c in cases:
        r = bench_case(*c, dtype=dtype, copy_gbs=args.copy_gbs, gen=gen, fused_sweep=args.fused_sweep)
        results.append(r)
        print(
            f"{r['in_f']:>5}→{r['out_f']:<5} r{r['rank']:<3} T{r['tokens']:<5} {r['distinct']:>3} {r['dist']:<7} "
            f"gpu {r['gpu_us']:7.1f} µs  host {r['host_us']:6.1f} / bound {r['bound_host_us']:5.1f} µs  "
            f"{r['gbs']:6.0f} GB/s  "
            f"{r['vs_floor']:5.2f}× floor  fused {r['fused_gpu_us']:6.1f} µs (best {r['fused_best_us']:6.1f})",
            flush=True,
        )
    modules = bench_modules(dtype, gen)
    plans = bench_plan()

    print("\n| in→out | rank | tokens | distinct | K splits | GPU µs | host µs (checked) | host µs (bound) | GB/s "
          "| × floor | fused GPU µs | fused, best config µs |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['in_f']}→{r['out_f']} | {r['rank']} | {r['tokens']} | {r['distinct']} {r['dist']} | {r['splits']} | "
            f"{r['gpu_us']:.1f} | {r['host_us']:.1f} | {r['bound_host_us']:.1f} | {r['gbs']:.0f} | "
            f"{r['vs_floor']:.2f} | {r['fused_gpu_us']:.1f} | {r['fused_best_us']:.1f} {r['fused_best_config'] or ''} |"
        )
    print(
        "\n| module in→out, 32 decode tokens | base Linear host µs | PEFT one adapter host µs | csgmv host µs "
        "| csgmv GPU µs |"
    )
    print("|---|---|---|---|---|")
    for m in modules:
        print(
            f"| {m['in_f']}→{m['out_f']} | {m['base_host_us']:.1f} | {m['peft_one_host_us']:.1f} | "
            f"{m['csgmv_host_us']:.1f} | {m['csgmv_gpu_us']:.1f} |"
        )
    print("\n| plan rows × tokens | build µs |")
    print("|---|---|")
    for pl in plans:
        print(f"| {pl['rows']} × {pl['tokens_per_row']} | {pl['build_us']:.1f} |")
    if args.out:
        launch_path = "triton" if os.environ.get("PEFT_CSGMV_TRITON_LAUNCH") == "1" else "direct"
        meta = run_meta(torch.device("cuda"), launch=launch_path)
        write_results(args.out, meta, kernels=results, modules=modules, plans=plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
