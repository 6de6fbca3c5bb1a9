"""The examples run end to end on the tiny default models, and the eval example agrees with stock PEFT."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(name, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [name])
    runpy.run_path(str(EXAMPLES / name), run_name="__main__")
    return capsys.readouterr().out


def test_quickstart(monkeypatch, capsys):
    out = _run("quickstart.py", monkeypatch, capsys)
    rows = [line.split(": ", 1) for line in out.splitlines() if ": [" in line]
    assert [name for name, _ in rows] == ["legal", "base", "chat", "code"]
    assert len({tokens for _, tokens in rows}) > 1, "the adapters should change the generated tokens"


def test_mixed_batch_generate(monkeypatch, capsys):
    out = _run("mixed_batch_generate.py", monkeypatch, capsys)
    assert [line.split("]")[0] for line in out.splitlines() if line.startswith("[")] == [
        "[legal",
        "[chat",
        "[code",
        "[base",
    ]


def test_eval_many_adapters_agrees_with_peft(monkeypatch, capsys):
    out = _run("eval_many_adapters.py", monkeypatch, capsys)
    diff = float(re.search(r"\|diff\| ([0-9.e+-]+)", out).group(1))
    assert diff < 1e-4, out
    assert len(re.findall(r"^task\d", out, flags=re.M)) == 8
    losses = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\w+)\s+([0-9.]+)\s", out, flags=re.M)}
    assert len(set(losses.values())) > 2, "adapters should give different losses"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
