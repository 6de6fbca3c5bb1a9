"""Experiment: one decode step of a csgmv model captured in a CUDA graph, against the same step run eagerly.

    python benchmarks/graph_decode.py --model 1b --out results/graph_decode_1b.json

Eager decode is host-bound (Python and launches per layer); a CUDA graph replays the step's kernels with no host work,
so its time is the GPU time of the step. The model runs with a ``StaticCache`` (fixed addresses, as capture needs);
the plan and the bound launches are warmed up first, so the captured step does no host-side work that replay would
skip. Rows: base model (no LoRA) and peft_csgmv with 32 distinct adapters, each eager and replayed; the logits of
replay and eager are compared. A capture that fails is reported (with the error) rather than raised: this is the
probe for making graph capture a supported path. On a machine without CUDA only the eager rows run.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_kernels import capture_graph  # noqa: E402

from peft_csgmv import enable_csgmv  # noqa: E402
from peft_csgmv._compat import cache_kwarg  # noqa: E402
from peft_csgmv.bench import (  # noqa: E402
    MODELS,
    Timer,
    add_adapters,
    build_model,
    device_and_dtype,
    run_meta,
    write_results,
)


def measure(label: str, model, batch: int, prompt: int, device: torch.device, repeats: int, **extra) -> dict:
    """Prefill into a StaticCache, then time one decode step eagerly and (on CUDA) as a replayed CUDA graph."""
    from transformers import StaticCache

    cuda = device.type == "cuda"
    timer = Timer(device)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    step_ids = torch.randint(3, vocab, (batch, 1), generator=g).to(device)
    cache = StaticCache(config=model.config, max_cache_len=prompt + 8)
    row = dict(row=label)
    with torch.no_grad():
        model(
            input_ids=input_ids,
            **{cache_kwarg(model): cache},
            cache_position=torch.arange(prompt, device=device),
            **extra,
        )
        position = torch.tensor([prompt], device=device)

        # Some transformers versions keep the cache's write position in the cache (a tensor advanced in place on
        # every update) rather than taking it from ``cache_position``: put it back before each timed step, inside
        # the step so that a captured graph does the same.
        counters = [
            t for t in (getattr(layer, "cumulative_length", None) for layer in cache.layers) if torch.is_tensor(t)
        ]

        def step():
            for t in counters:
                t.fill_(prompt)
            return model(input_ids=step_ids, **{cache_kwarg(model): cache}, cache_position=position, **extra).logits

        eager_logits = step().clone()
        row["eager_ms"] = timer(step, repeats, warmup=3)
        if not cuda:
            return row
        try:
            graph, graph_logits = capture_graph(step)
            row["replay_max_diff"] = (graph_logits.float() - eager_logits.float()).abs().max().item()
            row["replay_ms"] = timer(graph.replay, repeats, warmup=3)
        except Exception as e:  # the probe's answer, not a crash
            row["capture_error"] = f"{type(e).__name__}: {e}"[:500]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(MODELS), default="1b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    device, dtype = device_and_dtype(args.device)
    model = build_model(args.model, device, dtype)
    rows = [measure("base model, no LoRA", model, args.batch, args.prompt, device, args.repeats)]
    pm = add_adapters(model, args.adapters, [16], device)
    enable_csgmv(pm)
    names = [f"a{i % args.adapters}" for i in range(args.batch)]
    rows.append(
        measure(
            f"peft_csgmv, {len(set(names))} distinct", pm, args.batch, args.prompt, device, args.repeats,
            adapter_ids=names,
        )
    )  # fmt: skip
    print(f"\n| {args.model} decode step | eager ms | CUDA-graph replay ms | replay vs eager max |diff| | capture |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['eager_ms']:.2f} | {r.get('replay_ms', float('nan')):.2f} | "
            f"{r.get('replay_max_diff', float('nan')):.3g} | "
            f"{r.get('capture_error', 'ok' if 'replay_ms' in r else 'not run (no CUDA)')} |"
        )
    if args.out:
        write_results(args.out, run_meta(device, args=vars(args)), results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
