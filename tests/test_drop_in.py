"""Drop-in for PEFT's ``adapter_names``: whatever stock PEFT serves in a mixed batch, a csgmv call serves, with PEFT's
results; where PEFT raises, csgmv raises PEFT's exception with PEFT's message. Modules and adapters the kernels do not
reach run PEFT's own mixed-batch path (the kernels keep the rest); models whose adapters are not LoRA run PEFT's path
whole. Each case runs the same call through stock PEFT first and through csgmv after, and compares the outcomes.

Also here: calls that must fail cleanly before anything runs (an empty batch or sequence), and calls that must not
change the model when they fail (inputs on another device than the model)."""

from __future__ import annotations

import re

import pytest
import torch
from helpers import (
    ALL_LINEAR,
    BACKENDS,
    BASE,
    DEVICE,
    add_adapters,
    assert_adapters_matter,
    assert_close,
    close,
    make_batch,
    per_adapter,
    stitch,
    tiny_model,
)
from peft import GloraConfig, LoHaConfig, LoraConfig, RoadConfig, get_peft_model

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.executor import active_calls

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore:csgmv. .*PEFT:UserWarning")


def outcome(fn):
    """``("ok", output)`` or ``("raise", exception type, message)``."""
    try:
        with torch.no_grad():
            return ("ok", fn())
    except Exception as exc:  # noqa: BLE001 - the outcome is what is compared
        return ("raise", type(exc), str(exc))


def _logits(out):
    return out.logits if hasattr(out, "logits") else out


def assert_same_as_peft(model, call, names, backend="torch", tokens=False):
    """``call(adapter_names=names)`` through stock PEFT, then ``call(adapter_ids=...)`` / ``call(adapter_names=...)``
    through csgmv: the same output (within the fp32 tolerance; identical tokens for generate) or the same exception
    type and message. Returns PEFT's outcome."""
    assert not hasattr(model, "_csgmv")
    expected = outcome(lambda: call(adapter_names=list(names)))
    if expected[0] == "raise":
        # PEFT removes its adapter_names hooks only when the call succeeds: clear what its failed call left behind.
        for module in model.modules():
            module._forward_pre_hooks.clear()
    enable_csgmv(model, backend=backend)
    try:
        for arg, ids in (("adapter_names", list(names)), ("adapter_ids", [None if n == BASE else n for n in names])):
            got = outcome(lambda: call(**{arg: ids}))
            assert active_calls() == 0
            assert got[0] == expected[0], f"{arg}: csgmv {got[0]} ({got[1:]}) where PEFT gave {expected[0]}"
            if expected[0] == "raise":
                assert got[1] is expected[1], f"{arg}: csgmv raised {got[1].__name__}, PEFT {expected[1].__name__}"
                assert got[2] == expected[2].replace("adapter_names", arg) or got[2] == expected[2], (got, expected)
            elif tokens:
                assert torch.equal(got[1], expected[1]), f"{arg}: generated tokens differ from PEFT's"
            else:
                close(_logits(got[1]), _logits(expected[1]), f"{arg}: csgmv vs PEFT adapter_names")
    finally:
        disable_csgmv(model)
    return expected


# --------------------------------------------------------------------------------------------------------------------
# adapters that are not LoRA: PEFT's path, whole
# --------------------------------------------------------------------------------------------------------------------


def _other_method(config_cls, **kw):
    model, _ = tiny_model("llama")
    torch.manual_seed(1)
    peft_model = get_peft_model(model, config_cls(**kw), adapter_name="x0")
    peft_model.add_adapter("x1", config_cls(**kw))
    with torch.no_grad():  # non-trivial weights, different per adapter
        for name, p in peft_model.named_parameters():
            if ".x0" in name or ".x1" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return peft_model.eval().to(DEVICE)


