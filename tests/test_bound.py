"""The bound per-layer launches (kernels/bound.py) pass exactly what the checked launch path passes.

The direct launch path only exists for compiled kernels on a GPU; here the launchers get a stand-in compiled kernel
that records every launch, so the argument lists of both paths can be compared on the CPU. The GPU tests run the real
thing (every decode step after the first goes through the bound launches).
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peft_csgmv import disable_csgmv, enable_csgmv
from peft_csgmv.kernels import BoundLayer
from peft_csgmv.mapping import Mapping


class OneLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(40, 24, bias=False)

    def forward(self, x):
        return self.proj(x)


def _addr(a):
    return a.data_ptr() if isinstance(a, torch.Tensor) else a


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _assert_same_launch(got, expected):
    assert got[0] == expected[0] and got[2] == expected[2], f"{got[0]} grid {got[2]} != {expected[0]} {expected[2]}"
    args, want = got[3], expected[3]
    assert len(args) == len(want), f"{got[0]}: {len(args)} arguments, the checked path passes {len(want)}"
    for i, (a, b) in enumerate(zip(args, want)):
        assert _same(a, b), f"{got[0]} argument {i}: {a!r} != {b!r}"


def _two_adapters_in_a_call():
    """A one-layer model with adapters of ranks 4 and 8 on the Triton backend, a call with both open on its executor
    (the caller ends it and disables csgmv); ``(model, layer, executor, x)``."""
    torch.manual_seed(0)
    model = get_peft_model(OneLayer(), LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False), "a0")
    model.add_adapter("a1", LoraConfig(r=8, target_modules=["proj"], init_lora_weights=False))
    model.eval()
    enable_csgmv(model, backend="triton")
    names = ("a0", "a1", "a0", "a1")
    slots = tuple(model._csgmv.registry.index[n] for n in names)
    executor = model._csgmv.executor
    executor.begin(Mapping(row_slots=slots, names=names, arg_name="adapter_ids"))
    return model, model.base_model.model.proj, executor, torch.randn(4, 1, 40)


def test_bound_launches_match_the_checked_path(recorded):
    model, layer, executor, x = _two_adapters_in_a_call()
    try:
        with torch.no_grad():
            layer(x)  # first call: Triton compiles (recorded as "triton"); a plan used once is not bound
            assert [(e[0], e[1]) for e in recorded] == [("shrink", "triton"), ("expand", "triton")]
            plan = next(iter(executor.plans.values()))  # the PlanRun: plan, workspaces, bindings
            assert not isinstance(plan.bound[layer._csgmv_record.stack], BoundLayer)
            recorded.clear()
            layer(x)  # second call: the checked path's direct launch, then the launches are bound to the plan
            assert [(e[0], e[1]) for e in recorded] == [("shrink", "direct"), ("expand", "direct")]
            assert isinstance(plan.bound[layer._csgmv_record.stack], BoundLayer)

            recorded.clear()
            layer(x)  # bound launches
            via_bound = list(recorded)
            recorded.clear()
            plan.bound.clear()
            layer(x)  # the checked path through the launchers' direct launch
            via_checked = list(recorded)
            layer(x)  # binds again
            assert [(e[0], e[1]) for e in via_bound] == [("shrink", "direct"), ("expand", "direct")]
            assert [(e[0], e[1]) for e in via_checked] == [("shrink", "direct"), ("expand", "direct")]
            # The bound launches pass every tensor as its address; x (shrink argument 0) and y (expand arguments 2
            # and 3: y, and y again as the in-place output) are compared apart, as y is a new tensor each call.
            x_ptr = x.data_ptr()
            assert via_bound[0][3][0] == x_ptr and via_checked[0][3][0].data_ptr() == x_ptr
            assert via_bound[1][3][2] == via_bound[1][3][3], "bound expand: y is its own output"
            for got, expected, skip in zip(via_bound, via_checked, ((0,), (2, 3))):
                got_args = tuple(None if i in skip else _addr(a) for i, a in enumerate(got[3]))
                want_args = tuple(None if i in skip else _addr(a) for i, a in enumerate(expected[3]))
                _assert_same_launch((*got[:3], got_args), (*expected[:3], want_args))
            assert not any(isinstance(a, torch.Tensor) for e in via_bound for a in e[3]), "bound: addresses only"

            # A misaligned x would compile differently: the binding does not fit, the checked path runs.
            stack = layer._csgmv_record.stack
            bound = plan.bound[stack]
            wide = torch.randn(4 * 41 + 1)[1:].view(4, 41)[:, :40]
            assert wide.data_ptr() % 16 and not bound.fits(wide, torch.empty(4, 24), stack)
            assert bound.fits(torch.randn(4, 40), torch.empty(4, 24), stack)
            # A reallocated stack (a new adapter of a larger rank) does not fit either.
            model.add_adapter("a2", LoraConfig(r=16, target_modules=["proj"], init_lora_weights=False))
            model._csgmv.sync(model)
            assert layer._csgmv_record.stack.a is not bound.tensors[0]
            assert not bound.fits(torch.randn(4, 40), torch.empty(4, 24), layer._csgmv_record.stack)
    finally:
        executor.end()
        disable_csgmv(model)


def test_pdl_choice(monkeypatch):
    """Programmatic dependent launch only on CUDA devices of compute capability 9 and up, compiled (not interpreted),
    with a Triton whose ``gdc`` functions compile, and not under ``PEFT_CSGMV_PDL=0``."""
    from triton.language.extra.cuda import gdc

    from peft_csgmv.kernels import launch

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(launch, "interpreting", lambda: False)
    monkeypatch.setattr(launch, "_triton_has_pdl", lambda: True)
    monkeypatch.setattr(launch, "_capability", lambda device: 9)
    monkeypatch.delenv("PEFT_CSGMV_PDL", raising=False)
    launch.reset_pdl()
    try:
        assert launch.pdl(cuda) and not launch.pdl(torch.device("cpu"))
        assert launch.with_pdl(cuda, (("num_warps", 4),)) == (True, (("num_warps", 4), ("launch_pdl", True)))
        assert launch.with_pdl(torch.device("cpu"), (("num_warps", 4),)) == (False, (("num_warps", 4),))
        monkeypatch.setenv("PEFT_CSGMV_PDL", "0")
        assert launch.pdl(cuda), "the choice is made once per device"
        launch.reset_pdl()
        assert not launch.pdl(cuda)
        monkeypatch.delenv("PEFT_CSGMV_PDL")
        launch.reset_pdl()
        monkeypatch.setattr(launch, "_capability", lambda device: 8)
        assert not launch.pdl(cuda), "Ampere: no PDL"
    finally:
        launch.reset_pdl()
    monkeypatch.undo()

    # Triton 3.4's gdc functions take the ``_builder`` argument its compiler no longer passes: no PDL there.
    def old_wait(_builder=None):
        pass

    monkeypatch.setattr(gdc, "gdc_wait", old_wait)
    assert not launch._triton_has_pdl()


@pytest.mark.parametrize("pdl", [False, True], ids=["serial", "pdl"])
def test_pdl_reaches_checked_and_bound_launches(recorded, monkeypatch, pdl):
    """Where PDL is on, both kernels are compiled with ``USE_GDC`` and launched with Triton's ``launch_pdl`` option
    (part of the compiled kernel's key), and the bound launches use the kernels so compiled."""
    from peft_csgmv.kernels import launch

    monkeypatch.setattr(launch, "pdl", lambda device: pdl)
    model, layer, executor, x = _two_adapters_in_a_call()
    try:
        with torch.no_grad():
            for _ in range(3):  # Triton's launch, the direct launch (then bound), the bound launches
                layer(x)
        first, bound = recorded[:2], recorded[4:]
        for name, how, _, _, kwargs in first:
            kwargs = dict(kwargs)
            assert how == "triton" and kwargs["USE_GDC"] is pdl and kwargs.get("launch_pdl", False) is pdl, name
        plan = next(iter(executor.plans.values()))
        assert isinstance(plan.bound[layer._csgmv_record.stack], BoundLayer)
        assert [(e[0], e[1]) for e in bound] == [("shrink", "direct"), ("expand", "direct")]
        assert all(e[3][-1] is pdl for e in bound), "USE_GDC is the last constexpr of both kernels"
    finally:
        executor.end()
        disable_csgmv(model)


@pytest.mark.gpu
def test_bound_launches_on_later_calls():
    """From the third call with the same ids on, the layers go through the bound launches (device addresses,
    prepared argument lists): every patched layer has a binding, and the output is bit-identical to the first call's
    and matches per-adapter PEFT runs."""
    from helpers import close, interleaved, make, make_batch, per_adapter, stitch

    model = make("llama")
    names = interleaved(6)
    input_ids, mask = make_batch(6, 7)
    outs = per_adapter(model, names, lambda: model(input_ids, attention_mask=mask).logits)
    enable_csgmv(model)
    try:
        from peft_csgmv.kernels import BoundLayer

        first = model(input_ids, attention_mask=mask, adapter_ids=names).logits
        model(input_ids, attention_mask=mask, adapter_ids=names)  # a plan's second use binds its launches
        runs = list(model._csgmv.executor.plans.values())
        bound = [b for r in runs for b in r.bound.values()]
        assert bound and all(isinstance(b, BoundLayer) for b in bound), "no bound launches after the second call"
        second = model(input_ids, attention_mask=mask, adapter_ids=names).logits
    finally:
        disable_csgmv(model)
    assert torch.equal(first, second)
    close(second, stitch(outs, names), "bound launches vs per-adapter runs")
