"""``peft-csgmv generate`` by continuous batching, its default: the same greedy completions as ``--static-batches``
(fp32) over mixed adapters and base lines of uneven lengths, prefills split over steps and requests waiting for a
place; each record written as its request finishes, so an interrupted run resumes from what finished; a failed
request stops the run in one line; static batches taken, with a one-line note, where continuous batching cannot do
what the run asks; sizing flags refused where they cannot apply; the batching mode is no part of a result's
identity."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from peft_csgmv import batch
from peft_csgmv.cli import main
from peft_csgmv.continuous import continuous_batching_available
from peft_csgmv.toy import save_toy_checkout

pytestmark = pytest.mark.skipif(
    not continuous_batching_available(), reason="this transformers has no continuous batching (transformers >= 5)"
)

ADAPTERS = ["legal", None, "chat", "__base__", "chat", "legal", None, "legal", "chat"]
# Uneven prompts: 1 character to a few hundred (the longest over one 256-token cache block, and over a step).
TEXTS = ["a", "hello there", "the contract says " * 16, "yo", "good day to you, sir", "x " * 140, "ok",
         "what the parties agree on", "q"]  # fmt: skip
PROMPTS = [{"prompt": text, "adapter": adapter, "id": i} for i, (text, adapter) in enumerate(zip(TEXTS, ADAPTERS))]
NOTE = "static batches, not continuous batching: "


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    return save_toy_checkout(str(tmp_path_factory.mktemp("toy")), {"legal": 4, "chat": 8})


def _args(checkout, inp, out, *extra, new_tokens=7):
    base, adapters = checkout
    args = ["generate", "--base", base, "--input", str(inp), "--output", str(out), "--max-new-tokens",
            str(new_tokens), "--no-progress", "--device", "cpu", *extra]  # fmt: skip
    for name, path in adapters.items():
        args += ["--adapter", f"{name}={path}"]
    return args


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _mode(err):
    """The batching the run's count line says it used."""
    (line,) = [line for line in err.splitlines() if line.startswith("wrote ")]
    return "continuous" if "continuous batching)" in line else "static" if "static batches)" in line else line


@pytest.fixture
def generated(monkeypatch):
    """Each run's lines and whether it ran continuous batching (a spy on batch.generate_rows)."""
    runs = []
    real = batch.generate_rows

    def spy(model, tokenizer, rows, *a, **kw):
        runs.append((sorted(r.line for r in rows), kw.get("continuous") is not None))
        return real(model, tokenizer, rows, *a, **kw)

    monkeypatch.setattr(batch, "generate_rows", spy)
    return runs


@pytest.fixture(scope="module")
def static_reference(checkout, tmp_path_factory):
    """The --static-batches output of PROMPTS (fp32, greedy), and its input."""
    folder = tmp_path_factory.mktemp("reference")
    inp, out = folder / "in.jsonl", folder / "static.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out, "--static-batches", "--batch-size", "4")) == 0
    return inp, out


@pytest.mark.parametrize(
    "sizing",
    [[], ["--max-batch-tokens", "16", "--batch-size", "2"], ["--num-blocks", "4"], ["--max-resident-adapters", "1"]],
    ids=["defaults", "split-prefills-two-per-step", "four-blocks", "host-tier-one-resident"],
)
def test_continuous_batching_writes_what_static_batches_write(checkout, static_reference, tmp_path, capsys, sizing):
    """The default run, continuous batching, writes byte for byte the --static-batches output (fp32, greedy): mixed
    adapters and base lines, prompts from 1 to 280 tokens. Also with 16-token steps (each long prefill split over
    steps beside other requests' decode tokens) and two requests per step at most (the others wait and join as
    requests finish), with a cache of four blocks (requests wait for blocks), and with one adapter resident at a time
    (the host tier: requests of another adapter wait until the running ones finish)."""
    inp, reference = static_reference
    completions = [r["completion"] for r in _records(reference)]
    assert len(set(completions)) > 5, "the adapters and prompts hardly change the completions"
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(_args(checkout, inp, out, *sizing)) == 0
    err = capsys.readouterr().err
    assert _mode(err) == "continuous" and NOTE not in err
    assert out.read_bytes() == reference.read_bytes()


