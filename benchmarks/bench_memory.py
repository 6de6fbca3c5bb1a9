"""Adapter memory with csgmv enabled against PEFT alone, and the host tier at scale, in one run.

    python benchmarks/bench_memory.py --out results/memory_1b.json

Random weights from the 1B Llama layout (no hub), LoRA on all 7 projections. Three parts:

1. **Memory.** ``torch.cuda.memory_allocated`` before the adapters are added, after (PEFT alone), and after
   ``enable_csgmv`` (csgmv): for 32 and 128 adapters of rank 16, and 32 adapters of mixed ranks 8/16/64, each with
   PEFT's default fp32 adapters on the bf16 model and with bf16 adapters (``autocast_adapter_dtype=False``). The
   ratio column is (PEFT + what enabling added) / PEFT.
2. **Scale.** ``--scale`` bf16 adapters (1000: about 22 GiB) loaded, ``enable_csgmv(max_resident_adapters=64)``:
   the decode step (batch 32, prompt 256) with 32 distinct resident adapters, against the same step with only 32
   adapters loaded (no host tier) in the same run; GPU memory of both; and the host time a call with ids spends
   before its forward (validation, residency, opening the call: ``adapter_ids_scope``), which is all the tier adds
   to a call whose adapters are resident (the kernels do the same work); and, on CUDA, a 32-token ``generate`` on
   transformers' static cache (compiled decode: the host's drift does not enter) with both, and the GPU's busy time in
   it (``--no-static``: skip).
3. **Host-tier load cost.** A forward whose 32 adapters all wait in host memory (each copied into a slot first)
   against the same forward once they are resident, its plan new as the cold call's is (the rows in an order no call
   used: a plan's first use launches its kernels unbound, :mod:`peft_csgmv.kernels.bound`); per adapter, against its
   bytes over the measured pinned host→device bandwidth. The same call with its plan reused is printed beside it.
   ``--cold-phases N``: N more cold calls, each split into its moves (host ms, then device ms) and its forward;
   ``--trace-cold STEM``: one more under torch's profiler; ``--profile-call FILE``: cProfiles of opening calls.

The tables are printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from peft_csgmv import adapter_ids_scope, csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv._compat import cache_kwarg, output_cache
from peft_csgmv.bench import (
    Timer,
    build_model,
    crop_cache,
    decode_inputs,
    device_and_dtype,
    run_meta,
    write_results,
)

from common import add_many, clone_adapter, lora_layers

GIB = 2**30


def _allocated(device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    gc.collect()
    return torch.cuda.memory_allocated(device)


def _unload(pm):
    """The base model back, adapters gone, memory freed."""
    disable_csgmv(pm)
    base = pm.unload()
    del pm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return base


def memory_rows(model, device, cases) -> list[dict]:
    rows = []
    for n, ranks, fp32 in cases:
        before = _allocated(device)
        pm = add_many(model, n, ranks, device, fp32)
        peft = _allocated(device) - before
        enable_csgmv(pm)
        total = _allocated(device) - before
        stats = csgmv_stats(pm)
        row = dict(
            adapters=n,
            ranks="/".join(map(str, ranks)),
            adapter_dtype="fp32" if fp32 else "bf16",
            peft_gib=peft / GIB,
            csgmv_gib=total / GIB,
            ratio=total / peft if peft else float("nan"),
            stack_gib=stats["stack_bytes"] / GIB,
            shared_gib=stats["shared_bytes"] / GIB,
        )
        rows.append(row)
        print(f"memory {row}", flush=True)
        model = _unload(pm)
    return rows, model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--scale", type=int, default=1000, help="adapters loaded for the host-tier scale rows (0: skip)")
    p.add_argument("--resident", type=int, default=64, help="max_resident_adapters for the scale rows")
    p.add_argument("--cold-rounds", type=int, default=3, help="calls of 32 adapters waiting in host memory (median)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--memory-cases",
        default="32:16:fp32,128:16:fp32,32:8/16/64:fp32,32:16:bf16,32:8/16/64:bf16",
        help="n:ranks:dtype, comma-separated",
    )
    p.add_argument(
        "--no-static",
        dest="static",
        action="store_false",
        help="skip the static-cache generate of the scale rows (compiled decode: ~20 s of compile each)",
    )
    p.add_argument(
        "--profile-call",
        default=None,
        help="file: a cProfile of opening calls (as the call host µs column), 32 loaded then behind the tier",
    )
    p.add_argument(
        "--cold-phases",
        type=int,
        default=0,
        help="more cold calls, each split into its moves (host, then device) and its forward",
    )
    p.add_argument("--trace-cold", default=None, help="path stem: one more cold call under torch's profiler")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)

    device, dtype = device_and_dtype(args.device)
    timer = Timer(device)
    model = build_model(args.model, device, dtype)
    cases = []
    for case in filter(None, args.memory_cases.split(",")):
        n, ranks, dt = case.split(":")
        cases.append((int(n), [int(r) for r in ranks.split("/")], dt == "fp32"))
    memory, model = memory_rows(model, device, cases)

    # -- scale: decode with 32 distinct, first with 32 adapters loaded, then with --scale loaded and the host tier --
    input_ids, mask, step_ids, step_mask = decode_inputs(model.config.vocab_size, args.batch, args.prompt, device)
    names = [f"a{i % 32}" for i in range(args.batch)]

    def call_us(pm) -> float:
        """Host µs of opening and closing a call with ``names`` (no forward), median of 5 × 200."""
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(200):
                with adapter_ids_scope(pm, names):
                    pass
            samples.append((time.perf_counter() - t0) / 200 * 1e6)
        return sorted(samples)[2]

    def profiled(fn, title: str, rows: int = 25) -> None:
        """Append to --profile-call the cProfile of ``fn()``, its ``rows`` functions of most own time."""
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.runcall(fn)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
        with open(args.profile_call, "a") as f:
            f.write(f"# {title}\n{text.getvalue()}\n")

    def profile_call(pm, title: str) -> None:
        """With --profile-call, the cProfile of 1000 call openings with ``names`` (:func:`profiled`)."""

        def openings():
            for _ in range(1000):
                with adapter_ids_scope(pm, names):
                    pass

        if args.profile_call:
            profiled(openings, f"{title}: 1000 calls", rows=30)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(pm, ids) -> None:
        """One token per row, no cache: the forward of a cold call."""
        pm(input_ids=step_ids, attention_mask=step_mask[:, :1], adapter_ids=ids)

    def once_ms(fn) -> float:
        """ms of one ``fn()``, the device idle before and done after."""
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return (time.perf_counter() - t0) * 1e3

    def decode_ms(pm) -> float:
        cache_name = cache_kwarg(pm)
        with torch.no_grad():
            out = pm(input_ids=input_ids, attention_mask=mask, use_cache=True, adapter_ids=names)
            cache = output_cache(out)
            ms = timer(
                lambda: pm(
                    input_ids=step_ids, attention_mask=step_mask, use_cache=True, adapter_ids=names,
                    **{cache_name: cache},
                ),
                args.repeats,
                before=lambda: crop_cache(cache, args.prompt),
            )  # fmt: skip
        return ms

    def static_ms(pm) -> tuple[float, float] | tuple[None, None]:
        """A 32-token ``generate`` on transformers' static cache (compiled decode, CUDA graphs) with ``names``: the
        median of 3 after the first (which compiles), and the GPU's busy time in one more (the kernels' own time,
        torch profiler), ms; None off CUDA or with --no-static."""
        if device.type != "cuda" or not args.static:
            return None, None
        from common import call_series, kernel_times

        kw = dict(input_ids=input_ids, attention_mask=mask, adapter_ids=names, do_sample=False, max_new_tokens=32,
                  min_new_tokens=32, cache_implementation="static")  # fmt: skip
        with torch.no_grad():
            times = call_series(lambda: pm.generate(**kw), 4, lambda: torch.cuda.synchronize(device))["ms"]
            kernels, _, _, _ = kernel_times(lambda: pm.generate(**kw), 20.0)
        return statistics.median(times[1:]), sum(total for total, _ in kernels.values()) / 1e3

    def cold_split(pm, first: int) -> list[dict]:
        """--cold-phases calls of 32 adapters from host memory, sets not used before, split: opening the call alone
        (its moves: host ms until it returns, then ms until the device is done with them), then the forward alone
        (ms, the adapters resident now: the plan's second use, when the layers bind its launches; under cProfile in the
        first call with --profile-call, which then profiles the third use too), and the same adapters in an order no
        call used (a new plan); then, with --trace-cold, one more such call under torch's profiler."""
        rows = []
        for k in range(first, first + args.cold_phases + bool(args.trace_cold)):
            cold = [f"a{args.scale - 1 - 32 * k - i % 32}" for i in range(args.batch)]
            with torch.no_grad():
                if k == first + args.cold_phases:  # the traced call
                    from torch.profiler import ProfilerActivity, profile

                    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
                    sync()
                    with profile(activities=activities) as prof:
                        step(pm, cold)
                        sync()
                    prof.export_chrome_trace(args.trace_cold + ".json")
                    with open(args.trace_cold + ".txt", "w") as f:
                        for key in ("self_cpu_time_total", "self_device_time_total"):
                            f.write(prof.key_averages().table(sort_by=key, row_limit=30) + "\n")
                    continue
                sync()
                t0 = time.perf_counter()
                with adapter_ids_scope(pm, cold):
                    t1 = time.perf_counter()
                    sync()
                    t2 = time.perf_counter()
                if k == first and args.profile_call:
                    forward_ms = once_ms(lambda: profiled(lambda: step(pm, cold), "forward after the moves"))
                    profiled(lambda: step(pm, cold), "the same forward again")
                else:
                    forward_ms = once_ms(lambda: step(pm, cold))
                turned = cold[1:] + cold[:1]  # the same adapters, resident now, in an order no call used: a new plan
                new_plan_ms = once_ms(lambda: step(pm, turned))
            rows.append(
                dict(open_host_ms=(t1 - t0) * 1e3, open_device_ms=(t2 - t1) * 1e3, forward_ms=forward_ms,
                     new_plan_resident_ms=new_plan_ms)
            )  # fmt: skip
            print(f"cold call split: {rows[-1]}", flush=True)
        return rows

    scale = {}
    if args.scale:
        before = _allocated(device)
        pm = add_many(model, 32, [16], device, fp32=False)
        enable_csgmv(pm)
        gib = (_allocated(device) - before) / GIB
        static, busy = static_ms(pm)
        scale["loaded_32"] = dict(decode_ms=decode_ms(pm), gib=gib, call_us=call_us(pm), static_ms=static, busy_ms=busy)
        profile_call(pm, "32 adapters loaded")
        print(f"32 loaded: {scale['loaded_32']}", flush=True)
        disable_csgmv(pm)
        t0 = time.perf_counter()
        layers = lora_layers(pm)
        for i in range(32, args.scale):
            clone_adapter(pm, f"a{i % 32}", f"a{i}", layers)
            if i % 100 == 0:
                print(f"  {i} adapters, {time.perf_counter() - t0:.0f} s", flush=True)
        load_s = time.perf_counter() - t0
        peft_gib = (_allocated(device) - before) / GIB
        print(f"{args.scale} adapters loaded in {load_s:.0f} s: {peft_gib:.1f} GiB on the GPU", flush=True)
        t0 = time.perf_counter()
        enable_csgmv(pm, max_resident_adapters=args.resident)
        enable_s = time.perf_counter() - t0
        tier_gib = (_allocated(device) - before) / GIB
        # host-tier load cost: 32 adapters that wait in host memory (32 residents evicted for them), then the same
        # call resident; --cold-rounds sets of 32 never used before, the median taken
        cold_times = []
        for k in range(args.cold_rounds):
            cold = [f"a{args.scale - 1 - 32 * k - i % 32}" for i in range(args.batch)]
            cold_names = list(dict.fromkeys(cold))
            with torch.no_grad():
                cold_times.append(once_ms(lambda: step(pm, cold)))
        cold_ms = statistics.median(cold_times)  # (of an even count: the mean of the middle two)
        print(f"cold calls ms: {[round(t, 1) for t in cold_times]}", flush=True)
        cold_phases = cold_split(pm, args.cold_rounds) if args.cold_phases else []
        one_adapter_bytes = sum(
            p.numel() * p.element_size() for n, p in pm.named_parameters() if f".{cold_names[0]}." in n
        )
        with torch.no_grad():
            warm_ms = timer(lambda: step(pm, cold), 10)  # (its warm-up brings back any --cold-phases evicted)
            # A cold call's plan is new (its first use: no launches bound yet, :mod:`peft_csgmv.kernels.bound`): the
            # fair baseline is the same call resident with a plan no call used, the rows turned round each time.
            fresh_ms = statistics.median(once_ms(lambda: step(pm, cold[turn:] + cold[:turn])) for turn in range(1, 10))
        host = torch.empty(one_adapter_bytes * 32, dtype=torch.uint8).pin_memory() if device.type == "cuda" else None
        if host is not None:
            dev = torch.empty_like(host, device=device)
            bw_ms = timer(lambda: dev.copy_(host, non_blocking=True), 5)
            bw_gbs = host.numel() / (bw_ms / 1e3) / 1e9
            del host, dev
        else:
            bw_gbs = float("nan")
        per_adapter_ms = (cold_ms - fresh_ms) / len(cold_names)
        static, busy = static_ms(pm)
        scale["tier"] = dict(
            adapters=args.scale, resident=args.resident, load_s=load_s, enable_s=enable_s, peft_gib=peft_gib,
            gib=tier_gib, host_gib=csgmv_stats(pm)["host_bytes"] / GIB,
            decode_ms=decode_ms(pm), call_us=call_us(pm), static_ms=static, busy_ms=busy,
            cold_call_ms=cold_ms, cold_calls_ms=cold_times, cold_phases=cold_phases,
            warm_call_ms=warm_ms, fresh_plan_call_ms=fresh_ms,
            per_adapter_load_ms=per_adapter_ms, adapter_mib=one_adapter_bytes / 2**20, h2d_gb_s=bw_gbs,
            pcie_ms_per_adapter=one_adapter_bytes / (bw_gbs * 1e9) * 1e3,
        )  # fmt: skip
        print(f"tier: {scale['tier']}", flush=True)
        profile_call(pm, f"{args.scale} adapters, max_resident_adapters={args.resident}")
        _unload(pm)

    print()
    print(
        "| adapters | ranks | adapter dtype | PEFT alone GiB | with csgmv GiB | ratio | stacks GiB | of which PEFT's |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in memory:
        print(
            f"| {r['adapters']} | {r['ranks']} | {r['adapter_dtype']} | {r['peft_gib']:.3f} | {r['csgmv_gib']:.3f} | "
            f"{r['ratio']:.3f} | {r['stack_gib']:.3f} | {r['shared_gib']:.3f} |"
        )
    if scale:
        t, one = scale["tier"], scale["loaded_32"]
        print()
        print("| adapters loaded | on the GPU | adapter GiB on the GPU | host GiB (pinned) | decode-step ms, "
              "32 distinct | call host µs | static-cache generate ms (32 tokens), GPU busy ms |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")

        def static(row) -> str:
            return "—" if row["static_ms"] is None else f"{row['static_ms']:.1f}, {row['busy_ms']:.1f}"

        print(f"| 32 | all | {one['gib']:.2f} | — | {one['decode_ms']:.2f} | {one['call_us']:.0f} | {static(one)} |")
        print(
            f"| {t['adapters']} | {t['resident']} (max_resident_adapters) | {t['gib']:.2f} | {t['host_gib']:.2f} | "
            f"{t['decode_ms']:.2f} | {t['call_us']:.0f} | {static(t)} |"
        )
        print()
        print("| adapter MiB | cold call ms (32 from host, new plan) | resident, new plan ms "
              "| resident, plan reused ms | per adapter ms | its bytes over PCIe ms | pinned H2D GB/s |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        print(
            f"| {t['adapter_mib']:.1f} | {t['cold_call_ms']:.1f} | {t['fresh_plan_call_ms']:.2f} | "
            f"{t['warm_call_ms']:.2f} | "
            f"{t['per_adapter_load_ms']:.2f} | {t['pcie_ms_per_adapter']:.2f} | {t['h2d_gb_s']:.1f} |"
        )
    if args.out:
        write_results(args.out, run_meta(device, args=vars(args)), memory=memory, scale=scale)
    return 0


if __name__ == "__main__":
    sys.exit(main())
