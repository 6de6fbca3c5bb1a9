"""The ``peft-csgmv`` command: demo, batch generation from JSONL (parity with stock PEFT, bad lines, resume by content,
another input refused, error records retried, Ctrl-C, every bad path or adapter one line before the model loads, an
empty input, help texts), bench."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from test_moe_prototype import _has_3d_experts

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
        ids = {k: enc[k] for k in ("input_ids", "attention_mask")}  # not token_type_ids (transformers 4.x adds them)
        adapter = row.get("adapter")
        with torch.no_grad():
            if adapter in (None, "__base__"):
                with model.disable_adapter():
                    seq = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            else:
                model.set_adapter(adapter)
                seq = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
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


def test_generate_with_host_tier_matches_stock_peft(checkout, tmp_path, monkeypatch):
    """``--max-resident-adapters 1``: one adapter on the device at a time (the other in host memory, brought in when a
    batch needs it), no batch with more than one distinct adapter, and stock PEFT's completions."""
    from peft_csgmv import batch, csgmv_stats

    seen, loaded = [], []
    real_batches, real_load = batch.batches_by_length, batch.load_model

    def spy_batches(rows, lengths, batch_size, max_adapters=None):
        out = real_batches(rows, lengths, batch_size, max_adapters)
        seen.extend({rows[i].adapter for i in b} - {None} for b in out)
        return out

    def spy_load(*args, **kwargs):
        model, tok = real_load(*args, **kwargs)
        loaded.append(csgmv_stats(model))
        return model, tok

    monkeypatch.setattr(batch, "batches_by_length", spy_batches)
    monkeypatch.setattr(batch, "load_model", spy_load)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out, "--static-batches", "--max-resident-adapters", "1")) == 0
    (stats,) = loaded
    assert stats["max_resident_adapters"] == 1 and len(stats["resident"]) == 1 and stats["host_bytes"] > 0
    assert seen and all(len(adapters) <= 1 for adapters in seen), seen
    assert {"legal"} in seen and {"chat"} in seen
    records = {r["line"]: r for r in _records(out)}
    assert sorted(records) == list(range(1, len(PROMPTS) + 1))
    for line, want in enumerate(_stock_completions(checkout), start=1):
        assert records[line]["completion"] == want, f"line {line}: {records[line]['completion']!r} != {want!r}"


def test_batches_hold_at_most_max_adapters():
    """Batches of at most ``batch_size`` rows and ``max_adapters`` distinct adapters (base rows take none), every row
    once, rows of one adapter kept together within a prompt bucket; without the cap, plain length order."""
    import random

    from peft_csgmv.batch import Row, batches_by_length, prompt_bucket

    rng = random.Random(0)
    rows = [Row(i, "p", rng.choice([None, "a", "b", "c", "d", "e"])) for i in range(200)]
    lengths = [rng.randint(1, 70) for _ in rows]
    plain = batches_by_length(rows, lengths, 8)
    assert [i for b in plain for i in b] == sorted(range(200), key=lambda i: lengths[i])
    for cap in (1, 2, 5):
        out = batches_by_length(rows, lengths, 8, max_adapters=cap)
        assert sorted(i for b in out for i in b) == list(range(200))
        for b in out:
            assert 1 <= len(b) <= 8 and len({rows[i].adapter for i in b} - {None}) <= cap
        # each adapter's rows of a bucket come in consecutive batches: it moves onto the device once per bucket
        runs = [(prompt_bucket(lengths[i]), rows[i].adapter) for b in out for i in b]
        changes = [key for n, key in enumerate(runs) if n == 0 or runs[n - 1] != key]
        assert len(changes) == len(set(changes)), f"cap {cap}: an adapter's rows split within a bucket"
    with_cap = batches_by_length(rows, lengths, 8, max_adapters=6)
    assert max(len({rows[i].adapter for i in b} - {None}) for b in with_cap) > 1, "a cap above the adapters splits"


def test_adapters_load_in_fp32_as_peft_keeps_them_unless_model_dtype(checkout):
    """``--adapter-dtype fp32`` (the default): on a bf16 model the adapters stay in fp32, as PEFT's
    ``from_pretrained`` keeps them, and csgmv's logits are stock PEFT's for each adapter; ``model``: bf16 adapters."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from peft_csgmv import batch

    base, adapters = checkout
    model, tok = batch.load_model(base, adapters, dtype="bf16", device="cpu")
    lora = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert lora == {torch.float32} and model.get_base_model().dtype == torch.bfloat16
    stock = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    names = list(adapters)
    stock = PeftModel.from_pretrained(stock, adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        stock.load_adapter(adapters[name], adapter_name=name)
    stock.eval()
    enc = tok(["the contract says"] * len(names), return_tensors="pt")
    with torch.no_grad():
        got = model(input_ids=enc["input_ids"], adapter_ids=names).logits
        for i, name in enumerate(names):
            stock.set_adapter(name)
            want = stock(input_ids=enc["input_ids"]).logits[i]
            assert torch.allclose(got[i].float(), want.float(), rtol=0, atol=1e-2), name
            assert not torch.allclose(got[1 - i].float(), want.float(), rtol=0, atol=1e-2), "the adapters agree"
    model, _ = batch.load_model(base, adapters, dtype="bf16", device="cpu", adapter_dtype="model")
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.bfloat16}


def test_generate_static_cache_matches_stock_peft(checkout, tmp_path, static_caches):
    """``--cache-implementation static``: the same completions as stock PEFT's per-prompt runs, prompts padded to a
    power of two and the short last batch filled (what the static cache's shapes need; their outputs dropped). The
    three batches come in two prompt buckets (16 and 32 tokens), and the two of the second share one static cache,
    reset between them (on CUDA the compiled step's graph then replays): csgmv keeps it for calls of one size, as
    transformers releases before 5.x's ``_prepare_static_cache`` did themselves."""
    made = static_caches
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out, "--static-batches", "--cache-implementation", "static")) == 0
    assert len(made) == 2, f"{len(made)} static caches for three batches in two prompt buckets"
    records = {r["line"]: r for r in _records(out)}
    assert sorted(records) == list(range(1, len(PROMPTS) + 1))
    for line, want in enumerate(_stock_completions(checkout), start=1):
        assert records[line]["completion"] == want, f"line {line}: {records[line]['completion']!r} != {want!r}"


