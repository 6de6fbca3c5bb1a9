"""A model accelerate offloads (``cpu_offload``, ``disk_offload``, a ``device_map`` with ``"cpu"`` / ``"disk"`` entries,
PEFT's own re-dispatch in ``PeftModel.from_pretrained``): its offloaded layers' parameters are on ``meta`` outside
forward and accelerate's hooks bring them for each forward. csgmv reads their adapters from accelerate's weights maps,
keeps their stacks in host memory and lends them to the execution device for each forward (peft_csgmv/offload.py);
mixed calls, ``generate`` and the host tier give stock PEFT's results on the same placement, and ``disable_csgmv``
leaves the model, hooks included, as it found it.

On the CPU the execution device is the CPU (the hooks' mechanics are the same as on a GPU); the lending itself is
exercised on the CPU by lending to the CPU. The ``gpu`` tests run a model with some layers offloaded from one GPU,
a CPU / GPU split, and read the GPU's memory."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from helpers import ALL_LINEAR, BASE, add_adapters, assert_close, close, greedy_kwargs, per_adapter, stitch, tiny_model

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv
from peft_csgmv.slots import LentStack

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
NAMES = ["a0", BASE, "a1", "a0", "a1", BASE]
PREFIX = "base_model.model."
SPECS = {
    "a0": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR),
    "a1": dict(r=8, lora_alpha=4, target_modules=ALL_LINEAR),
}
gpu = pytest.mark.gpu


def _peft(layers: int = 4, dtype=torch.float32, specs=None, **sizes):
    model, _ = tiny_model("llama", dtype=dtype, layers=layers, **sizes)
    return add_adapters(model, specs or SPECS)


def _device_map(layers: int, where) -> dict:
    """A PeftModel's device map: decoder layer ``i`` on ``where(i)``, the rest on ``where(None)``."""
    rest = where(None)
    device_map = {f"{PREFIX}model.{n}": rest for n in ("embed_tokens", "norm", "rotary_emb")}
    device_map[f"{PREFIX}lm_head"] = rest
    device_map.update({f"{PREFIX}model.layers.{i}": where(i) for i in range(layers)})
    return device_map


def _cpu_offload(tmp_path):
    from accelerate import cpu_offload

    return cpu_offload(_peft(), execution_device="cpu")


def _disk_offload(tmp_path):
    from accelerate import disk_offload

    return disk_offload(_peft(), str(tmp_path / "offload"), execution_device="cpu")


def _cpu_and_disk(tmp_path):
    """Layers on the CPU (run there, weights in place) and on disk (offloaded, executed on the CPU)."""
    from accelerate import dispatch_model

    device_map = _device_map(4, lambda i: "cpu" if i is None or i % 2 == 0 else "disk")
    return dispatch_model(_peft(), device_map=device_map, main_device="cpu", offload_dir=str(tmp_path / "offload"))


PLACEMENTS = {"cpu_offload": _cpu_offload, "disk_offload": _disk_offload, "cpu_and_disk": _cpu_and_disk}


def _batch(rows: int, seq: int, seed: int = 0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, 97, (rows, seq), generator=g)
    mask = torch.ones_like(input_ids)
    mask[0, :2] = 0  # (left padding on one row)
    input_ids[0, :2] = 0
    return input_ids.to(device), mask.to(device)


def _offloaded_params(model) -> list[torch.Tensor]:
    return [p for n, p in model.named_parameters() if "lora_" in n and p.device.type == "meta"]


def _assert_differ(outs: dict) -> None:
    keys = list(outs)
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            assert (outs[a] - outs[b]).abs().max() > 1e-2, f"{a} and {b} give the same output: the test proves nothing"


