"""Continuous batching's attention per request (:mod:`peft_csgmv.attention`): transformers takes it for a flash
implementation (no dense mask, each request's lengths), each request's tokens stay stock PEFT's, the model's own
attention is back after the run, and where it cannot run it changes nothing. On the CPU the flash kernel is stood in
for by a float64 reference of what it computes; on a GPU the kernel itself is held to that reference."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import DEVICE, make

from peft_csgmv import attention, disable_csgmv, enable_csgmv
from peft_csgmv.continuous import continuous_batching_available

needs_cb = pytest.mark.skipif(
    not continuous_batching_available(), reason="this transformers has no continuous batching (transformers >= 5)"
)


def reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale):
    """:func:`attention.flash_varlen` in float64: each request's queries, the last of its tokens, attend causally to
    its keys (query ``j`` of ``tq`` sees keys ``0 .. tk - tq + j``); heads grouped as ``H // Hkv`` per key head."""
    heads, kv_heads = query.shape[1], key.shape[1]
    out = torch.zeros_like(query)
    cq, ck = cu_seq_q.tolist(), cu_seq_k.tolist()
    for i in range(len(cq) - 1):
        tq, tk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
        if tq == 0:
            continue
        q = query[cq[i] : cq[i + 1]].double().transpose(0, 1)
        k = key[ck[i] : ck[i + 1]].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        v = value[ck[i] : ck[i + 1]].double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
        scores = q @ k.transpose(1, 2) * (scale if scale is not None else q.shape[-1] ** -0.5)
        seen = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        scores = scores.masked_fill(~seen, float("-inf"))
        out[cq[i] : cq[i + 1]] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
    return out


@pytest.fixture
def stood_in(monkeypatch):
    """The attention runnable here: no refusal, the reference for the kernel; the calls it got."""
    calls = []  # (each request's queries, its keys) per call, read when called (transformers reuses the buffers)

    def kernel(query, key, value, cu_seq_q, cu_seq_k, *rest):
        calls.append((cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()))
        return reference(query, key, value, cu_seq_q, cu_seq_k, *rest)

    monkeypatch.setattr(attention, "refusal", lambda model: None)
    monkeypatch.setattr(attention, "flash_varlen", kernel)
    return calls


@needs_cb
@pytest.mark.parametrize("max_batch_tokens", [64, 8], ids=["whole-prefills", "split-prefills"])
def test_continuous_batching_with_varlen_attention_gives_each_request_its_adapter(stood_in, max_batch_tokens):
    """Under :func:`attention.varlen_attention` transformers' continuous batching passes each request's lengths and
    no mask, and every request's tokens are its own stock PEFT run's (fp32; split prefills attend to their request's
    cached tokens: a chunk's queries are the last of its keys); after the run the model attends as before."""
    from test_continuous import IDS, PROMPTS, _alone, _configs

    model = make("llama")
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model)
    try:
        config = model.get_base_model().config
        before = config._attn_implementation
        gen, cbc = _configs(max_batch_tokens=max_batch_tokens)
        with attention.varlen_attention(model):
            assert config._attn_implementation == attention.implementation_name()
            out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS)
        assert config._attn_implementation == before
        got = [out[f"req_{i}"].generated_tokens for i in range(len(PROMPTS))]
        want = [_alone(model, p, a, 5) for p, a in zip(PROMPTS, IDS)]
        assert len({tuple(w) for w in want}) > 2, "the adapters change nothing: the test would prove nothing"
        assert got == want
        assert stood_in, "the attention never ran"
        layers = model.get_base_model().config.num_hidden_layers
        assert len(stood_in) % layers == 0
        chunks = [(q, k) for qs, ks in stood_in for q, k in zip(qs, ks) if 1 < q < k]
        if max_batch_tokens == 8:  # prefill chunks after their request's cached tokens: fewer queries than keys
            assert chunks
        else:
            assert all(q in (1, k) for qs, ks in stood_in for q, k in zip(qs, ks))
    finally:
        disable_csgmv(model)


