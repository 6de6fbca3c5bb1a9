"""Where transformers' static-cache generate spends its time, per row: prefill (eager) against decode steps (compiled),
and the GPU kernels of one decode step.

    python benchmarks/profile_static.py --model 1b --out results/profile_static_1b.json

Rows: base model, PEFT one adapter, peft_csgmv with ``--distinct`` adapters (all ``cache_implementation="static"``).
Per row, after a warm-up generate (compile): the median wall time of a ``max_new_tokens=1`` generate (prefill and the
first token) and of a full one; a decode step is their difference over the remaining tokens. Then the CUDA kernels of
both, under the torch profiler: a decode step's kernels are the difference of the two profiles over the step count
(kernels replayed from CUDA graphs are listed one by one). The GPU's idle time of a step is split by the gaps between
consecutive kernels: gaps under ``--gap-us`` (kernels queued back to back, inside one CUDA graph) against longer ones
(the GPU waiting on the host). ``--cprofile N`` also prints the N functions with the most host time (cProfile,
``tottime``) over one full generate; ``--series N`` times N more full generates one by one (with the garbage
collections and compiles among them). Also measured: the host time of dynamo's guard check of the row's compiled
decode step (every step runs it before the CUDA graph), and in one more generate its first decode step (where the CUDA
graph is recorded again for the call's new cache) against the later ones. Printed: a table of prefill / step /
GPU-busy / gap / host-wait time per step for each row, and each row's kernels by time per step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from peft_csgmv import enable_csgmv
from peft_csgmv.bench import TARGETS, add_adapters, build_model, clock_up, device_and_dtype, run_meta, write_results

from common import call_series, kernel_times


class GuardTimer:
    """Host time of dynamo's guard check of each graph compiled while it is installed (every call of a compiled
    step runs it before the graph): the best of 30 batches of 50 checks against the locals the graph was traced with,
    in µs. Reads a private dynamo hook (``torch._dynamo.guards.guard_manager_testing_hook_fn``): absent, nothing is
    measured."""

    def __init__(self) -> None:
        self.us: list[float] = []

    def __enter__(self) -> "GuardTimer":
        import torch._dynamo.guards as guards

        self._guards = guards if hasattr(guards, "guard_manager_testing_hook_fn") else None
        if self._guards is not None:
            self._saved = guards.guard_manager_testing_hook_fn
            guards.guard_manager_testing_hook_fn = self._hook
        return self

    def _hook(self, manager, scope, builder) -> None:
        root = getattr(manager, "root", manager)
        try:  # a private API: where it differs, nothing is measured and the compile goes on
            if not root.check(scope):
                return
            best = float("inf")
            for _ in range(30):
                t0 = time.perf_counter()
                for _ in range(50):
                    root.check(scope)
                best = min(best, (time.perf_counter() - t0) / 50 * 1e6)
        except Exception:
            return
        self.us.append(best)

    def __exit__(self, *exc) -> None:
        if self._guards is not None:
            self._guards.guard_manager_testing_hook_fn = self._saved


class StepClock:
    """A stopping criterion that stops nothing and notes the time after each step of ``generate`` (the device
    synchronized first): the first decode step, which records the compiled step's CUDA graph whenever the call's
    cache is new, against the steps that replay it."""

    def __init__(self, sync) -> None:
        self.sync, self.times = sync, []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.sync()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def split(self) -> tuple[float, float]:
        """``(first decode step ms, median of the later steps ms)``."""
        gaps = [(b - a) * 1e3 for a, b in zip(self.times, self.times[1:])]
        return (gaps[0], statistics.median(gaps[1:])) if len(gaps) > 1 else (float("nan"), float("nan"))


def host_profile(fn, top: int) -> str:
    """The ``top`` functions by own host time over one call of ``fn`` (cProfile)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b")
    p.add_argument("--config", default=None, help="any causal-LM config.json (or folder) instead of --model")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated LoRA target modules")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--distinct", type=int, default=32)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--rows", default="base,peft,csgmv")
    p.add_argument("--gap-us", type=float, default=20.0, help="kernel gaps shorter than this count as in-graph gaps")
    p.add_argument("--cprofile", type=int, default=0, help="print the N functions with the most host time")
    p.add_argument("--series", type=int, default=0, help="then N more generates per row, each one's time printed")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    torch._dynamo.config.recompile_limit = 64
    device, dtype = device_and_dtype(None)
    model = build_model(args.model, device, dtype, args.config)
    g = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    rows = []
    steps = args.new_tokens - 1

    def run(target, new, extra):
        return target.generate(
            input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=new, min_new_tokens=new,
            cache_implementation="static", **extra,
        )  # fmt: skip

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(target, new, extra):
        return statistics.median(call_series(lambda: run(target, new, extra), args.repeats, sync)["ms"])

    def measure(label, target, **extra):
        with torch.no_grad():
            with GuardTimer() as guard_timer:
                run(target, args.new_tokens, extra)  # compile
            run(target, 1, extra)
            clock_up(device)
            prefill = timed(target, 1, extra)
            full = timed(target, args.new_tokens, extra)
            k1, short1, long1, _ = kernel_times(lambda: run(target, 1, extra), args.gap_us)
            kn, shortn, longn, graphs = kernel_times(lambda: run(target, args.new_tokens, extra), args.gap_us)
            host = host_profile(lambda: run(target, args.new_tokens, extra), args.cprofile) if args.cprofile else ""
            series = call_series(lambda: run(target, args.new_tokens, extra), args.series, sync)
            from transformers import StoppingCriteriaList

            clock = StepClock(sync)
            run(target, args.new_tokens, dict(extra, stopping_criteria=StoppingCriteriaList([clock])))
            first_step, later_steps = clock.split()
        per_step = {}
        for name, (us, n) in kn.items():
            us0, n0 = k1.get(name, (0.0, 0))
            if n - n0 > 0:
                per_step[name] = ((us - us0) / steps, (n - n0) / steps)
        prefill_gpu = sum(us for us, _ in k1.values()) / 1e3
        busy = sum(us for us, _ in per_step.values()) / 1e3
        step = (full - prefill) / steps
        row = dict(
            row=label, prefill_ms=prefill, generate_ms=full, step_ms=step, step_gpu_ms=busy, prefill_gpu_ms=prefill_gpu,
            tok_s=args.batch * args.new_tokens / full * 1e3, kernels_per_step=sum(n for _, n in per_step.values()),
            gap_ms=(shortn - short1) / steps / 1e3, host_wait_ms=(longn - long1) / steps / 1e3,
            guard_us=guard_timer.us[-1] if guard_timer.us else None, graph=graphs, first_step_ms=first_step,
            later_step_ms=later_steps,
            top=sorted(((k, us, n) for k, (us, n) in per_step.items()), key=lambda r: -r[1])[: args.top], series=series,
            prefill_top=sorted(((k, us, n) for k, (us, n) in k1.items()), key=lambda r: -r[1])[: args.top],
        )  # fmt: skip
        rows.append(row)
        print(f"\n{label}: prefill {prefill:.1f} ms (GPU {prefill_gpu:.1f}), step {step:.3f} ms (GPU busy {busy:.3f}, "
              f"gaps {row['gap_ms']:.3f}, host wait {row['host_wait_ms']:.3f}), {row['kernels_per_step']:.0f} "
              f"kernels/step, {row['tok_s']:.0f} tok/s, guard check {row['guard_us'] or float('nan'):.0f} µs",
              flush=True)  # fmt: skip
        print(f"  first decode step (the CUDA graph recorded for the call's new cache) {first_step:.2f} ms, later "
              f"steps {later_steps:.3f} ms (median; each synchronized)", flush=True)  # fmt: skip
        print(
            f"  decode graph replays: {graphs['count']} of {graphs['kernels']:.0f} kernels, GPU span "
            f"{graphs['span_us'] / 1e3:.3f} ms, busy (union) {graphs['busy_us'] / 1e3:.3f} ms",
            flush=True,
        )
        for name, us, n in row["top"]:
            print(f"  {us:8.1f} µs/step  {n:6.1f}×  {name[:110]}")
        print("  prefill (a 1-token generate), kernels by GPU time:")
        for name, us, n in row["prefill_top"]:
            print(f"  {us:8.1f} µs  {n:6.0f}×  {name[:110]}")
        if host:
            print(host, flush=True)
        if series["ms"]:
            each = " ".join(f"{t:.1f}" for t in series["ms"])
            print(f"  {len(series['ms'])} more generates, ms each: {each}; garbage collections {series['gc']} "
                  f"({series['gc_ms']:.1f} ms), graphs compiled {series['graphs']}", flush=True)  # fmt: skip

    wanted = args.rows.split(",")
    if "base" in wanted:
        measure("base model", model)
    pm = add_adapters(model, args.adapters, [args.rank], device, targets=args.targets.split(","))
    pm.set_adapter("a0")
    if "peft" in wanted:
        measure("PEFT one adapter", pm)
    enable_csgmv(pm)
    if "csgmv" in wanted:
        ids = [f"a{i % args.distinct}" for i in range(args.batch)]
        measure(f"peft_csgmv, {args.distinct} distinct", pm, adapter_ids=ids)

    print(f"\n| {args.model} | row | tok/s | prefill ms | decode step ms | GPU busy per step ms | in-graph gaps ms | "
          "host wait ms | kernels per step | guard check µs | graph span ms | graph busy ms |")  # fmt: skip
    print("|" + "---|" * 12)
    for r in rows:
        guard = "—" if r["guard_us"] is None else f"{r['guard_us']:.0f}"
        print(f"| {args.model} | {r['row']} | {r['tok_s']:.0f} | {r['prefill_ms']:.1f} | {r['step_ms']:.3f} | "
              f"{r['step_gpu_ms']:.3f} | {r['gap_ms']:.3f} | {r['host_wait_ms']:.3f} | "
              f"{r['kernels_per_step']:.0f} | {guard} | {r['graph']['span_us'] / 1e3:.3f} | "
              f"{r['graph']['busy_us'] / 1e3:.3f} |")  # fmt: skip
    if args.out:
        write_results(args.out, run_meta(device, args=vars(args)), results=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
