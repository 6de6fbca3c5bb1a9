"""End-to-end benchmark: base model, stock PEFT (one adapter, ``adapter_names``) and peft_csgmv, in one run.

    peft-csgmv bench --model 1b --out results/e2e_1b.json --plot results/e2e_1b.png
    python benchmarks/bench_e2e.py --model 1b --out results/e2e_1b.json        (the same)

Random weights from a transformers LlamaConfig (no hub). Rows: base model with no LoRA; PEFT with one active adapter;
PEFT ``adapter_names`` with 1 / 8 / 32 distinct adapters; peft_csgmv with the same batches (and one with base rows
mixed in). Columns: prefill ms (batch × prompt tokens), decode-step ms (one token per row over a KV cache of the
prompt length), generate tok/s (``max_new_tokens`` = ``min_new_tokens``). Medians of CUDA-event timings after a
warm-up. The table is printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Timer:
    """Median wall time of a callable: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int, warmup: int = 1, before=None) -> float:
        for _ in range(warmup):
            if before:
                before()
            fn()
        times = []
        for _ in range(repeats):
            if before:
                before()
            if self.cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def clock_up(device: torch.device, seconds: float = 0.5) -> None:
    """Keep the GPU busy for a moment before a row is timed: after a host-bound row (eager decode leaves the GPU mostly
    idle) the clocks can be down, and the next row's first timings would pay for it."""
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a @ a
        torch.cuda.synchronize(device)


def _median_over_rounds(rows: list[dict]) -> list[dict]:
    """One row per label, in first-seen order; a label measured in several rounds gets the median of each metric and
    keeps the single measurements under ``rounds``."""
    by_label: dict[str, list[dict]] = {}
    for r in rows:
        by_label.setdefault(r["row"], []).append(r)
    out = []
    for label, rs in by_label.items():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        merged = {"row": label}
        for key in ("prefill_ms", "decode_ms", "generate_tok_s"):
            merged[key] = statistics.median(r[key] for r in rs)
        merged["rounds"] = [{k: v for k, v in r.items() if k != "row"} for r in rs]
        out.append(merged)
    order = ("base model", "PEFT one adapter", "PEFT adapter_names", "peft_csgmv")
    return sorted(out, key=lambda r: next(i for i, p in enumerate(order + ("",)) if r["row"].startswith(p)))


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def crop_cache(cache, length: int) -> None:
    """Cut a KV cache back to ``length`` tokens (the prompt's, before the next decode step is timed)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def run_meta(device: torch.device, **extra) -> dict:
    """What every benchmark's result file records about its run: date, device, versions, Python, and ``extra``."""
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        device=_device_name(device),
        versions={m: __import__(m).__version__ for m in ("torch", "triton", "transformers", "peft")},
        python=sys.version.split()[0],
        **extra,
    )


def write_results(path: str, meta: dict, indent: int | None = 2, **payload) -> None:
    """``{"meta": meta, **payload}`` as JSON at ``path`` (its folder made if missing)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta=meta, **payload), f, indent=indent)


def decode_inputs(vocab: int, batch: int, prompt: int, device: torch.device, seed: int = 1) -> tuple:
    """``(input_ids, mask)`` of random prompts (batch × prompt) and ``(step_ids, step_mask)`` of one decode step over
    a KV cache of the prompt."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    input_ids = torch.randint(3, vocab, (batch, prompt), generator=g).to(device)
    mask = torch.ones_like(input_ids)
    step_ids = torch.randint(3, vocab, (batch, 1), generator=g).to(device)
    step_mask = torch.ones(batch, prompt + 1, dtype=mask.dtype, device=device)
    return input_ids, mask, step_ids, step_mask