@pytest.mark.parametrize(
    "arch, fields, says",
    [
        ("llama", dict(hidden=64), "CUDA device" if DEVICE.type != "cuda" else "float16 or bfloat16"),
        ("llama", dict(hidden=48), "head size of at most 256, a multiple of 8, not 12"),
        ("mistral", dict(hidden=64), "sliding window"),
        ("gemma3", dict(hidden=64), "sliding window"),
    ],
    ids=["fp32-or-cpu", "head-size-12", "mistral-window", "gemma3-layer-types"],
)
def test_refused_where_it_cannot_run_and_nothing_changes(arch, fields, says):
    """Where the attention cannot run (the CPU, fp32, a head size torch's flash kernel does not take, a sliding
    window) it is refused with its reason, and the model's configs are as they were."""
    from helpers import add_adapters, tiny_model, two_adapters

    base, targets = tiny_model(arch, **fields)
    model = add_adapters(base, two_adapters(targets)).to(DEVICE)
    configs = attention._configs(model.get_base_model())
    before = [c._attn_implementation for c in configs]
    assert says in (attention.refusal(model) or "")
    with pytest.raises(ValueError, match=f"varlen attention: .*{says}"):
        with attention.varlen_attention(model):
            pass
    assert [c._attn_implementation for c in configs] == before


def test_outside_continuous_batching_the_attention_says_so(stood_in):
    """A plain forward inside the scope (no request lengths from transformers) fails with a message naming the
    attention, not with wrong numbers; the model's attention is back afterwards."""
    model = make("llama")
    config = model.get_base_model().config
    before = config._attn_implementation
    x = torch.tensor([[1, 5, 6, 7]], device=model.get_base_model().device)
    with attention.varlen_attention(model):
        with pytest.raises(RuntimeError, match="only inside continuous batching"):
            model(input_ids=x)
    assert config._attn_implementation == before
    assert not stood_in


def test_command_choice(monkeypatch):
    """What the batch command and the server do with ``--varlen-attention`` / ``--no-varlen-attention`` / neither:
    asked and runnable, on quietly; asked where it cannot run, off with one line why; refused, off; neither, off
    unless :data:`attention.COMMAND_DEFAULT`, then on where it can run, saying so, and quietly off where it cannot."""
    model = object()
    why = {"now": "it runs on a CUDA device"}
    monkeypatch.setattr(attention, "refusal", lambda m: why["now"] if m is model else "another model")
    said = "--varlen-attention left out, SDPA's attention instead: it runs on a CUDA device"
    assert attention.command_choice(True, model) == (False, said)
    assert attention.command_choice(None, model) == (False, None)
    monkeypatch.setattr(attention, "COMMAND_DEFAULT", True)
    assert attention.command_choice(None, model) == (False, None)
    assert attention.command_choice(False, model) == (False, None)
    why["now"] = None
    assert attention.command_choice(True, model) == (True, None)
    on, note = attention.command_choice(None, model)
    assert on and "--no-varlen-attention" in note
    assert attention.command_choice(False, model) == (False, None)
    monkeypatch.setattr(attention, "COMMAND_DEFAULT", False)
    assert attention.command_choice(None, model) == (False, None)


def test_expandable_segments_while_attending_per_request(monkeypatch):
    """The allocator's segments are expandable from the first block on a CUDA device to the end of the last one
    (nested and concurrent runs share it; an error inside still ends it), and never where the user configured the
    allocator, on another device or another allocator backend."""
    calls = []
    monkeypatch.setattr(attention, "_set_expandable", calls.append)
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    for name in attention.ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    cuda = torch.device("cuda", 0)
    with attention.expandable_segments(cuda):
        assert calls == [True]
        with attention.expandable_segments(cuda):
            pass
        assert calls == [True]
    assert calls == [True, False]
    with pytest.raises(RuntimeError, match="inside"), attention.expandable_segments(cuda):
        raise RuntimeError("inside")
    assert calls == [True, False] * 2 and attention._segments_users == 0
    with attention.expandable_segments(torch.device("cpu")):
        pass
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "cudaMallocAsync")
    with attention.expandable_segments(cuda):
        pass
    monkeypatch.setattr(torch.cuda.memory, "get_allocator_backend", lambda: "native")
    for name in attention.ALLOCATOR_ENV:
        monkeypatch.setenv(name, "garbage_collection_threshold:0.8")
        with attention.expandable_segments(cuda):
            pass
        monkeypatch.delenv(name)
    assert calls == [True, False] * 2


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="the CUDA caching allocator")
@pytest.mark.skipif(any(os.environ.get(k) for k in attention.ALLOCATOR_ENV), reason="the allocator configured")
def test_gpu_expandable_segments():
    """On a GPU, memory taken while attending per request lies in an expandable segment; after it, in a fixed one."""

    def expandable(tensor) -> bool:
        ptr = tensor.data_ptr()
        for seg in torch.cuda.memory._snapshot()["segments"]:
            if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
                return seg["is_expandable"]
        raise AssertionError("no segment holds the tensor")

    torch.cuda.empty_cache()  # (no free block of an earlier test's expandable segments to reuse)
    with attention.expandable_segments(DEVICE):
        inside = torch.empty(96 << 20, dtype=torch.uint8, device=DEVICE)
        assert expandable(inside)
    after = torch.empty(80 << 20, dtype=torch.uint8, device=DEVICE)
    assert not expandable(after)
    del inside, after


