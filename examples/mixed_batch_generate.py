"""Generate for a batch whose rows use different LoRA adapters, in one call.

    python examples/mixed_batch_generate.py                       # a tiny random model with three adapters
    python examples/mixed_batch_generate.py --base meta-llama/Llama-3.2-1B \\
        --adapter legal=path/to/legal --adapter chat=path/to/chat

Each row names its adapter (None for the base model); the whole batch runs through each layer in two kernel launches.
"""

from __future__ import annotations

import argparse

import torch

from peft_csgmv.batch import load_model
from peft_csgmv.toy import checkout_or_toy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="base model path or hub id (default: a tiny random model)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--max-new-tokens", type=int, default=24)
    args = p.parse_args()

    with checkout_or_toy(args.base, args.adapter, {"legal": 4, "chat": 8, "code": 16}) as (base, adapters):
        run(args, base, adapters)


def run(args, base, adapters) -> None:
    model, tokenizer = load_model(base, adapters)  # loads every adapter and calls enable_csgmv

    names = list(adapters)
    prompts = ["The contract states that", "Hi! How are you", "def fibonacci(n):", "Once upon a time"]
    adapter_ids = [names[0], names[1 % len(names)], names[-1], None]  # None: the base model
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    batch = {k: v.to(model.get_input_embeddings().weight.device) for k, v in batch.items()}
    with torch.no_grad():
        out = model.generate(
            **batch,
            adapter_ids=adapter_ids,
            max_new_tokens=args.max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    for prompt, adapter, seq in zip(prompts, adapter_ids, out):
        text = tokenizer.decode(seq[batch["input_ids"].shape[1] :], skip_special_tokens=True)
        print(f"[{adapter or 'base'}] {prompt!r} -> {text!r}")


if __name__ == "__main__":
    main()
