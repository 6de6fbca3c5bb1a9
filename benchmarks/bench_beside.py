"""GPU time of compiled LoRA layers, host time out of the picture: each layer's LoRA beside its base product
(``peft_csgmv::lora_linear``, a side stream in the CUDA graph, the default on CUDA; its launches there go without
programmatic dependent launch) against after it (the ``lora`` op, ``PEFT_CSGMV_BESIDE=0``), with the base model and
PEFT one adapter in the same run.

    python benchmarks/bench_beside.py --out results/beside.json

A stack of decoder-like blocks with the 1B and 8B Llama layouts' projections (q, k, v, o, gate, up, down; an
elementwise stand-in for attention, RMS norms, residual adds), bf16, 32 rows of one token (a decode step), 32 LoRA
adapters r=16 on all 7 projections, compiled with ``torch.compile(mode="reduce-overhead")`` (inductor and CUDA graphs,
as transformers compiles the static cache's decode step). Per row: the median over rounds of the GPU time of a batch
of forwards (CUDA events), per forward and per LoRA layer over the base model; from the profiler, the kernels' summed
time and the time at least one ran (a sum above it: kernels overlapped). The table is printed last; the JSON holds GPU
name, versions and date.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F
from torch import nn

from peft_csgmv import adapter_ids_scope, disable_csgmv, enable_csgmv
from peft_csgmv.bench import MODELS, TARGETS, device_and_dtype, run_meta, write_results
from peft_csgmv.kernels.expand import expand_tiles
from peft_csgmv.kernels.shrink import shrink_tiles

from common import developer_switches


class Block(nn.Module):
    """A Llama decoder layer's projections around an elementwise stand-in for attention."""

    def __init__(self, hidden: int, kv: int, inter: int) -> None:
        super().__init__()
        self.q_proj, self.o_proj = nn.Linear(hidden, hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.k_proj, self.v_proj = nn.Linear(hidden, kv, bias=False), nn.Linear(hidden, kv, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.groups = hidden // kv

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.rms_norm(x, x.shape[-1:])
        kv = (self.k_proj(h) * torch.sigmoid(self.v_proj(h))).repeat_interleave(self.groups, dim=-1)
        x = x + self.o_proj(self.q_proj(h) * kv)
        h = F.rms_norm(x, x.shape[-1:])
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Blocks(nn.Module):
    def __init__(self, layout: dict, blocks: int) -> None:
        super().__init__()
        hidden, inter = layout["hidden_size"], layout["intermediate_size"]
        kv = hidden // layout["num_attention_heads"] * layout["num_key_value_heads"]
        self.layers = nn.ModuleList(Block(hidden, kv, inter) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def gpu_ms(fn, x: torch.Tensor, calls: int, rounds: int) -> float:
    """Median over ``rounds`` of the GPU time of ``calls`` forwards, per forward (ms)."""
    for _ in range(3):  # compile, record the CUDA graph, warm up
        fn(x)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(x)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def kernels_us(fn, x: torch.Tensor, calls: int) -> tuple[float, float]:
    """``(sum of the kernels' times, time with at least one kernel running)`` per forward, µs, from the profiler
    (kernels replayed from a CUDA graph are listed one by one): the first exceeds the second where kernels overlap."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
    )
    total = sum(stop - start for start, stop in spans)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return total / calls, busy / calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="1b,8b", help="built-in Llama layouts of peft_csgmv.bench")
    p.add_argument("--blocks", default="8,4", help="blocks of each layout")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--pdl-off", action="store_true", help="also both csgmv rows without PDL (PEFT_CSGMV_PDL=0)")
    p.add_argument(
        "--groups",
        action="store_true",
        help="the sibling-group rows instead (an eager call first, which learns the groups): groups beside their "
        "base products where their base weights hold >= 16 MiB together (PEFT_CSGMV_GROUPS=beside), the default "
        "(groups after them, layers that run beside out of groups), beside with a 10 MiB floor, no groups",
    )
    p.add_argument(
        "--tiles",
        default=None,
        help="the default csgmv rows instead, one per ';'-separated decode-tile override (PEFT_CSGMV_DECODE_TILES, "
        "e.g. 'default;shrink_per_sm=1;expand_block_n=256'; 'default' is no override), each after an eager call "
        "that learns the sibling groups",
    )
    p.add_argument("--reverse", action="store_true", help="the csgmv rows in reverse order (to see the order's effect)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device, dtype = device_and_dtype(None)
    if device.type != "cuda":
        print("bench_beside times CUDA graphs: it needs a GPU")
        return 2
    from peft import LoraConfig, get_peft_model

    results = []
    for name, blocks in zip(args.models.split(","), (int(b) for b in args.blocks.split(","))):
        torch.manual_seed(0)
        model = Blocks(MODELS[name], blocks).to(device, dtype).eval()
        x = torch.randn(args.rows, 1, MODELS[name]["hidden_size"], device=device, dtype=dtype)
        lora_layers = blocks * len(TARGETS)

        def row(label: str, fn) -> None:
            torch._dynamo.reset()
            with torch.no_grad():
                ms = gpu_ms(fn, x, args.calls, args.rounds)
                total, busy = kernels_us(fn, x, 5)
            results.append(dict(model=name, blocks=blocks, row=label, ms=ms, kernels_us=total, busy_us=busy))
            print(
                f"{name} {label:<40} {ms * 1e3:8.1f} µs per forward, kernels {total:8.1f} µs, busy {busy:8.1f} µs",
                flush=True,
            )

        row("base model, no LoRA", torch.compile(model, mode="reduce-overhead", dynamic=False))
        config = dict(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS, init_lora_weights=False)
        pm = get_peft_model(model, LoraConfig(**config), adapter_name="a0", autocast_adapter_dtype=False)
        for i in range(1, args.adapters):
            pm.add_adapter(f"a{i}", LoraConfig(**config), autocast_adapter_dtype=False)
        pm.to(device, dtype).eval()
        pm.set_adapter("a0")
        inner = pm.base_model.model
        row("PEFT one adapter", torch.compile(inner, mode="reduce-overhead", dynamic=False))
        ids = [f"a{i % args.adapters}" for i in range(args.rows)]
        variants = [(label, {"PEFT_CSGMV_BESIDE": beside, "PEFT_CSGMV_PDL": "1"})
                    for label, beside in (("LoRA after the base", "0"), ("beside", "1"))]  # fmt: skip
        if args.pdl_off:  # does programmatic dependent launch across the graph's fork cost or hide idle time?
            variants += [(f"{label}, no PDL", {**env, "PEFT_CSGMV_PDL": "0"}) for label, env in variants]
        if args.groups:
            variants = [
                ("groups beside (16 MiB)", {"PEFT_CSGMV_GROUPS": "beside"}),
                ("default: groups after the base", {}),
                ("groups beside, 10 MiB floor", {"PEFT_CSGMV_GROUPS": "beside", "PEFT_CSGMV_BESIDE_MIN_MIB": "10"}),
                ("no groups", {"PEFT_CSGMV_GROUPS": "0"}),
            ]
        if args.tiles is not None:
            variants = [
                (f"tiles {spec}", {"PEFT_CSGMV_DECODE_TILES": "" if spec == "default" else spec})
                for spec in args.tiles.split(";")
            ]
        for label, env in variants[::-1] if args.reverse else variants:
            with developer_switches(env):
                shrink_tiles.cache_clear(), expand_tiles.cache_clear()  # the tile choices read the switch again
                enable_csgmv(pm)
                if args.groups or args.tiles is not None:  # an eager call learns the groups
                    with torch.no_grad(), adapter_ids_scope(pm, ids):
                        inner(x)
                compiled = torch.compile(inner, mode="reduce-overhead", dynamic=False)

                def call(x, compiled=compiled, pm=pm):
                    with adapter_ids_scope(pm, ids):
                        return compiled(x)

                row(f"csgmv 32 distinct, {label}", call)
                disable_csgmv(pm)
            shrink_tiles.cache_clear(), expand_tiles.cache_clear()
        for r in results:
            if r["model"] == name:
                base = next(b["ms"] for b in results if b["model"] == name and b["row"].startswith("base"))
                r["lora_us_per_layer"] = (r["ms"] - base) * 1e3 / lora_layers
        del model, pm, inner
        torch.cuda.empty_cache()

    print()
    print("| layout | row | GPU µs per forward | LoRA µs per layer (over base) | kernels' µs (sum) | busy µs |")
    print("|---|---|---|---|---|---|")
    for r in results:
        layout = f"{r['model']} × {r['blocks']} blocks"
        print(
            f"| {layout} | {r['row']} | {r['ms'] * 1e3:.1f} | {r['lora_us_per_layer']:.2f} | {r['kernels_us']:.1f} | "
            f"{r['busy_us']:.1f} |"
        )
    if args.out:
        write_results(args.out, run_meta(device, args=vars(args)), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