@needs_cb
def test_batch_command_attends_per_request_by_default_where_told_to(stood_in, tmp_path, capsys, monkeypatch):
    """With :data:`attention.COMMAND_DEFAULT` on, a continuous-batching run that names neither flag attends per
    request (and says so in one line), its records those of ``--no-varlen-attention`` (fp32, greedy), which attends
    with SDPA."""
    from test_cli_continuous import PROMPTS, _args, _records, _write

    from peft_csgmv.cli import main
    from peft_csgmv.toy import save_toy_checkout

    monkeypatch.setattr(attention, "COMMAND_DEFAULT", True)
    checkout = save_toy_checkout(str(tmp_path / "toy"), {"legal": 4, "chat": 8})
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS[:4])
    assert main(_args(checkout, inp, tmp_path / "sdpa.jsonl", "--no-varlen-attention")) == 0
    assert not stood_in and "attention per request" not in capsys.readouterr().err
    assert main(_args(checkout, inp, tmp_path / "default.jsonl", "--max-batch-tokens", "16")) == 0
    assert stood_in and "attention per request by torch's flash kernel" in capsys.readouterr().err
    key = lambda r: r["line"]  # noqa: E731
    assert sorted(_records(tmp_path / "default.jsonl"), key=key) == sorted(_records(tmp_path / "sdpa.jsonl"), key=key)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's flash kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_flash_varlen_is_the_reference(dtype):
    """torch's flash kernel on packed requests equals the float64 reference: decode tokens, a prefill chunk after
    cached tokens, a whole prefill, grouped key heads, a padded step's tail (its rows are not compared), and inputs
    of any strides (queries heads-first as attention layers make them, keys every other row, values with a last
    dimension that is not contiguous)."""
    if not torch.backends.cuda.is_flash_attention_available():
        pytest.skip("this torch build has no flash attention kernel")
    torch.manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    lengths = [(1, 37), (1, 300), (24, 90), (57, 57), (1, 1)]  # (new tokens, keys) per request
    tq, tk = sum(q for q, _ in lengths), sum(k for _, k in lengths)
    q = torch.randn(heads, tq + 5, dim, device="cuda", dtype=dtype).transpose(0, 1)  # 5 padding rows at the end
    k = torch.randn(2 * (tk + 11), kv_heads, dim, device="cuda", dtype=dtype)[::2]
    v = torch.randn(tk + 11, kv_heads, 2 * dim, device="cuda", dtype=dtype)[..., ::2]
    cu_q = torch.tensor([0] + [sum(x for x, _ in lengths[: i + 1]) for i in range(len(lengths))], device="cuda")
    cu_k = torch.tensor([0] + [sum(x for _, x in lengths[: i + 1]) for i in range(len(lengths))], device="cuda")
    cu_q, cu_k = cu_q.to(torch.int32), cu_k.to(torch.int32)
    max_q, max_k = max(x for x, _ in lengths), max(x for _, x in lengths)
    got = attention.flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, 0.125)
    want = reference(q, k, v, cu_q, cu_k, max_q, max_k, 0.125)
    torch.testing.assert_close(got[:tq].float(), want[:tq].float(), atol=2e-2, rtol=2e-2)


