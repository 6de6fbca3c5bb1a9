"""MoE expert LoRA (``LoraConfig(target_parameters=[...])`` on transformers' 3D experts) in mixed batches, through the
model's normal call, against stock PEFT one adapter at a time.

Whole two-layer causal LMs with random weights (Qwen3-MoE, gpt-oss with its biases and clamped activation, Mixtral)
in fp32 on the CPU (the Triton kernels under the interpreter). Adapters of different ranks and alphas, one also on
the attention projections (``q_proj``, ``v_proj``: kernel layers beside the experts layers), randomly initialised
(``init_lora_weights=False``); base rows interleaved. Each row of a mixed batch must equal the row PEFT returns with
that row's adapter alone (``set_adapter``), base rows ``disable_adapter()``'s.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    BACKENDS,
    BASE,
    DEVICE,
    assert_adapters_matter,
    assert_close,
    assert_generations_differ,
    greedy_kwargs,
    per_adapter,
    stitch,
    tiny_moe,
)
from test_moe_prototype import _has_3d_experts

from peft_csgmv import csgmv_stats, disable_csgmv, enable_csgmv

pytestmark = pytest.mark.skipif(
    not _has_3d_experts(), reason="needs transformers' 3D experts and PEFT's target_parameters"
)

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ADAPTERS = {
    "a0": dict(r=4, lora_alpha=8, target_modules=[], target_parameters=EXPERTS),
    "a1": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj"], target_parameters=EXPERTS),
    "a2": dict(r=2, lora_alpha=16, target_modules=["q_proj"], target_parameters=EXPERTS),
}
ARCHS = ["qwen3_moe", "gpt_oss", "mixtral", "olmoe"]
VOCAB = 64


def moe_peft(arch: str, adapters=ADAPTERS):
    from peft import LoraConfig, get_peft_model

    model = tiny_moe(arch)
    pm = None
    for i, (name, spec) in enumerate(adapters.items()):
        torch.manual_seed(10 + i)
        config = LoraConfig(init_lora_weights=False, **spec)
        if pm is None:
            pm = get_peft_model(model, config, adapter_name=name)
        else:
            pm.add_adapter(name, config)
    return pm.eval()


def prompts(rows: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (rows, seq), generator=g).to(DEVICE)


def names_for(rows: int, adapters=tuple(ADAPTERS)) -> list[str]:
    cycle = [BASE, *adapters]
    return [cycle[i % len(cycle)] for i in range(rows)]


def close(actual, expected, what, dtype=None):
    assert actual.shape == expected.shape and torch.isfinite(actual).all(), what
    assert_close(actual, expected, dtype=dtype, what=what, scale=max(1.0, expected.abs().max().item()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_forward_matches_peft_per_adapter(arch, backend):
    pm = moe_peft(arch)
    ids = prompts(8, 5)
    names = names_for(8)
    expected = per_adapter(pm, names, lambda: pm(ids).logits)
    assert_adapters_matter(expected)
    enable_csgmv(pm, backend=backend)
    stats = csgmv_stats(pm)
    assert stats["expert_layers"] == 2 and stats["peft_path_modules"] == 0 and stats["expert_stack_bytes"] > 0
    with torch.no_grad():
        got = pm(ids, adapter_ids=names).logits
        stock = pm(ids).logits  # no ids: the active adapter through PEFT's own path, untouched
    close(got, stitch(expected, names), f"{arch}/{backend}")
    assert torch.equal(stock, expected["a0"])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_generate_matches_peft_per_adapter(arch):
    pm = moe_peft(arch)
    ids = prompts(4, 4, seed=1)
    names = names_for(4)
    kw = greedy_kwargs(4)
    expected = per_adapter(pm, names, lambda: pm.generate(input_ids=ids, **kw))
    assert_generations_differ(expected)
    enable_csgmv(pm, backend="torch")
    got = pm.generate(input_ids=ids, adapter_ids=names, **kw)
    assert torch.equal(got, stitch(expected, names))


def test_beams_and_triton_generate_match_peft():
    """Beam search (the ids repeat over each row's beams) with the Triton kernels."""
    pm = moe_peft("qwen3_moe")
    ids = prompts(4, 4, seed=2)
    names = names_for(4)
    kw = greedy_kwargs(3, num_beams=2)
    expected = per_adapter(pm, names, lambda: pm.generate(input_ids=ids, **kw))
    assert_generations_differ(expected)
    enable_csgmv(pm, backend="triton")
    got = pm.generate(input_ids=ids, adapter_ids=names, **kw)
    assert torch.equal(got, stitch(expected, names))


def test_adapters_added_and_deleted_after_enable_are_seen():
    from peft import LoraConfig

    pm = moe_peft("mixtral", {k: ADAPTERS[k] for k in ("a0", "a1")})
    enable_csgmv(pm, backend="torch")
    ids = prompts(4, 5, seed=3)
    torch.manual_seed(20)
    pm.add_adapter("a2", LoraConfig(init_lora_weights=False, **ADAPTERS["a2"]))
    pm.delete_adapter("a0")
    names = names_for(4, ("a1", "a2"))
    with torch.no_grad():
        got = pm(ids, adapter_ids=names).logits
    disable_csgmv(pm)
    expected = per_adapter(pm, names, lambda: pm(ids).logits)
    assert_adapters_matter(expected)
    close(got, stitch(expected, names), "after add/delete")


def test_rescaled_adapter_restacks():
    pm = moe_peft("qwen3_moe", {k: ADAPTERS[k] for k in ("a0", "a1")})
    enable_csgmv(pm, backend="torch")
    ids = prompts(3, 4, seed=4)
    names = names_for(3, ("a0", "a1"))
    with torch.no_grad():
        pm(ids, adapter_ids=names)
    from peft.tuners.lora import LoraLayer

    for module in pm.modules():  # (PEFT's own rescaling: experts layers and kernel layers alike)
        if isinstance(module, LoraLayer) and "a0" in module.scaling:
            module.set_scale("a0", 3.0)
    with torch.no_grad():
        got = pm(ids, adapter_ids=names).logits
    disable_csgmv(pm)
    close(got, stitch(per_adapter(pm, names, lambda: pm(ids).logits), names), "rescaled")


def test_disable_csgmv_gives_peft_its_forward_and_refusal_back():
    from peft.tuners.lora.layer import ParamWrapper

    pm = moe_peft("gpt_oss", {k: ADAPTERS[k] for k in ("a0", "a1")})
    ids = prompts(3, 4)
    names = names_for(3, ("a0", "a1"))
    wrappers = [m for m in pm.modules() if isinstance(m, ParamWrapper)]
    enable_csgmv(pm)
    with torch.no_grad():
        pm(ids, adapter_ids=names)
    disable_csgmv(pm)
    assert all(type(m) is ParamWrapper and "_csgmv_record" not in m.__dict__ for m in wrappers)
    with torch.no_grad(), pytest.raises(ValueError, match="mixed"):
        pm(ids, adapter_names=names)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_continuous_batching_gives_each_request_its_expert_adapter(arch):
    """transformers' continuous batching over expert LoRA: each packed step's tokens take their requests' adapters in
    the experts' products (steps of 8 tokens split the prompts, mixing prefill chunks and decode tokens of several
    adapters); every request's tokens are its own stock PEFT run's."""
    from peft_csgmv.continuous import continuous_batching_available

    if not continuous_batching_available():
        pytest.skip("this transformers has no continuous batching")
    from transformers import ContinuousBatchingConfig, GenerationConfig

    pm = moe_peft(arch)
    pm.get_base_model().generation_config.eos_token_id = None
    rows = prompts(4, 6, seed=2).tolist()
    rows[1], rows[3] = rows[1][:3], rows[3][:5]  # (uneven prompts)
    names = names_for(4)
    kw = greedy_kwargs(4, eos_token_id=None)
    want = []
    for row, name in zip(rows, names):
        ids = torch.tensor([row], device=DEVICE)
        want.append(per_adapter(pm, [name], lambda ids=ids: pm.generate(input_ids=ids, **kw))[name][0, len(row) :])
    assert len({tuple(w.tolist()) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
    enable_csgmv(pm, backend="torch")
    gen = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cbc = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=8)
    ids = [None if n == BASE else n for n in names]
    out = pm.generate_batch(rows, generation_config=gen, continuous_batching_config=cbc, adapter_ids=ids)
    disable_csgmv(pm)
    assert [out[f"req_{i}"].generated_tokens for i in range(4)] == [w.tolist() for w in want]


def test_experts_layer_decode_step_host_work(monkeypatch):
    """An experts layer's host work per decode step, on the path CUDA takes (torch's grouped base products, here on
    the CPU where torch has them too, and the plan in one launch, here under the interpreter): no op that reads the
    device on the host (``.item()``, ``.tolist()``, ``nonzero``), a bounded number of torch ops (the layer's: 12 on
    Qwen3-MoE when this was written, 28 while the plan took torch ops, 73 before they were cut down; the experts' own
    gate among them) and five Triton launches (the plan, a shrink and an expand per expert product); and the grouped
    path gives each row its adapter's PEFT result."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from peft_csgmv import moe, moe_plan
    from peft_csgmv.kernels import launch

    monkeypatch.setattr(moe, "GROUPED_ON_CPU", True)
    monkeypatch.setattr(moe_plan, "FUSED_ON_CPU", True)
    pm, dtype = moe_peft("qwen3_moe"), torch.float32
    if torch.device(DEVICE).type == "cuda":  # (torch's grouped product takes 16-bit weights on CUDA)
        pm, dtype = pm.to(torch.bfloat16), torch.bfloat16
    ids, step = prompts(6, 5, seed=5), prompts(6, 1, seed=6)
    names = names_for(6)
    expected = per_adapter(pm, names, lambda: pm(torch.cat([ids, step], 1)).logits[:, -1])
    enable_csgmv(pm, backend="triton")
    experts = [m for m in pm.modules() if getattr(m.__dict__.get("_csgmv_record"), "experts", None)]
    assert len(experts) == 2

    class Count(TorchDispatchMode):
        on, ops, launches = False, [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if Count.on:
                Count.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    def on(*_):
        Count.on = True
        Count.ops.append(None)  # (a layer begins)

    def off(*_):
        Count.on = False

    for m in experts:
        m.register_forward_pre_hook(on)
        m.register_forward_hook(off)
    real_launch = launch.Launcher.__call__

    def counted(self, *args, **kwargs):
        was, Count.on = Count.on, False  # (the interpreter's own tensor ops are not the layer's)
        Count.launches += was
        try:
            return real_launch(self, *args, **kwargs)
        finally:
            Count.on = was

    monkeypatch.setattr(launch.Launcher, "__call__", counted)
    with torch.no_grad():
        cache = pm(ids, adapter_ids=names, use_cache=True).past_key_values
        pm(step, past_key_values=cache, adapter_ids=names)  # (the plan's constants of this size are made once)
        cache.crop(-1)
        Count.launches, Count.ops = 0, []
        with Count():
            got = pm(step, past_key_values=cache, adapter_ids=names).logits[:, -1]
    close(got, stitch(expected, names), "grouped decode step", dtype=dtype)
    views = {"view", "_unsafe_view", "slice", "select", "transpose", "unsqueeze", "split", "lift_fresh", "alias"}
    assert not {"_local_scalar_dense", "item", "nonzero", "tolist"} & set(Count.ops), Count.ops
    per_layer = []
    for op in Count.ops:
        if op is None:
            per_layer.append([])
        elif op not in views:
            per_layer[-1].append(op)
    first, second = per_layer
    # The call's token groups go to the device once, in the first experts layer (through pinned memory on CUDA).
    upload = first[: len(first) - len(second)]
    assert first[len(upload) :] == second and set(upload) <= {"is_pinned", "_pin_memory", "_to_copy", "copy_"}, first
    assert len(upload) <= 3 and len(second) <= 14, f"{len(second)} torch ops per experts layer: {second}"
    assert Count.launches == 2 * 5


def _expert_weights(pm, name):
    from peft.tuners.lora.layer import ParamWrapper

    return [(m.lora_A[name].weight, m.lora_B[name].weight) for m in pm.modules()
            if isinstance(m, ParamWrapper) and name in m.lora_A]  # fmt: skip


def _stacks(pm) -> list:
    return [s for m in pm.modules() for s in (getattr(m.__dict__.get("_csgmv_record"), "experts", None) or {}).values()]


def _in_stacks(pm, w, stacks=None) -> bool:
    stacks = _stacks(pm) if stacks is None else stacks
    ptr = w.untyped_storage().data_ptr()
    return any(ptr in (s.a.untyped_storage().data_ptr(), s.b.untyped_storage().data_ptr()) for s in stacks)


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_expert_weights_are_stored_once(arch):
    """PEFT's expert weights of every adapter, of any rank, are views into csgmv's stacks (each slot holds PEFT's
    ``lora_A`` and rank-major ``lora_B`` at its adapter's own rank): counted in ``shared_bytes``, PEFT's own forward
    unchanged, an in-place edit of PEFT's weight seen by the kernels; a wider adapter added later restacks, the old
    stacks' views re-pointed into the new ones (values kept); ``disable_csgmv`` gives all their own memory back."""
    from peft import LoraConfig

    pm = moe_peft(arch, {k: ADAPTERS[k] for k in ("a0", "a1")})  # ranks 4 and 8: both shared
    ids = prompts(4, 5, seed=7)
    names = names_for(4, ("a0", "a1"))
    before = {n: [(a.clone(), b.clone()) for a, b in _expert_weights(pm, n)] for n in ("a0", "a1")}
    stock = per_adapter(pm, ["a1"], lambda: pm(ids).logits)["a1"]
    enable_csgmv(pm, backend="triton")
    stats = csgmv_stats(pm)
    shared = sum(a.nbytes + b.nbytes for n in ("a0", "a1") for a, b in _expert_weights(pm, n))
    for n in ("a0", "a1"):
        assert all(_in_stacks(pm, a) and _in_stacks(pm, b) for a, b in _expert_weights(pm, n)), n
    assert stats["shared_bytes"] >= shared > 0 and stats["expert_stack_bytes"] >= shared
    for n in ("a0", "a1"):  # the same values, PEFT's own layouts
        for (a, b), (a0, b0) in zip(_expert_weights(pm, n), before[n]):
            assert a.shape == a0.shape and b.shape == b0.shape and torch.equal(a, a0) and torch.equal(b, b0)
    with torch.no_grad():
        assert torch.equal(per_adapter(pm, ["a1"], lambda: pm(ids).logits)["a1"], stock)  # PEFT's forward reads views
        for _, b in _expert_weights(pm, "a1") + _expert_weights(pm, "a0"):  # in-place edits: the kernels see them
            b.mul_(-0.5)
        got = pm(ids, adapter_ids=names).logits
        edited = per_adapter(pm, names, lambda: pm(ids).logits)
    assert_adapters_matter(edited)
    close(got, stitch(edited, names), "after an in-place edit")
    assert not torch.allclose(edited["a1"], stock)

    torch.manual_seed(30)
    pm.add_adapter("a3", LoraConfig(init_lora_weights=False, r=12, lora_alpha=6, target_modules=[],
                                    target_parameters=EXPERTS))  # fmt: skip
    names = names_for(4, ("a1", "a3"))
    values = [(a.clone(), b.clone()) for a, b in _expert_weights(pm, "a1")]
    old = _stacks(pm)
    with torch.no_grad():
        got = pm(ids, adapter_ids=names).logits  # restacked at R = 12: every adapter shared in the new stacks
    for n in ("a1", "a3"):
        assert all(_in_stacks(pm, a) and _in_stacks(pm, b) for a, b in _expert_weights(pm, n)), n
        assert not any(_in_stacks(pm, w, old) for pair in _expert_weights(pm, n) for w in pair), n
    assert all(torch.equal(a, a0) and torch.equal(b, b0) for (a, b), (a0, b0) in zip(_expert_weights(pm, "a1"), values))
    stacks = _stacks(pm)
    disable_csgmv(pm)
    weights = [w for n in ("a0", "a1", "a3") for pair in _expert_weights(pm, n) for w in pair]
    assert stacks and not any(_in_stacks(pm, w, stacks) for w in weights)
    expected = per_adapter(pm, names, lambda: pm(ids).logits)
    close(got, stitch(expected, names), "a wider adapter added")
