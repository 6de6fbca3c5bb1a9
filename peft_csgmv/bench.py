"""End-to-end benchmark: base model, stock PEFT (one adapter, ``adapter_names``) and peft_csgmv, in one run.

    peft-csgmv bench --model 1b --out results/e2e_1b.json --plot results/e2e_1b.png
    python benchmarks/bench_e2e.py --model 1b --out results/e2e_1b.json        (the same)

Random weights from a transformers config (no hub): Llama sizes, or the MoE layouts qwen3-30b-a3b / gpt-oss-20b (cut to
``--layers``; tiny-moe and tiny-gpt-oss for CPU checks), whose adapters (``--moe``, on by default for them) are r=16
LoRA on the attention projections and on the experts' 3D ``gate_up_proj`` / ``down_proj`` (PEFT ``target_parameters``);
PEFT ``adapter_names`` refuses expert LoRA, so MoE runs skip those rows. Rows: base model with no LoRA (and again on the
loop csgmv's greedy ``generate`` runs on CUDA, its stop check a step late: the generate column to compare csgmv's with);
PEFT with one active adapter; PEFT ``adapter_names`` with 1 / 8 / 32 distinct adapters; peft_csgmv with the same batches
(and one with base rows mixed in); a measurement out of GPU memory reads NaN. Columns: prefill ms (batch × prompt
tokens), decode-step ms (one token per row over a KV cache of the prompt length), generate tok/s (``max_new_tokens`` =
``min_new_tokens``). Medians of CUDA-event timings after a warm-up; PEFT's one-adapter row and csgmv's rows alternate
over ``--rounds``, each reporting its median over them, and with more than one round the base model is measured as
many times, once before them and the others after (its row their median: a slow spell of the host in one measurement
moves no median of three). The table is printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import statistics
import sys
import time
import weakref

import torch

MODELS = {
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    # Mixture-of-experts layouts (``arch`` picks the config class), r=16 LoRA on attention and experts by default. The
    # real dimensions (transformers 5.25 config docstrings/defaults, and the models' config.json):
    # Qwen3-30B-A3B (Qwen3MoeConfig's defaults are its docstring checkpoint's but for 24 layers): hidden 2048, 48
    #   layers, 32 query / 4 KV heads of 128, 128 experts, 8 active, moe_intermediate 768, vocab 151936, untied.
    # gpt-oss-20b (GptOssConfig's defaults are gpt-oss-120b's 36 layers and 128 experts): hidden 2880, 24 layers, 64
    #   query / 8 KV heads of 64, 32 experts, 4 active, intermediate 2880 (experts with biases, swiglu_limit 7),
    #   sliding window 128 on alternate layers, vocab 201088, untied.
    # Both are cut to 16 layers by default (``--layers``): bf16 with 32 adapters, csgmv's stacks beside PEFT's copy
    # and the transient gathered expert weights of a decode step, ~55-60 GB, inside an 80 GB GPU.
    "qwen3-30b-a3b": dict(arch="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=16, full_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          vocab_size=151936),
    "gpt-oss-20b": dict(arch="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=16, full_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128, vocab_size=201088),
    "tiny-moe": dict(arch="qwen3_moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                     num_hidden_layers=2, full_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, num_experts_per_tok=2, vocab_size=1000),
    # gpt-oss's layout in miniature (sliding window 4 on alternate layers: a prompt of 4 or more fills it)
    "tiny-gpt-oss": dict(arch="gpt_oss", hidden_size=64, intermediate_size=32, num_hidden_layers=2, full_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8,
                         num_experts_per_tok=2, sliding_window=4, vocab_size=1000),
}  # fmt: skip
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MOE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # beside the experts' parameters below
EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


class Timer:
    """Median wall time of a callable: CUDA events on GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, repeats: int, warmup: int = 1, before=None) -> float:
        return statistics.median(self.samples(fn, repeats, warmup, before))

    def samples(self, fn, repeats: int, warmup: int = 1, before=None) -> list[float]:
        """Each of ``repeats`` timings (ms) of ``fn`` after ``warmup`` untimed calls; ``before`` runs untimed first."""
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
        return times


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


DEFERRED_BASE = "base model, stop check deferred (csgmv's generate loop)"


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


_PROMPT_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # (crop_cache, transformers before 5)


def crop_cache(cache, length: int) -> None:
    """Cut a KV cache back to ``length`` tokens (the prompt's, before the next decode step is timed).

    A sliding-window layer (gpt-oss, Mistral-style configs) that has filled its window keeps only the last
    ``window - 1`` states, and transformers 5 refuses to crop it unless it records its past
    (``activate_past_recording``: each step's update keeps the window plus the new tokens until the next ``crop``
    cuts them back). Recording is switched on here, before the first timed step, where the cache has it: the step
    computes the same (its attention sees the same ``window - 1`` past states plus the new token), and ``crop``
    brings back exactly the prompt's states. Layers without a window are cropped as before. Call it before every
    step, the first included (a step taken before recording is on cannot be taken back)."""
    activate = getattr(cache, "activate_past_recording", None)
    if activate is not None:
        activate()
    elif any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ())):
        # transformers before 5 cannot take a filled window back: the prompt's cache is kept at the first call and
        # put back at each later one.
        kept = _PROMPT_CACHES.get(cache)
        if kept is None:
            _PROMPT_CACHES[cache] = copy.deepcopy(cache)
        else:
            cache.__dict__.update(copy.deepcopy(kept).__dict__)
        return
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