def test_one_long_prompt_under_several_adapters(checkout, tmp_path, capsys):
    """The same prompt of over two cache blocks on lines of different adapters (and the base model), one request per
    step: each line gets its own adapter's completion, as with static batches. (transformers' prefix sharing would
    hand a later request the cached blocks of an earlier one with the same prompt, computed under another adapter:
    the command runs without it.)"""
    inp, out, static = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "static.jsonl"
    shared = "the parties agree that " * 26  # 598 tokens
    _write(inp, [{"prompt": shared, "adapter": a} for a in ("legal", "chat", None, "chat", "legal")])
    assert main(_args(checkout, inp, static, "--static-batches")) == 0
    assert len({r["completion"] for r in _records(static)}) == 3, "the adapters do not change the completion"
    capsys.readouterr()
    assert main(_args(checkout, inp, out, "--batch-size", "1")) == 0
    assert _mode(capsys.readouterr().err) == "continuous"
    assert out.read_bytes() == static.read_bytes()


def test_records_written_as_requests_finish_and_an_interrupted_run_resumes(
    checkout, static_reference, tmp_path, capsys, monkeypatch, generated
):
    """Ctrl-C after three requests finished: exit 130 in one line, the manager's thread stopped, the output holds
    those three records (complete lines; the file in finishing order); the same command generates only the rest, and
    the final output is an uninterrupted run's."""
    inp, reference = static_reference
    out = tmp_path / "out.jsonl"
    real_load = batch.load_model
    seen = []

    def load_then_break(*a, **kw):
        model, tokenizer = real_load(*a, **kw)
        init = model.init_continuous_batching

        def init_continuous_batching(**kwargs):
            manager = init(**kwargs)
            get_result = manager.get_result

            def interrupting(*args, **kwargs):
                if len(seen) == 3:
                    assert len(_records(out)) == 3, "each record is written as its request finishes"
                    raise KeyboardInterrupt
                result = get_result(*args, **kwargs)
                if result is not None and result.is_finished():
                    seen.append(result.request_id)
                return result

            manager.get_result = interrupting
            return manager

        model.init_continuous_batching = init_continuous_batching
        return model, tokenizer

    monkeypatch.setattr(batch, "load_model", load_then_break)
    threads = threading.active_count()
    assert main(_args(checkout, inp, out, "--batch-size", "2")) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "interrupted: rerun the same command to resume" and "Traceback" not in err
    assert threading.active_count() == threads, "the manager's generation thread is still running"
    kept = _records(out)
    assert len(kept) == 3 and out.read_text().endswith("\n")
    monkeypatch.setattr(batch, "load_model", real_load)
    assert main(_args(checkout, inp, out, "--batch-size", "2")) == 0
    assert generated[-1] == (sorted(set(range(1, len(PROMPTS) + 1)) - {r["line"] for r in kept}), True)
    assert out.read_bytes() == reference.read_bytes()


