"""dynamo's tracing of a static-cache decode step, on any machine (the CPU included): the base model, stock PEFT with
one adapter and peft_csgmv, each in a process of its own, on a small Llama of ``--layers`` layers (LoRA on all 7
projections). The backend runs the traced graph as it is (no AOT autograd, no inductor), so the first call's compile is
dynamo's alone: the part of a compile that csgmv's patched layers add to (docs/benchmarks.md, "Compile time").

    python benchmarks/trace_time.py --rows base,peft,csgmv --rounds 2
    python benchmarks/trace_time.py --rows csgmv --by-line 25     # where csgmv's own code spends the trace
    python benchmarks/trace_time.py --rows base,csgmv --device cuda --profile results/trace_prof

Per row: dynamo's ``bytecode_tracing`` and ``build_guards`` seconds, the graph's calls (``calls_captured``) and the
instructions dynamo stepped through. ``--by-line N``: the N lines of peft_csgmv that cost the trace most (time spent
stepping their instructions, nested calls not counted). ``--device cuda``: the same model on the GPU (csgmv's ops then
launch its Triton kernels, and hand their variants to the compile worker process as they are traced;
``csgmv-threads``: to a thread of the process; ``csgmv-noahead``: neither). ``--profile DIR``: a cProfile of each
row's first call, saved as ``DIR/<row>_<round>.pstats``, its 15 costliest functions (own time) printed (on Python
3.12 cProfile records every thread's calls, compiles on other threads included). The table is printed last.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time


def child(args) -> dict:
    import torch
    import torch._dynamo.symbolic_convert as sc
    from torch._dynamo.utils import compile_times, counters
    from transformers import AutoModelForCausalLM, CompileConfig, LlamaConfig

    from peft_csgmv.bench import add_adapters

    steps, lines, nested = collections.Counter(), collections.Counter(), []
    step = sc.InstructionTranslatorBase.step

    def counted(self):  # instructions by code object; with --by-line, time per peft_csgmv line (nested steps apart)
        steps[self.f_code.co_name] += 1
        if not args.by_line:
            return step(self)
        inst = self.instructions[self.instruction_pointer] if self.instruction_pointer is not None else None
        nested.append(0.0)
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            dt = time.perf_counter() - t0
            inner = nested.pop()
            if nested:
                nested[-1] += dt
            if inst is not None and inst.positions and "peft_csgmv" in self.f_code.co_filename:
                lines[
                    f"{os.path.basename(self.f_code.co_filename)}:{inst.positions.lineno} ({self.f_code.co_name})"
                ] += dt - inner

    sc.InstructionTranslatorBase.step = counted
    torch.manual_seed(0)
    heads, mlp = max(4, args.hidden // 64), 2 if args.hidden == 64 else 4
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=mlp * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(2, heads // 4), vocab_size=128,
                         max_position_embeddings=256)  # fmt: skip
    device = torch.device(args.device)
    model = AutoModelForCausalLM.from_config(config).eval().to(device)
    model.generation_config.pad_token_id = 0
    target, ids = model, None
    if args.row != "base":
        target = add_adapters(model, args.adapters, [8], device)
    if args.row == "peft":
        target.set_adapter("a0")
    if args.row.startswith("csgmv"):
        from peft_csgmv import enable_csgmv

        enable_csgmv(target)
        ids = [f"a{i % args.adapters}" for i in range(args.batch)]
    backend = (lambda gm, example_inputs: gm.forward) if args.backend == "none" else args.backend
    compile_config = CompileConfig(fullgraph=True, backend=backend, mode=None, dynamic=False)
    compile_config._compile_all_devices = True  # (transformers compiles the decode step on CUDA only, unless told)
    x = torch.randint(3, 128, (args.batch, 8)).to(device)
    kw = dict(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=3, min_new_tokens=3, do_sample=False,
              cache_implementation="static", compile_config=compile_config)  # fmt: skip
    if ids:
        kw["adapter_ids"] = ids
    profile = None
    if args.profile:
        import cProfile

        profile = cProfile.Profile()
    with torch.no_grad():
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        target.generate(**kw)
        if profile is not None:
            profile.disable()
        first = time.perf_counter() - t0
    top = []
    if profile is not None:
        import pstats

        os.makedirs(args.profile, exist_ok=True)
        profile.dump_stats(os.path.join(args.profile, f"{args.row}_{args.round}.pstats"))
        stats = pstats.Stats(profile).stats
        for (file, line, name), (_, calls, own, total, _) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:15]:
            top.append((own, total, calls, f"{os.path.basename(file)}:{line} ({name})"))
    names, values = compile_times(repr="csv", aggregate=True)
    phase = dict(zip(names, [float(v) if v not in ("", None) else 0.0 for v in values]))
    return dict(
        row=args.row, first_s=first, tracing_s=phase.get("bytecode_tracing", 0.0),
        guards_s=phase.get("build_guards", 0.0), backend_s=phase.get("OutputGraph.call_user_compiler", 0.0),
        calls=counters["stats"]["calls_captured"],
        graphs=counters["stats"]["unique_graphs"], instructions=sum(steps.values()),
        by_line=lines.most_common(args.by_line), profile_top=top,
    )  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="base,peft,csgmv")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--by-line", type=int, default=0, help="list the N peft_csgmv lines that cost the trace most")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (2048: the 1B layout's layer shapes; MLP 4x)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="none", help="none: the traced graph as it is; or a torch.compile backend "
                   "(aot_eager: AOT autograd's trace too, no inductor)")  # fmt: skip
    p.add_argument("--profile", default=None, help="a folder: cProfile each row's first call into it")
    p.add_argument("--out", default=None)
    p.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)  # a child's round
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # a child's row
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        with open(args.result, "w") as f:
            json.dump(child(args), f)
        return 0
    from common import row_runs

    results = []
    for r in range(args.rounds):
        for row in args.rows.split(","):
            argv = ["--layers", str(args.layers), "--hidden", str(args.hidden), "--adapters", str(args.adapters),
                    "--batch", str(args.batch), "--by-line", str(args.by_line), "--device", args.device,
                    "--round", str(r), "--backend", args.backend]  # fmt: skip
            if args.profile:
                argv += ["--profile", args.profile]
            (res,) = row_runs(__file__, row, argv)
            res["round"] = r
            results.append(res)
            print(f"{row} round {r}: first call {res['first_s']:.2f} s, tracing {res['tracing_s']:.2f} s", flush=True)
            for where, seconds in res["by_line"]:
                print(f"    {seconds:6.3f} s  {where}")
            for own, total, calls, where in res["profile_top"]:
                print(f"    own {own:6.3f} s  total {total:6.3f} s  {calls:7d} calls  {where}")
    print()
    print("| row | round | first call s | dynamo tracing s | guards s | backend s | graph calls | instructions |")
    print("|" + "---|" * 8)
    for res in results:
        print(f"| {res['row']} | {res['round']} | {res['first_s']:.2f} | {res['tracing_s']:.2f} | "
              f"{res['guards_s']:.2f} | {res['backend_s']:.2f} | {res['calls']} | {res['instructions']} |")  # fmt: skip
    if args.out:
        import torch

        from peft_csgmv.bench import run_meta, write_results

        write_results(args.out, run_meta(torch.device(args.device), args=vars(args)), results=results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
