"""Host cost of the host tier's moves: calls whose adapters all wait in host memory, without the forward.

    python benchmarks/bench_tier_host.py                  # CPU or GPU: 100 adapters, 64 resident, calls of 32
    python benchmarks/bench_tier_host.py --phases         # and where the time goes (timers around each step;
                                                          # evict includes park, bring_in includes place)
    python benchmarks/bench_tier_host.py --repoint        # and the floor of this design: re-pointing PEFT's weights
                                                          # alone (page views, then host views), per adapter

A Llama of the 1B layout's depth (16 layers, LoRA on all 7 projections: 112 LoRA layers, 224 weights per adapter) at
small widths, so that the copies are cheap and what is left is the bookkeeping per weight that the tier pays on every
move. Each call opens ``adapter_ids_scope`` with 32 adapters that are all in host memory (each evicts a resident one);
the median over ``--calls`` such calls, per adapter. The first calls (two by default) move an adapter into every slot
and are not counted: the timed calls are the steady state of a long run (each slot has taken adapters before); the
first moves are printed apart.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from peft_csgmv import adapter_ids_scope, enable_csgmv
from peft_csgmv.bench import add_adapters


def _timed(owner, name: str, totals: collections.Counter):
    """Wrap ``owner.name`` to add its wall time to ``totals[name]``."""
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0

    setattr(owner, name, wrapper)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--resident", type=int, default=64)
    p.add_argument("--per-call", type=int, default=32)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--phases", action="store_true", help="also time the steps of a move (adds a little overhead)")
    p.add_argument("--cprofile", type=int, default=0, help="then print the N functions with the most own host time")
    p.add_argument(
        "--repoint",
        action="store_true",
        help="also time re-pointing each adapter's PEFT weights at a page and back, nothing else",
    )
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    if args.adapters < args.resident + args.per_call:
        p.error("--adapters must exceed --resident by at least --per-call (every counted call brings all in)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)  # fmt: skip
    t0 = time.perf_counter()
    model = add_adapters(LlamaForCausalLM(config).to(device), args.adapters, [args.rank], device)  # all 7 projections
    print(f"{args.adapters} adapters added in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    enable_csgmv(model, max_resident_adapters=args.resident)

    def call(names):
        with adapter_ids_scope(model, names):
            pass
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    order = [f"a{i}" for i in range(args.adapters)]
    nxt = args.resident  # the first adapters are resident from the start: begin with the others
    first = []  # the calls that move an adapter into each slot for the first time
    for _ in range(-(-args.resident // args.per_call)):  # every slot takes one move before the timed calls
        t0 = time.perf_counter()
        call([order[(nxt + i) % args.adapters] for i in range(args.per_call)])
        first.append(time.perf_counter() - t0)
        nxt += args.per_call
    totals: collections.Counter = collections.Counter()
    if args.phases:
        from peft_csgmv import tier
        from peft_csgmv.slots import LoraStack
        from peft_csgmv.tier import DevicePages

        for name in ("evict", "bring_in", "to_host"):
            _timed(tier.HostTier, name, totals)
        _timed(DevicePages, "place", totals)  # an adapter's slot set in a group's layers
        _timed(tier, "empty_slot", totals)  # emptied in its layers
        _timed(LoraStack, "refresh", totals)
    times = []
    profiler = None
    if args.cprofile:
        import cProfile

        profiler = cProfile.Profile()
    for _ in range(args.calls):
        names = [order[(nxt + i) % args.adapters] for i in range(args.per_call)]
        nxt += args.per_call
        t0 = time.perf_counter()
        if profiler is not None:
            profiler.runcall(call, names)
        else:
            call(names)
        times.append(time.perf_counter() - t0)
    if profiler is not None:
        import pstats

        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(args.cprofile)
    median_ms = statistics.median(times) * 1e3
    print("| layers | adapters | resident | calls of | median ms per call | ms per adapter | device |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {args.layers} | {args.adapters} | {args.resident} | {args.per_call} | {median_ms:.1f} | "
          f"{median_ms / args.per_call:.2f} | {device.type} |")  # fmt: skip
    first_ms = statistics.median(first) * 1e3
    print(f"\n| the first move into each slot (calls before the timed ones) | ms per adapter |\n|---|---|\n"
          f"| median of {len(first)} calls of {args.per_call} | {first_ms / args.per_call:.2f} |")  # fmt: skip
    if args.phases:
        moved = args.calls * args.per_call
        print("\n| step | ms per adapter |\n|---|---|")
        for name, total in totals.most_common():
            print(f"| {name} | {total * 1e3 / moved:.2f} |")
    if args.repoint:
        repoint(model, order)
    return 0


def repoint(model, names: list[str]) -> None:
    """Time what a move cannot do without: re-pointing an adapter's PEFT weights that view its page at a slot's page
    (views made as its host region's are, :func:`~peft_csgmv.tier.packed_views`) and back at its host region's views
    (``.data`` set twice per weight), those weights and nothing else. Once with one adapter over and over (the objects
    in the CPU's caches), once cycling through the hosted adapters of ``names``, as the timed calls take them (each
    one's objects untouched since its last move). The weights are left as they were."""
    from peft_csgmv.tier import packed_views

    state = model._csgmv
    tier = state.tier
    slot = next(iter(state.registry.index.values()))
    names = [name for name in names if name not in state.registry.index]  # in host memory: their weights put back
    moves = {}  # name -> (parameters, their page views, their host views) per group of pages
    for name in names:
        placement = tier.placements[name]
        moves[name] = []
        for pages, region, params, host_views in tier.regions(name):
            if pages is not None:
                offsets = placement.shared(pages)[1]
                moves[name].append(
                    (params, packed_views(pages.page(slot, region.numel()), params, offsets), host_views)
                )

    def there_and_back(name: str) -> None:
        for params, page_views, host_views in moves[name]:
            for view, p in zip(page_views, params):
                p.data = view
            for view, p in zip(host_views, params):
                p.data = view

    hot = []
    for _ in range(50):
        t0 = time.perf_counter()
        there_and_back(names[0])
        hot.append(time.perf_counter() - t0)
    cold = []
    for name in names:
        t0 = time.perf_counter()
        there_and_back(name)
        cold.append(time.perf_counter() - t0)
    weights = sum(len(params) for params, _, _ in moves[names[0]])
    print(f"\n| re-pointing PEFT's weights, page and back ({weights} weights) | ms per adapter |\n|---|---|")
    print(f"| one adapter over and over | {statistics.median(hot) * 1e3:.3f} |")
    print(f"| {len(names)} adapters in turn | {statistics.median(cold) * 1e3:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