def test_static_cache_calls_share_shapes(checkout, tmp_path):
    """On the static cache every ``generate`` call has ``batch_size`` rows (a short last batch filled with copies of
    its last row, adapter included) and a power-of-two prompt length, and only the real rows are written;
    ``cache_implementation`` goes to ``generate`` as given (the static cache itself is csgmv's to keep, see
    :func:`test_generate_static_cache_matches_stock_peft`)."""
    from transformers import AutoTokenizer

    import peft_csgmv.batch as batch

    assert [batch.prompt_bucket(n) for n in (1, 16, 17, 64, 65, 300)] == [16, 16, 32, 64, 128, 512]
    tok = AutoTokenizer.from_pretrained(checkout[0])
    calls = []

    class Model:
        def get_input_embeddings(self):
            return torch.nn.Embedding(2, 2)

        def generate(self, input_ids, attention_mask, adapter_ids, pad_token_id, **kw):
            calls.append((tuple(input_ids.shape), list(adapter_ids), kw))
            return torch.cat([input_ids, torch.full((len(input_ids), 2), 7)], dim=1)

    prompts = ["a b c", "word " * 20, "x", "y y", "z " * 40]
    rows = [batch.Row(line=i + 1, prompt=p, adapter=f"a{i}") for i, p in enumerate(prompts)]
    out = tmp_path / "out.jsonl"
    stats = batch.generate_rows(Model(), tok, rows, str(out), batch_size=3, progress=False,
                                cache_implementation="static", max_new_tokens=2)  # fmt: skip
    assert stats["rows"] == 5 and sorted(r["line"] for r in _records(out)) == [1, 2, 3, 4, 5]
    assert [c[2] for c in calls] == [dict(cache_implementation="static", max_new_tokens=2)] * 2
    (shape1, ids1, kw1), (shape2, ids2, kw2) = calls
    assert shape1[0] == shape2[0] == 3, "a short batch is filled up to the batch size"
    assert {shape1[1], shape2[1]} <= {16, 32, 64, 128} and shape1[1] & (shape1[1] - 1) == 0
    assert shape1[1] != shape2[1], "two prompt buckets"
    assert ids2[1] == ids2[2], "the filler row repeats the last row (its adapter too)"
    calls.clear()
    batch.generate_rows(Model(), tok, rows[:2], str(tmp_path / "dynamic.jsonl"), batch_size=3, progress=False)
    assert calls[0][0][0] == 2, "the dynamic cache takes the batch as it is"


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


def test_demo_agrees(capsys):
    assert main(["demo", "--device", "cpu"]) == 0
    assert "on cpu csgmv runs its plain-torch backend" in capsys.readouterr().out


def test_bench_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "e2e.json", tmp_path / "e2e.png"
    rc = main(["bench", "--model", "tiny", "--adapters", "4", "--distinct", "1,4", "--batch", "4", "--prompt", "8",
               "--new-tokens", "2", "--repeats", "1", "--device", "cpu",
               "--out", str(out), "--plot", str(png)])  # fmt: skip
    assert rc == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("bench on the cpu: csgmv runs its plain-torch backend") and "a minute or two" in first
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["rounds"] == 1  # the CPU default
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