def test_a_failed_request_stops_the_run_in_one_line(checkout, tmp_path, capsys, monkeypatch):
    """A request the manager fails (here its result carries an error after the first request finished): exit 1, one
    line naming the input line and the error, the finished record kept; the same command then finishes the run."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS[:4])
    real_load = batch.load_model
    finished = []

    def load_then_fail(*a, **kw):
        model, tokenizer = real_load(*a, **kw)
        init = model.init_continuous_batching

        def init_continuous_batching(**kwargs):
            manager = init(**kwargs)
            get_result = manager.get_result

            def failing(*args, **kwargs):
                result = get_result(*args, **kwargs)
                if result is not None and result.is_finished():
                    finished.append(result.request_id)
                    if len(finished) == 2:
                        result.error = "out of blocks"
                return result

            manager.get_result = failing
            return manager

        model.init_continuous_batching = init_continuous_batching
        return model, tokenizer

    monkeypatch.setattr(batch, "load_model", load_then_fail)
    assert main(_args(checkout, inp, out)) == 1
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    failed = int(finished[1][len("row") :]) + 1  # (request row<i>: the i-th line to generate, here line i + 1)
    assert line == (
        f"peft-csgmv generate: error: continuous batching failed on input line {failed}: out of blocks; what "
        "finished is in the output: rerun the same command to resume"
    )
    assert len(_records(out)) == 1
    monkeypatch.setattr(batch, "load_model", real_load)
    assert main(_args(checkout, inp, out)) == 0
    assert [r["line"] for r in _records(out)] == [1, 2, 3, 4]


# --- static batches where continuous batching cannot do what the run asks ----------------------------------------


def _no_continuous_batching(monkeypatch):
    import peft_csgmv.continuous as continuous

    monkeypatch.setattr(continuous, "continuous_batching_available", lambda: False)


@pytest.mark.parametrize(
    "case, extra, says",
    [
        ("old transformers", [], "transformers "),
        ("static cache", ["--cache-implementation", "static"], "--cache-implementation static is a static-batch"),
    ],
)
def test_static_batches_with_a_note_where_continuous_batching_cannot(
    checkout, static_reference, tmp_path, capsys, monkeypatch, generated, case, extra, says
):
    """Before the model loads: a transformers without continuous batching, the static cache. One line
    says why, the run takes static batches, and its output is the static batches' output."""
    if case == "old transformers":
        _no_continuous_batching(monkeypatch)
    inp, reference = static_reference
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(_args(checkout, inp, out, *extra)) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith(NOTE)]
    assert len(notes) == 1 and notes[0][len(NOTE) :].startswith(says), err
    assert _mode(err) == "static" and generated[-1][1] is False
    assert out.read_bytes() == reference.read_bytes()


AUTO = "static-cache batches, not continuous batching: "


@pytest.mark.parametrize(
    "extra, auto",
    [
        ([], True),
        (["--continuous-batching"], False),
        (["--cache-implementation", "dynamic"], False),
        (["--max-batch-tokens", "64"], False),
        (["--max-resident-adapters", "1"], True),
    ],
    ids=["default", "continuous-batching", "dynamic-cache", "sized", "host-tier"],
)
def test_a_long_run_on_a_gpu_takes_static_cache_batches(
    checkout, static_reference, tmp_path, capsys, monkeypatch, generated, extra, auto
):
    """A run past ``STATIC_PAYS_TOKENS`` (rows × new tokens) on a device where the static cache's decode step compiles
    takes static-cache batches of 64 by itself, in one line, unless it asked for a batching or sized continuous
    batching; either way its output is the --static-batches output (fp32, greedy). Here the CPU stands for the GPU
    and the threshold is the 9 lines' 63 tokens."""
    from peft_csgmv import cli

    monkeypatch.setattr(cli, "AUTO_STATIC_DEVICES", ("cpu",))
    monkeypatch.setattr(cli, "STATIC_PAYS_TOKENS", len(PROMPTS) * 7)
    inp, reference = static_reference
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(_args(checkout, inp, out, *extra)) == 0
    err = capsys.readouterr().err
    notes = [line for line in err.splitlines() if line.startswith(AUTO)]
    if auto:
        assert len(notes) == 1 and "9 rows x 7 new tokens" in notes[0], err
        assert _mode(err) == "static" and generated[-1][1] is False
    else:
        assert not notes and _mode(err) == "continuous", err
    assert out.read_bytes() == reference.read_bytes()