# (layers accelerate runs on the CPU take Triton only under its interpreter, which the tests turn on without CUDA)
ON_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter only without CUDA")
CPU_BACKENDS = ["torch", pytest.param("triton", marks=ON_CUDA)]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_mixed_forward_matches_stock_peft(placement, backend, tmp_path, kernel_calls):
    """Every kernel layer of an offloaded model runs the kernels (none falls back to PEFT's path), with stock PEFT's
    logits for each row's adapter; PEFT's parameters stay accelerate's (on meta outside forward)."""
    model = PLACEMENTS[placement](tmp_path)
    offloaded = len(_offloaded_params(model))
    assert offloaded, "nothing is offloaded: the test proves nothing"
    input_ids, mask = _batch(len(NAMES), 7)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    _assert_differ(outs)
    enable_csgmv(model, backend=backend)
    stats = csgmv_stats(model)
    assert stats["offloaded_layers"] > 0 and stats["offloaded_stack_bytes"] > 0
    kernel_calls.clear()
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
    close(got, stitch(outs, NAMES), f"{placement}, {backend}")
    assert len(kernel_calls) == stats["kernel_layers"], "some layer took PEFT's path"
    assert len(_offloaded_params(model)) == offloaded, "PEFT's offloaded parameters were moved"
    with torch.no_grad():  # PEFT's own spelling takes the same path
        got = model(input_ids, attention_mask=mask, adapter_names=NAMES).logits
    close(got, stitch(outs, NAMES), f"{placement}, adapter_names")


@pytest.mark.parametrize("placement", ["cpu_offload", "cpu_and_disk"])
def test_mixed_generate_matches_stock_peft(placement, tmp_path):
    model = PLACEMENTS[placement](tmp_path)
    input_ids, mask = _batch(len(NAMES), 5, seed=1)
    kw = greedy_kwargs(6)
    outs = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    assert not torch.equal(outs["a0"], outs["a1"]), "the adapters generate the same tokens: the test proves nothing"
    enable_csgmv(model)
    with torch.no_grad():
        got = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
    assert torch.equal(got, stitch(outs, NAMES))
    beams = dict(kw, num_beams=2)
    ids = ["a1", "a0"]
    outs = per_adapter(model, ids, lambda: model.generate(input_ids=input_ids[:2], attention_mask=mask[:2], **beams))
    with torch.no_grad():
        got = model.generate(input_ids=input_ids[:2], attention_mask=mask[:2], adapter_ids=ids, **beams)
    assert torch.equal(got, stitch(outs, ids))


def test_host_tier_on_an_offloaded_model(tmp_path):
    """``max_resident_adapters=1`` on a model with layers in place and layers offloaded: the tier moves adapters in
    and out of the layers it holds, the offloaded layers' stacks follow the slots, and each call gives stock PEFT's
    results; a call needing more adapters than fit fails before anything moves."""
    model = _cpu_and_disk(tmp_path)
    input_ids, mask = _batch(len(NAMES), 7, seed=2)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model, max_resident_adapters=1)
    stats = csgmv_stats(model)
    assert 0 < stats["offloaded_layers"] < stats["kernel_layers"]
    for names in (["a0", BASE] * 3, ["a1", "a1", BASE, "a1", BASE, BASE], ["a0"] * 6, [BASE, "a1"] * 3):
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        close(got, stitch(outs, names), f"host tier, ids {names}")
        assert csgmv_stats(model)["resident"] == [n for n in names if n != BASE][:1]
    with pytest.raises(ValueError, match="distinct adapters"):
        model(input_ids, attention_mask=mask, adapter_ids=NAMES)
    with torch.no_grad():  # (unchanged by the refused call)
        got = model(input_ids, attention_mask=mask, adapter_ids=["a1"] * 6).logits
    close(got, outs["a1"], "host tier after a refused call")


