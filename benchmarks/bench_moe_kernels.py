"""The MoE expert-LoRA kernels timed on one MoE layer of real shape (untuned).

    python benchmarks/bench_moe_kernels.py --out results/moe_kernels.json

For each (layout, tokens, distinct slots) on random routing, bf16, rank 16, it reports GPU µs (median of
``triton.testing.do_bench``) of:
* plan: ``MoePlan.build`` from the router's ``top_k_index`` (device ops, no sync);
* base: the experts' two grouped products over the plan's sorted order (``F.grouped_mm``, what transformers'
  ``grouped_mm`` runs; the gate between them excluded);
* lora: ``moe_shrink`` + ``moe_expand`` for gate/up (x by token) and for down (sorted order), on stacks laid out as
  :class:`~peft_csgmv.moe.MoeStack` keeps them (PEFT's own layouts per slot: ``own_rank``);
* floor: the bytes the LoRA must move (x and the per-pair rows it reads and writes, each used (slot, expert)'s A and B
  once) over ``--copy-gbs``, and lora's ratio to it.
The table is printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import random

import torch
import triton

from peft_csgmv.bench import run_meta, write_results
from peft_csgmv.kernels.moe import moe_expand, moe_shrink
from peft_csgmv.moe_plan import MoePlan

# name → (hidden, expert intermediate, experts, top_k)
LAYOUTS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "gpt-oss-20b": (2880, 2880, 32, 4),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def one_case(layout, tokens, slots, rank, device, copy_gbs):
    hidden, inter, experts, top_k = LAYOUTS[layout]
    dtype = torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(tokens * 31 + slots)
    index = torch.argsort(torch.rand(tokens, experts, generator=g), dim=1)[:, :top_k].to(device)
    rng = random.Random(tokens + slots)
    token_slot = torch.tensor([rng.randrange(slots) for _ in range(tokens)], dtype=torch.int32, device=device)

    def plan_build():
        return MoePlan.build(token_slot, index, experts, slots)

    plan = plan_build()
    pairs = plan.num_pairs
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w_gu = torch.randn(experts, 2 * inter, hidden, device=device, dtype=dtype) * hidden**-0.5
    w_d = torch.randn(experts, hidden, inter, device=device, dtype=dtype) * inter**-0.5
    stacks = []
    for k, n in ((hidden, 2 * inter), (inter, hidden)):
        a = torch.randn(slots, experts, rank, k, device=device, dtype=dtype) * k**-0.5
        b_store = torch.randn(slots, n, rank, experts, device=device, dtype=dtype) * rank**-0.5  # PEFT's (N, r·E)
        stacks.append((a, b_store.permute(0, 3, 1, 2)))
    ranks = torch.full((slots,), rank, dtype=torch.int32, device=device)
    scalings = torch.full((slots,), 2.0, dtype=torch.float32, device=device)
    perm = plan.permutation.long()
    xs = x[perm // top_k]
    offs = plan.expert_offsets
    h = torch.randn(pairs, 2 * inter, device=device, dtype=dtype)
    act = torch.randn(pairs, inter, device=device, dtype=dtype)
    o = torch.randn(pairs, hidden, device=device, dtype=dtype)

    def base():
        torch.nn.functional.grouped_mm(xs, w_gu.transpose(-2, -1), offs=offs, out_dtype=dtype)
        torch.nn.functional.grouped_mm(act, w_d.transpose(-2, -1), offs=offs, out_dtype=dtype)

    def lora():
        (a_gu, b_gu), (a_d, b_d) = stacks
        t = moe_shrink(x, a_gu, ranks, plan, x_rows="token", own_rank=True)
        moe_expand(t, b_gu, ranks, scalings, plan, h, y_rows="sorted", own_rank=True)
        t = moe_shrink(act, a_d, ranks, plan, x_rows="sorted", own_rank=True)
        moe_expand(t, b_d, ranks, scalings, plan, o, y_rows="sorted", own_rank=True)

    row = dict(layout=layout, tokens=tokens, slots=slots, rank=rank, pairs=pairs, segments=plan.num_segments,
               live_segments=len(plan.segments()), chunk=plan.chunk_size)  # fmt: skip
    for name, fn in (("plan", plan_build), ("base", base), ("lora", lora)):
        row[f"{name}_us"] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
    used = row["live_segments"] and len({(s, e) for s, e, *_ in plan.segments()})
    elem = 2  # bf16
    weight_bytes = used * rank * elem * (hidden + 2 * inter + inter + hidden)
    act_bytes = elem * (tokens * hidden + pairs * (2 * 2 * inter + inter + 2 * hidden)) + 4 * 4 * pairs * rank
    row["floor_us"] = (weight_bytes + act_bytes) / (copy_gbs * 1e3)
    row["lora_over_floor"] = row["lora_us"] / row["floor_us"]
    row["lora_over_base"] = row["lora_us"] / row["base_us"]
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="results/moe_kernels.json")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--tokens", nargs="+", type=int, default=[8, 64, 2048])
    parser.add_argument("--slots", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--copy-gbs", type=float, default=4300.0)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows = [one_case(layout, tokens, slots, args.rank, device, args.copy_gbs)
            for layout in args.layouts for tokens in args.tokens for slots in args.slots]  # fmt: skip
    write_results(args.out, run_meta(device, copy_gbs=args.copy_gbs), rows=rows)
    head = f"{'layout':<14}{'T':>6}{'S':>3}{'pairs':>7}{'segs':>6}{'plan µs':>9}{'base µs':>9}{'lora µs':>9}"
    print(head + f"{'floor µs':>10}{'lora/floor':>11}{'lora/base':>10}")
    for r in rows:
        print(f"{r['layout']:<14}{r['tokens']:>6}{r['slots']:>3}{r['pairs']:>7}{r['live_segments']:>6}"
              f"{r['plan_us']:>9.1f}{r['base_us']:>9.1f}{r['lora_us']:>9.1f}{r['floor_us']:>10.1f}"
              f"{r['lora_over_floor']:>11.2f}{r['lora_over_base']:>10.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