@pytest.mark.parametrize("extra, auto", [([], False), (["--no-varlen-attention"], True)], ids=["per-request", "sdpa"])
def test_a_long_run_attending_per_request_keeps_continuous_batching(
    checkout, static_reference, tmp_path, capsys, monkeypatch, extra, auto
):
    """Where continuous batching attends per request (the default where it can run: here with the float64 stand-in
    for the kernel), a long run of even lines keeps continuous batching; with --no-varlen-attention it takes
    static-cache batches as above. Either way its output is the --static-batches output (fp32, greedy)."""
    from test_attention import reference

    from peft_csgmv import attention, cli

    monkeypatch.setattr(cli, "AUTO_STATIC_DEVICES", ("cpu",))
    monkeypatch.setattr(cli, "STATIC_PAYS_TOKENS", len(PROMPTS) * 7)
    monkeypatch.setattr(attention, "COMMAND_DEFAULT", True)
    monkeypatch.setattr(attention, "refusal", lambda model: None)
    calls = []
    monkeypatch.setattr(attention, "flash_varlen", lambda *a: (calls.append(1), reference(*a))[1])
    inp, want = static_reference
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(_args(checkout, inp, out, *extra)) == 0
    err = capsys.readouterr().err
    if auto:
        assert AUTO in err and _mode(err) == "static" and not calls, err
    else:
        assert AUTO not in err and _mode(err) == "continuous" and calls, err
        assert "attention per request by torch's flash kernel" in err
    assert out.read_bytes() == want.read_bytes()


def test_a_short_run_keeps_continuous_batching(checkout, static_reference, tmp_path, capsys, monkeypatch):
    """One token short of ``STATIC_PAYS_TOKENS``: continuous batching, no note."""
    from peft_csgmv import cli

    monkeypatch.setattr(cli, "AUTO_STATIC_DEVICES", ("cpu",))
    monkeypatch.setattr(cli, "STATIC_PAYS_TOKENS", len(PROMPTS) * 7 + 1)
    inp, _ = static_reference
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert main(_args(checkout, inp, out)) == 0
    err = capsys.readouterr().err
    assert AUTO not in err and _mode(err) == "continuous", err


def test_a_long_run_with_line_limits_keeps_continuous_batching(checkout, tmp_path, capsys, monkeypatch):
    """Lines with their own max_new_tokens (uneven answers, continuous batching's case): no static-cache batches,
    however long the run."""
    from peft_csgmv import cli

    monkeypatch.setattr(cli, "AUTO_STATIC_DEVICES", ("cpu",))
    monkeypatch.setattr(cli, "STATIC_PAYS_TOKENS", 1)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [dict(PROMPTS[0], max_new_tokens=3)] + PROMPTS[1:])
    capsys.readouterr()
    assert main(_args(checkout, inp, out)) == 0
    err = capsys.readouterr().err
    assert AUTO not in err and _mode(err) == "continuous", err


def test_continuous_batching_flag_conflicts(checkout, static_reference, tmp_path, capsys):
    inp, _ = static_reference
    for extra, says in ((["--static-batches"], "--static-batches"),
                        (["--cache-implementation", "static"], "--cache-implementation static")):  # fmt: skip
        capsys.readouterr()
        assert main(_args(checkout, inp, tmp_path / "out.jsonl", "--continuous-batching", *extra)) == 2
        assert f"--continuous-batching and {says}: give one of them" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, says",
    [
        ({"num_beams": 2}, "num_beams=2"),
        ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
        ({"min_new_tokens": 3}, "min_new_tokens=3"),
        ({"no_repeat_ngram_size": 2}, "NoRepeatNGramLogitsProcessor"),
    ],
)
def test_generation_config_continuous_batching_lacks_runs_static_batches(
    checkout, tmp_path, capsys, generated, settings, says
):
    """A checkpoint whose generation_config.json asks for what continuous batching does not do (beam search, a
    repetition penalty, a minimum length, an n-gram ban): static batches, with one line naming it, and the output of
    --static-batches (which honours it)."""
    import shutil

    from transformers import GenerationConfig

    base, adapters = checkout
    own = tmp_path / "base"
    shutil.copytree(base, own)
    config = GenerationConfig.from_pretrained(own)
    config.update(**settings)
    config.save_pretrained(own)
    inp, out, static = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "static.jsonl"
    _write(inp, PROMPTS[:5])
    assert main(_args((str(own), adapters), inp, static, "--static-batches")) == 0
    capsys.readouterr()
    assert main(_args((str(own), adapters), inp, out)) == 0
    err = capsys.readouterr().err
    (note,) = [line for line in err.splitlines() if line.startswith(NOTE)]
    assert note == f"{NOTE}the model's generation config asks for {says}, which continuous batching does not do"
    assert _mode(err) == "static" and generated[-1][1] is False
    assert out.read_bytes() == static.read_bytes()


