"""The ``peft-csgmv`` command: demo, batch generation from JSONL (parity with stock PEFT, bad lines, resume), bench."""

from __future__ import annotations

import json

import pytest
import torch

from peft_csgmv.cli import main
from peft_csgmv.toy import save_toy_checkout

RANKS = {"legal": 4, "chat": 8}


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return save_toy_checkout(str(tmp_path_factory.mktemp("toy")), RANKS)


def _write(path, lines):
    path.write_text("".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines))


def _args(checkout, inp, out, *extra):
    base, adapters = checkout
    args = ["generate", "--base", base, "--input", str(inp), "--output", str(out), "--max-new-tokens", "6",
            "--batch-size", "3", "--no-progress", "--device", "cpu", *extra]  # fmt: skip
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    return args


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


PROMPTS = [
    {"prompt": "hello there", "adapter": "legal", "id": "a"},
    {"prompt": "hi", "adapter": None},
    {"prompt": "good day to you, sir", "adapter": "chat", "id": 7},
    {"prompt": "yo", "adapter": "__base__"},
    {"prompt": "the contract says", "adapter": "legal"},
    {"prompt": "ok", "adapter": "chat"},
    {"prompt": "no adapter key"},
]


def _stock_completions(checkout):
    """Each prompt alone through stock PEFT with its adapter (base rows under disable_adapter), greedy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, adapters = checkout
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0], autocast_adapter_dtype=False)
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name, autocast_adapter_dtype=False)
    model.eval()
    out = []
    for row in PROMPTS:
        enc = tok([row["prompt"]], return_tensors="pt")
        adapter = row.get("adapter")
        with torch.no_grad():
            if adapter in (None, "__base__"):
                with model.disable_adapter():
                    seq = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
            else:
                model.set_adapter(adapter)
                seq = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
        new = seq[0, enc["input_ids"].shape[1] :]
        out.append(tok.decode(new[new != 0], skip_special_tokens=True))
    return out


def test_generate_matches_stock_peft(checkout, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out)) == 0
    records = {r["line"]: r for r in _records(out)}
    assert sorted(records) == list(range(1, len(PROMPTS) + 1))
    expected = _stock_completions(checkout)
    assert len(set(expected)) > 2, "the adapters do not change the completions"
    for line, (row, want) in enumerate(zip(PROMPTS, expected), start=1):
        rec = records[line]
        assert rec["completion"] == want, f"line {line} ({row.get('adapter')}): {rec['completion']!r} != {want!r}"
        assert rec["adapter"] == (None if row.get("adapter") in (None, "__base__") else row["adapter"])
        assert ("id" in rec) == ("id" in row) and rec.get("id") == row.get("id")


def test_bad_lines_stop_before_generating(checkout, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [PROMPTS[0], "not json", {"prompt": "x", "adapter": "nope"}, {"adapter": "chat"}, ["a list"]])
    assert main(_args(checkout, inp, out)) == 2
    err = capsys.readouterr().err
    assert "line 2: not valid JSON" in err
    assert "line 3: unknown adapter 'nope'" in err
    assert "line 4: missing or empty 'prompt'" in err
    assert "line 5: expected a JSON object" in err
    assert not out.exists()


def test_bad_lines_skipped_with_error_records(checkout, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [PROMPTS[0], "{broken", PROMPTS[2], {"prompt": "", "adapter": "chat"}])
    assert main(_args(checkout, inp, out, "--on-error", "skip")) == 0
    records = {r["line"]: r for r in _records(out)}
    assert sorted(records) == [1, 2, 3, 4], "every input line must be accounted for"
    assert "error" in records[2] and "error" in records[4]
    assert "completion" in records[1] and "completion" in records[3]


def test_resume_skips_finished_rows_and_cuts_a_torn_line(checkout, tmp_path, monkeypatch):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out)) == 0
    full = _records(out)
    # Keep the first two finished records, then a torn write, as an interrupted run leaves it.
    kept = out.read_text().splitlines(keepends=True)[:2]
    out.write_text("".join(kept) + '{"line": 9, "compl')
    seen = []
    import peft_csgmv.batch as batch

    real = batch.generate_rows

    def spy(model, tokenizer, rows, *a, **kw):
        seen.extend(r.line for r in rows)
        return real(model, tokenizer, rows, *a, **kw)

    monkeypatch.setattr(batch, "generate_rows", spy)
    assert main(_args(checkout, inp, out)) == 0
    done_first = {json.loads(line)["line"] for line in kept}
    assert sorted(seen) == sorted(set(range(1, len(PROMPTS) + 1)) - done_first)
    resumed = _records(out)
    assert sorted(r["line"] for r in resumed) == list(range(1, len(PROMPTS) + 1))
    assert {r["line"]: r["completion"] for r in resumed} == {r["line"]: r["completion"] for r in full}


def test_demo_agrees():
    assert main(["demo", "--device", "cpu"]) == 0


def test_bench_writes_json_and_plot(tmp_path):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    rc = main(["bench", "--model", "tiny", "--adapters", "4", "--distinct", "1,4", "--batch", "4", "--prompt", "8",
               "--new-tokens", "2", "--repeats", "1", "--device", "cpu",
               "--out", str(out), "--plot", str(png)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["row"] for r in data["results"]}
    assert {
        "base model, no LoRA",
        "PEFT one adapter",
        "PEFT adapter_names, 4 distinct",
        "peft_csgmv, 4 distinct",
    } <= rows
    assert png.stat().st_size > 1000


def test_generate_with_device_map(checkout, tmp_path):
    """``--device-map`` goes through accelerate's loading path (here onto the CPU) and gives the same completions."""
    inp, out, out_map = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "out_map.jsonl"
    _write(inp, PROMPTS[:3])
    assert main(_args(checkout, inp, out)) == 0
    args = _args(checkout, inp, out_map, "--device-map", "cpu")
    i = args.index("--device")
    del args[i : i + 2]
    assert main(args) == 0
    assert {r["line"]: r["completion"] for r in _records(out_map)} == {
        r["line"]: r["completion"] for r in _records(out)
    }


def test_bench_any_config(tmp_path):
    """``--config`` benchmarks any causal-LM config (here a tiny GPT-2 with its own target modules)."""
    from transformers import GPT2Config

    GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0).save_pretrained(tmp_path)
    out = tmp_path / "e2e.json"
    rc = main(["bench", "--config", str(tmp_path), "--targets", "c_attn,c_proj,c_fc", "--adapters", "2", "--distinct",
               "1,2", "--batch", "2", "--prompt", "4", "--new-tokens", "1", "--repeats", "1", "--device", "cpu",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    assert {r["row"] for r in json.loads(out.read_text())["results"]} >= {"peft_csgmv, 2 distinct", "PEFT one adapter"}
