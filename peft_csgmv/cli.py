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
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from . import disable_csgmv, enable_csgmv

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
    )  # fmt: skip
    base = LlamaForCausalLM(config).to(dev, dtype).eval()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {"legal": 4, "chat": 8, "code": 16, "math": 32}
    model = None
    for name, rank in adapters.items():
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    model.eval()

    names = ["legal", "__base__", "chat", "code", "math", "legal", "__base__", "code"]
    batch, length = len(names), 32
    input_ids = torch.randint(3, config.vocab_size, (batch, length), device=dev)
    mask = torch.ones_like(input_ids)
    mask[1::3, :5] = 0  # some left padding
    print(f"peft_csgmv demo on {dev} ({dtype}): {len(adapters)} adapters (ranks {list(adapters.values())}), "
          f"batch {batch} × {length} tokens, rows {names}")

    with torch.no_grad():
        ref, t_peft = _timed(lambda: model(input_ids, attention_mask=mask, adapter_names=names).logits, dev)
        ref_gen = model.generate(input_ids=input_ids, attention_mask=mask, adapter_names=names,
                                 max_new_tokens=8, do_sample=False, pad_token_id=0)
    enable_csgmv(model)
    try:
        out, t_csgmv = _timed(lambda: model(input_ids, attention_mask=mask, adapter_ids=names).logits, dev)
        gen = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=names,
                             max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        disable_csgmv(model)

    diff = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    same_tokens = torch.equal(gen, ref_gen)
    agree = diff <= tol * max(scale, 1.0)
    print(f"forward logits: max |csgmv - PEFT| = {diff:.3g} (logits up to {scale:.3g}) -> "
          f"{'agree' if agree else 'DISAGREE'}")
    print(f"greedy generate, 8 new tokens: {'token-identical' if same_tokens else 'tokens differ'}")
    print(f"forward time: PEFT adapter_names {t_peft * 1e3:.1f} ms, csgmv {t_csgmv * 1e3:.1f} ms")
    return agree and (same_tokens or dtype != torch.float32)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="peft-csgmv", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="run the demo (the default)")
    p_demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    args = parser.parse_args(argv)
    if args.command in (None, "demo"):
        return 0 if demo(getattr(args, "device", None)) else 1
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
