"""Run PEFT's own mixed-adapter-batch tests, unchanged, against stock PEFT and against peft_csgmv.

    python benchmarks/peft_tests/run.py            # csgmv run (then a stock run where none is saved), a table
    python benchmarks/peft_tests/run.py --stock    # the stock-PEFT baseline only
    python benchmarks/peft_tests/run.py -k "TestMixedAdapterBatches and LoRA"   # a subset (pytest -k expression)
    python benchmarks/peft_tests/run.py --table    # print the table of the saved results, run nothing

The tests (PEFT's repository ``tests/`` folder at the installed PEFT version):

* ``tests/test_custom_models.py::TestMixedAdapterBatches`` (all of it)
* ``test_mixed_adapter_batches`` and ``test_generate_with_mixed_adapter_batches`` of ``tests/test_decoder_models.py``,
  ``tests/test_encoder_decoder_models.py`` and ``tests/test_target_parameters.py`` (``PeftCommonTester.
  _test_mixed_adapter_batches`` / ``_test_generate_with_mixed_adapter_batches_and_beam_search`` in
  ``tests/testing_common.py``)
* ``tests/test_trainable_tokens.py::TestTrainableTokens::test_multiple_adapters_mixed_forward``

How the test files are obtained (``--tests-dir`` overrides all of it): PEFT's source distribution on PyPI ships the
``tests/`` folder, so ``pip download peft==<installed version> --no-deps --no-binary :all:`` fetches it; the
``tests/`` folder is extracted to ``<workdir>/tests`` (``<workdir>`` defaults to ``$TMPDIR/peft_peer_tests-<version>``,
outside the repository) and an empty ``tests/__init__.py`` is added, since the test modules use relative imports (the
repository has that file; the sdist does not, nor PEFT's ``tests/conftest.py``, which only adds a ``--regression``
option and a macOS-only report hook that these tests do not need). If the sdist lacks ``tests/``, pass
``--tests-dir`` pointing at a checkout's ``tests/`` folder of the same PEFT version.

The test modules import ``datasets`` and ``diffusers`` at module level, for tests outside this selection. Where those
packages are not installed, ``<workdir>/stubs`` provides import-only stand-ins (which raise if ever used).

Hub models: the decoder, encoder-decoder, target-parameter and trainable-token tests load tiny hub models
(``peft-internal-testing/...``, ``hf-internal-testing/...``, ``trl-internal-testing/...``). Where the hub is out of
reach, the plugin builds a tiny random-weight model of the same architecture from a config instead (see
``plugin._tiny_configs``), in both the stock and the csgmv run; ``--hub`` loads the real models.

The csgmv side: ``plugin.py`` beside this script (loaded into pytest with ``-p plugin``, this folder on
``PYTHONPATH``) wraps ``PeftModel.forward`` / ``generate`` and those of every task subclass so that a call with
``adapter_names`` first runs ``enable_csgmv(model)`` (once per model), then goes through csgmv's patched instance
method.

Results go to ``<workdir>/results-stock.jsonl`` and ``<workdir>/results-csgmv.jsonl`` (one JSON record per test); the
table merges the two by test id.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/peft_tests/, which holds plugin.py
REPO = HERE.parents[1]
TEST_FILES = [
    "tests/test_custom_models.py",
    "tests/test_decoder_models.py",
    "tests/test_encoder_decoder_models.py",
    "tests/test_target_parameters.py",
    "tests/test_trainable_tokens.py",
]


def peft_version() -> str:
    from importlib.metadata import version

    return version("peft")


def obtain_tests(workdir: Path, version: str) -> Path:
    """Download PEFT's sdist for ``version`` and extract its ``tests/`` folder to ``workdir/tests``."""
    tests = workdir / "tests"
    if (tests / "testing_common.py").exists():
        return tests
    with tempfile.TemporaryDirectory() as tmp:
        print(f"downloading the peft=={version} sdist from PyPI for its tests/ folder ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"peft=={version}",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                tmp,
                "-q",
            ],
            check=True,
        )
        sdists = list(Path(tmp).glob("peft-*.tar.gz"))
        if not sdists:
            sys.exit("pip download gave no peft-*.tar.gz")
        with tarfile.open(sdists[0]) as tar:
            prefix = f"{sdists[0].name[: -len('.tar.gz')]}/tests/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix) and m.isfile()]
            if not members:
                sys.exit(
                    f"the peft=={version} sdist has no tests/ folder; pass --tests-dir with the tests/ folder of a "
                    f"PEFT checkout at v{version}"
                )
            tests.mkdir(parents=True, exist_ok=True)
            for m in members:
                m.name = m.name[len(prefix) :]
                tar.extract(m, tests, filter="data")
    (tests / "__init__.py").touch()
    return tests