def is_moe(name: str | None = None, config=None) -> bool:
    """Whether a built-in layout (``name``) or a loaded config has experts."""
    if config is not None:
        return any(getattr(config, k, None) for k in ("num_experts", "num_local_experts"))
    return "arch" in MODELS.get(name, {})


def build_model(
    name: str, device: torch.device, dtype: torch.dtype, config_path: str | None = None, layers: int | None = None
):
    """Random weights from a built-in layout (``name``; ``layers`` overrides its layer count) or from any causal-LM
    config (``config_path``: a ``config.json`` or a folder holding one); no weights are downloaded."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    if config_path:
        config = AutoConfig.from_pretrained(config_path)
        if layers:
            config.num_hidden_layers = layers
    else:
        kw = {k: v for k, v in MODELS[name].items() if k not in ("arch", "full_layers")}
        if layers:
            kw["num_hidden_layers"] = layers
        arch = MODELS[name].get("arch")
        if arch is None:
            config = LlamaConfig(max_position_embeddings=4096, **kw)
        else:
            cls = {"qwen3_moe": transformers.Qwen3MoeConfig, "gpt_oss": transformers.GptOssConfig}[arch]
            config = cls(pad_token_id=0, bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def add_adapters(
    model,
    n: int,
    ranks: list[int],
    device: torch.device,
    fp32_adapters: bool = False,
    targets=TARGETS,
    target_parameters=None,
):
    """``n`` randomly initialised adapters ``a0``... (ranks cycled), on ``targets`` and, for expert LoRA, on the 3D
    parameters ``target_parameters``."""
    from peft import LoraConfig, get_peft_model

    extra = dict(target_parameters=list(target_parameters)) if target_parameters else {}

    peft_model = None
    with torch.device(device):
        for i in range(n):
            r = ranks[i % len(ranks)]
            cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False, **extra)
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
    elif args.model.startswith("tiny"):
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
    p.add_argument("--model", choices=sorted(MODELS), default="1b", help="a built-in layout (Llama sizes, MoE layouts)")
    p.add_argument("--config", default=None, help="any causal-LM config.json (or folder) instead of --model")
    p.add_argument(
        "--layers", type=int, default=None, help="cut the layer count (MoE layouts: 16 by default, said in the table)"
    )
    p.add_argument(
        "--targets",
        default=None,
        help=f"comma-separated LoRA target modules (default {','.join(TARGETS)}; with --moe {','.join(MOE_TARGETS)})",
    )
    p.add_argument(
        "--moe",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="LoRA on the experts too (target_parameters " + ",".join(EXPERT_PARAMETERS) + "); PEFT adapter_names "
        "rows skipped (PEFT refuses them). Default: on for a model with experts",
    )
    p.add_argument(
        "--peft-one-repeats",
        type=int,
        default=None,
        help="prefill/decode repeats of the PEFT one-adapter rows (default --repeats; expert LoRA rebuilds every "
        "expert's weight each forward, so keep it low on big MoE layouts)",
    )
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
    from ._compat import cache_kwarg, deferred_stop_check, output_cache

    device, dtype = device_and_dtype(args.device)
    if args.rounds is None:
        args.rounds = 3 if device.type == "cuda" else 1
    if device.type != "cuda":
        print(cpu_note(args), flush=True)
    ranks = [int(r) for r in args.ranks.split(",")]
    distinct = [int(d) for d in args.distinct.split(",") if int(d) <= args.adapters]
    timer = Timer(device)
    model = build_model(args.model, device, dtype, args.config, args.layers)
    model_label = os.path.basename(os.path.normpath(args.config)) if args.config else args.model
    if args.moe is None:
        args.moe = is_moe(config=model.config)
    if args.targets is None:
        args.targets = ",".join(MOE_TARGETS if args.moe else TARGETS)
    full = MODELS.get(args.model, {}).get("full_layers") if not args.config else None
    if args.layers or (full and full != model.config.num_hidden_layers):
        model_label += f" ({model.config.num_hidden_layers}" + (f" of {full}" if full else "") + " layers)"
    if args.moe and not args.csgmv_only:
        print("expert LoRA: PEFT adapter_names refuses mixed batches on it, its rows are skipped", flush=True)
        args.csgmv_only = True
    vocab = model.config.vocab_size
    cache_name = cache_kwarg(model)  # "cache" from transformers 5.24 on, "past_key_values" before
    input_ids, mask, step_ids, step_mask = decode_inputs(vocab, args.batch, args.prompt, device)
    results = []

    def measure(label: str, call, gen_repeats: int | None = None, repeats: int | None = None, cache_call=None):
        """``call(**kw)`` runs the model (forward or generate) with the row's adapter arguments. A measurement that
        runs out of GPU memory is NaN (noted in the row's ``oom``); the decode step's KV cache then comes from
        ``cache_call`` (the same shapes without the row's adapter arguments)."""
        repeats = repeats or args.repeats
        oom: list[str] = []

        def guarded(what, fn):
            try:
                return fn()
            except torch.OutOfMemoryError:
                oom.append(what)
                print(f"{label}: {what} ran out of GPU memory", flush=True)
                torch.cuda.empty_cache()
                return None

        clock_up(device)
        with torch.no_grad():
            prefill = guarded(
                "prefill",
                lambda: timer(
                    lambda: call("forward", input_ids=input_ids, attention_mask=mask, use_cache=False), repeats
                ),
            )
            prompt_kw = dict(input_ids=input_ids, attention_mask=mask, use_cache=True)
            out = guarded("cache", lambda: call("forward", **prompt_kw))
            if out is None and cache_call is not None:
                out = guarded("cache from the plain call", lambda: cache_call("forward", **prompt_kw))
            cache = output_cache(out) if out is not None else None
            decode = (
                None
                if cache is None
                else guarded(
                    "decode",
                    lambda: timer(
                        lambda: call(
                            "forward",
                            input_ids=step_ids,
                            attention_mask=step_mask,
                            use_cache=True,
                            **{cache_name: cache},
                        ),
                        repeats * 2,
                        before=lambda: crop_cache(cache, args.prompt),
                    ),
                )
            )
            out = cache = None  # free the KV cache before generate
            reps = gen_repeats if gen_repeats is not None else max(2, args.repeats // 3)
            gen_ms = None
            if reps > 0:
                gen_ms = guarded(
                    "generate",
                    lambda: timer(
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
                    ),
                )
            tok_s = args.batch * args.new_tokens / (gen_ms / 1e3) if gen_ms else float("nan")
        nan = float("nan")
        prefill, decode = prefill if prefill is not None else nan, decode if decode is not None else nan
        row = dict(row=label, prefill_ms=prefill, decode_ms=decode, generate_tok_s=tok_s)
        if oom:
            row["oom"] = oom
        results.append(row)
        print(
            f"{label:<40} prefill {prefill:9.2f} ms  decode {decode:8.2f} ms  generate {tok_s:9.1f} tok/s", flush=True
        )

    def runner(target, **extra):
        def call(kind, **kw):
            return getattr(target, "generate" if kind == "generate" else "__call__")(**kw, **extra)

        return call

    def base_rows(model) -> None:
        measure("base model, no LoRA", runner(model))
        # csgmv's greedy generate calls on CUDA read transformers' stop flag a step late (enable_csgmv's
        # defer_stop_check), a loop that does not wait for the GPU at every step: the base model on that loop too, for
        # the generate column (the forward columns are the same calls).
        with deferred_stop_check():
            measure(DEFERRED_BASE, runner(model))

    base_rows(model)
    t0 = time.perf_counter()
    pm = add_adapters(
        model,
        args.adapters,
        ranks,
        device,
        args.fp32_adapters,
        [t for t in args.targets.split(",") if t],
        EXPERT_PARAMETERS if args.moe else None,
    )
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
        measure("PEFT one adapter", runner(pm), gen_repeats=gen_reps, repeats=args.peft_one_repeats)
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
                measure(label, runner(pm, adapter_ids=names_for(d)), gen_repeats=gen_reps, cache_call=runner(pm))
            measure(
                f"peft_csgmv, {max(distinct)} distinct + 1/4 base rows",
                runner(pm, adapter_ids=names_for(max(distinct), base_rows=True)),
                gen_repeats=gen_reps,
                cache_call=runner(pm),
            )
        finally:
            disable_csgmv(pm)
    if args.rounds > 1:
        # The base model again after the rounds, on a fresh copy (the first now holds the adapters), so that it is
        # measured as many times as the rows of the rounds: its row is the median of them all (a host that is slow at
        # the start, or at the end, then does not set every ratio alone).
        del pm, model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        model = build_model(args.model, device, dtype, args.config, args.layers)
        for _ in range(args.rounds - 1):
            base_rows(model)
    results[:] = _median_over_rounds(results)

    ref = {r["row"]: r for r in results}
    one = ref["PEFT one adapter"]
    base = ref["base model, no LoRA"]
    print()
    header = (
        f"| {model_label} | row | prefill ms | × base | decode-step ms | × base | generate tok/s | decode vs PEFT one "
        "| decode vs PEFT names |"
    )
    print(header)
    print("|" + "---|" * 9)
    for r in results:
        mixed = ref.get(r["row"].replace("peft_csgmv", "PEFT adapter_names"))
        vs_names = f"{r['decode_ms'] / mixed['decode_ms']:.3f}" if mixed and mixed is not r else ""
        print(
            f"| {model_label} | {r['row']} | {r['prefill_ms']:.1f} | {r['prefill_ms'] / base['prefill_ms']:.2f} | "
            f"{r['decode_ms']:.2f} | {r['decode_ms'] / base['decode_ms']:.2f} | {r['generate_tok_s']:.1f} | "
            f"{r['decode_ms'] / one['decode_ms']:.3f} | {vs_names} |"
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
