"""The dependency floors (peft_csgmv/_compat.py): the same numbers as pyproject.toml, refused below them in one line
naming the package, found and needed versions; the KV-cache spelling of old and new transformers."""

from __future__ import annotations

import re
import warnings
from importlib import metadata
from pathlib import Path

import pytest
import torch
from helpers import ALL_LINEAR, add_adapters, tiny_model

from peft_csgmv import _compat
from peft_csgmv._compat import FLOORS, cache_kwarg, check_versions, output_cache, too_old


def test_pyproject_declares_the_same_floors():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    declared = {}
    for dep in project["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", dep.replace(" ", ""))
        if m:
            declared[m.group(1)] = m.group(2)
    for package, floor in FLOORS.items():
        assert _compat._release(declared[package]) == _compat._release(floor), package


def test_below_a_floor_is_one_clear_line():
    found = {"peft": "0.17.1", "transformers": "5.24.0", "triton": "3.3.1", "accelerate": None}
    problems = too_old(found)
    peft, triton = FLOORS["peft"], FLOORS["triton"]
    assert problems == [
        f"peft_csgmv needs peft>={peft}, found peft 0.17.1 (pip install -U 'peft>={peft}')",
        f"peft_csgmv needs triton>={triton}, found triton 3.3.1 (pip install -U 'triton>={triton}')",
    ]
    with pytest.raises(ImportError, match=r"needs peft>=.*found peft 0\.17\.1.*; .*found triton 3\.3\.1"):
        check_versions(found)


def test_at_and_above_the_floors_and_pre_releases_pass(monkeypatch):
    assert too_old(dict(FLOORS)) == []
    assert too_old({p: f + "rc1" for p, f in FLOORS.items()}) == []  # a pre-release of the floor counts as it
    assert too_old({p: f"{int(f.split('.')[0]) + 1}.0.0.dev0+local" for p, f in FLOORS.items()}) == []
    assert too_old({p: None for p in FLOORS}) == []  # not installed: not this check's business
    monkeypatch.setattr(metadata, "version", lambda name: {"peft": "0.19.1"}.get(name, "99.0"))
    with pytest.raises(ImportError, match=r"found peft 0\.19\.1"):
        check_versions()


def test_release_numbers():
    assert _compat._release("5.25.0.dev0") == (5, 25)
    assert _compat._release("2.13.0+cpu") == (2, 13)
    assert _compat._release("0.19.0rc1") == (0, 19)
    assert _compat._release("3.4") == _compat._release("3.4.0")
    assert _compat._release("1.10.0") > _compat._release("1.9.9")


def test_kv_cache_spelling_decodes_without_deprecation_warnings():
    """A prefill, then one decode step over its cache, with this transformers version's own names (``cache`` from
    5.24 on): the same logits as the whole sequence at once, and no FutureWarning."""
    adapter = {"x": dict(r=4, lora_alpha=8, target_modules=ALL_LINEAR)}
    for model in (tiny_model("llama")[0], add_adapters(tiny_model("llama")[0], adapter)):
        ids = torch.randint(4, 60, (2, 6))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            first = model(ids[:, :5], use_cache=True)
            step = model(ids[:, 5:], use_cache=True, **{cache_kwarg(model): output_cache(first)})
            whole = model(ids).logits
        torch.testing.assert_close(step.logits[:, -1], whole[:, -1], atol=1e-5, rtol=1e-5)
