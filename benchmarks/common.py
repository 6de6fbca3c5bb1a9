"""The helpers that only the benchmark scripts use: developer switches set for a block, compile-time rows each in a
process of its own, kernels timed from CUDA-graph replays, the batch command's checkout and prompts, profiler read-outs
of a static-cache generate. What the ``peft-csgmv bench`` command needs too (model layouts, random-weight models and
adapters, the timer, result files with device, versions and date) stays in the package: ``peft_csgmv.bench``.

A script run as ``python benchmarks/<script>.py`` has this folder first on ``sys.path``, so ``import common`` finds
this module; the package itself is installed.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from peft_csgmv.bench import MODELS, TARGETS, add_adapters


@contextlib.contextmanager
def developer_switches(env: dict[str, str]):
    """csgmv's developer switches set for the block (environment variables read when a model is enabled, and
    ``PEFT_CSGMV_PDL`` when a device's kernels next launch), then put back as the caller had them."""
    from peft_csgmv.kernels.launch import reset_pdl

    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    reset_pdl()
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_pdl()


# Compile-time benchmarks (compile_time.py, trace_time.py) run each row in a process of its own; these rows
# run csgmv with its compile-ahead switched (``PEFT_CSGMV_COMPILE_AHEAD``: off, or on a thread of the process).
AHEAD_ROWS = {"csgmv-noahead": "0", "csgmv-threads": "1"}


def row_runs(script: str, row: str, argv: list[str], runs: int = 1):
    """Row ``row`` of a compile-time benchmark, ``runs`` times, each in a process of its own (``script --row ROW
    --result FILE`` and ``argv``; the process writes its result as JSON to FILE) over one folder of compile caches
    (inductor's and Triton's) that starts empty, so a second run finds the first one's compiled artifacts, with the
    row's compile-ahead switch; yields each run's result as it ends."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        cmd = [sys.executable, script, "--row", row, "--result", result, *argv]
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(tmp, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(tmp, "triton"))  # fmt: skip
        if row in AHEAD_ROWS:
            env["PEFT_CSGMV_COMPILE_AHEAD"] = AHEAD_ROWS[row]
        for _ in range(runs):
            subprocess.run(cmd, env=env, check=True)
            with open(result) as f:
                yield json.load(f)


# Kernels timed from CUDA-graph replays (bench_kernels.py, tune_kernels.py).

# (in, out) of the 1B and 8B Llama layouts' projections.
SHAPES = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048), (4096, 4096), (4096, 1024), (4096, 14336),
          (14336, 4096)]  # fmt: skip


def row_slots(rows: int, distinct: int, dist: str, gen: torch.Generator) -> list[int]:
    """The adapter slot of each of ``rows`` rows over ``distinct`` adapters: in turn (``uniform``) or zipf-skewed."""
    if dist == "uniform":
        return [i % distinct for i in range(rows)]
    # zipf-skewed: slot s with weight 1/(s+1)
    w = torch.tensor([1.0 / (s + 1) for s in range(distinct)])
    return torch.multinomial(w, rows, replacement=True, generator=gen).tolist()


def capture_graph(fn, iters: int = 1):
    """``fn`` warmed up on a side stream, then ``iters`` calls of it captured in a CUDA graph, replayed once.
    Returns the graph and the last captured call's result (its tensors are the graph's outputs)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def graph_time_us(fn, iters: int = 20, replays: int = 20) -> float:
    """GPU µs per call of ``fn``: the median over ``replays`` replays of a CUDA graph of ``iters`` calls."""
    graph, _ = capture_graph(fn, iters)
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return statistics.median(times)


# The batch command's inputs and its runs (bench_multi_gpu.py, bench_cli.py).


def save_checkout(folder: str, model_name: str, device: str = "cuda:0") -> tuple[str, dict[str, str]]:
    """A checkout saved in ``folder``: a built-in Llama layout's random bf16 weights with a character tokenizer, and 32
    LoRA adapters r=16 on all 7 projections (made on ``device``); ``(base folder, {adapter name: its folder})``."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from peft_csgmv.toy import CHARS, char_tokenizer

    cfg = dict(MODELS[model_name], vocab_size=4 + len(CHARS))
    config = LlamaConfig(max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2, **cfg)
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config).to(torch.bfloat16)
    base_dir = os.path.join(folder, "base")
    base.save_pretrained(base_dir)
    char_tokenizer().save_pretrained(base_dir)
    pm = None
    with torch.device(device):
        for i in range(32):
            lc = LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
            if pm is None:
                pm = get_peft_model(base, lc, adapter_name=f"a{i}", autocast_adapter_dtype=False)
            else:
                pm.add_adapter(f"a{i}", lc, autocast_adapter_dtype=False)
    adapters_dir = os.path.join(folder, "adapters")
    pm.save_pretrained(adapters_dir)
    paths = {}
    for i in range(32):
        nested = os.path.join(adapters_dir, f"a{i}")
        paths[f"a{i}"] = nested if os.path.isdir(nested) else adapters_dir
    del pm, base  # (the commands run next size their caches by the GPU memory left free: give this process's back)
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    return base_dir, paths


def write_prompts(path: str, rows: int, words: tuple[int, int], limits: tuple[int, int] | None = None) -> None:
    """A JSONL of ``rows`` prompts of ``words[0]``..``words[1]`` random words, over the 32 adapters in turn; with
    ``limits``, each line's own ``max_new_tokens`` in ``limits[0]``..``limits[1]`` (answers of uneven length)."""
    rng = random.Random(0)
    vocab = ["the", "contract", "says", "hello", "model", "adapter", "prompt", "batch", "token", "tenant"]
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(rng.choice(vocab) for _ in range(rng.randint(*words)))
            line = {"prompt": text, "adapter": f"a{i % 32}", "id": i}
            if limits is not None:
                line["max_new_tokens"] = rng.randint(*limits)
            f.write(json.dumps(line) + "\n")