@pytest.mark.parametrize(
    "config_cls,kw",
    [
        (RoadConfig, dict(group_size=8, target_modules=["q_proj", "v_proj"], init_weights=False)),
        (GloraConfig, dict(r=4, target_modules=["q_proj", "v_proj"])),
    ],
    ids=["road", "glora"],
)
def test_other_peft_methods_served_as_peft_serves_them(config_cls, kw):
    """RoAd and GLoRA mix adapters per row in PEFT; enable_csgmv accepts such a model (with a warning) and a call
    with ids gives PEFT's own mixed-batch result."""
    model = _other_method(config_cls, **kw)
    input_ids, mask = make_batch(6, 5)
    names = [BASE, "x0", "x1", "x1", BASE, "x0"]

    def call(**ids):
        return model(input_ids, attention_mask=mask, **ids)

    outs = {}
    for name in ("x0", "x1"):
        model.set_adapter(name)
        with torch.no_grad():
            outs[name] = model(input_ids, attention_mask=mask).logits
    with model.disable_adapter(), torch.no_grad():
        outs[BASE] = model(input_ids, attention_mask=mask).logits
    assert_adapters_matter(outs)
    with pytest.warns(UserWarning, match=r"csgmv: adapters that are not LoRA \('x0': (ROAD|GLORA)"):
        enable_csgmv(model)
    disable_csgmv(model)
    expected = assert_same_as_peft(model, call, names)
    assert expected[0] == "ok", f"PEFT itself refused: {expected}"

    def gen(**ids):
        return model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=3, do_sample=False, **ids)

    expected = assert_same_as_peft(model, gen, names, tokens=True)
    assert expected[0] == "ok"


def test_method_without_mixed_batches_gives_peft_outcome():
    """LoHa has no mixed-batch path in PEFT: the call has PEFT's outcome, whatever it is."""
    model = _other_method(LoHaConfig, r=4, target_modules=["q_proj"], init_weights=False)
    input_ids, mask = make_batch(3, 5)
    assert_same_as_peft(model, lambda **ids: model(input_ids, attention_mask=mask, **ids), [BASE, "x0", "x1"])


# --------------------------------------------------------------------------------------------------------------------
# LoRA adapters and layers the kernels do not serve: PEFT's path for exactly those
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_alora_mixed_with_plain_lora(backend, kernel_calls):
    """aLoRA (activated LoRA: applies from the invocation tokens on) mixes with plain adapters and base rows as in PEFT:
    its rows run PEFT's variant forward in each layer, the plain adapters' rows the kernels."""
    model, targets = tiny_model("llama")
    invocation = [7, 8]
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(
            r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=invocation,
            task_type="CAUSAL_LM",
        ),
    }  # fmt: skip
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(6, 8)
    input_ids[:, 3:5] = torch.tensor(invocation, device=DEVICE)  # every row invokes aLoRA mid-prompt
    names = ["al", "a0", BASE, "al", "a0", "al"]
    expected = assert_same_as_peft(
        model, lambda **ids: model(input_ids, attention_mask=mask, **ids), names, backend=backend
    )
    assert expected[0] == "ok"
    assert kernel_calls, "the plain adapter's rows did not use the kernels"
    # aLoRA changes the output after its invocation only, and does change it there.
    with torch.no_grad():
        base = model(input_ids, attention_mask=mask, adapter_names=[BASE] * 6).logits
    diff = (expected[1].logits[0] - base[0]).abs().amax(-1)
    assert diff[:3].max() < 1e-6 and diff[5:].max() > 1e-3
    gen = lambda **ids: model.generate(  # noqa: E731
        input_ids=input_ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, **ids
    )
    assert assert_same_as_peft(model, gen, names, backend=backend, tokens=True)[0] == "ok"
    # With aLoRA the *active* adapter, PEFT's forward hooks pass offsets for it to every layer; the call's own offsets
    # (from its ids) are the ones that count.
    model.set_adapter("al")
    names = ["a0", BASE, "a0", "al", BASE, "a0"]
    call = lambda **ids: model(input_ids, attention_mask=mask, **ids)  # noqa: E731
    assert assert_same_as_peft(model, call, names, backend=backend)[0] == "ok"


def test_alora_refuses_beams_as_peft_does():
    model, targets = tiny_model("llama")
    specs = {"al": dict(r=4, target_modules=["q_proj"], alora_invocation_tokens=[7], task_type="CAUSAL_LM")}
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(2, 6)
    gen = lambda **ids: model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=2, num_beams=2, **ids)  # noqa: E731
    expected = assert_same_as_peft(model, gen, ["al", BASE])
    assert expected[:2] == ("raise", ValueError) and "Beam search" in expected[2]


class MhaNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = torch.nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.out(self.mha(x, x, x)[0])


class GruNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.gru = torch.nn.GRU(16, 16, batch_first=True)

    def forward(self, x):
        return self.gru(self.lin(x))[0]


class ParamNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.proj = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.proj(torch.relu(self.lin(x)))


def _custom(net_cls, **config):
    torch.manual_seed(0)
    model = get_peft_model(net_cls(), LoraConfig(init_lora_weights=False, **config), adapter_name="a0")
    model.add_adapter("a1", LoraConfig(init_lora_weights=False, **config))
    return model.eval().to(DEVICE)