def device_and_dtype(name: str | None) -> tuple[torch.device, torch.dtype]:
    """The benchmarks' device (``name``, else CUDA when there is one) and model dtype: bf16 on CUDA, fp32 on the CPU."""
    device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    return device, torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(name: str, device: torch.device, dtype: torch.dtype, config_path: str | None = None):
    """Random weights from a built-in Llama size (``name``) or from any causal-LM config (``config_path``: a
    ``config.json`` or a folder holding one); no weights are downloaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if config_path:
        config = AutoConfig.from_pretrained(config_path)
    else:
        config = LlamaConfig(max_position_embeddings=4096, **MODELS[name])
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def add_adapters(model, n: int, ranks: list[int], device: torch.device, fp32_adapters: bool = False, targets=TARGETS):
    from peft import LoraConfig, get_peft_model

    peft_model = None
    with torch.device(device):
        for i in range(n):
            r = ranks[i % len(ranks)]
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)
            if peft_model is None:
                # PEFT keeps adapters in fp32 on a bf16 base unless told otherwise; the default here is the model's
                # dtype (faster for PEFT, so the stricter baseline).
                peft_model = get_peft_model(model, cfg, adapter_name=f"a{i}", autocast_adapter_dtype=fp32_adapters)
            else:
                peft_model.add_adapter(f"a{i}", cfg, autocast_adapter_dtype=fp32_adapters)
    return peft_model.eval()


def cpu_note(args) -> str:
    """The line a CPU run starts with: what runs there, what its times are worth, and how long it takes."""
    if args.config:
        span = "its time grows with the model and --batch, --prompt, --new-tokens (--model tiny: a minute or two)"
    elif args.model == "tiny":
        span = "the tiny model takes a minute or two at the default sizes"
    else:
        span = f"the {args.model} model takes hours at these sizes (--model tiny: a minute or two)"
    return (
        "bench on the cpu: csgmv runs its plain-torch backend (the Triton kernels need CUDA), so these times say "
        f"nothing of its GPU speed and swing from run to run; {span}"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="peft-csgmv bench",
        description=__doc__.replace("``", "`"),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", choices=sorted(MODELS), default="1b", help="a built-in Llama size")
    p.add_argument("--config", default=None, help="any causal-LM config.json (or folder) instead of --model")
    p.add_argument("--targets", default=",".join(TARGETS), help="comma-separated LoRA target modules")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--ranks", default="16", help="comma-separated ranks, cycled over the adapters (e.g. 8,16,64)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--distinct", default="1,8,32")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument(
        "--peft-generate-repeats",
        type=int,
        default=1,
        help="generate repeats for PEFT adapter_names rows (they are slow)",
    )
    p.add_argument("--skip-peft-mixed-generate", action="store_true")
    p.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="rounds over the PEFT one-adapter and csgmv rows (alternating; medians over rounds are reported) "
        "(default: 3 on CUDA, 1 on the CPU)",
    )
    p.add_argument("--fp32-adapters", action="store_true", help="keep adapter weights in fp32 (PEFT's default)")
    p.add_argument("--csgmv-only", action="store_true", help="skip the PEFT adapter_names rows")
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--plot", default=None, help="PNG plot of decode-step time against distinct adapters")
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)

    from . import csgmv_stats, disable_csgmv, enable_csgmv
    from ._compat import cache_kwarg, output_cache

    device, dtype = device_and_dtype(args.device)
    if args.rounds is None:
        args.rounds = 3 if device.type == "cuda" else 1
    if device.type != "cuda":
        print(cpu_note(args), flush=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    distinct = [int(d) for d in args.distinct.split(",") if int(d) <= args.adapters]
    timer = Timer(device)
    model = build_model(args.model, device, dtype, args.config)
    model_label = os.path.basename(os.path.normpath(args.config)) if args.config else args.model
    vocab = model.config.vocab_size
    cache_name = cache_kwarg(model)  # "cache" from transformers 5.24 on, "past_key_values" before
    input_ids, mask, step_ids, step_mask = decode_inputs(vocab, args.batch, args.prompt, device)
    results = []

    def measure(label: str, call, gen_repeats: int | None = None):
        """``call(**kw)`` runs the model (forward or generate) with the row's adapter arguments."""
        clock_up(device)
        with torch.no_grad():
            prefill = timer(
                lambda: call("forward", input_ids=input_ids, attention_mask=mask, use_cache=False), args.repeats
            )
            out = call("forward", input_ids=input_ids, attention_mask=mask, use_cache=True)
            cache = output_cache(out)
            decode = timer(
                lambda: call(
                    "forward", input_ids=step_ids, attention_mask=step_mask, use_cache=True, **{cache_name: cache}
                ),
                args.repeats * 2,
                before=lambda: crop_cache(cache, args.prompt),
            )
            out = cache = None  # free the KV cache before generate
            reps = gen_repeats if gen_repeats is not None else max(2, args.repeats // 3)
            if reps > 0:
                gen_ms = timer(
                    lambda: call(
                        "generate",
                        input_ids=input_ids,
                        attention_mask=mask,
                        do_sample=False,
                        max_new_tokens=args.new_tokens,
                        min_new_tokens=args.new_tokens,
                    ),
                    reps,
                    warmup=1 if reps > 1 else 0,
                )
                tok_s = args.batch * args.new_tokens / (gen_ms / 1e3)
            else:
                tok_s = float("nan")
        row = dict(row=label, prefill_ms=prefill, decode_ms=decode, generate_tok_s=tok_s)
        results.append(row)
        print(
            f"{label:<40} prefill {prefill:9.2f} ms  decode {decode:8.2f} ms  generate {tok_s:9.1f} tok/s", flush=True
        )

    def runner(target, **extra):
        def call(kind, **kw):
            return getattr(target, "generate" if kind == "generate" else "__call__")(**kw, **extra)

        return call

    measure("base model, no LoRA", runner(model))
    t0 = time.perf_counter()
    pm = add_adapters(model, args.adapters, ranks, device, args.fp32_adapters, args.targets.split(","))
    print(f"loaded {args.adapters} adapters (ranks {ranks}) in {time.perf_counter() - t0:.1f} s", flush=True)
    pm.set_adapter("a0")

    def names_for(d: int, base_rows: bool = False):
        names = [f"a{i % d}" for i in range(args.batch)]
        if base_rows:
            names = ["__base__" if i % 4 == 3 else n for i, n in enumerate(names)]
        return names

    peft_gen = 0 if args.skip_peft_mixed_generate else args.peft_generate_repeats
    for d in [] if args.csgmv_only else distinct:
        measure(f"PEFT adapter_names, {d} distinct", runner(pm, adapter_names=names_for(d)), gen_repeats=peft_gen)
    # The rows compared with each other (PEFT one adapter and the csgmv rows) are measured in rounds, alternating, and
    # each reports its median over the rounds: eager decode is host-bound, and a slow spell of the host then lands
    # in one round of every row instead of all of one row.
    gen_reps = max(2, args.repeats // 3) if args.rounds == 1 else max(1, max(2, args.repeats // 3) // args.rounds)
    fast_rows = [f"peft_csgmv, {d} distinct" for d in distinct]
    setup: dict = {}
    for rnd in range(args.rounds):
        if args.rounds > 1:
            print(f"-- round {rnd + 1} of {args.rounds}", flush=True)
        measure("PEFT one adapter", runner(pm), gen_repeats=gen_reps)
        t0 = time.perf_counter()
        enable_csgmv(pm)
        if rnd == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            setup["enable_s"] = time.perf_counter() - t0
            stats = csgmv_stats(pm)
            setup["stack_mib"] = stats["stack_bytes"] / 2**20
            print(
                f"enable_csgmv: {setup['enable_s']:.2f} s, stacks {setup['stack_mib']:.0f} MiB "
                f"({stats['kernel_layers']} layers)",
                flush=True,
            )
        try:
            for d, label in zip(distinct, fast_rows):
                measure(label, runner(pm, adapter_ids=names_for(d)), gen_repeats=gen_reps)
            measure(
                f"peft_csgmv, {max(distinct)} distinct + 1/4 base rows",
                runner(pm, adapter_ids=names_for(max(distinct), base_rows=True)),
                gen_repeats=gen_reps,
            )
        finally:
            disable_csgmv(pm)
    results[:] = _median_over_rounds(results)

    ref = {r["row"]: r for r in results}
    one = ref["PEFT one adapter"]
    print()
    header = (
        f"| {model_label} | row | prefill ms | decode-step ms | generate tok/s | decode vs PEFT one "
        "| decode vs PEFT names |"
    )
    print(header)
    print("|" + "---|" * 7)
    for r in results:
        mixed = ref.get(r["row"].replace("peft_csgmv", "PEFT adapter_names"))
        vs_names = f"{r['decode_ms'] / mixed['decode_ms']:.3f}" if mixed and mixed is not r else ""
        print(
            f"| {model_label} | {r['row']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | "
            f"{r['generate_tok_s']:.1f} | {r['decode_ms'] / one['decode_ms']:.3f} | {vs_names} |"
        )
    if args.out:
        write_results(args.out, run_meta(device, label=model_label, args=vars(args), **setup), results=results)
    if args.plot:
        from .plot import plot_decode_vs_distinct

        meta = dict(args=vars(args), device=_device_name(device), label=model_label)
        plot_decode_vs_distinct([dict(meta=meta, results=results)], args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