def test_an_adapter_continuous_batching_cannot_give_per_request_runs_static_batches(checkout, tmp_path, capsys):
    """An aLoRA adapter (its rows' adapter applies from their invocation tokens on, which a packed step cannot say):
    a run whose lines ask for it takes static batches, with one line naming it, and writes the --static-batches
    output; a run whose lines do not ask for it runs continuous batching."""
    from peft import LoraConfig, get_peft_model

    from peft_csgmv.toy import tiny_llama

    torch.manual_seed(5)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], alora_invocation_tokens=[7, 8],
                        init_lora_weights=False, task_type="CAUSAL_LM")  # fmt: skip
    alora = tmp_path / "alora"
    get_peft_model(tiny_llama(), config).save_pretrained(alora)
    base, adapters = checkout
    with_alora = (base, dict(adapters, inv=str(alora)))
    inp, out, static = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "static.jsonl"
    _write(inp, PROMPTS[:4] + [{"prompt": "we decide the clause", "adapter": "inv"}])
    assert main(_args(with_alora, inp, static, "--static-batches")) == 0
    capsys.readouterr()
    assert main(_args(with_alora, inp, out)) == 0
    err = capsys.readouterr().err
    (note,) = [line for line in err.splitlines() if line.startswith(NOTE)]
    assert note == f"{NOTE}adapter 'inv' is an aLoRA adapter: it cannot be given per request under continuous batching"
    assert _mode(err) == "static" and out.read_bytes() == static.read_bytes()
    _write(inp, PROMPTS[:4])
    assert main(_args(with_alora, inp, tmp_path / "plain.jsonl")) == 0
    err = capsys.readouterr().err
    assert _mode(err) == "continuous" and NOTE not in err


def test_continuous_obstacle_sees_a_model_over_several_devices(checkout):
    """A model that --device-map put on several devices takes static batches (the paged cache lives on one); one on a
    single device, or without a map, runs continuous batching."""
    base, adapters = checkout
    model, tokenizer = batch.load_model(base, adapters, device="cpu")
    greedy = dict(max_new_tokens=4, do_sample=False)
    assert batch.continuous_obstacle(model, tokenizer, **greedy) is None
    sampled = dict(greedy, do_sample=True, temperature=0.7, top_p=0.9, top_k=20)
    assert batch.continuous_obstacle(model, tokenizer, **sampled) is None, "temperature, top-p, top-k are supported"
    inner = model.get_base_model()
    inner.hf_device_map = {"model.embed_tokens": "cpu", "model.layers": "cpu"}
    assert batch.continuous_obstacle(model, tokenizer, **greedy) is None
    inner.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "lm_head": "cpu"}
    assert batch.continuous_obstacle(model, tokenizer, **greedy) == (
        "the model is spread over 3 devices (--device-map); continuous batching keeps its cache on one"
    )


# --- sizing -------------------------------------------------------------------------------------------------------


def test_sizing_defaults_and_flags():
    """On a CPU: steps of CPU_MAX_BATCH_TOKENS tokens, and a cache for the longest requests one step can hold, at full
    length (not transformers' share of the free RAM); on a GPU transformers sizes both from the free memory. Flags
    pass through; --cache-memory leaves the block count to transformers."""
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    needs = [10, 300, 40, 700, 20]  # blocks of 256 tokens: 1, 2, 1, 3, 1
    config = batch.Continuous().config(cpu, needs)
    assert config.max_batch_tokens == batch.CPU_MAX_BATCH_TOKENS and config.num_blocks == 8
    assert batch.Continuous(max_requests=2).config(cpu, needs).num_blocks == 5, "the two longest"
    assert batch.Continuous(max_batch_tokens=1).config(cpu, needs).num_blocks == 3, "one request per step"
    config = batch.Continuous().config(gpu, needs)
    assert config.num_blocks is None and config.max_batch_tokens is None and config.max_memory_percent is None
    config = batch.Continuous(max_batch_tokens=64, num_blocks=9, max_requests=3, seed=4).config(cpu, needs)
    assert (config.max_batch_tokens, config.num_blocks, config.max_requests_per_batch, config.seed) == (64, 9, 3, 4)
    config = batch.Continuous(cache_memory=0.25).config(cpu, needs)
    assert config.num_blocks is None and config.max_memory_percent == 0.25
    assert config.use_cuda_graph is None and config.use_async_batching is None, "left to the manager"
    assert config.allow_block_sharing is False, "a cached prompt block belongs to the adapter that computed it"