@pytest.mark.parametrize(
    "net_cls,config,error",
    [
        (MhaNet, dict(r=4, target_modules=["mha", "out"]), TypeError),
        (GruNet, dict(r=4, target_modules=["lin"], modules_to_save=["gru"]), TypeError),
        (ParamNet, dict(r=4, target_modules=["proj"], target_parameters=["lin.weight"]), ValueError),
    ],
    ids=["multihead-attention", "modules_to_save-gru", "target_parameters"],
)
def test_modules_peft_cannot_mix_raise_peft_errors(net_cls, config, error):
    """Where PEFT's mixed batches refuse a module, enable_csgmv accepts the model (warning that the module runs on
    PEFT's path) and a call raises PEFT's exception with PEFT's message; the model stays usable without ids."""
    model = _custom(net_cls, **config)
    x = torch.randn(4, 3, 16, device=DEVICE)
    with torch.no_grad():
        stock = model(x)
    with pytest.warns(UserWarning, match="through PEFT's own mixed-batch path"):
        enable_csgmv(model)
    disable_csgmv(model)
    expected = assert_same_as_peft(model, lambda **ids: model(x, **ids), [BASE, "a0", "a1", "a0"])
    assert expected[:2] == ("raise", error), expected
    enable_csgmv(model)
    with torch.no_grad():
        assert torch.equal(model(x), stock)


def test_modules_to_save_around_unmixable_module_added_after_enable():
    """An adapter added after enabling with ``modules_to_save`` around a norm: the call has PEFT's outcome."""
    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, target_modules=targets)}).to(DEVICE)
    input_ids, mask = make_batch(3, 5)
    enable_csgmv(model)
    model.add_adapter(
        "m", LoraConfig(init_lora_weights=False, r=4, target_modules=["q_proj"], modules_to_save=["norm"])
    )
    model.set_adapter("m")
    disable_csgmv(model)
    expected = assert_same_as_peft(model, lambda **ids: model(input_ids, attention_mask=mask, **ids), ["m", "a0", BASE])
    assert expected[:2] == ("raise", TypeError)


def test_dora_on_peft_path_layer_raises_peft_error_before_anything_runs(kernel_calls):
    """DoRA on a layer the kernels do not serve (an embedding): PEFT refuses DoRA in mixed batches, and so does csgmv
    there, with PEFT's message, before any kernel runs. (DoRA on Linear layers is served: tests/test_dora.py.)"""
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=targets),
        "d": dict(r=4, lora_alpha=8, target_modules=["embed_tokens"], use_dora=True),
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(2, 5)
    expected = assert_same_as_peft(model, lambda **ids: model(input_ids, attention_mask=mask, **ids), ["a0", "d"])
    assert expected[:2] == ("raise", ValueError)
    assert kernel_calls == []


# --------------------------------------------------------------------------------------------------------------------
# calls that fail before anything runs, and calls that must not change the model
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture
def enabled():
    model, targets = tiny_model("llama")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", *targets]),
        "a1": dict(r=8, lora_alpha=4, target_modules=targets),
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(3, 5)
    with torch.no_grad():
        expected = model(input_ids, attention_mask=mask, adapter_names=["a0", BASE, "a1"]).logits
    enable_csgmv(model, backend="torch")
    return model, input_ids, mask, expected


@pytest.mark.parametrize(
    "shape,message",
    [((0, 5), r"`adapter_ids` was given with an input of 0 rows"), ((3, 0), r"0 tokens per row")],
    ids=["no-rows", "no-tokens"],
)
@pytest.mark.parametrize("method", ["forward", "generate"])
def test_empty_batch_or_sequence_refused(enabled, kernel_calls, shape, message, method):
    model, input_ids, mask, expected = enabled
    empty = torch.zeros(shape, dtype=torch.long, device=DEVICE)
    ids = ["a0", None, "a1"]
    with pytest.raises(ValueError, match=message):
        if method == "forward":
            model(empty, adapter_ids=ids)
        else:
            model.generate(input_ids=empty, attention_mask=torch.ones_like(empty), adapter_ids=ids, max_new_tokens=2)
    assert kernel_calls == [] and active_calls() == 0
    with torch.no_grad():
        close(model(input_ids, attention_mask=mask, adapter_ids=ids).logits, expected, "valid call after the error")