def _hooks_and_forwards(model) -> dict:
    """What accelerate and PEFT set on each module: its class, its hook, its instance forward, its parameters'
    devices."""
    return {
        name: (
            type(m),
            m.__dict__.get("_hf_hook"),
            m.__dict__.get("forward"),
            tuple((n, p.device, p.dtype) for n, p in m.named_parameters(recurse=False)),
        )
        for name, m in model.named_modules()
    }


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_enable_disable_round_trip(placement, tmp_path):
    """``disable_csgmv`` leaves an offloaded model as it found it (classes, accelerate's hooks and forwards,
    parameters on meta), and stock PEFT's calls give what they gave before."""
    model = PLACEMENTS[placement](tmp_path)
    input_ids, mask = _batch(len(NAMES), 6, seed=3)
    before = _hooks_and_forwards(model)
    with torch.no_grad():
        stock = model(input_ids, attention_mask=mask, adapter_names=NAMES).logits
    single = per_adapter(model, ["a1"], lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model)
    with torch.no_grad():
        model(input_ids, attention_mask=mask, adapter_ids=NAMES)
    disable_csgmv(model)
    assert _hooks_and_forwards(model) == before
    with torch.no_grad():
        assert torch.equal(model(input_ids, attention_mask=mask, adapter_names=NAMES).logits, stock)
    after = per_adapter(model, ["a1"], lambda: model(input_ids, attention_mask=mask).logits)
    assert torch.equal(after["a1"], single["a1"])


def test_stacks_lent_to_the_execution_device(tmp_path):
    """The lending an offloaded layer's stack gets where its layer runs on another device (a GPU), exercised on the
    CPU by lending to the CPU: each forward copies the call's slots only, binds nothing to the plan (a lent stack's
    tensors are the forward's), and the results are stock PEFT's."""
    model = _cpu_offload(tmp_path)
    input_ids, mask = _batch(len(NAMES), 7, seed=4)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model)
    stacks = [layer._csgmv_record.stack for layer in model._csgmv.layers.values()]
    assert all(s.runs_on is None and s.device.type == "cpu" for s in stacks)  # (run where they live)
    lent = []
    for stack in stacks:
        stack.runs_on = torch.device("cpu")
        lend = stack.lend

        def lending(device, slots, lend=lend):
            lent.append((slots, lend(device, slots)))
            return lent[-1][1]

        stack.lend = lending
    for names in (NAMES, ["a1", BASE] * 3):
        lent.clear()
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        close(got, stitch(outs, names), f"lent stacks, ids {names}")
        assert len(lent) == len(stacks)
        slots = {model._csgmv.registry.index[n] for n in names if n != BASE}
        assert all(set(s) == slots for s, _ in lent)
        assert all(isinstance(s, LentStack) for _, s in lent)
    # Only the call's slots' weights are copied: a0's (the first slot) alone takes fewer elements than both.
    stack, slot = stacks[0], model._csgmv.registry.index["a0"]
    one = stack.lend(torch.device("cpu"), frozenset({slot}))
    both = stack.lend(torch.device("cpu"), frozenset(model._csgmv.registry.index.values()))
    assert one.a.data.numel() < both.a.data.numel() <= stack.data.numel()
    assert torch.equal(one.a.slot(slot), stack.a.slot(slot)) and torch.equal(one.b.slot(slot), stack.b.slot(slot))
    assert one.a.data.data_ptr() != stack.data.data_ptr()  # (a copy: the forward's own)
    for run in model._csgmv.executor.plans.values():
        assert not any(getattr(key, "lent", False) for key in run.bound), "a lent stack was bound to a plan"


def test_adapters_loaded_after_enabling(tmp_path):
    """An adapter added to an offloaded model after enabling (PEFT leaves its weights where it made them, on the
    host, with no hook: accelerate dispatched the model before it came) gets what stock PEFT gives for it, beside the
    offloaded ones."""
    model = _cpu_offload(tmp_path)
    input_ids, mask = _batch(len(NAMES), 6, seed=5)
    enable_csgmv(model)
    from peft import LoraConfig

    model.add_adapter("a2", LoraConfig(r=2, target_modules=ALL_LINEAR, init_lora_weights=False))
    names = ["a2", "a0", BASE, "a1", "a0", "a2"]
    try:
        stock = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
        stock_error = None
    except Exception as exc:  # noqa: BLE001 (stock PEFT's outcome is the expectation)
        stock_error = exc
    if stock_error is not None:
        with pytest.raises(type(stock_error)):
            model(input_ids, attention_mask=mask, adapter_ids=names)
        with torch.no_grad():  # (the other adapters still serve)
            got = model(input_ids, attention_mask=mask, adapter_ids=["a0", "a1", BASE, "a0", "a1", BASE]).logits
        ref = per_adapter(model, ["a0", "a1", BASE], lambda: model(input_ids, attention_mask=mask).logits)
        close(got, stitch(ref, ["a0", "a1", BASE, "a0", "a1", BASE]), "after a failed call")
        return
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(got, stitch(stock, names), "adapter added after enabling")


