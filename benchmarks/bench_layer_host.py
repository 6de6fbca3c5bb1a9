"""Host (Python) cost of one patched LoRA layer per call, against the base ``nn.Linear`` and PEFT's one-adapter layer.

    python benchmarks/bench_layer_host.py                 # CPU or GPU; kernel launches included
    python benchmarks/bench_layer_host.py --stub-launch   # launches replaced by a no-op: the Python path alone

Eager decode is host-bound (two launches plus Python per LoRA layer per step), so this is the number to drive down.
A 32-row decode input through one layer with 8 adapters; best of 3 timings of many calls.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from peft import LoraConfig, get_peft_model

from peft_csgmv import adapter_ids_scope, enable_csgmv
from peft_csgmv.kernels import launch


class OneLayer(torch.nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.proj = torch.nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.proj(x)


def best_us(fn, n: int) -> float:
    for _ in range(min(n, 200)):
        fn()
    best = float("inf")
    for _ in range(3):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stub-launch", action="store_true", help="replace kernel launches by a no-op")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--calls", type=int, default=5000)
    args = p.parse_args(argv)
    if args.stub_launch:
        launch.Launcher.__call__ = lambda self, grid, a, c, o=(): None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = get_peft_model(
        OneLayer(args.dim, args.dim), LoraConfig(r=16, target_modules=["proj"], init_lora_weights=False), "a0"
    )
    for i in range(1, 8):
        model.add_adapter(f"a{i}", LoraConfig(r=16, target_modules=["proj"], init_lora_weights=False))
    model = model.eval().to(device)
    layer = model.base_model.model.proj
    x = torch.randn(32, 1, args.dim, device=device)
    rows = {}
    with torch.no_grad():
        rows["base nn.Linear call"] = best_us(lambda: layer.base_layer(x), args.calls)
        rows["PEFT lora.Linear, one adapter"] = best_us(lambda: layer(x), args.calls)
        enable_csgmv(model, backend="triton" if device == "cuda" or args.stub_launch else "torch")
        with adapter_ids_scope(model, [f"a{i % 8}" for i in range(32)]):
            label = "csgmv layer, 8 adapters" + (" (launches stubbed)" if args.stub_launch else "")
            rows[label] = best_us(lambda: layer(x), args.calls)
    print(f"\n| layer, 32 decode rows, {device} | µs per call |\n|---|---|")
    for name, us in rows.items():
        print(f"| {name} | {us:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
