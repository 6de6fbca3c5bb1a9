"""The ``peft-csgmv`` command. With no arguments it runs the demo: a small random-weight model with several adapters
of different ranks, one mixed batch through stock PEFT and through csgmv, and whether they agree."""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 3):
    """Run ``fn`` once to warm up, then ``repeats`` times; return (last result, median seconds)."""
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


def demo(device: str | None = None, seed: int = 0) -> bool:
    """Build a small model with four adapters, run a mixed batch both ways, print the comparison. Returns whether
    they agree."""
    from . import disable_csgmv, enable_csgmv
    from .toy import tiny_llama, with_adapters

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    vocab = 1000
    base = tiny_llama(hidden=256, layers=4, seed=seed, vocab_size=vocab).to(dev, dtype)
    adapters = {"legal": 4, "chat": 8, "code": 16, "math": 32}
    model = with_adapters(base, adapters, seed=seed + 1)

    names = ["legal", "__base__", "chat", "code", "math", "legal", "__base__", "code"]
    batch, length = len(names), 32
    input_ids = torch.randint(3, vocab, (batch, length), device=dev)
    mask = torch.ones_like(input_ids)
    mask[1::3, :5] = 0  # some left padding
    print(
        f"peft_csgmv demo on {dev} ({dtype}): {len(adapters)} adapters (ranks {list(adapters.values())}), "
        f"batch {batch} × {length} tokens, rows {names}"
    )

    greedy = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref, t_peft = _timed(lambda: model(input_ids, attention_mask=mask, adapter_names=names).logits, dev)
        ref_gen = model.generate(adapter_names=names, **greedy)
    enable_csgmv(model)
    try:
        out, t_csgmv = _timed(lambda: model(input_ids, attention_mask=mask, adapter_ids=names).logits, dev)
        gen = model.generate(adapter_ids=names, **greedy)
    finally:
        disable_csgmv(model)

    diff = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    same_tokens = torch.equal(gen, ref_gen)
    agree = diff <= tol * max(scale, 1.0)
    print(
        f"forward logits: max |csgmv - PEFT| = {diff:.3g} (logits up to {scale:.3g}) -> "
        f"{'agree' if agree else 'DISAGREE'}"
    )
    if same_tokens:
        print("greedy generate, 8 new tokens: token-identical")
    else:
        share = (gen == ref_gen).float().mean().item()
        print(
            f"greedy generate, 8 new tokens: {share:.0%} of tokens identical ({dtype}: rounding can flip near-ties "
            "of a random model; in fp32 they are identical)"
        )
    print(f"forward time: PEFT adapter_names {t_peft * 1e3:.1f} ms, csgmv {t_csgmv * 1e3:.1f} ms")
    return agree and (same_tokens or dtype != torch.float32)


def _adapter_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def generate_command(args) -> int:
    """``peft-csgmv generate``: see peft_csgmv/batch.py."""
    from .batch import InputError, finished_lines, generate_rows, load_model, read_rows, write_errors

    adapters = dict(args.adapter)
    if len(adapters) != len(args.adapter):
        print("error: an adapter name is given twice", file=sys.stderr)
        return 2
    rows, errors = read_rows(args.input, adapters, args.prompt_key, args.adapter_key)
    if errors:
        print(InputError(errors), file=sys.stderr)
        if args.on_error == "stop":
            print("stopped before generating anything (use --on-error skip to skip bad lines)", file=sys.stderr)
            return 2
    done = finished_lines(args.output)
    todo = [r for r in rows if r.line not in done]
    if errors:
        write_errors(args.output, errors, done)
    print(
        f"{len(rows)} rows ({len(rows) - len(todo)} already done), {len(errors)} bad lines; {len(adapters)} adapters",
        file=sys.stderr,
    )
    if not todo:
        return 0
    model, tokenizer = load_model(args.base, adapters, args.dtype, args.device_map, args.device, args.backend)
    torch.manual_seed(args.seed)
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
    if args.do_sample:
        gen.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    stats = generate_rows(
        model, tokenizer, todo, args.output, batch_size=args.batch_size, progress=not args.no_progress, **gen
    )
    print(
        f"wrote {stats['rows']} rows, {stats['new_tokens']} new tokens in {stats['seconds']:.1f} s "
        f"({stats['new_tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s) to {args.output}",
        file=sys.stderr,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peft-csgmv", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="run the demo (the default)")
    p_demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")

    p_gen = sub.add_parser("generate", help="generate for a JSONL file of prompts, each with its own adapter")
    p_gen.add_argument("--base", required=True, help="base model (path or hub id)")
    p_gen.add_argument(
        "--adapter",
        action="append",
        type=_adapter_arg,
        required=True,
        metavar="NAME=PATH",
        help="a LoRA adapter to load (repeat for more)",
    )
    p_gen.add_argument("--input", required=True, help='JSONL: {"prompt": ..., "adapter": NAME|null, "id": ...}')
    p_gen.add_argument("--output", required=True, help="JSONL results; an existing file is resumed")
    p_gen.add_argument("--batch-size", type=int, default=16)
    p_gen.add_argument("--max-new-tokens", type=int, default=128)
    p_gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p_gen.add_argument("--temperature", type=float, default=1.0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--top-k", type=int, default=50)
    p_gen.add_argument("--seed", type=int, default=0)
    p_gen.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto")
    p_gen.add_argument("--device-map", default=None, help="accelerate device map, e.g. auto")
    p_gen.add_argument("--device", default=None, help="without --device-map: cuda or cpu (default: cuda if present)")
    p_gen.add_argument("--backend", choices=["auto", "triton", "torch"], default="auto")
    p_gen.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="bad input lines: stop before generating (default) or skip them with an error record",
    )
    p_gen.add_argument("--prompt-key", default="prompt")
    p_gen.add_argument("--adapter-key", default="adapter")
    p_gen.add_argument("--no-progress", action="store_true")

    sub.add_parser("bench", help="end-to-end benchmark against PEFT (options: peft-csgmv bench --help)", add_help=False)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return 0 if demo(getattr(args, "device", None)) else 1
    if args.command == "generate":
        return generate_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