@pytest.mark.skipif(
    tuple(int(p) for p in importlib.metadata.version("peft").split(".")[:2]) < (0, 21),
    reason="PEFT before 0.21 fails its own re-dispatch of this placement (KeyError on the output layer's key)",
)
def test_peft_from_pretrained_redispatch(tmp_path, monkeypatch):
    """The usual way to an offloaded PeftModel: a base loaded with a ``device_map`` that puts layers on disk, then
    ``PeftModel.from_pretrained`` (PEFT dispatches the model again with its first adapter, which offloads that
    adapter's weights with their layers) and ``load_adapter`` for a second one (left where PEFT puts it)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    # PEFT's offload update writes a copy of the checkpoint at its absolute path made relative (to the working folder)
    monkeypatch.chdir(tmp_path)

    source = _peft()
    source.save_pretrained(tmp_path / "adapters")
    base, _ = tiny_model("llama", layers=4)
    base.save_pretrained(tmp_path / "base")
    device_map = _device_map(4, lambda i: "cpu" if i is None or i % 2 == 0 else "disk")
    base_map = {k[len(PREFIX) :]: v for k, v in device_map.items()}
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", device_map=base_map, offload_folder=tmp_path / "o1")
    model = PeftModel.from_pretrained(
        base, tmp_path / "adapters" / "a0", adapter_name="a0", device_map=device_map, offload_dir=str(tmp_path / "o2")
    )
    model.load_adapter(tmp_path / "adapters" / "a1", adapter_name="a1")
    model.eval()
    assert _offloaded_params(model), "PEFT's dispatch offloaded nothing: the test proves nothing"
    input_ids, mask = _batch(len(NAMES), 6, seed=6)
    outs = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits)
    _assert_differ(outs)
    enable_csgmv(model)
    assert csgmv_stats(model)["offloaded_layers"] > 0
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits
    close(got, stitch(outs, NAMES), "PeftModel.from_pretrained on an offloaded base")


# -- GPU: layers offloaded from one GPU, a CPU / GPU split, the GPU's memory ----------------------------------------


def _auto_half(model, dtype):
    """``device_map="auto"`` with a ``max_memory`` that leaves about half the decoder layers to CPU offload on GPU
    0 (accelerate's placement, as ``from_pretrained(..., device_map="auto", max_memory=...)`` makes it)."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import compute_module_sizes

    sizes = compute_module_sizes(model)
    layers = model.base_model.model.config.num_hidden_layers
    rest = sum(sizes[f"{PREFIX}{n}"] for n in ("model.embed_tokens", "model.norm", "lm_head"))
    layer = sizes[f"{PREFIX}model.layers.0"]
    budget = rest + layer * (layers // 2 + 1)  # (accelerate keeps room for the largest offloaded layer)
    device_map = infer_auto_device_map(
        model, max_memory={0: budget, "cpu": 64 << 30}, no_split_module_classes=["LlamaDecoderLayer"]
    )
    placed = {v for k, v in device_map.items() if ".layers." in k}
    assert placed == {0, "cpu"}, f"device map {device_map}: not split between the GPU and CPU offload"
    return dispatch_model(model, device_map=device_map)


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_auto_device_map_with_cpu_offload(dtype):
    """Half the layers offloaded from GPU 0 to the CPU (run on the GPU, weights brought by accelerate per forward):
    fp32 greedy tokens equal stock PEFT's per adapter on the same placement; bf16 logits within PEFT's tolerance."""
    model = _auto_half(_peft(layers=6, dtype=dtype, hidden=128, intermediate=256), dtype)
    input_ids, mask = _batch(len(NAMES), 9, seed=7, device="cuda:0")
    logits = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits.float())
    kw = greedy_kwargs(6)
    tokens = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw))
    enable_csgmv(model)
    stacks = [layer._csgmv_record.stack for layer in model._csgmv.layers.values()]
    lent = [s for s in stacks if s.runs_on is not None]
    assert lent and all(s.device.type == "cpu" and s.runs_on.type == "cuda" for s in lent)
    assert all(s.data.is_pinned() for s in lent)
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits.float()
        generated = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw)
    ref = stitch(logits, NAMES)
    assert_close(got, ref, dtype, scale=max(1.0, ref.abs().max().item()) * 2, what=f"offloaded, {dtype}")
    if dtype == torch.float32:
        assert torch.equal(generated, stitch(tokens, NAMES))


