"""``peft-csgmv generate`` data-parallel: several processes (``torchrun`` here; ``accelerate launch`` starts the same
processes on GPUs) each generate their share of the lines into their own part file, and the first merges them. Checked
on the CPU (gloo) with two real processes, each with its own continuous-batching manager (or its own static batches):
the output is byte for byte the one-process output; a run resumes what earlier runs with another process count left
in their part files (torn lines cut, edited lines redone), and the final output holds every line once; the sharding
takes every line once; flags that pick one device are refused."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from peft_csgmv import batch
from peft_csgmv.cli import main
from peft_csgmv.continuous import continuous_batching_available
from peft_csgmv.toy import save_toy_checkout

PROMPTS = [
    {"prompt": f"prompt number {i} " + "x " * (i % 5), "adapter": ["legal", "chat", None][i % 3], "id": i}
    for i in range(11)
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    base, adapters = save_toy_checkout(str(root / "toy"), {"legal": 4, "chat": 8})
    inp = root / "in.jsonl"
    inp.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    flags = ["--base", base, "--input", str(inp), "--max-new-tokens", "6", "--batch-size", "3", "--no-progress"]
    for name, path in adapters.items():
        flags += ["--adapter", f"{name}={path}"]
    reference = root / "one.jsonl"
    assert main(["generate", *flags, "--output", str(reference), "--device", "cpu"]) == 0
    return flags, inp, reference


def _torchrun(flags, out, processes=2) -> subprocess.CompletedProcess:
    # On the CPU (gloo), as the docstring says, on machines with GPUs too.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes),
           "-m", "peft_csgmv", "generate", *flags, "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.parametrize("batching", ["continuous batching", "static batches"])
def test_two_processes_write_what_one_writes(setup, tmp_path, batching):
    """Each process runs its own continuous-batching manager over its share (or its own static batches with
    --static-batches); the merged output is the one-process output (continuous batching, fp32, greedy)."""
    flags, _, reference = setup
    out = tmp_path / "two.jsonl"
    proc = _torchrun(flags + (["--static-batches"] if batching == "static batches" else []), out)
    assert "2 processes, each on its own share of the lines" in proc.stderr
    if not continuous_batching_available():
        batching = "static batches"  # (transformers before 5: the command says so and takes static batches)
    # (A progress bar of the other process may share a line with a message: the messages are found, not the lines.)
    wrote = re.findall(r"process (\d) of 2: wrote (\d+) rows, [^(]*\(([^,]*), ([^)]*)\) to ", proc.stderr)
    assert sorted((rank, rows, how) for rank, rows, _, how in wrote) == [("0", "6", batching), ("1", "5", batching)]
    assert out.read_bytes() == reference.read_bytes()
    assert batch.part_paths(str(out)) == [], "part files left behind"


def test_resume_after_a_run_with_another_process_count(setup, tmp_path):
    """An interrupted 3-process run left its output and part files: records for lines 1-3 in the output, lines 4-5
    and a torn line in part 0, a record for line 10 whose input line has since been edited in part 2. Two processes
    generate only what is missing, and the output is the one-process output, every line once."""
    flags, inp, reference = setup
    records = [json.loads(line) for line in reference.read_text().splitlines()]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    part0 = batch.part_path(str(out), 0, 3)
    with open(part0, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records[3:5]) + '{"line": 7, "compl')
    stale = dict(records[9], input_sha1="0" * 40)
    with open(batch.part_path(str(out), 2, 3), "w") as f:
        f.write(json.dumps(stale) + "\n")
    proc = _torchrun(flags, out)
    assert "11 lines: 6 to generate, 5 already done" in proc.stderr
    assert "1 results dropped" in proc.stderr
    assert out.read_bytes() == reference.read_bytes()
    assert batch.part_paths(str(out)) == []
    # And one process resumes what two left (nothing here): the same file, untouched.
    assert main(["generate", *flags, "--output", str(out), "--device", "cpu"]) == 0
    assert out.read_bytes() == reference.read_bytes()


def test_one_process_merges_parts_left_by_several(setup, tmp_path, capsys):
    flags, _, reference = setup
    records = [json.loads(line) for line in reference.read_text().splitlines()]
    out = tmp_path / "out.jsonl"
    for rank in range(4):
        with open(batch.part_path(str(out), rank, 4), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in records[rank::4][:2]))
    assert main(["generate", *flags, "--output", str(out), "--device", "cpu"]) == 0
    assert "11 lines: 3 to generate, 8 already done" in capsys.readouterr().err
    assert out.read_bytes() == reference.read_bytes()
    assert batch.part_paths(str(out)) == []


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_shards_take_every_line_once(world):
    rows = list(range(23))
    shares = [batch.Shard(rank, world).take(rows) for rank in range(world)]
    assert sorted(r for share in shares for r in share) == rows
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


@pytest.mark.parametrize("flag", [["--device", "cpu"], ["--device-map", "auto"]])
def test_device_flags_refused_with_several_processes(setup, tmp_path, capsys, monkeypatch, flag):
    flags, _, _ = setup
    monkeypatch.setattr(batch, "current_shard", lambda: batch.Shard(0, 2, "cpu"))
    out = tmp_path / "out.jsonl"
    assert main(["generate", *flags, "--output", str(out), *flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} with 2 processes" in err and "leave" in err
    assert not out.exists()


def test_more_processes_than_gpus_refused_before_anything(setup, tmp_path, capsys, monkeypatch):
    """Two processes on a machine with one GPU: each would take the GPU of its local rank, and the second fails in the
    first collective with CUDA's "invalid device ordinal". The command says so up front and writes nothing."""
    flags, _, _ = setup
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out.jsonl"
    assert main(["generate", *flags, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "2 processes on this machine but 1 GPU visible" in err and "accelerate launch --cpu" in err
    assert not out.exists() and batch.part_paths(str(out)) == []
