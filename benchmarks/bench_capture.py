"""Host time of one LoRA op call in compiled code's two settings: run as it is (compiled code without CUDA graphs runs
every op of every step so) and while a CUDA graph is captured (transformers' static cache captures the decode step's
graph again at every ``generate``: it makes a new cache each call, at new addresses), against the op's Python alone
(what the dispatcher's registration adds) and a plain ``F.linear``.

    python benchmarks/bench_capture.py --out results/capture_1b.json

One gate_proj-sized layer of the built-in 1B layout (random bf16 weights, 32 adapters r=16 on all 7 projections),
a static plan of 32 rows of one token over 32 distinct adapters. Per row: µs of host time per call eagerly and
under capture (``--calls`` calls in one graph, best of ``--rounds``), and the capture's end (instantiation) in ms.
CUDA only. The table is printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from peft_csgmv import enable_csgmv, ops  # noqa: E402
from peft_csgmv.bench import add_adapters, build_model, run_meta, write_results  # noqa: E402
from peft_csgmv.executor import StaticPlan  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--calls", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_capture times CUDA-graph captures: it needs a GPU", file=sys.stderr)
        return 2
    dev, dtype = torch.device("cuda"), torch.bfloat16
    pm = add_adapters(build_model(args.model, dev, dtype), 32, [16], dev)
    enable_csgmv(pm)
    layer = pm.get_base_model().model.layers[0].mlp.gate_proj
    stack, weight = layer._csgmv_stack, layer.base_layer.weight
    plan = StaticPlan(32, 32, 1, dev)
    plan.fill(tuple(pm._csgmv.slots_for([f"a{i}" for i in range(32)])))
    x = torch.randn(32, weight.shape[1], device=dev, dtype=dtype)
    y = F.linear(x, weight)
    p3 = (plan.permutation, plan.seg_indptr, plan.seg_slot)
    tail = (stack.handle, stack.version, plan.chunk, True, False)
    calls = {
        "peft_csgmv::lora (after the base product)": lambda: ops.lora(x, y, *p3, None, *tail),
        "its Python alone": lambda: ops._lora(x, y, *p3, None, *tail),
        "peft_csgmv::lora_linear (beside the base product)": lambda: ops.lora_linear(x, weight, None, *p3, *tail),
        "its Python alone ": lambda: ops._lora_linear(x, weight, None, *p3, *tail),
        "F.linear": lambda: F.linear(x, weight),
    }
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants
        for f in calls.values():
            for _ in range(3):
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    rows = []
    for label, f in calls.items():
        eager = capture = end = float("inf")
        for _ in range(args.rounds):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    f()
                t1 = time.perf_counter()
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            capture, end = min(capture, (t1 - t0) / args.calls * 1e6), min(end, (t2 - t1) * 1e3)
            t0 = time.perf_counter()
            for _ in range(args.calls):
                f()
            eager = min(eager, (time.perf_counter() - t0) / args.calls * 1e6)
            torch.cuda.synchronize()
        rows.append(dict(row=label.strip(), eager_us=eager, capture_us=capture, capture_end_ms=end))
        print(rows[-1], flush=True)
    print(f"\n| {args.model}, one gate_proj layer, 32 distinct | host µs per call, eager | under capture | "
          f"capture end ms ({args.calls} calls) |")  # fmt: skip
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['eager_us']:.1f} | {r['capture_us']:.1f} | {r['capture_end_ms']:.2f} |")
    if args.out:
        write_results(args.out, run_meta(dev, args=vars(args)), results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
