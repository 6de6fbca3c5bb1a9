"""Host work of one MoE experts layer per decode step: torch ops dispatched and Triton launches per experts-layer
forward, with csgmv's mixed-adapter expert LoRA.

    python benchmarks/count_moe_ops.py                  # tiny Qwen3-MoE layout, batch 32, 8 distinct adapters
    python benchmarks/count_moe_ops.py --model tiny-gpt-oss --distinct 32

Eager decode at batch 32 is host-bound: each torch op costs a dispatch (and, on a GPU, usually a launch), each Triton
kernel a launch, so the count per MoE layer is what to drive down. Runs on the CPU (the count is the same as on a
GPU): the Triton launches are counted and skipped (their outputs are not needed for a count), and the base experts'
products take the grouped product the CUDA path takes (``torch.nn.functional.grouped_mm``, which torch also runs on
the CPU), not the CPU path's product per expert, and the plans the CUDA path's one launch (counted; their arrays come
from the torch path, uncounted). Ops are counted with a ``TorchDispatchMode`` between the experts
layer's forward pre-hook and its forward hook; views (no kernel on a GPU) are counted apart.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

# (the CUDA path's one-launch plan is taken on the CPU where Triton interprets: its launch is counted, then skipped)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.bench import EXPERT_PARAMETERS, MOE_TARGETS, add_adapters, build_model, crop_cache, decode_inputs
from peft_csgmv.kernels import launch

VIEWS = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "t", "transpose", "permute", "as_strided",
    "alias", "unsqueeze", "squeeze", "detach", "_reshape_alias", "unbind", "split", "chunk", "lift_fresh",
}  # fmt: skip


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.on = False
        self.trace = False
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.on:
            self.ops[func.overloadpacket.__name__] += 1
            if self.trace:
                print(func, [tuple(a.shape) if isinstance(a, torch.Tensor) else a for a in args][:3])
        return func(*args, **(kwargs or {}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-moe", choices=["tiny-moe", "tiny-gpt-oss"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--distinct", type=int, default=8)
    p.add_argument("--show", action="store_true", help="print every op's count")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed")
    p.add_argument("--trace", action="store_true", help="print every op as it is dispatched")
    args = p.parse_args(argv)

    from peft_csgmv import moe, moe_plan

    moe.GROUPED_ON_CPU = True  # count the CUDA path's grouped base products
    moe_plan.FUSED_ON_CPU = True  # and its plans in one launch
    launches = collections.Counter()
    filled = [0.0]  # seconds the plans' stand-in arrays took in the current forward (not timed)

    def counted(self, grid, a, c, o=()):
        if counter.on:
            launches[self.kernel.fn.__name__] += 1
        if self.kernel.fn.__name__ == "_moe_plan_kernel":  # (the plan's arrays, which the products read: the torch
            on, counter.on, moe_plan.FUSED_ON_CPU = counter.on, False, False  # path's, uncounted and untimed)
            filled[0] -= time.perf_counter()
            try:
                group, index, perm, offsets, segments = a[:5]
                num_experts, num_slots, chunk = a[10:13]
                plan = moe_plan.MoePlan.from_groups(group, index, num_experts, num_slots, chunk)
                perm.copy_(plan.permutation)
                offsets.copy_(plan.expert_offsets)
                segments.copy_(torch.cat([plan.seg_start, plan.seg_end, plan.seg_slot, plan.seg_expert]))
            finally:
                counter.on, moe_plan.FUSED_ON_CPU = on, True
                filled[0] += time.perf_counter()

    launch.Launcher.__call__ = counted
    counter = Counter()
    counter.trace = args.trace
    device = torch.device("cpu")
    torch.set_num_threads(1)
    model = build_model(args.model, device, torch.float32)
    pm = add_adapters(model, args.adapters, [16], device, False, MOE_TARGETS, EXPERT_PARAMETERS)
    enable_csgmv(pm, backend="triton")
    input_ids, mask, step_ids, step_mask = decode_inputs(model.config.vocab_size, args.batch, args.prompt, device)
    ids = [f"a{i % args.distinct}" for i in range(args.batch)]
    experts = [m for m in pm.modules() if hasattr(m, "_csgmv_record") and m._csgmv_record.experts is not None]
    calls = [0]

    spent: list = []

    def pre(module, inputs):
        counter.on = True
        calls[0] += 1
        filled[0] = 0.0
        spent.append(-time.perf_counter())

    def post(module, inputs, output):
        spent[-1] += time.perf_counter() - filled[0]
        counter.on = False

    for m in experts:
        m.register_forward_pre_hook(pre)
        m.register_forward_hook(post)
    with torch.no_grad():
        out = pm(input_ids=input_ids, attention_mask=mask, use_cache=True, adapter_ids=ids)
        cache = out.past_key_values
        step = dict(input_ids=step_ids, attention_mask=step_mask, past_key_values=cache, use_cache=True)
        crop_cache(cache, args.prompt)  # (before every step, the first too: sliding-window layers record from here)
        pm(**step, adapter_ids=ids)  # (a first step makes what later ones reuse: plan constants of this size)
        crop_cache(cache, args.prompt)
        counter.ops.clear()
        launches.clear()
        calls[0] = 0
        with counter:
            pm(**step, adapter_ids=ids)
        counted_calls, triton = calls[0], sum(launches.values())
        shown = dict(launches)
        spent.clear()
        for _ in range(args.steps):
            crop_cache(cache, args.prompt)
            pm(**step, adapter_ids=ids)
        host_us = statistics.median(spent) * 1e6
    disable_csgmv(pm)
    n = counted_calls
    total = sum(counter.ops.values())
    views = sum(v for k, v in counter.ops.items() if k in VIEWS)
    print(f"{args.model}: {n} experts layers, batch {args.batch}, {args.distinct} distinct adapters")
    if args.show:
        for name, count in counter.ops.most_common():
            print(f"  {name:<28} {count / n:6.1f}{'  (view)' if name in VIEWS else ''}")
        for name, count in shown.items():
            print(f"  triton {name:<21} {count / n:6.1f}")
    print(
        f"per experts-layer forward: {total / n:.1f} torch ops ({(total - views) / n:.1f} not views, "
        f"{views / n:.1f} views), {triton / n:.1f} Triton launches; {host_us:.0f} µs on this CPU (median over "
        f"{args.steps} steps, one thread; the ops run, the launches are skipped)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
