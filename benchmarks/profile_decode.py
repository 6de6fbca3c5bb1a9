"""Where an eager decode step's host time goes: cProfile over decode steps of the base model, PEFT with one adapter
and peft_csgmv with 32 distinct adapters (the same step as ``bench_e2e.py``'s decode column).

    python benchmarks/profile_decode.py --model 1b --out results/profile_decode_1b.txt
    python benchmarks/profile_decode.py --model qwen3-30b-a3b --layers 16   # a MoE layout: LoRA on the experts too

Prints, per row, the wall time per step with and without the profiler and the functions with the most own time;
the text file holds the full listings. cProfile slows Python down, so read the shares, not the absolute times.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch

from peft_csgmv import enable_csgmv
from peft_csgmv._compat import cache_kwarg, output_cache
from peft_csgmv.bench import (
    EXPERT_PARAMETERS,
    MODELS,
    MOE_TARGETS,
    TARGETS,
    add_adapters,
    build_model,
    crop_cache,
    device_and_dtype,
    is_moe,
)  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=None, help="cut the layout to this many layers")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    device, dtype = device_and_dtype(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model = build_model(args.model, device, dtype, layers=args.layers)
    moe = is_moe(args.model)
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    step_ids = torch.randint(3, model.config.vocab_size, (args.batch, 1), generator=g).to(device)
    step_mask = torch.ones(args.batch, args.prompt + 1, dtype=torch.long, device=device)
    report = io.StringIO()

    def profile(label: str, m, **extra):
        with torch.no_grad():
            cache = output_cache(m(input_ids=input_ids, use_cache=True, **extra))

            def steps(n):
                for _ in range(n):
                    crop_cache(cache, args.prompt)
                    m(input_ids=step_ids, attention_mask=step_mask, **{cache_kwarg(m): cache}, use_cache=True, **extra)
                sync()

            steps(5)
            t0 = time.perf_counter()
            steps(args.steps)
            plain = (time.perf_counter() - t0) / args.steps * 1e3
            prof = cProfile.Profile()
            t0 = time.perf_counter()
            prof.runcall(steps, args.steps)
            profiled = (time.perf_counter() - t0) / args.steps * 1e3

        def listing(order: str) -> str:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(args.top)
            return s.getvalue()

        head = f"== {label}: {plain:.2f} ms per step ({profiled:.2f} ms under cProfile)"
        by_own = listing("tottime")
        print(head, flush=True)
        lines = [ln for ln in by_own.splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("ncalls"))
        print("\n".join(lines[start : start + 1 + 15]), flush=True)
        report.write(head + "\n" + by_own + "\n" + listing("cumulative") + "\n")

    profile("base model, no LoRA", model)
    # (a MoE layout: r=16 on the attention projections and the experts' parameters, as bench_e2e.py's MoE rows)
    targets, experts = (MOE_TARGETS, EXPERT_PARAMETERS) if moe else (TARGETS, None)
    pm = add_adapters(model, 32, [16], device, False, targets, experts)
    profile("PEFT one adapter", pm)
    enable_csgmv(pm)
    profile("peft_csgmv, 32 distinct", pm, adapter_ids=[f"a{i}" for i in range(args.batch)])
    if args.out:
        with open(args.out, "w") as f:
            f.write(report.getvalue())
    return 0


if __name__ == "__main__":
    sys.exit(main())