def use_tests_dir(workdir: Path, source: Path) -> Path:
    tests = workdir / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    shutil.copytree(source, tests)
    (tests / "__init__.py").touch()
    return tests


def write_stubs(workdir: Path) -> Path | None:
    """Import-only stand-ins for ``datasets`` / ``diffusers`` where they are not installed."""
    stubs = workdir / "stubs"
    missing = [m for m in ("datasets", "diffusers") if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    bodies = {
        "datasets": "def load_dataset(*args, **kwargs):\n    raise RuntimeError('datasets is a stub here')\n",
        "diffusers": (
            "class StableDiffusionPipeline:\n    def __init__(self, *args, **kwargs):\n"
            "        raise RuntimeError('diffusers is a stub here')\n"
        ),
    }
    for m in missing:
        (stubs / m).mkdir(parents=True, exist_ok=True)
        (stubs / m / "__init__.py").write_text(bodies[m])
    return stubs


def run_pytest(workdir: Path, mode: str, args, results: Path) -> int:
    ini = workdir / "pytest.ini"
    # PEFT's own pytest settings (pyproject.toml) add coverage options and turn transformers' deprecation warnings
    # into errors; neither is about mixed batches, so this ini leaves them out.
    ini.write_text("[pytest]\nmarkers =\n    regression: PEFT regression tests\n")
    env = dict(os.environ)
    paths = [str(HERE)]
    stubs = write_stubs(workdir)
    if stubs is not None:
        paths.append(str(stubs))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["PEER_MODE"] = mode
    env["PEER_BACKEND"] = args.backend
    env["PEER_RESULTS"] = str(results)
    env["PEER_TINY_MODELS"] = "0" if args.hub else "1"
    env["PEER_DTYPE"] = args.dtype
    if not args.hub:
        env["HF_HUB_OFFLINE"] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        if not torch.cuda.is_available():
            env.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        pass
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-c",
        str(ini),
        "--rootdir",
        str(workdir),
        "-p",
        "plugin",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rN",
        "--tb=line",
        *TEST_FILES,
    ]
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.pytest_args
    print(f"[{mode}] {' '.join(cmd)}", flush=True)
    return subprocess.run(cmd, cwd=workdir, env=env).returncode