def _stacks(model):
    state = model._csgmv
    return {
        # The storage's raw bytes: the alignment gaps between slots are never written (uninitialized memory may hold
        # NaN patterns, which no float comparison calls equal).
        name: (
            layer._csgmv_record.stack.device,
            layer._csgmv_record.stack.data.data_ptr(),
            layer._csgmv_record.stack.data.view(torch.uint8).clone(),
        )
        for name, layer in state.layers.items()
    }


def test_inputs_on_another_device_leave_the_model_as_it_was(enabled):
    """A call whose inputs are on another device than the model (here: meta) has PEFT's outcome for those layers and
    moves no stack: the next call on the right device is right."""
    model, input_ids, mask, expected = enabled
    before = _stacks(model)
    with torch.no_grad():
        outcome(lambda: model(input_ids.to("meta"), attention_mask=mask.to("meta"), adapter_ids=["a0", None, "a1"]))
        outcome(lambda: model(input_ids.to("meta"), adapter_ids=["a0", None, "a1"]))
    after = _stacks(model)
    for name, (device, ptr, a) in before.items():
        assert after[name][0] == device and after[name][1] == ptr, f"{name}: the stack moved"
        assert torch.equal(after[name][2], a), f"{name}: the stack changed"
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits
    close(got, expected, "valid call after a call on another device")
    enable_csgmv(model, backend="torch")  # restacking keeps it right too
    with torch.no_grad():
        close(model(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits, expected, "restacked")


def test_stack_move_is_all_or_nothing(monkeypatch):
    """``LoraStack.to`` copies every tensor before it replaces any: a copy that fails leaves the stack as it was."""
    from peft_csgmv.slots import LoraStack

    stack = LoraStack(in_features=6, out_features=5, capacity=2, dtype=torch.float32, device=DEVICE)
    stack.set_slot(0, torch.randn(3, 6), torch.randn(5, 3), 2.0)
    data, ranks = stack.data, stack.ranks
    calls = []

    def failing_to(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("copy failed")
        return torch.Tensor.clone(self)

    monkeypatch.setattr(torch.Tensor, "to", failing_to)
    with pytest.raises(RuntimeError, match="copy failed"):
        stack.to(torch.device("meta"))
    monkeypatch.undo()
    assert stack.data is data and stack.ranks is ranks and stack.device == torch.device(DEVICE)


def test_embed_scale_read_per_call():
    """A scaled embedding's ``embed_scale`` is read on every call, as PEFT reads it: changing it after enabling
    changes the csgmv output exactly as it changes PEFT's."""
    model, _ = tiny_model("gemma3")
    specs = {
        "a0": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
        "a1": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "v_proj"]),
    }
    model = add_adapters(model, specs).to(DEVICE)
    input_ids, mask = make_batch(3, 5)
    names = ["a0", BASE, "a1"]
    enable_csgmv(model, backend="torch")
    with torch.no_grad():
        model(input_ids, attention_mask=mask, adapter_ids=names)  # stacks built with the original scale
    model.get_input_embeddings().get_base_layer().embed_scale.mul_(3.0)
    # Calls without ids are stock PEFT: each adapter's own run, with the new scale, is the reference.
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    assert_adapters_matter(outs)
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    close(got, stitch(outs, names), "csgmv after embed_scale changed")


def test_warning_names_peft_path_modules():
    """enable_csgmv says once which modules run at PEFT's speed."""
    model, targets = tiny_model("llama")
    specs = {"a0": dict(r=4, target_modules=targets, modules_to_save=["lm_head"])}
    model = add_adapters(model, specs).to(DEVICE)
    with pytest.warns(UserWarning, match=re.escape("1 module(s)") + r".*lm_head"):
        enable_csgmv(model)
    assert not any(ALL_LINEAR[0] in n for n in model._csgmv.peft_path)


