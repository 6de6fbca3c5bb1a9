"""Score one evaluation set under many adapters at once: every (example, adapter) pair is a row of one mixed batch.

    python examples/eval_many_adapters.py                # a tiny random model with eight adapters
    python examples/eval_many_adapters.py --base PATH --adapter a=PATH --adapter b=PATH --texts eval.txt

Prints each adapter's mean next-token loss (and perplexity) over the texts, and checks the numbers against stock PEFT
for the first adapter. With PEFT alone this is one pass per adapter (or a slow ``adapter_names`` batch); here it is a
single batched forward per chunk of rows.
"""

from __future__ import annotations

import argparse
import math

import torch

from peft_csgmv import disable_csgmv
from peft_csgmv.batch import load_model
from peft_csgmv.toy import checkout_or_toy

TEXTS = [
    "The parties agree to the terms below.",
    "Thanks, that sounds great to me!",
    "for i in range(10): print(i)",
    "It was a dark and stormy night.",
]


def row_losses(model, batch, adapter_ids):
    """Mean next-token cross-entropy of every row (padding excluded)."""
    logits = model(**batch, adapter_ids=adapter_ids).logits[:, :-1].float()
    targets = batch["input_ids"][:, 1:]
    mask = batch["attention_mask"][:, 1:].bool()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum(1) / mask.sum(1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--texts", help="a text file, one example per line")
    p.add_argument("--rows-per-batch", type=int, default=64)
    args = p.parse_args()

    with checkout_or_toy(args.base, args.adapter, {f"task{i}": 4 * (1 + i % 4) for i in range(8)}) as (base, adapters):
        run(args, base, adapters)


def run(args, base, adapters) -> None:
    texts = [t.strip() for t in open(args.texts)] if args.texts else TEXTS
    model, tokenizer = load_model(base, adapters)
    device = model.get_input_embeddings().weight.device

    names = [None] + list(adapters)  # None: the base model, as a reference row
    pairs = [(name, text) for name in names for text in texts]
    losses: dict = {name: [] for name in names}
    with torch.no_grad():
        for i in range(0, len(pairs), args.rows_per_batch):
            chunk = pairs[i : i + args.rows_per_batch]
            batch = tokenizer([t for _, t in chunk], return_tensors="pt", padding=True, padding_side="left")
            batch = {k: v.to(device) for k, v in batch.items()}
            for (name, _), loss in zip(chunk, row_losses(model, batch, [n for n, _ in chunk]).tolist()):
                losses[name].append(loss)

    print(f"{'adapter':<12} {'loss':>8} {'ppl':>10}")
    for name in names:
        mean = sum(losses[name]) / len(losses[name])
        print(f"{name or 'base':<12} {mean:8.4f} {math.exp(mean):10.2f}")

    # Cross-check the first adapter against stock PEFT.
    first = names[1]
    disable_csgmv(model)
    model.set_adapter(first)
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        logits = model(**batch).logits[:, :-1].float()
    mask = batch["attention_mask"][:, 1:].bool()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["input_ids"][:, 1:], reduction="none")
    stock = ((nll * mask).sum(1) / mask.sum(1)).mean().item()
    ours = sum(losses[first]) / len(losses[first])
    print(f"stock PEFT, adapter {first}: loss {stock:.4f} (csgmv {ours:.4f}, |diff| {abs(stock - ours):.2e})")


if __name__ == "__main__":
    main()