@gpu
def test_gpu_cpu_and_gpu_layers():
    """A device map with decoder layers on the CPU and on the GPU (main device the CPU: each layer runs where it
    lives): the CPU layers' stacks on the CPU (torch backend), the GPU layers' on the GPU (Triton), a plan on each,
    and stock PEFT's tokens."""
    from accelerate import dispatch_model

    model = _peft(layers=4)
    device_map = _device_map(4, lambda i: 0 if i is None or i % 2 else "cpu")
    model = dispatch_model(model, device_map=device_map, main_device="cpu")
    input_ids, mask = _batch(len(NAMES), 7, seed=8)
    logits = per_adapter(model, NAMES, lambda: model(input_ids, attention_mask=mask).logits.cpu())
    kw = greedy_kwargs(5)
    tokens = per_adapter(model, NAMES, lambda: model.generate(input_ids=input_ids, attention_mask=mask, **kw).cpu())
    enable_csgmv(model)
    devices = {str(layer._csgmv_record.stack.device) for layer in model._csgmv.layers.values()}
    assert devices == {"cpu", "cuda:0"}
    assert {d.type for d in model._csgmv.devices} == {"cpu", "cuda"}
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=NAMES).logits.cpu()
        generated = model.generate(input_ids=input_ids, attention_mask=mask, adapter_ids=NAMES, **kw).cpu()
    close(got, stitch(logits, NAMES), "CPU / GPU split")
    assert torch.equal(generated, stitch(tokens, NAMES))
    assert {key[3].type for key in model._csgmv.executor.plans} == {"cpu", "cuda"}


@gpu
def test_gpu_offloaded_adapters_not_resident():
    """GPU memory: an offloaded layer's adapters are not resident on the GPU between forwards (what enabling and a
    call leave allocated is far less than the offloaded layers' stacks), and a call's peak holds at most one
    offloaded layer's stack beyond what stock PEFT's own call peaks at."""
    specs = {f"a{i}": dict(r=64, lora_alpha=64, target_modules=ALL_LINEAR) for i in range(8)}
    model = _auto_half(_peft(layers=8, hidden=256, intermediate=512, specs=specs), torch.float32)
    names = [f"a{i}" for i in range(8)]
    input_ids, mask = _batch(len(names), 16, seed=9, device="cuda:0")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        stock = model(input_ids, attention_mask=mask, adapter_names=names).logits
    torch.cuda.synchronize()
    stock_peak = torch.cuda.max_memory_allocated() - before
    del stock
    enable_csgmv(model)
    stats = csgmv_stats(model)
    offloaded = stats["offloaded_stack_bytes"]
    largest = max(
        layer._csgmv_record.stack.data.nbytes
        for layer in model._csgmv.layers.values()
        if layer._csgmv_record.stack.runs_on is not None
    )
    assert offloaded >= 3 * largest, "too few offloaded layers to tell"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del got
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - before
    assert left < offloaded // 4, f"{left} bytes left on the GPU after a call; offloaded stacks hold {offloaded}"
    assert peak <= stock_peak + 2 * largest + (8 << 20), f"peak {peak} vs stock {stock_peak} (+ one stack {largest})"
    assert peak < offloaded, f"peak {peak}: the offloaded layers' stacks ({offloaded}) were all on the GPU at once"