@needs_cb
def test_batch_command_with_varlen_attention_writes_what_static_batches_write(stood_in, tmp_path, capsys):
    """``peft-csgmv generate --varlen-attention``: continuous batching attends per request and writes the records
    static batches write (fp32, greedy); with nowhere to run it, the command says so in one line and runs SDPA."""
    from test_cli_continuous import PROMPTS, _args, _records, _write

    from peft_csgmv.cli import main
    from peft_csgmv.toy import save_toy_checkout

    checkout = save_toy_checkout(str(tmp_path / "toy"), {"legal": 4, "chat": 8})
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS)
    assert main(_args(checkout, inp, tmp_path / "static.jsonl", "--static-batches", "--batch-size", "4")) == 0
    capsys.readouterr()
    args = _args(checkout, inp, tmp_path / "varlen.jsonl", "--varlen-attention", "--max-batch-tokens", "16")
    assert main(args) == 0
    assert "left out" not in capsys.readouterr().err
    assert stood_in
    key = lambda r: r["line"]  # noqa: E731
    assert sorted(_records(tmp_path / "varlen.jsonl"), key=key) == sorted(_records(tmp_path / "static.jsonl"), key=key)


@needs_cb
def test_batch_command_varlen_attention_flags(tmp_path, capsys):
    """``--varlen-attention`` with static batches is refused in one line; where it cannot run (here: the CPU) the
    run says why in one line and attends with SDPA."""
    from test_cli_continuous import PROMPTS, _args, _records, _write

    from peft_csgmv.cli import main
    from peft_csgmv.toy import save_toy_checkout

    checkout = save_toy_checkout(str(tmp_path / "toy"), {"legal": 4, "chat": 8})
    inp = tmp_path / "in.jsonl"
    _write(inp, PROMPTS[:3])
    out = tmp_path / "out.jsonl"
    assert main(_args(checkout, inp, out, "--varlen-attention", "--static-batches")) == 2
    err = capsys.readouterr().err
    assert "--varlen-attention and --static-batches: it is continuous batching's attention" in err
    assert not out.exists()
    assert main(_args(checkout, inp, out, "--varlen-attention")) == 0
    err = capsys.readouterr().err
    assert "--varlen-attention left out, SDPA's attention instead: " in err
    assert len(_records(out)) == 3


@pytest.mark.gpu
@needs_cb
@pytest.mark.skipif(DEVICE.type != "cuda", reason="torch's flash kernel runs on CUDA")
def test_gpu_varlen_attention_in_continuous_batching(monkeypatch):
    """bf16 on a GPU: every attention call of a continuous-batching run (eager steps, split prefills, two adapters)
    equals the float64 reference on the inputs transformers gave it; the same requests under CUDA graphs (the kernel
    captured and replayed) all finish, each with its number of tokens, and the model attends with SDPA after."""
    from helpers import add_adapters, tiny_model, two_adapters
    from test_continuous import IDS, PROMPTS, _configs
    from transformers import ContinuousBatchingConfig

    base, targets = tiny_model("llama", dtype=torch.bfloat16, hidden=64, intermediate=96)
    model = add_adapters(base, two_adapters(targets)).to(DEVICE)
    model.get_base_model().generation_config.eos_token_id = None
    enable_csgmv(model)
    try:
        assert attention.refusal(model) is None
        worst, real = [], attention.flash_varlen

        def checked(query, key, value, cu_q, cu_k, max_q, max_k, scale):
            out = real(query, key, value, cu_q, cu_k, max_q, max_k, scale)
            want = reference(query, key, value, cu_q, cu_k, max_q, max_k, scale)
            rows = int(cu_q[-1])
            err = (out[:rows].float() - want[:rows].float()).abs().max().item()
            worst.append(err / max(1.0, want[:rows].float().abs().max().item()))
            return out

        monkeypatch.setattr(attention, "flash_varlen", checked)
        gen, cbc = _configs(max_batch_tokens=8)
        with attention.varlen_attention(model):
            model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=cbc, adapter_ids=IDS)
        assert worst and max(worst) < 2e-2, max(worst)
        monkeypatch.setattr(attention, "flash_varlen", real)
        graphed = ContinuousBatchingConfig(num_blocks=32, max_batch_tokens=8, use_cuda_graph=True)
        with attention.varlen_attention(model):
            out = model.generate_batch(PROMPTS, generation_config=gen, continuous_batching_config=graphed,
                                       adapter_ids=IDS)  # fmt: skip
        assert [len(out[f"req_{i}"].generated_tokens) for i in range(len(PROMPTS))] == [5] * len(PROMPTS)
        assert model.get_base_model().config._attn_implementation == "sdpa"
    finally:
        disable_csgmv(model)
