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
import os
import sys
import tempfile

import torch

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.bench import (
    Timer,
    add_adapters,
    build_model,
    clock_up,
    crop_cache,
    decode_inputs,
    run_meta,
    write_results,
)

from common import run_generate, save_checkout, write_prompts


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
        clock_up(device)
        name = cache_kwarg(target)
        with torch.no_grad():
            prefill = timer(lambda: target(input_ids=input_ids, attention_mask=mask, use_cache=False, **extra), 5)
            cache = output_cache(target(input_ids=input_ids, attention_mask=mask, use_cache=True, **extra))
            decode = timer(
                lambda: target(input_ids=step, attention_mask=step_mask, use_cache=True, **{name: cache}, **extra),
                args.repeats,
                before=lambda: crop_cache(cache, args.prompt),
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