def test_requests_per_step_capped_where_attention_takes_a_dense_mask():
    """On a GPU whose paged attention is SDPA or eager (one dense mask over the step's cached tokens), at most
    DENSE_MASK_MAX_REQUESTS requests per step unless --batch-size says otherwise; with flash attention (csgmv's per
    request included), on a CPU, or without the model, transformers' own default."""
    from types import SimpleNamespace

    cpu, gpu = torch.device("cpu"), torch.device("cuda")

    def model(impl):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))

    cap = batch.DENSE_MASK_MAX_REQUESTS
    for impl in ("sdpa", "eager", "paged|sdpa", None):
        assert batch.Continuous().config(gpu, [10], model(impl)).max_requests_per_batch == cap, impl
    assert batch.Continuous(max_requests=700).config(gpu, [10], model("sdpa")).max_requests_per_batch == 700
    for impl in ("flash_attention_2", "paged|flash_attention_3", "kernels-community/flash-attn"):
        assert batch.Continuous().config(gpu, [10], model(impl)).max_requests_per_batch is None, impl
    assert batch.Continuous().config(cpu, [10], model("sdpa")).max_requests_per_batch is None
    assert batch.Continuous(varlen_attention=True).config(gpu, [10], model("sdpa")).max_requests_per_batch is None
    assert batch.Continuous().config(gpu, [10]).max_requests_per_batch is None


def _errors(err):
    lines = [line for line in err.splitlines() if "error:" in line]
    assert lines and all(line.startswith("peft-csgmv generate: error: ") for line in lines), err
    return [line[len("peft-csgmv generate: error: ") :] for line in lines]