def code_state() -> dict:
    """What peft_csgmv code a csgmv run tested: the repository's HEAD, the files under peft_csgmv/ that differ from it,
    and a hash of peft_csgmv/'s Python sources as they were (others may be editing them)."""
    import hashlib

    state = {"peft": peft_version()}
    try:
        state["head"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        state["modified"] = subprocess.run(
            ["git", "status", "--porcelain", "--", "peft_csgmv"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.split("\n")
        state["modified"] = [ln[3:] for ln in state["modified"] if ln.strip()]
    except (OSError, subprocess.CalledProcessError):
        pass
    h = hashlib.sha256()
    for f in sorted((REPO / "peft_csgmv").rglob("*.py")):
        h.update(f.relative_to(REPO).as_posix().encode() + b"\0" + f.read_bytes())
    state["sources_sha256"] = h.hexdigest()[:16]
    return state


def load(results: Path) -> dict[str, dict]:
    if not results.exists():
        return {}
    out = {}
    for line in results.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            out[rec["nodeid"]] = rec
    return out


def short_id(nodeid: str) -> str:
    return nodeid.replace("tests/test_", "").replace(".py::", "::")


def first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    return lines[0] if lines else ""


def print_table(
    stock: dict,
    csgmv: dict,
    selected: set[str] | None,
    show_all: bool = False,
    workdir: Path | None = None,
    suffix: str = "",
) -> None:
    ids = sorted(set(stock) | set(csgmv)) if selected is None else sorted(selected)
    if not ids:
        print("no results")
        return
    skipped_both = [
        i for i in ids if all(r.get(i, {"result": "skipped"})["result"] == "skipped" for r in (stock, csgmv))
    ]
    all_ids = ids
    if not show_all and skipped_both:
        reasons: dict[str, int] = {}
        for i in skipped_both:
            r = (csgmv.get(i) or stock.get(i))["skip_reason"]
            key = "Mixed adapter batches not supported for <non-LoRA/RoAd config>" if "not supported for" in r else r
            reasons[key] = reasons.get(key, 0) + 1
        ids = [i for i in ids if i not in set(skipped_both)]
    width = min(max(len(short_id(i)) for i in ids), 140)
    print(f"\n{'test':<{width}}  {'stock':<8}  {'csgmv':<8}  csgmv failure / note")
    print("-" * (width + 60))
    for i in ids:
        s, c = stock.get(i), csgmv.get(i)
        sr = s["result"] if s else "-"
        cr = c["result"] if c else "-"
        note = ""
        if c and c["result"].startswith(("failed", "error")):
            note = f"{c['exc_type']}: {first_line(c['exc_msg'])}"
            if c["enable_errors"]:
                note += "  [raised by enable_csgmv]"
        elif c and c["result"] == "passed" and not c["csgmv_calls"]:
            note = "(csgmv never engaged)"
        elif s and sr.startswith(("failed", "error")):
            note = f"stock: {s['exc_type']}: {first_line(s['exc_msg'])}"
        elif (c or s) and (c or s)["result"] == "skipped":
            note = (c or s)["skip_reason"][:100]
        if c and c.get("enable_warnings"):
            note += "  [enable_csgmv warned: " + "; ".join(dict.fromkeys(c["enable_warnings"]))[:160] + "]"
        if c and c.get("tuner_calls"):
            note += f"  [{c['tuner_calls']} adapter_names call(s) reached a tuner model directly]"
        print(f"{short_id(i):<{width}}  {sr:<8}  {cr:<8}  {note}")

    if not show_all and skipped_both:
        print(f"\n({len(skipped_both)} tests skipped in both runs not shown (--all shows them):")
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
            print(f"   {n:4d}  {reason[:110]}")
        print(")")

    def counts(res: dict) -> str:
        sel = [res[i] for i in all_ids if i in res]
        by = {}
        for r in sel:
            key = r["result"].split("(")[0]
            by[key] = by.get(key, 0) + 1
        return ", ".join(f"{v} {k}" for k, v in sorted(by.items())) or "not run"

    print(f"\nstock: {counts(stock)}")
    print(f"csgmv: {counts(csgmv)}")
    ran = [csgmv[i] for i in all_ids if i in csgmv and csgmv[i]["result"] == "passed"]
    if ran:
        engaged = sum(1 for r in ran if r["csgmv_calls"])
        print(f"csgmv engaged (its forward or generate took the call) in {engaged} of the {len(ran)} passed tests")
    tiny = sorted({m for r in list(stock.values()) + list(csgmv.values()) for m in r.get("tiny_models", [])})
    if tiny:
        print("hub models replaced by tiny config-built models: " + ", ".join(tiny))
    if workdir is not None and (workdir / f"state-csgmv{suffix}.json").exists():
        st = json.loads((workdir / f"state-csgmv{suffix}.json").read_text())
        mod = ", ".join(st.get("modified", [])) or "none"
        print(
            f"csgmv code tested: HEAD {st.get('head', '?')}, modified under peft_csgmv/: {mod}; "
            f"sources sha256 {st['sources_sha256']}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stock", action="store_true", help="run stock PEFT only (the baseline)")
    p.add_argument("-k", help="pytest -k expression to run a subset")
    p.add_argument("--table", action="store_true", help="print the table of saved results and run nothing")
    p.add_argument("--rerun-stock", action="store_true", help="run the stock baseline again before the csgmv run")
    p.add_argument("--tests-dir", type=Path, help="use this PEFT tests/ folder instead of the PyPI sdist's")
    p.add_argument("--workdir", type=Path, help="where tests and results live (default: a temp folder per version)")
    p.add_argument("--backend", default="auto", help="enable_csgmv backend (auto | triton | torch)")
    p.add_argument("--all", action="store_true", help="also list the tests skipped in both runs")
    p.add_argument("--hub", action="store_true", help="load the real hub models instead of tiny config-built ones")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="bf16: the transformers models the tests load are bf16 (their adapters fp32, PEFT's default); results "
        "saved apart from the fp32 run's",
    )
    p.add_argument(
        "--fetch",
        metavar="VERSION",
        help="only download PEFT VERSION's tests/ into wheels/peft-VERSION/tests (for a machine without PyPI, e.g. "
        "the GPU image's PEFT: carry wheels/ and pass --tests-dir there)",
    )
    p.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = p.parse_args()
    if args.fetch:
        print(obtain_tests(REPO / "wheels" / f"peft-{args.fetch}", args.fetch))
        return

    version = peft_version()
    workdir = args.workdir or Path(tempfile.gettempdir()) / f"peft_peer_tests-{version}"
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.dtype == "fp32" else f"-{args.dtype}"
    stock_file, csgmv_file = workdir / f"results-stock{suffix}.jsonl", workdir / f"results-csgmv{suffix}.jsonl"

    if args.table:
        print_table(load(stock_file), load(csgmv_file), None, args.all, workdir, suffix)
        return

    if args.tests_dir:
        use_tests_dir(workdir, args.tests_dir.resolve())
    else:
        obtain_tests(workdir, version)
    print(f"PEFT {version} tests in {workdir / 'tests'}", flush=True)

    # Each run writes its records to a fresh file; they are merged into the saved results afterwards, so that a -k
    # subset updates only its own rows.
    def run(mode: str, saved: Path) -> dict:
        fresh = workdir / f"run-{mode}{suffix}.jsonl"
        state = code_state()
        rc = run_pytest(workdir, mode, args, fresh)
        if mode == "csgmv" and state["sources_sha256"] != code_state()["sources_sha256"]:
            print("[csgmv] warning: peft_csgmv/ changed while the tests ran; results may mix two versions")
        (workdir / f"state-{mode}{suffix}.json").write_text(json.dumps(state))
        new = load(fresh)
        merged = {**load(saved), **new}
        saved.write_text("".join(json.dumps(r) + "\n" for r in merged.values()))
        print(f"[{mode}] pytest exit code {rc}, {len(new)} tests recorded", flush=True)
        return new

    if args.stock:
        new = run("stock", stock_file)
        print_table(load(stock_file), load(csgmv_file), set(new), args.all, workdir, suffix)
        return
    if args.rerun_stock:
        run("stock", stock_file)
    new = run("csgmv", csgmv_file)
    if set(new) - set(load(stock_file)):
        print("no stock result saved for some of these tests: running the stock baseline on the same selection")
        run("stock", stock_file)
    print_table(load(stock_file), load(csgmv_file), set(new), args.all, workdir, suffix)


if __name__ == "__main__":
    main()
