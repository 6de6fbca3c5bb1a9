"""Tiny random-weight models for the demo, the examples and the tests (no hub needed): a character-level tokenizer,
a small Llama, and LoRA adapters of chosen ranks, optionally saved to a directory as a real checkout would be."""

from __future__ import annotations

import contextlib
import os
import tempfile

import torch

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'\"-()\n"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def char_tokenizer():
    """A character-level fast tokenizer (``<pad>`` 0, ``<s>`` 1, ``</s>`` 2, ``<unk>`` 3, then one id per char)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for i, ch in enumerate(CHARS):
        vocab[ch] = 4 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        padding_side="left",
    )  # fmt: skip


def tiny_llama(hidden: int = 64, layers: int = 2, seed: int = 0, vocab_size: int | None = None):
    """A small random-weight LlamaForCausalLM sized for :func:`char_tokenizer`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size or 4 + len(CHARS), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def with_adapters(base, ranks: dict[str, int], seed: int = 1):
    """Wrap ``base`` into a PeftModel holding one random LoRA adapter per ``ranks`` entry (alpha = 2·rank)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = None
    for name, r in ranks.items():
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=TARGETS, init_lora_weights=False)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
    return model.eval()


def save_toy_checkout(directory: str, ranks: dict[str, int], hidden: int = 64, layers: int = 2):
    """Save a tiny base model with its tokenizer and one adapter per ``ranks`` entry under ``directory``.
    Returns ``(base_dir, {name: adapter_dir})``."""
    base_dir = os.path.join(directory, "base")
    tiny_llama(hidden, layers).save_pretrained(base_dir)
    char_tokenizer().save_pretrained(base_dir)
    paths = {}
    for i, (name, r) in enumerate(ranks.items()):
        peft_model = with_adapters(tiny_llama(hidden, layers), {name: r}, seed=10 + i)
        paths[name] = os.path.join(directory, "adapters", name)
        peft_model.save_pretrained(paths[name])
        # save_pretrained nests non-default adapter names in a sub-folder
        nested = os.path.join(paths[name], name)
        if os.path.isdir(nested):
            paths[name] = nested
    return base_dir, paths


@contextlib.contextmanager
def checkout_or_toy(base: str | None, adapter_args: list[str], ranks: dict[str, int]):
    """``(base, {name: path})`` from ``--base`` / ``--adapter NAME=PATH`` arguments, or, without ``base``, a toy
    checkout with one adapter per ``ranks`` entry in a temporary directory (removed on exit)."""
    if base:
        yield base, dict(a.split("=", 1) for a in adapter_args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        yield save_toy_checkout(tmp, ranks)
