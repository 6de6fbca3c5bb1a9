"""Several GPUs: a model spread with ``device_map``, and batch generation data-parallel, against one GPU, in one run.

    python benchmarks/bench_multi_gpu.py --out results/multi_gpu.json          # needs two or more GPUs

Random weights from the built-in Llama layouts (no hub), 32 LoRA adapters r=16 on all 7 projections, bf16.

1. **device_map** (``--split-model``, default 8b): prefill (batch × prompt) and decode-step time with csgmv and 32
   distinct adapters, the model on one GPU and then the same model dispatched over ``--gpus`` GPUs (consecutive decoder
   layers per GPU, embeddings on the first, norm and head on the last: what ``device_map="auto"`` does for a model too
   big for one GPU); base-model rows for both placements too. Target: the split decode step within 1.1× one GPU's.
2. **data-parallel** (``--dp-model``, default 1b): a checkout (base, char tokenizer, 32 adapters) saved to a temporary
   folder and a JSONL of ``--rows`` prompts over the 32 adapters; ``peft-csgmv generate`` in one process on one GPU,
   then ``accelerate launch --num_processes N -m peft_csgmv generate`` on the same file. tok/s = new tokens over the
   generation time (every process's own, the slowest one's for the data-parallel run; model loading excluded), and
   the wall time of each command. Target: ≥ 1.9× one GPU with two.

The tables are printed last; the JSON holds GPU names, versions and date.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from peft_csgmv import disable_csgmv, enable_csgmv  # noqa: E402
from peft_csgmv.bench import (  # noqa: E402
    MODELS,
    TARGETS,
    Timer,
    _clock_up,
    _crop,
    add_adapters,
    build_model,
    decode_inputs,
    run_meta,
    write_results,
)


def split_map(model, gpus: int) -> dict:
    """Consecutive decoder layers per GPU; embeddings on the first, final norm and head on the last."""
    layers = model.config.num_hidden_layers
    dm = {"model.embed_tokens": 0, "model.rotary_emb": gpus - 1, "model.norm": gpus - 1, "lm_head": gpus - 1}
    for i in range(layers):
        dm[f"model.layers.{i}"] = i * gpus // layers
    return dm


def device_map_rows(args, timer) -> list[dict]:
    from accelerate import dispatch_model

    from peft_csgmv._compat import cache_kwarg, output_cache

    device = torch.device("cuda:0")
    model = build_model(args.split_model, device, torch.bfloat16)
    input_ids, mask, step, step_mask = decode_inputs(model.config.vocab_size, args.batch, args.prompt, device)
    names = [f"a{i % 32}" for i in range(args.batch)]
    rows = []

    def measure(label, target, **extra):
        _clock_up(device)
        name = cache_kwarg(target)
        with torch.no_grad():
            prefill = timer(lambda: target(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra), 5)
            cache = output_cache(target(input_ids=input_ids, attention_mask=mask, use_cache=True, **extra))
            decode = timer(
                lambda: target(input_ids=step, attention_mask=step_mask, use_cache=True, **{name: cache}, **extra),
                args.repeats,
                before=lambda: _crop(cache, args.prompt),
            )
        rows.append(dict(row=label, prefill_ms=prefill, decode_ms=decode))
        print(f"{label:<48} prefill {prefill:8.2f} ms  decode {decode:7.2f} ms", flush=True)

    measure("base model, one GPU", model)
    pm = add_adapters(model, 32, [16], device)
    enable_csgmv(pm)
    measure("peft_csgmv 32 distinct, one GPU", pm, adapter_ids=names)
    disable_csgmv(pm)
    dispatch_model(pm.base_model.model, device_map=split_map(pm.base_model.model, args.gpus))
    with pm.disable_adapter():
        measure(f"base model, device_map over {args.gpus} GPUs", pm)
    enable_csgmv(pm)
    measure(f"peft_csgmv 32 distinct, device_map over {args.gpus} GPUs", pm, adapter_ids=names)
    return rows


def save_checkout(folder: str, model_name: str) -> tuple[str, dict[str, str]]:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_csgmv.toy import CHARS, char_tokenizer

    cfg = dict(MODELS[model_name], vocab_size=4 + len(CHARS))
    config = LlamaConfig(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, **cfg)
    torch.manual_seed(0)
    with torch.device("cuda:0"):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    base_dir = os.path.join(folder, "base")
    base.save_pretrained(base_dir)
    char_tokenizer().save_pretrained(base_dir)
    pm = None
    with torch.device("cuda:0"):
        for i in range(32):
            lc = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
            if pm is None:
                pm = get_peft_model(base, lc, adapter_name=f"a{i}", autocast_adapter_dtype=False)
            else:
                pm.add_adapter(f"a{i}", lc, autocast_adapter_dtype=False)
    adapters_dir = os.path.join(folder, "adapters")
    pm.save_pretrained(adapters_dir)
    paths = {}
    for i in range(32):
        nested = os.path.join(adapters_dir, f"a{i}")
        paths[f"a{i}"] = nested if os.path.isdir(nested) else adapters_dir
    return base_dir, paths


def write_prompts(path: str, rows: int, words: tuple[int, int]) -> None:
    """A JSONL of ``rows`` prompts of ``words[0]``..``words[1]`` random words, over the 32 adapters in turn."""
    rng = random.Random(0)
    vocab = ["the", "contract", "says", "hello", "model", "adapter", "prompt", "batch", "token", "tenant"]
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))
            f.write(json.dumps({"prompt": text, "adapter": f"a{i % 32}", "id": i}) + "\n")


_WROTE = re.compile(r"wrote (\d+) rows, (\d+) new tokens in ([\d.]+) s")


def run_generate(cmd: list[str], env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-3000:]}")
    found = [(int(r), int(t), float(s)) for r, t, s in _WROTE.findall(proc.stderr)]
    tokens, seconds = sum(t for _, t, _ in found), max(s for _, _, s in found)
    return dict(processes=len(found), rows=sum(r for r, _, _ in found), new_tokens=tokens, generate_s=seconds,
                tok_s=tokens / seconds, wall_s=wall)  # fmt: skip


def data_parallel_rows(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        base, adapters = save_checkout(folder, args.dp_model)
        inp = os.path.join(folder, "in.jsonl")
        write_prompts(inp, args.rows, (20, 60))
        common = ["generate", "--base", base, "--input", inp, "--batch-size", str(args.dp_batch),
                  "--max-new-tokens", str(args.new_tokens), "--no-progress",
                  "--adapter-dtype", args.adapter_dtype]  # fmt: skip
        for name, path in adapters.items():
            common += ["--adapter", f"{name}={path}"]
        env = dict(os.environ)
        one = run_generate([sys.executable, "-m", "peft_csgmv", *common, "--output", os.path.join(folder, "one.jsonl")],
                        dict(env, CUDA_VISIBLE_DEVICES="0"))  # fmt: skip
        rows.append(dict(row="one process, one GPU", **one))
        print(f"one GPU: {one}", flush=True)
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(args.gpus),
                  "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                  "-m", "peft_csgmv"]  # fmt: skip
        many = run_generate([*launch, *common, "--output", os.path.join(folder, "many.jsonl")], env)
        rows.append(dict(row=f"accelerate launch, {args.gpus} processes", **many))
        print(f"{args.gpus} GPUs: {many}", flush=True)
        with open(os.path.join(folder, "one.jsonl")) as a, open(os.path.join(folder, "many.jsonl")) as b:
            same = a.read() == b.read()
        rows[-1]["same_output"] = same
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=min(2, torch.cuda.device_count()))
    p.add_argument("--split-model", default="8b")
    p.add_argument("--dp-model", default="1b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rows", type=int, default=1024, help="prompts in the data-parallel JSONL")
    p.add_argument("--dp-batch", type=int, default=64, help="--batch-size of the generate command")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument(
        "--adapter-dtype",
        default="model",
        help="the command's --adapter-dtype: model (bf16 adapters, as this benchmark's earlier figures) or fp32",
    )
    p.add_argument("--parts", default="device-map,data-parallel")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.gpus < 2:
        print("needs two or more CUDA devices", file=sys.stderr)
        return 2
    timer = Timer(torch.device("cuda:0"))
    parts = args.parts.split(",")
    split = device_map_rows(args, timer) if "device-map" in parts else []
    torch.cuda.empty_cache()
    dp = data_parallel_rows(args) if "data-parallel" in parts else []

    if split:
        ref = {r["row"]: r for r in split}
        one = ref["peft_csgmv 32 distinct, one GPU"]
        print()
        print(f"| {args.split_model} | row | prefill ms | decode-step ms | decode vs csgmv one GPU |")
        print("|---|---|---|---|---|")
        for r in split:
            print(f"| {args.split_model} | {r['row']} | {r['prefill_ms']:.1f} | {r['decode_ms']:.2f} | "
                  f"{r['decode_ms'] / one['decode_ms']:.3f} |")  # fmt: skip
    if dp:
        print()
        print(
            f"| {args.dp_model}, {args.rows} rows | processes | new tokens | generate s | tok/s | vs one GPU | wall s |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in dp:
            print(f"| {r['row']} | {r['processes']} | {r['new_tokens']} | {r['generate_s']:.1f} | {r['tok_s']:.0f} | "
                  f"{r['tok_s'] / dp[0]['tok_s']:.2f} | {r['wall_s']:.0f} |")  # fmt: skip
    if args.out:
        meta = run_meta(torch.device("cuda:0"), args=vars(args), gpus=torch.cuda.device_count())
        write_results(args.out, meta, device_map=split, data_parallel=dp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