_WROTE = re.compile(r"wrote (\d+) rows, (\d+) new tokens in ([\d.]+) s")


def run_generate(cmd: list[str], env: dict) -> dict:
    """Run a ``peft-csgmv generate`` command (one process or several): rows, new tokens, generation time (the slowest
    process's, model loading excluded), tok/s and the command's wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])} ... failed:\n{proc.stderr[-3000:]}")
    found = [(int(r), int(t), float(s)) for r, t, s in _WROTE.findall(proc.stderr)]
    tokens, seconds = sum(t for _, t, _ in found), max(s for _, _, s in found)
    return dict(processes=len(found), rows=sum(r for r, _, _ in found), new_tokens=tokens, generate_s=seconds,
                tok_s=tokens / seconds, wall_s=wall)  # fmt: skip


# Profiler read-outs of a static-cache generate (profile_static.py, bench_memory.py).


def kernel_times(fn, gap_us: float) -> tuple[dict, float, float, dict]:
    """``({kernel name: (total µs, count)}, short gaps µs, long gaps µs, graphs)`` of the device kernels ``fn`` runs:
    the idle time between consecutive kernels, in gaps shorter than ``gap_us`` and in longer ones. ``graphs``: the
    bursts of kernels (runs with no gap of ``gap_us`` or more) of the most frequent kernel count, i.e. the decode
    step's CUDA-graph replays: their count, median kernel count, and median span (first kernel's start to last
    kernel's end: the graph's GPU time, kernels on two streams counted once) and busy time (the union of their
    kernels' intervals)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    out: dict = collections.defaultdict(lambda: [0.0, 0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out[e.name][0] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            out[e.name][1] += 1
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    short = long = 0.0
    end = spans[0][1] if spans else 0.0
    bursts = []  # [start, end, kernels, union µs]
    if spans:
        bursts.append([spans[0][0], spans[0][1], 1, spans[0][1] - spans[0][0]])
    for start, stop in spans[1:]:
        gap = start - end
        if gap > 0:
            if gap < gap_us:
                short += gap
            else:
                long += gap
                bursts.append([start, stop, 0, 0.0])
        burst = bursts[-1]
        burst[2] += 1
        burst[3] += max(0.0, stop - max(start, end))
        burst[1] = max(burst[1], stop)
        end = max(end, stop)
    # The decode step's replays: the most frequent burst size (kernel count). Not the largest burst: without a gap
    # between them (no graph recorded in between, as with a kept cache), the prefill and the first steps make one.
    sizes = collections.Counter(b[2] for b in bursts if b[2] > 1)
    mode = sizes.most_common(1)[0][0] if sizes else 0
    big = [b for b in bursts if b[2] == mode]
    graphs = dict(
        count=len(big),
        kernels=statistics.median(b[2] for b in big) if big else 0,
        span_us=statistics.median(b[1] - b[0] for b in big) if big else 0.0,
        busy_us=statistics.median(b[3] for b in big) if big else 0.0,
    )
    return dict(out), short, long, graphs


def call_series(fn, n: int, sync) -> dict:
    """``n`` more calls of ``fn`` one after another: each call's wall ms, and over all of them the garbage collections
    (count, ms) and the graphs dynamo compiled (a drift of the timed median shows here call by call)."""
    import gc

    from torch._dynamo.utils import counters

    pauses: list[float] = []
    started: list[float] = []

    def on_gc(phase, info) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append(time.perf_counter() - started.pop())

    graphs0 = counters["stats"]["unique_graphs"]
    gc.callbacks.append(on_gc)
    ms = []
    try:
        for _ in range(n):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ms.append((time.perf_counter() - t0) * 1e3)
    finally:
        gc.callbacks.remove(on_gc)
    return dict(ms=ms, gc=len(pauses), gc_ms=sum(pauses) * 1e3, graphs=counters["stats"]["unique_graphs"] - graphs0)


def clone_adapter(pm, src: str, new: str, layers=None) -> None:
    """Add adapter ``new`` as a copy of ``src`` (its own weight tensors), module by module. PEFT's ``add_adapter`` /
    ``load_adapter`` scan every module of the model per adapter, and the model grows with each adapter, so loading
    N adapters that way costs O(N²) (0.3 s per adapter at the start on the 1B layout, 0.5 s after 20 more): hours for
    a thousand. The benchmark's many adapters are made this way; csgmv sees them as it sees PEFT's. ``layers``: the
    model's LoRA layers (:func:`lora_layers`), found once for many clones."""
    for module in lora_layers(pm) if layers is None else layers:
        for attr in (*module.adapter_layer_names, *module.other_param_names, "lora_variant"):
            held = getattr(module, attr, None)
            if held is not None and src in held:
                value = held[src]
                held[new] = copy.deepcopy(value) if isinstance(value, torch.nn.Module | torch.Tensor) else value
    pm.peft_config[new] = copy.copy(pm.peft_config[src])


def lora_layers(pm) -> list:
    from peft.tuners.lora import LoraLayer

    return [m for m in pm.modules() if isinstance(m, LoraLayer)]


def add_many(model, n: int, ranks: list[int], device, fp32: bool):
    """``n`` adapters ``a0``… of ``ranks`` (cycled): one per rank through PEFT, the rest cloned from those."""
    pm = add_adapters(model, len(ranks), ranks, device, fp32_adapters=fp32)
    layers = lora_layers(pm)
    for i in range(len(ranks), n):
        clone_adapter(pm, f"a{i % len(ranks)}", f"a{i}", layers)
    return pm