def test_bench_moe_layout(tmp_path):
    """A MoE layout puts LoRA on the experts too (``target_parameters``) and skips PEFT ``adapter_names`` (which
    refuses expert LoRA); ``--layers`` cuts the layer count and the label says so."""
    out = tmp_path / "e2e.json"
    rc = main(["bench", "--model", "tiny-moe", "--layers", "1", "--adapters", "2", "--distinct", "1,2", "--batch", "2",
               "--prompt", "4", "--new-tokens", "1", "--repeats", "1", "--device", "cpu",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["meta"]["args"]["moe"] and data["meta"]["label"] == "tiny-moe (1 of 2 layers)"
    rows = {r["row"] for r in data["results"]}
    assert {"base model, no LoRA", "PEFT one adapter", "peft_csgmv, 2 distinct"} <= rows
    assert not any(r.startswith("PEFT adapter_names") for r in rows)
    assert all(r["decode_ms"] == r["decode_ms"] for r in data["results"])  # no NaN


def test_bench_crop_cache_rolls_back_sliding_window_layers():
    """The decode step is timed on the prompt's KV cache, cut back before each step (``crop_cache``). gpt-oss's
    sliding-window layers, past their window, are cut back too (transformers 5 refuses unless they record their
    past): every step sees the prompt's cache and gives the same logits as a step on a fresh prefill."""
    from peft_csgmv._compat import cache_kwarg, output_cache
    from peft_csgmv.bench import build_model, crop_cache, decode_inputs

    model = build_model("tiny-gpt-oss", torch.device("cpu"), torch.float32)
    assert model.config.sliding_window == 4 and "sliding_attention" in model.config.layer_types
    input_ids, mask, step_ids, step_mask = decode_inputs(model.config.vocab_size, 2, 9, torch.device("cpu"))
    cache_name = cache_kwarg(model)

    def step(cache):
        return model(input_ids=step_ids, attention_mask=step_mask, use_cache=True, **{cache_name: cache}).logits

    with torch.no_grad():
        fresh = step(output_cache(model(input_ids=input_ids, attention_mask=mask, use_cache=True)))
        cache = output_cache(model(input_ids=input_ids, attention_mask=mask, use_cache=True))
        for _ in range(3):
            crop_cache(cache, 9)
            assert cache.get_seq_length() == 9
            torch.testing.assert_close(step(cache), fresh, rtol=0, atol=0)


@pytest.mark.skipif(not _has_3d_experts(), reason="needs transformers' 3D experts and PEFT's target_parameters")
def test_bench_sliding_window_layout(tmp_path):
    """The gpt-oss layout (sliding-window layers, a prompt past the window) runs the whole bench."""
    out = tmp_path / "e2e.json"
    rc = main(["bench", "--model", "tiny-gpt-oss", "--adapters", "2", "--distinct", "1,2", "--batch", "2",
               "--prompt", "8", "--new-tokens", "1", "--repeats", "2", "--device", "cpu",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    rows = {r["row"] for r in data["results"]}
    assert {"base model, no LoRA", "PEFT one adapter", "peft_csgmv, 2 distinct"} <= rows
    assert all(r["decode_ms"] == r["decode_ms"] for r in data["results"])  # no NaN


# --- argument checks: each problem one line naming the argument, exit 2, before the model loads ---------------------


@pytest.fixture
def no_model_load(monkeypatch):
    import peft_csgmv.batch as batch

    def refuse(*a, **kw):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(batch, "load_model", refuse)


def _errors(err):
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and all(line.startswith("peft-csgmv generate: error: ") for line in lines), err
    assert "Traceback" not in err
    return [line[len("peft-csgmv generate: error: ") :] for line in lines]


def _replace(args, option, value):
    args = list(args)
    args[args.index(option) + 1] = value
    return args


def test_bad_paths_each_one_line_before_the_model_loads(checkout, tmp_path, capsys, no_model_load):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS[:2])
    good = _args(checkout, inp, out)
    base, adapters = checkout
    cases = {
        "--input": (_replace(good, "--input", str(tmp_path / "missing.jsonl")), "no such file"),
        "--input ": (_replace(good, "--input", str(tmp_path)), "is a folder"),
        "--output": (_replace(good, "--output", str(tmp_path / "no_dir" / "out.jsonl")), "does not exist"),
        "--output ": (_replace(good, "--output", str(tmp_path)), "is a folder"),
        "--output  ": (_replace(good, "--output", str(inp)), "is the --input file"),
        "--base": (_replace(good, "--base", str(tmp_path / "no_model")), "no such folder"),
        "--base ": (_replace(good, "--base", str(tmp_path)), "no config.json"),
        "--adapter legal=": (
            _replace(good, "--adapter", f"legal={tmp_path / 'no_adapter'}"),
            "no such folder",
        ),
        "--adapter legal= ": (_replace(good, "--adapter", f"legal={base}"), "no adapter_config.json"),
        "--device": (good + ["--device", "nonsense"], "not a device"),
        "--device ": (good + ["--device-map", "cpu"], "give one of them"),
        "--output   ": (_replace(good, "--output", str(tmp_path / "o.jsonl")), "where the run's settings are kept"),
    }
    (tmp_path / "o.jsonl.settings.json").mkdir()
    for start, (args, words) in cases.items():
        assert main(args) == 2, start
        (problem,) = _errors(capsys.readouterr().err)
        assert problem.startswith(start.strip()) and words in problem, (start, problem)
    assert not out.exists()
    # Several problems at once: every one, one line each.
    args = _replace(_replace(good, "--input", str(tmp_path / "missing.jsonl")), "--output", str(tmp_path))
    args += ["--adapter", f"code={tmp_path / 'nope'}", "--adapter", f"legal={adapters['legal']}"]
    assert main(args) == 2
    problems = _errors(capsys.readouterr().err)
    assert [p.split(":")[0] for p in problems] == [
        "--adapter legal=...",
        f"--input {tmp_path / 'missing.jsonl'}",
        f"--output {tmp_path}",
        f"--adapter code={tmp_path / 'nope'}",
    ]


def test_adapter_folder_of_a_nested_save_is_pointed_to(checkout, tmp_path, capsys, no_model_load):
    """``save_pretrained`` puts a non-default adapter in a sub-folder: the message names the folder to give."""
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS[:1])
    base, adapters = checkout
    parent = os.path.dirname(adapters["legal"])
    assert main(_replace(_args(checkout, inp, tmp_path / "o.jsonl"), "--adapter", f"legal={parent}")) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert problem.startswith(f"--adapter legal={parent}: no adapter_config.json") and adapters["legal"] in problem


def test_hub_id_that_is_no_repo_is_one_line_before_the_model_loads(checkout, tmp_path, capsys, monkeypatch):
    """A value that is no local folder but looks like a hub id is looked up with one request (here the hub is out of
    reach) before the model loads."""
    import huggingface_hub

    import peft_csgmv.batch as batch

    def offline(self, repo, filename, **kw):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "file_exists", offline)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(batch, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS[:1])
    args = _replace(_args(checkout, inp, tmp_path / "o.jsonl"), "--adapter", "legal=adapters/legal")
    assert main(args) == 2
    err = capsys.readouterr().err
    (problem,) = [line for line in err.splitlines() if "error:" in line]
    assert problem.startswith("peft-csgmv generate: error: --adapter legal=adapters/legal: no such local folder")
    assert "ConnectionError" in problem
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1: no request at all
    assert main(args) == 2
    (problem,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert problem.endswith("--adapter legal=adapters/legal: no such local folder, and not in the hub cache (offline)")
    assert not (tmp_path / "o.jsonl").exists()


def test_bad_numbers_refused_by_the_parser(checkout, tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS[:1])
    for option, value in [
        ("--batch-size", "0"),
        ("--max-new-tokens", "-1"),
        ("--top-p", "1.5"),
        ("--temperature", "0"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(_args(checkout, inp, tmp_path / "o.jsonl", option, value))
        assert e.value.code == 2
        assert f"argument {option}: expected" in capsys.readouterr().err


def test_empty_input_says_so_and_writes_nothing(checkout, tmp_path, capsys, no_model_load):
    out = tmp_path / "out.jsonl"
    for text in ["", "\n  \n\n"]:
        inp = tmp_path / "in.jsonl"
        inp.write_text(text)
        assert main(_args(checkout, inp, out)) == 0
        assert capsys.readouterr().err.strip() == "input has no lines: nothing to do"
        assert not out.exists()


# --- resume by content --------------------------------------------------------------------------------------------


@pytest.fixture
def generated(monkeypatch):
    """The input lines each run generates (a spy on batch.generate_rows)."""
    import peft_csgmv.batch as batch

    runs = []
    real = batch.generate_rows

    def spy(model, tokenizer, rows, *a, **kw):
        runs.append(sorted(r.line for r in rows))
        return real(model, tokenizer, rows, *a, **kw)

    monkeypatch.setattr(batch, "generate_rows", spy)
    return runs


def _in_input_order(path, n):
    records = _records(path)
    assert [r["line"] for r in records] == list(range(1, n + 1)), "one record per input line, in input order"
    return records


def test_another_input_is_refused_in_one_line(checkout, tmp_path, capsys, generated):
    inp, other, out = tmp_path / "in.jsonl", tmp_path / "other.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS[:4])
    _write(other, [{"prompt": f"something else {i}", "adapter": "chat"} for i in range(5)])
    assert main(_args(checkout, inp, out)) == 0
    before = out.read_text()
    capsys.readouterr()
    assert main(_args(checkout, other, out)) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert problem.startswith(f"--output {out}: it holds 4 results, none for a line of this input") and (
        "--overwrite" in problem
    )
    assert out.read_text() == before and generated == [[1, 2, 3, 4]]
    assert main(_args(checkout, other, out, "--overwrite")) == 0
    records = _in_input_order(out, 5)
    assert generated[-1] == [1, 2, 3, 4, 5] and all(r["adapter"] == "chat" for r in records)


def test_a_file_that_is_no_output_is_refused_not_truncated(checkout, tmp_path, capsys, no_model_load):
    inp, out = tmp_path / "in.jsonl", tmp_path / "notes.txt"
    _write(inp, PROMPTS[:2])
    out.write_text("my notes\nsecond line\n")
    assert main(_args(checkout, inp, out)) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert problem.startswith(f"--output {out}: line 1 is not a peft-csgmv result record")
    assert out.read_text() == "my notes\nsecond line\n"


def test_edited_lines_are_generated_again_and_the_rest_resumed(checkout, tmp_path, capsys, generated):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = [dict(r) for r in PROMPTS]
    _write(inp, rows)
    assert main(_args(checkout, inp, out)) == 0
    first = {r["line"]: r for r in _in_input_order(out, len(rows))}
    rows[2] = {"prompt": "an edited prompt", "adapter": "legal"}
    _write(inp, rows[:6])  # line 3 edited, line 7 gone
    capsys.readouterr()
    assert main(_args(checkout, inp, out)) == 0
    assert generated[-1] == [3]
    assert "2 results dropped" in capsys.readouterr().err
    records = {r["line"]: r for r in _in_input_order(out, 6)}
    assert records[3]["adapter"] == "legal" and records[3]["completion"] != first[3]["completion"]
    assert all(records[n] == first[n] for n in (1, 2, 4, 5, 6))
    assert main(_args(checkout, inp, out)) == 0 and len(generated) == 2, "nothing left to do"


def test_error_records_are_retried_once_the_input_is_fixed(checkout, tmp_path, capsys, generated):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [PROMPTS[0], "{broken", PROMPTS[2], {"prompt": "x", "adapter": "nope"}]
    _write(inp, lines)
    assert main(_args(checkout, inp, out, "--on-error", "skip")) == 0
    records = _in_input_order(out, 4)
    assert ["error" in r for r in records] == [False, True, False, True]
    # Unchanged input: the bad lines are read again (and are still bad), nothing is generated.
    assert main(_args(checkout, inp, out, "--on-error", "skip")) == 0
    assert generated == [[1, 3]] and _records(out) == records
    # Fixed input: those lines are generated now, the others are kept.
    lines[1], lines[3] = PROMPTS[1], {"prompt": "x", "adapter": "chat"}
    _write(inp, lines)
    capsys.readouterr()
    assert main(_args(checkout, inp, out)) == 0
    assert "2 error records from an earlier run" in capsys.readouterr().err
    assert generated[-1] == [2, 4]
    fixed = _in_input_order(out, 4)
    assert all("completion" in r for r in fixed) and fixed[0] == records[0] and fixed[2] == records[2]


def test_ctrl_c_stops_in_one_line_and_a_rerun_finishes(checkout, tmp_path, capsys, monkeypatch, generated):
    """Static batches, Ctrl-C during the second batch: exit 130, one line, the first batch's records kept (complete
    lines); the same command again generates only the rest, and the result equals an uninterrupted run's."""
    import peft_csgmv.batch as batch

    inp, out, full = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "full.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, full)) == 0
    real_load = batch.load_model
    seen_inputs = []

    def load_then_break(*a, **kw):
        model, tokenizer = real_load(*a, **kw)
        real_generate = model.generate

        def generate(**kwargs):
            seen_inputs.append(sorted(k for k, v in kwargs.items() if isinstance(v, torch.Tensor)))
            if len(seen_inputs) == 2:
                raise KeyboardInterrupt
            return real_generate(**kwargs)

        model.generate = generate
        return model, tokenizer

    monkeypatch.setattr(batch, "load_model", load_then_break)
    capsys.readouterr()
    assert main(_args(checkout, inp, out, "--static-batches")) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted: rerun the same command to resume" and "Traceback" not in err
    assert seen_inputs[0] == ["attention_mask", "input_ids"], "generate gets the ids and the mask only"
    kept = _records(out)
    assert len(kept) == 3 and out.read_text().endswith("\n"), "the first batch (3 rows), complete lines"
    monkeypatch.setattr(batch, "load_model", real_load)
    assert main(_args(checkout, inp, out, "--static-batches")) == 0
    assert generated[-1] == sorted(set(range(1, len(PROMPTS) + 1)) - {r["line"] for r in kept})
    assert _in_input_order(out, len(PROMPTS)) == _records(full)


def _summary(err):
    """The command's count line: ``N lines: T to generate, D already done, ...``."""
    (line,) = [line for line in err.splitlines() if " lines: " in line and "to generate" in line]
    return line


def _by_request(path):
    return {r["input_sha1"]: r["completion"] for r in _records(path)}


def test_inserted_deleted_and_blank_lines_shift_nothing(checkout, tmp_path, capsys, generated):
    """Resuming goes by each line's request, not its line number: blank lines added, a line inserted above the others
    and one deleted, the rest moved down. Only the inserted line is generated; every other line keeps its earlier
    completion, and the output's ``line`` and ``id`` are those of the input now."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out)) == 0
    first = _by_request(out)
    assert len(first) == len(PROMPTS)
    # Blank lines only: nothing to generate; the records say the lines where they are now.
    _write(inp, ["", PROMPTS[0], "   ", "", *PROMPTS[1:], ""])
    capsys.readouterr()
    assert main(_args(checkout, inp, out)) == 0
    assert _summary(capsys.readouterr().err).startswith("7 lines: 0 to generate, 7 already done")
    assert len(generated) == 1
    assert [r["line"] for r in _records(out)] == [2, 5, 6, 7, 8, 9, 10] and _by_request(out) == first
    # A new line inserted first, PROMPTS[4] deleted, blank lines in between; PROMPTS[2] gets another id.
    new = {"prompt": "an inserted prompt", "adapter": "chat", "id": "new"}
    renumbered = dict(PROMPTS[2], id=8)
    lines = [new, "", PROMPTS[0], PROMPTS[1], "", renumbered, PROMPTS[3], PROMPTS[5], "", PROMPTS[6]]
    _write(inp, lines)
    assert main(_args(checkout, inp, out)) == 0
    err = capsys.readouterr().err
    assert _summary(err).startswith("7 lines: 1 to generate, 6 already done") and "1 results dropped" in err
    assert generated[-1] == [1], "only the inserted line is generated"
    records = _records(out)
    rows = [(n, x) for n, x in enumerate(lines, start=1) if x != ""]
    assert [r["line"] for r in records] == [n for n, _ in rows], "one record per input line, in input order"
    for record, (_, row) in zip(records, rows):
        assert ("id" in record) == ("id" in row) and record.get("id") == row.get("id")
        if row is not new:
            assert record["completion"] == first[record["input_sha1"]], row
    assert records[0]["adapter"] == "chat" and records[0]["input_sha1"] not in first
    assert main(_args(checkout, inp, out)) == 0 and len(generated) == 2, "nothing left to do"


def test_duplicate_lines_each_get_a_completion(checkout, tmp_path, capsys, generated):
    """The same request on k lines needs k completions (here sampled, so each its own): a record stays with the line
    it was written for while that line holds the same request; the others go, in order, to the other lines of that
    request; records beyond k are dropped."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    same, other = {"prompt": "say it again", "adapter": "legal"}, {"prompt": "something else", "adapter": None}
    sample = ["--do-sample", "--seed", "3"]
    _write(inp, [same, same])
    assert main(_args(checkout, inp, out, *sample)) == 0
    c1, c2 = [r["completion"] for r in _records(out)]
    assert c1 != c2, "two samples of one prompt"
    # An interrupted run leaves its records in finishing order: each still goes to the line it was written for.
    out.write_text("".join(reversed(out.read_text().splitlines(keepends=True))))
    assert main(_args(checkout, inp, out, *sample)) == 0 and len(generated) == 1
    assert [(r["line"], r["completion"]) for r in _records(out)] == [(1, c1), (2, c2)]
    _write(inp, [same, other, same, same])
    capsys.readouterr()
    assert main(_args(checkout, inp, out, *sample)) == 0
    assert _summary(capsys.readouterr().err).startswith("4 lines: 2 to generate, 2 already done")
    assert generated[-1] == [2, 4]
    records = _records(out)
    assert [r["line"] for r in records] == [1, 2, 3, 4]
    assert records[0]["completion"] == c1 and records[2]["completion"] == c2
    assert records[0]["input_sha1"] == records[2]["input_sha1"] == records[3]["input_sha1"]
    # Fewer copies: the first two of the three kept, the third dropped with the other line's.
    _write(inp, [same, same])
    assert main(_args(checkout, inp, out, *sample)) == 0
    assert "2 results dropped" in capsys.readouterr().err and len(generated) == 2
    assert [(r["line"], r["completion"]) for r in _records(out)] == [(1, c1), (2, c2)]


def test_changed_settings_refused_naming_them_and_overwrite_reruns(checkout, tmp_path, capsys, generated):
    """A rerun with another ``--max-new-tokens`` (or sampling) is refused before anything runs, in one line naming the
    setting, the output and its settings file untouched; ``--overwrite`` starts over with the new settings. Options
    that change how the work runs, not what it computes, are no difference, nor is the base model named by another
    path to the same folder."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    saved = tmp_path / "out.jsonl.settings.json"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out)) == 0
    stored = json.loads(saved.read_text())
    assert stored["settings"]["max_new_tokens"] == 6 and set(stored["adapters"]) == set(RANKS)
    before, settings_before = out.read_bytes(), saved.read_bytes()
    capsys.readouterr()

    assert main(_args(checkout, inp, out, "--max-new-tokens", "4")) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert problem == (
        f"--output {out}: written with max_new_tokens=6; this run has max_new_tokens=4; give another --output, "
        "or --overwrite to start it afresh"
    )
    assert main(_args(checkout, inp, out, "--do-sample")) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert "written with do_sample=false; this run has do_sample=true" in problem
    assert out.read_bytes() == before and saved.read_bytes() == settings_before and len(generated) == 1

    # How the work runs is no difference (greedy decoding reads no seed nor temperature either).
    base = checkout[0]
    same = ["--batch-size", "2", "--backend", "torch", "--cache-implementation", "static", "--seed", "5",
            "--temperature", "0.5", "--max-resident-adapters", "1", "--on-error", "skip"]  # fmt: skip
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        args = _replace(_args(checkout, inp, out, *same), "--base", os.path.relpath(base))
        assert main(args) == 0
    finally:
        os.chdir(cwd)
    assert _summary(capsys.readouterr().err).startswith("7 lines: 0 to generate, 7 already done")
    assert out.read_bytes() == before and len(generated) == 1

    # Without its settings file the records still decide: the same settings resume (and the file is written again),
    # others are refused, without naming them.
    saved.unlink()
    assert main(_args(checkout, inp, out, "--max-new-tokens", "4")) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert "its results were made with other settings than this run's" in problem and "is missing" in problem
    assert main(_args(checkout, inp, out)) == 0
    assert saved.read_bytes() == settings_before and len(generated) == 1

    assert main(_args(checkout, inp, out, "--max-new-tokens", "4", "--overwrite")) == 0
    assert generated[-1] == list(range(1, len(PROMPTS) + 1))
    records = _in_input_order(out, len(PROMPTS))
    assert all(r["new_tokens"] <= 4 for r in records) and any(r["new_tokens"] == 4 for r in records)
    assert json.loads(saved.read_text())["settings"]["max_new_tokens"] == 4
    assert main(_args(checkout, inp, out, "--max-new-tokens", "4")) == 0 and len(generated) == 2


def test_changed_adapter_weights_refused_naming_the_adapter(checkout, tmp_path, capsys, generated):
    """An adapter is its files' bytes: the same bytes in another folder are the same adapter, an adapter added to the
    run concerns no earlier result, but other weights under the same name are refused, naming that adapter only."""
    import shutil

    from safetensors.torch import load_file, save_file

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    legal, moved = tmp_path / "legal", tmp_path / "elsewhere" / "legal"
    shutil.copytree(checkout[1]["legal"], legal)
    shutil.copytree(legal, moved)
    _write(inp, PROMPTS)
    assert main(_replace(_args(checkout, inp, out), "--adapter", f"legal={legal}")) == 0
    before = out.read_bytes()
    assert main(_replace(_args(checkout, inp, out), "--adapter", f"legal={moved}")) == 0
    args = _replace(_args(checkout, inp, out), "--adapter", f"legal={legal}") + ["--adapter", f"code={moved}"]
    assert main(args) == 0
    assert out.read_bytes() == before and len(generated) == 1

    weights = legal / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v * 2 if "lora_B" in k else v for k, v in tensors.items()}, str(weights), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(_replace(_args(checkout, inp, out), "--adapter", f"legal={legal}")) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert (
        problem.startswith(f"--output {out}: written with adapter legal=") and "this run has adapter legal=" in problem
    )
    assert "chat" not in problem and "--overwrite" in problem
    assert out.read_bytes() == before and len(generated) == 1
    assert main(_replace(_args(checkout, inp, out, "--overwrite"), "--adapter", f"legal={legal}")) == 0
    assert generated[-1] == list(range(1, len(PROMPTS) + 1))
    first = {r["line"]: r for r in map(json.loads, before.decode().splitlines())}
    changed = [
        r["line"] for r in _in_input_order(out, len(PROMPTS)) if r["completion"] != first[r["line"]]["completion"]
    ]
    assert changed and all(PROMPTS[n - 1].get("adapter") == "legal" for n in changed), changed


def test_output_without_settings_refused_unless_it_holds_only_error_records(checkout, tmp_path, capsys, generated):
    """An output whose completion records carry no ``settings_sha1`` (an earlier format) is refused in one line (which
    settings made them is unknown), untouched; ``--overwrite`` starts over. One holding only error records is no
    loss to start over: it is resumed."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS[:3])
    old = [{"line": n, "adapter": None, "completion": "old", "new_tokens": 1, "input_sha1": "0" * 40} for n in (1, 2)]
    out.write_text("".join(json.dumps(r) + "\n" for r in old))
    before = out.read_text()
    assert main(_args(checkout, inp, out)) == 2
    (problem,) = _errors(capsys.readouterr().err)
    assert problem.startswith(f"--output {out}: its results carry no settings_sha1") and "--overwrite" in problem
    assert out.read_text() == before and not generated
    assert not (tmp_path / "out.jsonl.settings.json").exists()
    assert main(_args(checkout, inp, out, "--overwrite")) == 0 and generated == [[1, 2, 3]]
    assert all("completion" in r and r["settings_sha1"] for r in _in_input_order(out, 3))

    errors_only = tmp_path / "errors.jsonl"
    errors_only.write_text(json.dumps({"line": 2, "error": "not valid JSON", "input_sha1": "0" * 40}) + "\n")
    assert main(_args(checkout, inp, errors_only)) == 0 and generated[-1] == [1, 2, 3]
    assert all("completion" in r for r in _in_input_order(errors_only, 3))


def test_adapter_fingerprint_reads_the_files_peft_loads(checkout, monkeypatch):
    """An adapter's fingerprint is over its config and weights file, wherever they lie: a hub id's come from the hub
    cache (here a stand-in for ``hf_hub_download``), and one that cannot be fetched is one line naming the adapter."""
    import huggingface_hub

    from peft_csgmv import identity

    legal = checkout[1]["legal"]
    fetched = []

    def download(repo, filename, **kw):
        fetched.append((repo, filename))
        return os.path.join(legal, filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    assert identity.adapter_sha1("org/legal") == identity.adapter_sha1(legal)
    assert fetched == [("org/legal", "adapter_config.json"), ("org/legal", "adapter_model.safetensors")]
    assert identity.adapter_sha1(legal) != identity.adapter_sha1(checkout[1]["chat"])

    def offline(repo, filename, **kw):
        raise OSError("no connection")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(identity.SettingsError, match=r"^--adapter legal=org/legal: its files could not be read "):
        identity.run_settings(checkout[0], {"legal": "org/legal"}, max_new_tokens=4)
    greedy = identity.run_settings(checkout[0], {"legal": legal}, max_new_tokens=4, seed=1, temperature=0.5)
    assert greedy.fields == identity.run_settings(checkout[0], {"legal": legal}, max_new_tokens=4).fields
    assert "seed" not in greedy.fields, "greedy decoding reads no seed"
    sampled = identity.run_settings(checkout[0], {"legal": legal}, max_new_tokens=4, do_sample=True, seed=1)
    assert sampled.fields["seed"] == 1 and sampled.fingerprint("legal") != greedy.fingerprint("legal")
    assert greedy.fingerprint(None) != greedy.fingerprint("legal")


# --- help ---------------------------------------------------------------------------------------------------------


def test_every_generate_option_has_help_and_its_default(capsys):
    from peft_csgmv.cli import build_parser

    parser, subparsers = build_parser()
    for action in subparsers["generate"]._actions:
        if "-h" in action.option_strings:
            continue
        text = subparsers["generate"]._get_formatter()._get_help_string(action)
        assert len(action.help or "") > 10, action.option_strings
        assert "(required)" in text if action.required else "default" in text, (action.option_strings, text)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "(default: 16)" in text and "(default: 128)" in text and "input_sha1" in text and "settings_sha1" in text
    with pytest.raises(SystemExit):
        main(["--help"])
    top = capsys.readouterr().out
    assert "``" not in top and ":func:" not in top and "generate" in top


def _console_script():
    path = os.path.join(os.path.dirname(sys.executable), "peft-csgmv")
    if not os.path.exists(path) or not os.path.isdir("/proc/self"):
        pytest.skip("needs the installed peft-csgmv script and /proc")
    return path


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(args, ready, timeout=120):
    """Start the command, wait until ``ready(pid)``, send SIGINT; return (exit status, stderr). The command starts with
    Ctrl-C's default disposition, as from a terminal, whatever the test run's own is (a shell starts background jobs
    with SIGINT ignored, which a child inherits, and Python then installs no handler for it)."""
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready(proc.pid):
            assert proc.poll() is None, f"finished before the signal: {proc.communicate()[1]}"
            assert time.monotonic() < deadline, "never got ready"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        return proc.wait(timeout=timeout), proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()


def test_real_ctrl_c_while_importing_and_while_generating(checkout, tmp_path):
    """SIGINT to the real command, once while it still imports torch and friends, once after its first batch: each
    time one line and exit status 130, no traceback; the same command then finishes the rest."""
    script = _console_script()
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    adapters = [None, "legal", "chat"]
    _write(inp, [{"prompt": f"prompt {i} " + "x" * (i % 20), "adapter": adapters[i % 3]} for i in range(60)])
    args = [script] + _args(checkout, inp, out, "--max-new-tokens", "16")

    def importing_torch(pid):
        with open(f"/proc/{pid}/maps") as maps:
            return "libtorch" in maps.read()

    def first_batch_written(pid):
        return out.exists() and out.stat().st_size > 0

    for ready in (importing_torch, first_batch_written):
        status, err = _interrupt(args, ready)
        assert status == 130, err
        assert err.strip().splitlines()[-1] == "interrupted: rerun the same command to resume", err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    kept = _records(out)
    assert 0 < len(kept) < 60 and out.read_text().endswith("\n")
    assert main(_args(checkout, inp, out, "--max-new-tokens", "16")) == 0
    records = _in_input_order(out, 60)
    assert all("completion" in r for r in records)


def test_an_error_raised_while_ctrl_c_is_handled_is_an_interrupt(monkeypatch, capsys):
    """Ctrl-C inside torch's vmap (transformers' masks) raises KeyboardInterrupt there, and torch's cleanup then raises
    a RuntimeError while it is handled: the command stops with its one line and 130 all the same; any other error is
    raised as it is."""
    from peft_csgmv import cli

    def interrupted_inside_torch(args, prog):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RuntimeError("!dynamicLayerStack.empty() INTERNAL ASSERT FAILED") from None

    monkeypatch.setattr(cli, "generate_command", interrupted_inside_torch)
    argv = ["generate", "--base", "b", "--adapter", "a=p", "--input", "i", "--output", "o"]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip().splitlines()[-1] == "interrupted: rerun the same command to resume"

    def failed(args, prog):
        raise RuntimeError("a real error")

    monkeypatch.setattr(cli, "generate_command", failed)
    with pytest.raises(RuntimeError, match="a real error"):
        cli.main(argv)


LIMITS = {1: 2, 3: 4, 5: 1, 6: 9}  # input line -> its own max_new_tokens (the run's: 6)


def _limited(rows):
    return [dict(r, **({"max_new_tokens": LIMITS[n]} if n in LIMITS else {})) for n, r in enumerate(rows, start=1)]


@pytest.fixture(scope="module")
def whole_completions(checkout, tmp_path_factory):
    """PROMPTS by static batches with the run's limit for every line, 6 and 9: {limit: {line: record}}."""
    folder = tmp_path_factory.mktemp("limits")
    plain = folder / "in.jsonl"
    _write(plain, PROMPTS)
    whole = {}
    for limit in (6, 9):
        out = folder / f"out{limit}.jsonl"
        args = _args(checkout, plain, out, "--static-batches")
        args[args.index("--max-new-tokens") + 1] = str(limit)
        assert main(args) == 0
        whole[limit] = {r["line"]: r for r in _records(out)}
    return whole


@pytest.mark.parametrize(
    "extra",
    [[], ["--static-batches"], ["--static-batches", "--cache-implementation", "static"]],
    ids=["default", "static-batches", "static-cache"],
)
def test_a_line_with_its_own_max_new_tokens(checkout, tmp_path, whole_completions, extra):
    """A line's "max_new_tokens" replaces --max-new-tokens for it, below or above the run's: its completion is the
    first that many tokens of the completion with a larger limit (greedy, fp32), by the default batching and by
    static batches (which decode until a batch's largest limit, on the static cache until the next power of two, and
    cut each row to its own); lines without one keep the run's."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, _limited(PROMPTS))
    assert main(_args(checkout, inp, out, *extra)) == 0
    got = {r["line"]: r for r in _records(out)}
    assert sorted(got) == list(range(1, len(PROMPTS) + 1))
    for line, record in got.items():
        limit = LIMITS.get(line, 6)
        whole = whole_completions[max(limit, 6)][line]
        assert whole["completion"].startswith(record["completion"]), (line, record, whole)
        assert record["new_tokens"] == min(limit, whole["new_tokens"]), (line, record, whole)
    six = whole_completions[6]
    assert any(got[n]["new_tokens"] < six[n]["new_tokens"] for n in LIMITS if LIMITS[n] < 6), "no limit cut anything"
    assert got[6]["new_tokens"] > six[6]["new_tokens"], "the larger limit added nothing: the test proves nothing"


def test_a_changed_line_limit_regenerates_that_line(checkout, tmp_path, capsys, generated):
    """The line's own limit is part of its request's fingerprint: changing it regenerates that line alone; a line
    without one keeps the fingerprint of its prompt and adapter (outputs written before limits existed resume)."""
    from peft_csgmv import identity

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = _limited(PROMPTS)
    _write(inp, rows)
    assert main(_args(checkout, inp, out)) == 0
    records = {r["line"]: r for r in _records(out)}
    assert records[2]["input_sha1"] == identity.request_sha1(PROMPTS[1]["prompt"], None)
    rows[0] = dict(rows[0], max_new_tokens=3)
    _write(inp, rows)
    assert main(_args(checkout, inp, out)) == 0
    assert generated[-1] == [1]
    assert {r["line"]: r for r in _records(out)}[1]["new_tokens"] <= 3


def test_bad_line_limits_are_bad_lines(checkout, tmp_path, capsys):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bad = [0, -3, "5", 2.5, True, [4]]
    _write(inp, [PROMPTS[0]] + [{"prompt": "x", "max_new_tokens": value} for value in bad])
    assert main(_args(checkout, inp, out)) == 2
    err = capsys.readouterr().err
    for n, value in enumerate(bad, start=2):
        assert f"line {n}: 'max_new_tokens' must be a positive integer, got {value!r}" in err, err
    assert not out.exists()
