"""A model accelerate offloads on one GPU: half the decoder layers' weights in host memory, brought to the GPU for each
forward by accelerate's hooks (what ``device_map="auto"`` with a ``max_memory`` smaller than the model does), against
the same placement with stock PEFT, in one run.

    python benchmarks/bench_offload.py --out results/offload_8b.json          # needs a GPU

Random weights from the built-in Llama layouts (no hub), 32 LoRA adapters r=16 on all 7 projections, bf16 model and
adapters; the decoder layers from ``--offloaded`` of them on (default: the second half) offloaded to the CPU, executed
on GPU 0. Rows, each on that placement: the base model (no LoRA), stock PEFT with one active adapter, csgmv with 32
distinct adapters and with one adapter on every row (an offloaded layer's stack lends the call's adapters only), and
csgmv 32 distinct with the offloaded layers' stacks kept on the GPU (the placement policy not taken: it saves the
transfer and holds the stacks' bytes on the GPU for good, which accelerate meant to keep free). Columns: prefill ms
(batch × prompt), decode-step ms (one token per row over a KV cache of the prompt), the GPU memory allocated between
calls and the peak of a decode step, in MiB. An offloaded forward's time is mostly accelerate's copies of the layers'
weights from pageable host memory, whose speed drifts by ±15% over a minute; so the rows but the last are measured in
``--rounds`` alternating rounds (csgmv enabled and disabled in each), and each time is the median over every round's
CUDA-event timings after a warm-up, its spread the lowest and highest round median. The table is printed last; the
JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.bench import (
    MODELS,
    Timer,
    add_adapters,
    build_model,
    clock_up,
    crop_cache,
    decode_inputs,
    run_meta,
    write_results,
)

MIB = 1 << 20


def offload_map(model, first: int) -> dict:
    """A PeftModel's device map: decoder layers from ``first`` on offloaded to the CPU, everything else on GPU 0."""
    prefix = "base_model.model."
    layers = model.base_model.model.config.num_hidden_layers
    device_map = {f"{prefix}model.{n}": 0 for n in ("embed_tokens", "norm", "rotary_emb")}
    device_map[f"{prefix}lm_head"] = 0
    device_map.update({f"{prefix}model.layers.{i}": 0 if i < first else "cpu" for i in range(layers)})
    return device_map


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="8b", choices=[m for m in MODELS if "arch" not in MODELS[m]])
    p.add_argument("--layers", type=int, default=None, help="cut the layout to this many decoder layers")
    p.add_argument("--offloaded", type=int, default=None, help="the first offloaded layer (default: half of them)")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of every row but the last")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from accelerate import dispatch_model

    from peft_csgmv._compat import cache_kwarg, output_cache

    device = torch.device("cuda:0")
    timer = Timer(device)
    # Built on the GPU (fast random init), the layers to offload then moved to host memory before dispatching, so that
    # accelerate's weights map holds host tensors, as from_pretrained's offload does.
    model = build_model(args.model, device, torch.bfloat16, layers=args.layers)
    pm = add_adapters(model, args.adapters, [args.rank], device)
    layers = model.config.num_hidden_layers
    first = layers // 2 if args.offloaded is None else args.offloaded
    for i in range(first, layers):
        model.model.layers[i].to("cpu")
    torch.cuda.empty_cache()
    pm = dispatch_model(pm, device_map=offload_map(pm, first))
    input_ids, mask, step, step_mask = decode_inputs(model.config.vocab_size, args.batch, args.prompt, device)
    distinct = [f"a{i % args.adapters}" for i in range(args.batch)]
    samples: dict[str, dict] = {}

    def measure(label, **extra):
        clock_up(device)
        name = cache_kwarg(pm)
        times = {}
        with torch.no_grad():
            times["prefill"] = timer.samples(
                lambda: pm(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra), args.repeats
            )
            cache = output_cache(pm(input_ids=input_ids, attention_mask=mask, use_cache=True, **extra))
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated() / MIB
            torch.cuda.reset_peak_memory_stats()
            times["decode"] = timer.samples(
                lambda: pm(input_ids=step, attention_mask=step_mask, use_cache=True, **{name: cache}, **extra),
                args.repeats,
                before=lambda: crop_cache(cache, args.prompt),
            )
            peak = torch.cuda.max_memory_allocated() / MIB
        row = samples.setdefault(label, dict(row=label, prefill=[], decode=[], rounds=[], resident_mib=0, peak_mib=0))
        row["prefill"] += times["prefill"]
        row["decode"] += times["decode"]
        row["rounds"].append(statistics.median(times["decode"]))
        row["resident_mib"], row["peak_mib"] = max(row["resident_mib"], resident), max(row["peak_mib"], peak)
        torch.cuda.empty_cache()  # (the KV cache goes with this call)
        print(f"{label:<58} prefill {statistics.median(times['prefill']):9.2f} ms  decode "
              f"{statistics.median(times['decode']):8.2f} ms  resident {resident:8.0f} MiB  peak {peak:8.0f} MiB",
              flush=True)  # fmt: skip

    stats = None
    for _ in range(args.rounds):
        with pm.disable_adapter():
            measure("base model")
        pm.set_adapter("a0")
        measure("PEFT one adapter")
        enable_csgmv(pm)
        stats = csgmv_stats(pm)
        measure(f"peft_csgmv {args.adapters} distinct", adapter_ids=distinct)
        measure("peft_csgmv one adapter on every row", adapter_ids=["a0"] * args.batch)
        disable_csgmv(pm)
    # The policy not taken, once, last: each offloaded layer's stack kept on the GPU (no transfer per forward).
    enable_csgmv(pm)
    for layer in pm._csgmv.layers.values():
        stack = layer._csgmv_record.stack
        if stack.runs_on is not None:
            stack.to(stack.runs_on)
            stack.runs_on = None
            pm._csgmv.executor.drop_bindings(stack)
    pm._csgmv._find_devices()
    measure(f"peft_csgmv {args.adapters} distinct, offloaded stacks kept on the GPU", adapter_ids=distinct)
    disable_csgmv(pm)
    rows = []
    for row in samples.values():
        rows.append(dict(row=row["row"], prefill_ms=statistics.median(row["prefill"]),
                         decode_ms=statistics.median(row["decode"]), decode_round_ms=row["rounds"],
                         resident_mib=row["resident_mib"], peak_mib=row["peak_mib"]))  # fmt: skip

    base = rows[0]
    peft = rows[1]
    print()
    print(f"{args.model}, {layers - first} of {layers} layers offloaded to the CPU, batch {args.batch}, prompt "
          f"{args.prompt}, {args.adapters} adapters r={args.rank}; offloaded layers' stacks "
          f"{stats['offloaded_stack_bytes'] / MIB:.0f} MiB in host memory")  # fmt: skip
    print("| row | prefill ms | decode-step ms | round medians | decode vs PEFT one adapter | vs base | resident MiB "
          "| peak MiB |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs_peft, vs_base = r["decode_ms"] / peft["decode_ms"], r["decode_ms"] / base["decode_ms"]
        spread = f"{min(r['decode_round_ms']):.0f}–{max(r['decode_round_ms']):.0f}"
        print(f"| {r['row']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | {spread} | {vs_peft:.3f} | {vs_base:.3f} "
              f"| {r['resident_mib']:.0f} | {r['peak_mib']:.0f} |")  # fmt: skip
    if args.out:
        meta = run_meta(device, args=vars(args), offloaded_layers=layers - first, layers=layers,
                        offloaded_stack_bytes=stats["offloaded_stack_bytes"])  # fmt: skip
        write_results(args.out, meta, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
