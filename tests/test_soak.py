"""Soak: a seeded random sequence of what users do to an enabled model — mixed calls with random ids, batch shapes and
slices, wrong calls, adapters added, deleted, edited in place and rescaled, merges — with every valid call compared
against stock PEFT's own per-adapter runs of the same rows, and every wrong call required to fail cleanly and leave
the model right for the next one. Also through the host tier (2 slots): every call and every stock run then moves
adapters in and out of slots, and a call needing more distinct adapters than fit is one of the wrong calls."""

from __future__ import annotations

import gc
import random
import weakref

import pytest
import torch
from helpers import ALL_LINEAR, BASE, DEVICE, add_adapters, close, per_adapter, stitch, tiny_model
from peft import LoraConfig

from peft_csgmv import enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")


def _config(rng: random.Random) -> LoraConfig:
    targets = rng.sample(ALL_LINEAR, rng.randint(2, len(ALL_LINEAR)))
    if rng.random() < 0.3:
        targets.append("embed_tokens")
    extra = {}
    if rng.random() < 0.2 and "embed_tokens" not in targets:
        extra["use_dora"] = True
    elif rng.random() < 0.2 and "embed_tokens" not in targets:  # PEFT refuses lora_bias on an Embedding
        extra["lora_bias"] = True
    return LoraConfig(
        init_lora_weights=False, r=rng.choice([1, 2, 4, 8, 16]), lora_alpha=rng.choice([1, 4, 8, 16]),
        use_rslora=rng.random() < 0.3, target_modules=targets, **extra,
    )  # fmt: skip


class Soak:
    def __init__(self, seed: int, backend: str, tier: int | None = None):
        self.tier = tier  # max_resident_adapters
        self.rng = random.Random(seed)
        torch.manual_seed(seed)
        model, targets = tiny_model("llama")
        self.model = add_adapters(model, {"a0": dict(r=4, lora_alpha=8, target_modules=targets)}).to(DEVICE)
        self.counter = 1
        for _ in range(2):
            self.add()
        enable_csgmv(self.model, backend=backend, max_resident_adapters=tier)
        self.backend = backend

    @property
    def adapters(self) -> list[str]:
        return list(self.model.peft_config)

    def add(self):
        name = f"a{self.counter}"
        self.counter += 1
        self.model.add_adapter(name, _config(self.rng))

    def batch(self):
        rows, seq = self.rng.randint(1, 7), self.rng.randint(1, 6)
        wide = torch.randint(3, 97, (rows * 2, seq + 3), device=DEVICE)
        # Slices as a hand-written loop makes them: every other row, a window of columns, or the last column.
        kind = self.rng.choice(["plain", "rows", "window", "last"])
        if kind == "rows":
            ids = wide[::2, :seq]
        elif kind == "window":
            ids = wide[:rows, 2 : 2 + seq]
        elif kind == "last":
            ids = wide[:rows, -1:]
        else:
            ids = wide[:rows, :seq].contiguous()
        return ids

    def names(self, rows: int) -> list[str | None]:
        adapters = self.adapters
        if self.tier is not None:  # no more distinct adapters than fit
            adapters = self.rng.sample(adapters, min(len(adapters), self.rng.randint(1, self.tier)))
        pool = [*adapters, None, BASE]
        n = (
            rows
            if rows == 1 or self.rng.random() < 0.8
            else self.rng.choice([d for d in range(1, rows) if rows % d == 0])
        )
        return [self.rng.choice(pool) for _ in range(n)]

    def check_call(self):
        input_ids = self.batch()
        ids = self.names(input_ids.shape[0])
        k = input_ids.shape[0] // len(ids)
        rows = [n if n is not None else BASE for n in ids for _ in range(k)]
        outs = per_adapter(self.model, rows, lambda: self.model(input_ids).logits)
        with torch.no_grad():
            got = self.model(input_ids, adapter_ids=ids).logits
        close(got, stitch(outs, rows), f"soak call ids={ids} shape={tuple(input_ids.shape)}")

    def wrong_call(self):
        input_ids = self.batch()
        rows = input_ids.shape[0]
        kinds = ["unknown", "length", "empty-rows", "not-a-list", "training"]
        if self.tier is not None and len(self.adapters) > self.tier and rows > self.tier:
            kinds.append("too-many")
        kind = self.rng.choice(kinds)
        kw = {"adapter_ids": [self.rng.choice(self.adapters) for _ in range(rows)]}
        if kind == "too-many":  # more distinct adapters than the host tier's slots
            kw["adapter_ids"][: self.tier + 1] = self.rng.sample(self.adapters, self.tier + 1)
        elif kind == "unknown":
            kw["adapter_ids"][-1] = "missing"
        elif kind == "length":
            kw["adapter_ids"] = kw["adapter_ids"] * 2 + ["a0"]
        elif kind == "empty-rows":
            input_ids = input_ids[:0]
        elif kind == "not-a-list":
            kw["adapter_ids"] = "a0"
        else:
            self.model.train()
        try:
            with pytest.raises((ValueError, TypeError)):
                self.model(input_ids, **kw)
        finally:
            self.model.eval()
        assert active_calls() == 0

    def edit(self):
        name = self.rng.choice(self.adapters)
        with torch.no_grad():
            for pname, p in self.model.named_parameters():
                if f"lora_B.{name}." in pname:
                    p.mul_(1.5)
        # documented: restack after editing weights in place
        enable_csgmv(self.model, backend=self.backend, max_resident_adapters=self.tier)

    def rescale(self):
        name = self.rng.choice(self.adapters)
        for module in self.model.modules():
            if hasattr(module, "set_scale") and name in getattr(module, "scaling", {}):
                module.set_scale(name, self.rng.choice([0.5, 2.0]))

    def merge_then_unmerge(self):
        mergeable = [n for n in self.adapters if not self.model.peft_config[n].lora_bias]  # no base bias to merge into
        name = self.rng.choice(mergeable)
        self.model.set_adapter(name)
        self.model.merge_adapter()
        with pytest.raises(ValueError, match="merged adapters"):
            self.model(self.batch(), adapter_ids=[name])
        self.model.unmerge_adapter()

    def delete(self):
        if len(self.adapters) > 2:
            name = self.rng.choice(self.adapters)
            self.model.delete_adapter(name)
            if self.model.active_adapter not in self.adapters:
                self.model.set_adapter(self.adapters[0])

    def step(self):
        op = self.rng.choices(
            [self.check_call, self.wrong_call, self.add, self.delete, self.edit, self.rescale, self.merge_then_unmerge],
            weights=[8, 3, 1, 1, 1, 1, 1],
        )[0]
        op()


@pytest.mark.parametrize(
    "backend,seed,steps,tier",
    [("torch", 0, 40, None), ("torch", 1, 40, None), ("triton", 2, 15, None), ("torch", 3, 40, 2), ("torch", 4, 40, 2)],
)
def test_soak(backend, seed, steps, tier):
    soak = Soak(seed, backend, tier)
    for _ in range(steps):
        soak.step()
        if soak.rng.random() < 0.3:
            soak.check_call()
    soak.check_call()
    # After all that, the model is still freed as soon as it is dropped, as a stock one is (tests/test_freed.py): the
    # collector first takes the cycles the wrong calls' caught exceptions left (their tracebacks hold the model),
    # then runs no more.
    refs = [weakref.ref(soak.model), *(weakref.ref(p) for p in soak.model.parameters())]
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        del soak
        alive = [r() for r in refs if r() is not None]
        assert not alive, f"{len(alive)} of {len(refs)} objects outlived the model's last reference (reference cycles)"
    finally:
        if enabled:
            gc.enable()