def test_sizing_flags_refused_where_they_cannot_apply(checkout, tmp_path, capsys, monkeypatch):
    """Sizing flags with --static-batches, and --num-blocks with --cache-memory: one line each before the model
    loads. A --num-blocks too small for a request: one line naming its input line, before anything is generated."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, PROMPTS)
    real_load = batch.load_model
    monkeypatch.setattr(batch, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    cases = [
        (["--static-batches", "--num-blocks", "4", "--max-batch-tokens", "32"],
         ["--max-batch-tokens 32: sizes continuous batching, which --static-batches turns off; give one",
          "--num-blocks 4: sizes continuous batching, which --static-batches turns off; give one"]),
        (["--static-batches", "--cache-memory", "0.5"],
         ["--cache-memory 0.5: sizes continuous batching, which --static-batches turns off; give one"]),
        (["--num-blocks", "4", "--cache-memory", "0.5"], ["--num-blocks 4 and --cache-memory 0.5: give one of them"]),
    ]  # fmt: skip
    for extra, want in cases:
        assert main(_args(checkout, inp, out, *extra)) == 2
        assert _errors(capsys.readouterr().err) == want
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            main(_args(checkout, inp, out, "--cache-memory", bad))
        assert "argument --cache-memory: expected" in capsys.readouterr().err
    assert not out.exists()
    monkeypatch.setattr(batch, "load_model", real_load)
    assert main(_args(checkout, inp, out, "--num-blocks", "1")) == 2
    assert _errors(capsys.readouterr().err) == [
        "--num-blocks 1: the cache holds 256 tokens, input line 3 needs 295 (its prompt and --max-new-tokens)"
    ]
    assert out.read_text() == ""


def test_cuda_graphs_flag(checkout, static_reference, tmp_path, capsys, monkeypatch):
    """``--cuda-graphs``: continuous batching's steps the graphed way (on the CPU, where transformers captures no
    graph, ``continuous.GRAPHED_ON_CPU`` runs them so: padded plans and groups rewritten before each step) writes the
    --static-batches output byte for byte; with static batches, accelerate's placement or the torch backend it is
    refused in one line each, before the model loads."""
    from peft_csgmv import continuous

    inp, reference = static_reference
    out = tmp_path / "out.jsonl"
    real_load = batch.load_model
    monkeypatch.setattr(batch, "load_model", lambda *a, **k: pytest.fail("the model must not load"))
    graphs = "--cuda-graphs runs continuous batching's steps as CUDA graphs"
    cases = [
        (["--static-batches"], [f"--cuda-graphs and --static-batches: {graphs}; give one of them"]),
        (["--device-map", "auto"], [f"--cuda-graphs and --device-map auto: {graphs}, which cannot replay "
                                    "accelerate's placement; leave one out",
                                    "--device cpu and --device-map auto: give one of them"]),
        (["--backend", "torch"], [f"--cuda-graphs and --backend torch: {graphs}, which need the Triton kernels"]),
    ]  # fmt: skip
    for extra, want in cases:
        assert main(_args(checkout, inp, out, "--cuda-graphs", *extra)) == 2
        assert _errors(capsys.readouterr().err) == want
    assert not out.exists()
    monkeypatch.setattr(batch, "load_model", real_load)
    monkeypatch.setattr(continuous, "GRAPHED_ON_CPU", True)
    graphed = []
    own_open = continuous.open_step
    monkeypatch.setattr(continuous, "open_step", lambda *a: graphed.append(a[4] is not None) or own_open(*a))
    assert main(_args(checkout, inp, out, "--cuda-graphs", "--max-batch-tokens", "16", "--backend", "triton")) == 0
    assert _mode(capsys.readouterr().err) == "continuous" and graphed and all(graphed)
    assert out.read_bytes() == reference.read_bytes()


def test_cuda_graphs_by_default_where_they_replay(monkeypatch):
    """Continuous batching's steps run as CUDA graphs where the loaded model can replay them
    (``continuous.graphs_refusal``) and no --device-map placed it, unless --no-cuda-graphs says otherwise;
    --cuda-graphs asks for them whatever the model (its refusals come from the checks and the manager)."""
    from peft_csgmv import continuous
    from peft_csgmv.cli import _graphs, build_parser

    def graphs(refusal, *flags):
        monkeypatch.setattr(continuous, "graphs_refusal", lambda model: refusal)
        flags = ["generate", "--base", "b", "--adapter", "a=p", "--input", "i", "--output", "o", *flags]
        return _graphs(build_parser()[0].parse_args(flags), object())

    assert graphs(None) and graphs("the model is not on a CUDA device", "--cuda-graphs")
    assert not graphs(None, "--no-cuda-graphs") and not graphs("the model is not on a CUDA device")
    assert not graphs(None, "--device-map", "auto")  # (accelerate's placement: refused when asked for, so not taken)


# --- identity -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sample", [[], ["--do-sample", "--seed", "3"]], ids=["greedy", "sampled"])
def test_batching_mode_is_no_part_of_identity(checkout, tmp_path, capsys, generated, sample):
    """An output begun with static batches is resumed by continuous batching and the other way round, greedy or
    sampled, without refusal: the records' settings_sha1 and the settings file are the same either way (the batching
    decides which draw a sampled row gets, as the batch size does, not what is computed)."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    saved = tmp_path / "out.jsonl.settings.json"
    _write(inp, PROMPTS[:3])
    assert main(_args(checkout, inp, out, "--static-batches", *sample)) == 0
    settings = saved.read_bytes()
    _write(inp, PROMPTS[:6])
    assert main(_args(checkout, inp, out, *sample)) == 0
    assert generated[-1] == ([4, 5, 6], True) and saved.read_bytes() == settings
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, out, "--static-batches", *sample)) == 0
    assert generated[-1] == ([7, 8, 9], False) and saved.read_bytes() == settings
    records = _records(out)
    assert [r["line"] for r in records] == list(range(1, len(PROMPTS) + 1))
    assert len({r["settings_sha1"] for r in records if r["adapter"] == "legal"}) == 1
