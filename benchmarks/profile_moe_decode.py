"""Whether an eager MoE decode step is host- or GPU-bound, and which kernels fill it: the base model and csgmv with
expert LoRA (r = 16 on attention and both expert parameters), each step timed wall-clock and then run under
torch.profiler (the sum of its GPU kernels, the ops with the most GPU and the most host time, and the ops that read the
device on the host).

    python benchmarks/profile_moe_decode.py --model qwen3-30b-a3b --layers 8 --distinct 32

A step whose wall time exceeds its GPU kernels' sum is host-bound: the GPU waits for launches. CUDA only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from peft_csgmv import enable_csgmv
from peft_csgmv._compat import cache_kwarg, output_cache
from peft_csgmv.bench import (
    EXPERT_PARAMETERS,
    MODELS,
    MOE_TARGETS,
    add_adapters,
    build_model,
    crop_cache,
    decode_inputs,
)

SYNCS = ("Synchronize", "aten::item", "aten::nonzero", "_local_scalar_dense")


def profile_step(label: str, target, ids, mask, step, smask, prompt: int, rows: int, **extra) -> None:
    """Wall time of ``target``'s decode step over a cache of ``prompt`` tokens (median of 30 after 10 warm-up steps:
    fewer did not hold still on an H100), then 3 steps under the profiler: GPU kernel time per step, the ``rows`` ops
    with the most GPU time and those with the most host time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    kw = cache_kwarg(target)
    with torch.no_grad():
        cache = output_cache(target(input_ids=ids, attention_mask=mask, use_cache=True, **extra))

        def decode():
            crop_cache(cache, prompt)
            target(input_ids=step, attention_mask=smask, use_cache=True, **{kw: cache}, **extra)

        for _ in range(10):
            decode()
        times = []
        for _ in range(30):
            torch.cuda.synchronize()
            start = time.perf_counter()
            decode()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1e3)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                decode()
            torch.cuda.synchronize()
    events = prof.key_averages()
    # (the kernels' own events: an op's row carries its kernels' time too, which summing every row counts twice)
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not getattr(e, "is_user_annotation", False)]
    gpu = sum(e.self_device_time_total for e in kernels) / 3 / 1e3
    print(f"| {label} | {statistics.median(times):.2f} | {gpu:.2f} |", flush=True)
    print(events.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    # (the host's side: where a host-bound step's time goes; waiting in a synchronize counts here too)
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60), flush=True)
    for e in events:
        if any(s in e.key for s in SYNCS) and e.count:
            print(f"  reads the device on the host: {e.key} x{e.count // 3} per step", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    moe = sorted(name for name, spec in MODELS.items() if spec.get("arch") in ("qwen3_moe", "gpt_oss", "mixtral"))
    p.add_argument("--model", choices=moe, default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--distinct", type=int, default=32, help="distinct adapters over the batch's rows")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--rows", type=int, default=16, help="busiest ops listed per table")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", 0)
    model = build_model(args.model, device, torch.bfloat16, layers=args.layers)
    ids, mask, step, smask = decode_inputs(model.config.vocab_size, args.batch, args.prompt, device)
    title = f"{args.model} ({args.layers} layers), batch {args.batch}, prompt {args.prompt}"
    print(f"| {title} | wall ms | GPU kernels ms |")
    print("|---|---|---|")
    profile_step("base model", model, ids, mask, step, smask, args.prompt, args.rows)
    peft_model = add_adapters(
        model, args.distinct, [16], device, targets=MOE_TARGETS, target_parameters=EXPERT_PARAMETERS
    )
    enable_csgmv(peft_model)
    names = [f"a{i % args.distinct}" for i in range(args.batch)]
    label = f"csgmv, {args.distinct} distinct"
    profile_step(label, peft_model, ids, mask, step, smask, args.prompt, args.rows, adapter_ids=names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
