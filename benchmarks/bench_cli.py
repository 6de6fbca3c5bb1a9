"""The batch command on one GPU: ``peft-csgmv generate`` by continuous batching (``--continuous-batching``, eager
steps or CUDA graphs) against static batches with the dynamic cache (eager decode, ``--static-batches``) and with the
static cache (transformers' compiled decode, ``--static-batches --cache-implementation static``), and the command's
own choice (``default``: no batching flag), on the same JSONL, in one run. ``--limits LOW,HIGH`` gives each line its
own ``max_new_tokens``, standing for answers that end at different points; the ``blind`` run is the command's
default before continuous batching (eager static batches of its default 16 rows, by prompt length) on such answers
when nothing tells their lengths ahead: the lines without their limits, every line decoded to ``--new-tokens``, and
only each line's own limit of tokens counted as generated (a batch decodes until its longest answer ends, as it
would until its last row's stop token).

    python benchmarks/bench_cli.py --out results/cli_1b.json

A checkout saved to a temporary folder (the built-in Llama layout's random weights in bf16, a character tokenizer, 32
LoRA adapters r=16 on all 7 projections) and a JSONL of ``--rows`` prompts over the 32 adapters, ``--words`` random
words each (with the character tokenizer the default range gives prompts of 140–236 tokens: one power-of-two prompt
bucket, so the static run compiles one decode step). Per row: new tokens over the command's own generation time
(model loading excluded; the static run's compile included, as a user pays it), the wall time, and how many
completions agree with the first run's (bf16: greedy decoding parts after near ties). ``--batch-size`` is the static
batches' rows per call, not the blind run's (continuous batching runs with its own defaults). A run that fails gets a
row with the last line of its error (out of memory, say), and the runs after it still run; "vs first" is to the first
run that finished. The table is printed last; the JSON holds GPU name, versions and date.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import torch

from peft_csgmv.bench import run_meta, write_results

from common import run_generate, save_checkout, write_prompts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1b", help="a built-in Llama layout of peft_csgmv.bench")
    p.add_argument("--rows", type=int, default=2048)
    p.add_argument("--words", default="25,34", help="words per prompt: LOW,HIGH")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64, help="--max-new-tokens (the largest line limit with --limits)")
    p.add_argument(
        "--limits",
        default=None,
        help="LOW,HIGH: each line's own max_new_tokens, uneven answers (e.g. 16,512; --new-tokens should be HIGH)",
    )
    p.add_argument(
        "--adapter-dtype",
        default="model",
        help="the command's --adapter-dtype: model (bf16 adapters, as this benchmark's earlier figures) or fp32",
    )
    p.add_argument(
        "--max-resident-adapters",
        type=int,
        default=None,
        help="the command's --max-resident-adapters (the host tier) for every run; default: not given",
    )
    p.add_argument(
        "--runs",
        "--caches",
        default="continuous,dynamic,static",
        help="the runs, in order: continuous (--continuous-batching --no-cuda-graphs: eager steps), uncapped (the "
        "same with --batch-size 1024, transformers' own cap of requests per step), graphs (--continuous-batching "
        "--cuda-graphs: each step a CUDA graph, the default on CUDA), dynamic "
        "(--static-batches), static (--static-batches --cache-implementation static), default (no batching flag: "
        "the command's choice), blind (--static-batches at the command's own batch size, on the lines without their "
        "own limits, each line's limit of its new tokens counted: answers that end at a stop token, unknown ahead; "
        "the default before continuous batching; needs --limits). A run may add the command's flags of its own: "
        "graphs+--batch-size=64+--max-batch-tokens=2048",
    )
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cli times the static cache's compiled decode: it needs a GPU", file=sys.stderr)
        return 2
    low, high = (int(w) for w in args.words.split(","))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        base, adapters = save_checkout(folder, args.model)
        inp = os.path.join(folder, "in.jsonl")
        limits = tuple(int(n) for n in args.limits.split(",")) if args.limits else None
        write_prompts(inp, args.rows, (low, high), limits)
        blind_inp, limit_of = os.path.join(folder, "in_blind.jsonl"), {}
        with open(inp) as f, open(blind_inp, "w") as g:
            for line in f:
                record = json.loads(line)
                limit_of[record["id"]] = record.pop("max_new_tokens", None)
                g.write(json.dumps(record) + "\n")
        common = ["generate", "--base", base, "--input", inp, "--max-new-tokens", str(args.new_tokens),
                  "--no-progress", "--adapter-dtype", args.adapter_dtype]  # fmt: skip
        for name, path in adapters.items():
            common += ["--adapter", f"{name}={path}"]
        if args.max_resident_adapters is not None:
            common += ["--max-resident-adapters", str(args.max_resident_adapters)]
        static = ["--static-batches", "--batch-size", str(args.batch_size)]
        flags = {
            "default": [],
            "continuous": ["--continuous-batching", "--no-cuda-graphs"],
            "uncapped": ["--continuous-batching", "--no-cuda-graphs", "--batch-size", "1024"],  # (transformers' own)
            "graphs": ["--continuous-batching", "--cuda-graphs"],
            "dynamic": static + ["--cache-implementation", "dynamic"],
            "static": static + ["--cache-implementation", "static"],
            "blind": ["--static-batches", "--cache-implementation", "dynamic"],  # the command's own batch size
        }
        runs = [spec.split("+") for spec in args.runs.split(",")]  # [name, "--flag=value", ...]
        for name, *_ in runs:
            if name not in flags:
                p.error(f"unknown run {name!r}; runs: {', '.join(flags)}")
        if any(name == "blind" for name, *_ in runs) and limits is None:
            p.error("the blind run needs --limits")
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"))
        outputs = {}
        for i, (run, *extra) in enumerate(runs):
            out = os.path.join(folder, f"run{i}.jsonl")
            own = flags[run] + [part for flag in extra for part in flag.split("=", 1)]
            cmd = [sys.executable, "-m", "peft_csgmv", *common, *own, "--output", out]
            if run == "blind":
                cmd[cmd.index(inp)] = blind_inp
            label = " ".join(own) or "the default (the command's choice)"
            try:
                row = dict(row=label, **run_generate(cmd, env))
            except RuntimeError as e:  # (the run's row says why; the runs after it still run)
                last = [line for line in str(e).splitlines() if line.strip()][-1]
                rows.append(dict(row=label, failed=last[-400:]))
                print(rows[-1], flush=True)
                continue
            with open(out) as f:
                records = [json.loads(line) for line in f]
            if run == "blind":  # only each answer's own length counts; the rest is what a static batch pays for it
                row["row"] += " (blind to the lines' limits: the default before continuous batching)"
                row["decoded_tokens"] = row["new_tokens"]
                row["new_tokens"] = sum(min(r["new_tokens"], limit_of[r["id"]]) for r in records)
                row["tok_s"] = row["new_tokens"] / row["generate_s"]
            else:
                outputs[i] = [r["completion"] for r in records]
                if len(outputs) > 1:
                    first = next(iter(outputs.values()))
                    row["same_as_first"] = sum(a == b for a, b in zip(first, outputs[i])) / max(len(first), 1)
            rows.append(row)
            print(row, flush=True)

    print()
    print(f"| {args.model}, {args.rows} rows | new tokens | generate s | tok/s | vs first | same | wall s |")
    print("|---|---|---|---|---|---|---|")
    done = [r for r in rows if "failed" not in r]
    for r in rows:
        if "failed" in r:
            print(f"| {r['row']} | failed: {r['failed']} | | | | | |")
            continue
        same = f"{r['same_as_first'] * 100:.1f}%" if "same_as_first" in r else "-"
        print(f"| {r['row']} | {r['new_tokens']} | {r['generate_s']:.1f} | {r['tok_s']:.0f} | "
              f"{r['tok_s'] / done[0]['tok_s']:.2f} | {same} | {r['wall_s']:.0f} |")  # fmt: skip
    if args.out:
        write_results(args.out, run_meta(torch.device("cuda:0"), args=vars(args)), results=rows)
    return 1 if len(done) < len(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
