"""transformers' fast path with mixed adapters: ``generate(..., cache_implementation="static")``, which compiles the
decode step (inductor, CUDA graphs), against the same path for the base model and stock PEFT with one adapter, in one
run.

    python benchmarks/bench_static.py --model 1b --out results/static_1b.json

Random weights from a transformers LlamaConfig (no hub). Rows, all with ``cache_implementation="static"`` and
transformers' default compile config: base model (no LoRA), the base model with a ``StaticCache`` kept by the caller
(reset before each call: what csgmv does for its calls by default, ``enable_csgmv(keep_static_cache=True)``), the
base model with its stop check deferred by a step (what csgmv's greedy calls do by default,
``enable_csgmv(defer_stop_check=None)``; transformers defers it on Apple GPUs only), PEFT one adapter for the whole
batch, peft_csgmv with 1 / 8 / 32 distinct adapters, the widest of them with a new cache per call (transformers' way,
``keep_static_cache=False``) and with the stop check read at every step (``defer_stop_check=False``); then peft_csgmv
32 distinct eager (dynamic cache). Per row: the first ``generate`` (compile included) and the median of ``--repeats``
more; ``compile s`` = first − median. tok/s counts new tokens (batch × ``--new-tokens``, ``min_new_tokens`` equal)
over the median. Also reported: how many graphs
dynamo compiled while each row ran (the csgmv rows share one: the ids change, the graph does not). The table is
printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv._compat import cache_kwarg, deferred_stop_check
from peft_csgmv.bench import (
    EXPERT_PARAMETERS,
    MOE_TARGETS,
    TARGETS,
    add_adapters,
    build_model,
    clock_up,
    device_and_dtype,
    is_moe,
    run_meta,
    write_results,
)
from peft_csgmv.kernels.launch import pdl

from common import developer_switches

DEFERRED = "base model, stop check deferred (as csgmv's calls)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        default="1b",
        help="a built-in layout of peft_csgmv.bench (tiny, 1b, 8b; the MoE layouts qwen3-30b-a3b, gpt-oss-20b, whose "
        "adapters also take the experts' 3D parameters)",
    )
    p.add_argument("--layers", type=int, default=None, help="cut the layout to this many decoder layers")
    p.add_argument("--config", default=None, help="any causal-LM config.json (or folder) instead of --model")
    p.add_argument(
        "--targets",
        default=None,
        help="comma-separated LoRA target modules (default: the 7 projections; the attention's 4 for a MoE layout)",
    )
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--distinct", default="1,8,32")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--fused",
        action="store_true",
        help="also the widest row with one launch per layer in decode (PEFT_CSGMV_FUSED_DECODE)",
    )
    p.add_argument(
        "--pdl-off",
        action="store_true",
        help="also the widest row without programmatic dependent launch (PEFT_CSGMV_PDL=0), to see what it gives",
    )
    p.add_argument(
        "--after",
        action="store_true",
        help="also the widest row with each layer's LoRA after its base product, not beside it (PEFT_CSGMV_BESIDE=0)",
    )
    p.add_argument(
        "--serial",
        action="store_true",
        help="also the widest row with every launch serial: no PDL, no side stream "
        "(PEFT_CSGMV_PDL=0, PEFT_CSGMV_BESIDE=0)",
    )
    p.add_argument(
        "--no-groups",
        action="store_true",
        help="also the widest row without sibling groups (PEFT_CSGMV_GROUPS=0: each layer its own LoRA launches, "
        "where by default layers that read the same input run theirs in one shrink and one expand launch)",
    )
    p.add_argument(
        "--groups-beside",
        action="store_true",
        help="also the widest row with sibling groups beside their members' base products (PEFT_CSGMV_GROUPS=beside: "
        "layers that run beside theirs join groups, and a group of base weights over the beside floor together runs "
        "its LoRA beside them)",
    )
    p.add_argument(
        "--beside-min-mib",
        type=float,
        default=None,
        help="also the widest row with only layers of base weights of at least this many MiB beside them "
        "(PEFT_CSGMV_BESIDE_MIN_MIB; the others after)",
    )
    p.add_argument(
        "--lean",
        action="store_true",
        help="only the base model, the widest csgmv row and the switched rows (no PEFT, eager or narrower rows)",
    )
    p.add_argument(
        "--reuse-cache",
        action="store_true",
        help="every static row passes one StaticCache of its own, reset before each generate, where transformers makes "
        "a new one per call (whose new addresses make the compiled step record its CUDA graph again): the rows' "
        "times without that recording",
    )
    p.add_argument("--out", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)

    from torch._dynamo.utils import counters

    torch._dynamo.config.recompile_limit = 64  # the rows' graphs share one compiled callable
    device, dtype = device_and_dtype(args.device)
    model = build_model(args.model, device, dtype, args.config, args.layers)
    moe = is_moe(config=model.config)
    targets = args.targets.split(",") if args.targets else MOE_TARGETS if moe else TARGETS
    g = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    results = []
    cache_name = cache_kwarg(model)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def measure(label: str, target, static: bool = True, kept: bool = False, **extra):
        clock_up(device)
        kw = dict(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=args.new_tokens,
                  min_new_tokens=args.new_tokens, **extra)  # fmt: skip
        cache = None
        if static and (args.reuse_cache or kept):
            from transformers import StaticCache

            # Sized as transformers sizes the cache it makes (the last token is not written back).
            cache = StaticCache(config=model.config, max_cache_len=args.prompt + args.new_tokens - 1)
        elif static:
            kw["cache_implementation"] = "static"
        graphs_before = counters["stats"]["unique_graphs"]
        times = []
        with torch.no_grad():
            for _ in range(args.repeats + 1):
                if cache is not None:
                    cache.reset()
                    kw[cache_name] = cache
                sync()
                t0 = time.perf_counter()
                out = target.generate(**kw)
                sync()
                times.append(time.perf_counter() - t0)
        assert out.shape[1] == args.prompt + args.new_tokens
        steady = statistics.median(times[1:])
        row = dict(
            row=label, static=static, first_s=times[0], generate_s=steady, compile_s=max(0.0, times[0] - steady),
            tok_s=args.batch * args.new_tokens / steady, graphs=counters["stats"]["unique_graphs"] - graphs_before,
        )  # fmt: skip
        results.append(row)
        print(
            f"{label:<44} first {row['first_s']:7.2f} s  median {steady * 1e3:8.1f} ms  {row['tok_s']:8.1f} tok/s  "
            f"graphs {row['graphs']}",
            flush=True,
        )
        return out

    measure("base model, no LoRA", model)
    if not args.reuse_cache:
        # What csgmv's calls do by default (enable_csgmv's keep_static_cache), done by the caller for the base model.
        measure("base model, a cache kept by the caller", model, kept=True)
    # csgmv's greedy calls read transformers' stop flag a step late (enable_csgmv's defer_stop_check): the base model
    # with the same loop, for comparison (transformers defers the check on Apple GPUs only). With a new cache per call:
    # transformers defers with a cache the caller passes only where that cache can be cropped (not 5.17's StaticCache).
    with deferred_stop_check():
        measure(DEFERRED, model)
    pm = add_adapters(
        model, args.adapters, [args.rank], device, targets=targets, target_parameters=EXPERT_PARAMETERS if moe else None
    )
    pm.set_adapter("a0")
    if not args.lean:
        measure("PEFT one adapter", pm)
    enable_csgmv(pm)
    distinct = [int(d) for d in args.distinct.split(",") if int(d) <= args.adapters]
    if args.lean:
        distinct = [max(distinct)]
    outs = {}
    for d in distinct:
        ids = [f"a{i % d}" for i in range(args.batch)]
        outs[d] = measure(f"peft_csgmv, {d} distinct", pm, adapter_ids=ids)
    ids = [f"a{i % max(distinct)}" for i in range(args.batch)]
    if not args.reuse_cache:
        enable_csgmv(pm, keep_static_cache=False)
        measure(f"peft_csgmv, {max(distinct)} distinct, a new cache per call", pm, adapter_ids=ids)
        enable_csgmv(pm)
    enable_csgmv(pm, defer_stop_check=False)
    got = measure(f"peft_csgmv, {max(distinct)} distinct, stop check not deferred", pm, adapter_ids=ids)
    same_deferred = (outs[max(distinct)] == got).float().mean().item()
    print(f"stop check deferred vs not, csgmv: {same_deferred * 100:.1f}% of tokens identical")
    enable_csgmv(pm)
    same = None
    if not args.lean:
        eager = measure(f"peft_csgmv, {max(distinct)} distinct, eager", pm, static=False, adapter_ids=ids)
        # Greedy tokens of the compiled and the eager path (bf16: the two paths may part after a near tie).
        same = (outs[max(distinct)] == eager).float().mean().item()
        print(f"compiled vs eager csgmv, {max(distinct)} distinct: {same * 100:.1f}% of tokens identical")
    disable_csgmv(pm)
    # The widest row again under developer switches (read when a model is enabled), to see what each gives.
    variants = []
    if args.fused:
        variants.append(("fused", "fused decode", {"PEFT_CSGMV_FUSED_DECODE": "1"}))
    if args.pdl_off:
        variants.append(("no_pdl", "no PDL", {"PEFT_CSGMV_PDL": "0"}))
    if args.after:
        variants.append(("after", "LoRA after the base product", {"PEFT_CSGMV_BESIDE": "0"}))
    if args.serial:
        variants.append(
            ("serial", "serial (no PDL, no side stream)", {"PEFT_CSGMV_PDL": "0", "PEFT_CSGMV_BESIDE": "0"})
        )
    if args.no_groups:
        variants.append(("no_groups", "no sibling groups", {"PEFT_CSGMV_GROUPS": "0"}))
    if args.groups_beside:
        variants.append(("groups_beside", "groups beside their base products", {"PEFT_CSGMV_GROUPS": "beside"}))
    if args.beside_min_mib is not None:
        env = {"PEFT_CSGMV_BESIDE_MIN_MIB": str(args.beside_min_mib)}
        variants.append(("beside_min", f"beside only base weights ≥ {args.beside_min_mib:g} MiB", env))
    same_variant = {}
    for key, label, env in variants:
        with developer_switches(env):
            enable_csgmv(pm)
            got = measure(f"peft_csgmv, {max(distinct)} distinct, {label}", pm, adapter_ids=ids)
            same_variant[key] = (outs[max(distinct)] == got).float().mean().item()
            print(f"{label} vs default compiled csgmv: {same_variant[key] * 100:.1f}% of tokens identical")
            disable_csgmv(pm)

    name = os.path.basename(os.path.normpath(args.config)) if args.config else args.model
    ref = {r["row"]: r for r in results}
    base, one = ref["base model, no LoRA"], ref.get("PEFT one adapter")
    deferred = ref[DEFERRED]
    print()
    print(
        f"| {name} | row (cache_implementation=static) | generate tok/s | vs PEFT one | vs base | "
        "vs base, stop check deferred | compile s |"
    )
    print("|" + "---|" * 7)
    for r in results:
        label = r["row"] + ("" if r["static"] else " (dynamic cache)")
        vs_one = f"{r['tok_s'] / one['tok_s']:.2f}" if one else "—"
        print(
            f"| {name} | {label} | {r['tok_s']:.0f} | {vs_one} | "
            f"{r['tok_s'] / base['tok_s']:.2f} | {r['tok_s'] / deferred['tok_s']:.2f} | {r['compile_s']:.1f} |"
        )
    if args.out:
        meta = run_meta(
            device,
            args=vars(args),
            compiled_vs_eager_identical=same,
            deferred_vs_not_identical=same_deferred,
            variants_vs_default_identical=same_variant,
            pdl=pdl(device),
        )
        write_results(args.out, meta, results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