def test_nested_call_restores_the_outer_one(enabled):
    """A model called with other ids inside a call (from a hook, say): after the inner call the outer one's layers see
    the outer ids again."""
    model, input_ids, mask, expected = enabled
    layers = model.base_model.model.model.layers
    inner = []

    def hook(module, args):
        if not inner:
            inner.append(None)  # the inner call runs this hook too
            inner[0] = model(input_ids, attention_mask=mask, adapter_ids=["a1", "a1", "a0"]).logits

    handle = layers[0].register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            got = model(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits
    finally:
        handle.remove()
    assert inner[0] is not None and active_calls() == 0
    close(got, expected, "outer call after a nested one")


def test_patching_is_undone_exactly_and_keeps_instance_forwards():
    """``enable_csgmv`` gives each PEFT module a subclass of its class (same name) with the csgmv forward, and a module
    that has a forward of its own (accelerate's hooks set one) the csgmv forward over it; ``disable_csgmv`` gives back
    every module's class and that module's own forward. Meanwhile calls give PEFT's results."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, lora_alpha=8, target_modules=targets),
                                 "a1": dict(r=8, lora_alpha=4, target_modules=targets)}).to(DEVICE)  # fmt: skip
    hooked = model.base_model.model.model.layers[0].self_attn.q_proj
    add_hook_to_module(hooked, ModelHook())
    own = hooked.__dict__["forward"]
    classes = {name: type(m) for name, m in model.named_modules()}
    names = ["a0", BASE, "a1"]
    input_ids, mask = make_batch(3, 5)
    expected = stitch(per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits), names)
    enable_csgmv(model, backend="torch")
    patched = model.base_model.model.model.layers[1].self_attn.q_proj
    assert type(patched) is not classes["base_model.model.model.layers.1.self_attn.q_proj"]
    assert type(patched).__name__ == "Linear" and "forward" not in patched.__dict__
    assert hooked.__dict__["forward"] is not own
    with torch.no_grad():
        got = model(input_ids, attention_mask=mask, adapter_ids=["a0", None, "a1"]).logits
    close(got, expected, "a csgmv call through a hooked layer")
    disable_csgmv(model)
    assert {name: type(m) for name, m in model.named_modules()} == classes
    assert hooked.__dict__["forward"] is own
    assert not any("forward" in m.__dict__ for m in model.modules() if m is not hooked)


def test_deepcopy_of_an_enabled_model_is_refused_loudly():
    """Patched modules name their executor by handle, so a copy would run its calls through the original's state:
    ``copy.deepcopy`` of an enabled model raises, and so does pickling it (``torch.save(model)``), with one message
    that says what to do, and the model keeps working; a copy made before enabling works; ``copy.copy`` (the same
    modules and state) works; after ``disable_csgmv`` the model pickles again, as stock PEFT's does."""
    import copy
    import io
    import pickle

    model, targets = tiny_model("llama")
    model = add_adapters(model, {"a0": dict(r=4, lora_alpha=8, target_modules=targets)}).to(DEVICE)
    input_ids, mask = make_batch(2, 5)
    expected = per_adapter(model, ["a0"], lambda: model(input_ids, attention_mask=mask).logits)["a0"]
    twin = copy.deepcopy(model)
    enable_csgmv(model, backend="torch")
    for refused in (copy.deepcopy, pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match="deepcopy of a model with csgmv enabled, and pickling it"):
            refused(model)
    shallow = copy.copy(model)
    assert type(shallow) is type(model) and shallow.base_model is model.base_model
    for m in (model, enable_csgmv(twin, backend="torch"), shallow):
        with torch.no_grad():
            close(m(input_ids, attention_mask=mask, adapter_ids=["a0", "a0"]).logits, expected, "after the refusal")
    disable_csgmv(model)
    loaded = pickle.loads(pickle.dumps(model))
    with torch.no_grad():
        close(loaded(input_ids, attention_mask=mask).logits, expected, "stock PEFT's model, pickled after disabling")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_alora_mixed_half(dtype):
    """aLoRA rows (PEFT's forward in each layer) mixed with kernel rows, in half precision: the same logits as PEFT's
    own ``adapter_names`` path."""
    model, targets = tiny_model("llama")
    specs = {
        "a": dict(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM"),
        "al": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[7, 8],
                   task_type="CAUSAL_LM"),
    }  # fmt: skip
    pm = add_adapters(model.to("cuda"), specs).to(dtype)
    names = ["al", "a", "__base__", "al", "a"]
    ids = torch.randint(9, 97, (len(names), 10), device="cuda")
    ids[:, 4:6] = torch.tensor([7, 8], device="cuda")
    with torch.no_grad():
        ref = pm(ids, adapter_names=names).logits.float()
        base = pm(ids, adapter_names=["__base__"] * len(names)).logits.float()
    assert (ref[0] - base[0]).abs().max() > 0.05
    enable_csgmv(pm)
    try:
        with torch.no_grad():
            out = pm(ids, adapter_ids=names).logits.float()
    finally:
        disable_csgmv(pm)
    assert_close(out, ref, dtype, scale=max(1.0, ref.abs().max().item()) * 2, what="aLoRA mixed logits")
