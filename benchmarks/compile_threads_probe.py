"""Probe: do Triton compiles of the library's kernels run in parallel threads? (GIL released during compile?)

python benchmarks/compile_threads_probe.py serial|threads
"""

import concurrent.futures as cf
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from peft_csgmv.kernels.shrink import _shrink_kernel  # noqa: E402

mode = sys.argv[1]
dev = torch.device("cuda")
x = torch.randn(64, 2048, device=dev, dtype=torch.bfloat16)
a = torch.randn(4, 16, 2048, device=dev, dtype=torch.bfloat16)
t = torch.empty(1, 64, 16, device=dev, dtype=torch.float32)
i32 = torch.zeros(64, device=dev, dtype=torch.int32)
i64 = torch.zeros(4, device=dev, dtype=torch.int64)
configs = [(bm, bk, w) for bm in (16, 32, 64) for bk in (32, 64, 128) for w in (2, 4)]


def one(cfg):
    bm, bk, w = cfg
    t0 = time.perf_counter()
    _shrink_kernel.warmup(
        x,
        a,
        t,
        i32,
        i32,
        i32,
        i32,
        i64,
        2048,
        2048,
        2048,
        1,
        16 * 2048,
        2048,
        1,
        0,
        16,
        1,
        BLOCK_M=bm,
        BLOCK_R=16,
        BLOCK_K=bk,
        DOT_PRECISION="tf32",
        POOLED=False,
        ALIGN=1,
        USE_GDC=False,
        num_warps=w,
        num_stages=3,
        grid=(1,),
    )
    return time.perf_counter() - t0


t0 = time.perf_counter()
if mode == "serial":
    each = [one(c) for c in configs]
else:
    with cf.ThreadPoolExecutor(int(sys.argv[2]) if len(sys.argv) > 2 else 8) as pool:
        each = list(pool.map(one, configs))
print(f"{mode}: {len(configs)} compiles in {time.perf_counter() - t0:.2f} s (each {sum(each) / len(each):.2f} s)")
