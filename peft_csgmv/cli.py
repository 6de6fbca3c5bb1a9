"""The ``peft-csgmv`` command: the demo (the default), ``generate`` (batch generation from JSONL, see batch.py),
``serve`` (an OpenAI-compatible HTTP server, see serve.py) and ``bench`` (see bench.py). Every problem with
``generate``'s arguments is found before the model loads and reported as one line naming the argument (exit 2); Ctrl-C
stops with one line (exit 130)."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

import torch

from .batch import CPU_MAX_BATCH_TOKENS, DENSE_MASK_MAX_REQUESTS
from .identity import settings_path


def say(message) -> None:
    """One line to stderr in one write: the processes of a data-parallel run share it, and print's two writes (the
    text, then the newline) let their lines run into each other."""
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int = 3):
    """Run ``fn`` once to warm up, then ``repeats`` times; return (last result, median seconds)."""
    out = fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return out, sorted(times)[len(times) // 2]


def demo(device: str | None = None, seed: int = 0) -> bool:
    """Build a small model with four adapters, run a mixed batch both ways, print the comparison. Returns whether
    they agree."""
    from . import disable_csgmv, enable_csgmv
    from .toy import tiny_llama, with_adapters

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    vocab = 1000
    base = tiny_llama(hidden=256, layers=4, seed=seed, vocab_size=vocab).to(dev, dtype)
    adapters = {"legal": 4, "chat": 8, "code": 16, "math": 32}
    model = with_adapters(base, adapters, seed=seed + 1)

    names = ["legal", "__base__", "chat", "code", "math", "legal", "__base__", "code"]
    batch, length = len(names), 32
    input_ids = torch.randint(3, vocab, (batch, length), device=dev)
    mask = torch.ones_like(input_ids)
    mask[1::3, :5] = 0  # some left padding
    print(
        f"peft_csgmv demo on {dev} ({dtype}): {len(adapters)} adapters (ranks {list(adapters.values())}), "
        f"batch {batch} × {length} tokens, rows {names}"
    )
    if dev.type == "cpu":
        print(
            "on cpu csgmv runs its plain-torch backend (the Triton kernels need CUDA): the times below say nothing "
            "of its speed on a GPU, and swing from run to run"
        )

    greedy = dict(input_ids=input_ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref, t_peft = _timed(lambda: model(input_ids, attention_mask=mask, adapter_names=names).logits, dev)
        ref_gen = model.generate(adapter_names=names, **greedy)
    enable_csgmv(model)
    try:
        out, t_csgmv = _timed(lambda: model(input_ids, attention_mask=mask, adapter_ids=names).logits, dev)
        gen = model.generate(adapter_ids=names, **greedy)
    finally:
        disable_csgmv(model)

    diff = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    same_tokens = torch.equal(gen, ref_gen)
    agree = diff <= tol * max(scale, 1.0)
    print(
        f"forward logits: max |csgmv - PEFT| = {diff:.3g} (logits up to {scale:.3g}) -> "
        f"{'agree' if agree else 'DISAGREE'}"
    )
    if same_tokens:
        print("greedy generate, 8 new tokens: token-identical")
    else:
        share = (gen == ref_gen).float().mean().item()
        print(
            f"greedy generate, 8 new tokens: {share:.0%} of tokens identical ({dtype}: rounding can flip near-ties "
            "of a random model; in fp32 they are identical)"
        )
    print(f"forward time: PEFT adapter_names {t_peft * 1e3:.1f} ms, csgmv {t_csgmv * 1e3:.1f} ms")
    return agree and (same_tokens or dtype != torch.float32)


DESCRIPTION = """\
Fast mixed-adapter LoRA batches for HuggingFace transformers + PEFT.

With no command, runs the demo: a small random-weight model with four adapters, one mixed batch through stock PEFT
and through csgmv, whether they agree and the time of each."""

GENERATE_DESCRIPTION = """\
Generate a completion for every line of a JSONL file, each line with its own adapter, by continuous batching: every
request with its line's adapter goes to one manager (transformers' continuous batching), which packs prefill chunks
and decode tokens of many requests and adapters into each step and takes new requests as others finish.

input:  one JSON object per line: {"prompt": "...", "adapter": "legal", "id": 17}; "adapter" absent, null or
        "__base__" means the base model; "id" is optional and echoed; "max_new_tokens" (optional, a positive
        integer) is the line's own limit in place of --max-new-tokens; blank lines are skipped.
output: one JSON object per input line: {"line": 3, "id": 17, "adapter": "legal", "completion": "...",
        "new_tokens": 42, "input_sha1": "...", "settings_sha1": "..."}, or {"line": 5, "error": "...", ...} for
        a bad line under --on-error skip. input_sha1 is the SHA-1 of the line's request (its prompt and adapter,
        and its own max_new_tokens where it gives one), settings_sha1 that of the run settings that made it;
        OUTPUT.settings.json beside the output holds those
        settings: --base, --dtype, --adapter-dtype, --max-new-tokens, --do-sample (with it --temperature, --top-p,
        --top-k, --seed) and each adapter's files (by their SHA-1). "line" and "id" are those of the input now.
order:  each record is appended as soon as its request finishes (with --static-batches, batch by batch); when the
        run completes the file is rewritten in input order.
resume: run the same command again. A line is done when the output holds a completion with its input_sha1,
        wherever the line was: inserted, deleted, moved or blank lines shift nothing; new lines, edited lines and
        lines with an error record are generated (records no line asks for are dropped). The same request on k
        lines needs k completions. An output holding another input's results, results made with other settings
        (the message names them) or results without settings_sha1 is refused before anything runs, unless
        --overwrite (start afresh). The other options (batching, batch size, cache, device, backend, ...) change how
        the work runs, not what it computes: they may differ between runs.
checks: paths, adapters and options are checked before the model loads: each problem is one line, exit 2. Bad
        input lines are all listed before anything runs. An input with no lines exits 0 without an output.
        Ctrl-C stops after writing the finished requests (exit 130): rerun the same command to resume.
static: --static-batches runs padded batches of --batch-size rows through generate() instead, grouped by prompt
        length. The command runs them by itself, with a one-line note, where continuous batching cannot do what
        the run asks: transformers before 5 (no continuous batching), --cache-implementation static,
        a --device-map over several devices, or a model generation config that asks for
        what continuous batching lacks (beam search, repetition penalty, minimum lengths, stop strings, ...).
sizing: continuous batching's paged KV cache and its steps: --max-batch-tokens (tokens per step), --num-blocks
        (cache blocks of 256 tokens) or --cache-memory (a share of the free GPU memory), --batch-size (requests
        per step at most; 128 by default on a GPU whose attention is SDPA or eager).
speed:  on a CUDA device continuous batching runs each step as transformers' CUDA graph, captured once per step
        size (--no-cuda-graphs: eager steps). --static-batches --cache-implementation static runs transformers'
        compiled decode (CUDA), one compile per batch shape: prompts are padded to a power of two and the last
        batch filled, so a run compiles a few shapes, and each batch decodes until its longest answer is done. A
        run on a GPU whose lines share one length limit, with rows x --max-new-tokens of 65536 or more (and none
        of the options above that choose the batching or size continuous batching), takes these static-cache
        batches, 64 rows each, by itself, saying so in one line, where continuous batching would attend with
        SDPA's mask (docs/benchmarks.md); --continuous-batching keeps continuous batching. Where the flash-attn
        package is missing continuous batching attends per request with torch's own flash kernel wherever it
        can (CUDA, bf16/fp16), saying so in one line; --no-varlen-attention: one dense mask over every running
        request's cache (SDPA's; 2.8-3.7x slower on uneven lines on an H100). --adapter-dtype model: bf16
        adapters on a bf16 model (the default, fp32, is PEFT's).
memory: --max-resident-adapters N keeps N adapters on the GPU, the rest in host memory; a step (or a static
        batch) then holds at most N distinct adapters, requests of others waiting for a slot.
gpus:   accelerate launch --num_processes N -m peft_csgmv generate ... (or torchrun) runs N processes, one per GPU,
        each with its own continuous-batching manager over every N-th line still to do, writing
        OUTPUT.part-R-of-N; the first merges the parts when all are done. A later run, with any number of
        processes, resumes from the output and any parts left."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written; every option's help ends with its default."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.required or action.default is argparse.SUPPRESS or "default" in text or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


def _adapter_arg(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def _number(kind, low, high=None, low_open=False, what=""):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}")
        if value < low or (low_open and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text}")
        return value

    return parse


# A hub repo id: "name" or "owner/name" (what is not a local path and not shaped like this is a missing folder).
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _hub_id_shaped(value: str) -> bool:
    return bool(_HUB_ID.match(value)) and ".." not in value and not value.endswith((".json", ".jsonl"))


def _folder_problem(label: str, value: str, needed: str, kind: str) -> str | None:
    """A local folder must hold ``needed``; a value that names nothing here must look like a hub id."""
    if os.path.isdir(value):
        if os.path.isfile(os.path.join(value, needed)):
            return None
        nested = sorted(d for d in os.listdir(value) if os.path.isfile(os.path.join(value, d, needed)))
        hint = f" (there is one in {os.path.join(value, nested[0])}: give that folder)" if nested else ""
        return f"{label}: no {needed} in {value}{hint}"
    if os.path.exists(value):
        return f"{label}: {value} is a file, not a {kind} folder"
    if _hub_id_shaped(value):
        return None  # a hub id: looked up before the model loads (_hub_problem)
    return f"{label}: no such folder: {value}"


def _hub_problem(label: str, repo: str, needed: str) -> str | None:
    """For a value that is no local folder: is it a hub repo holding ``needed``? One quick request, no retries."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache

        if isinstance(try_to_load_from_cache(repo, needed), str):
            return None
        if constants.HF_HUB_OFFLINE:
            return f"{label}: no such local folder, and not in the hub cache (offline)"
        from huggingface_hub import HfApi

        if HfApi().file_exists(repo, needed):
            return None
        return f"{label}: no such local folder, and no hub repo {repo} with a {needed} (or no access to it)"
    except Exception as e:  # noqa: BLE001 - any failure to ask is reported, in one line
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        return f"{label}: no such local folder, and the hub could not be asked about it ({type(e).__name__}: {reason})"


def _labels(args) -> tuple[str, list[tuple[str, str]]]:
    return f"--base {args.base}", [(f"--adapter {name}={path}", path) for name, path in args.adapter]


def check_generate_args(args) -> list[str]:
    """Every problem with ``generate``'s paths and options that can be seen without loading anything, one line
    each (hub ids are looked up by ``check_hub_args``)."""
    problems = []
    names = [name for name, _ in args.adapter]
    for name in sorted({n for n in names if names.count(n) > 1}):
        problems.append(f"--adapter {name}=...: the name {name!r} is given {names.count(name)} times")
    if "__base__" in names:
        problems.append("--adapter __base__=...: __base__ is the base model's name; choose another")

    inp = args.input
    if not os.path.exists(inp):
        problems.append(f"--input {inp}: no such file")
    elif os.path.isdir(inp):
        problems.append(f"--input {inp}: is a folder, not a file")
    else:
        try:
            with open(inp, "rb"):
                pass
        except OSError as e:
            problems.append(f"--input {inp}: cannot be read ({e.strerror or e})")

    out = args.output
    parent = os.path.dirname(os.path.abspath(out))
    if os.path.isdir(out):
        problems.append(f"--output {out}: is a folder; give a file path (e.g. {os.path.join(out, 'out.jsonl')})")
    elif not os.path.isdir(parent):
        problems.append(f"--output {out}: its folder {parent} does not exist")
    elif not os.access(parent, os.W_OK) or (os.path.exists(out) and not os.access(out, os.W_OK)):
        problems.append(f"--output {out}: cannot be written")
    elif os.path.isfile(inp) and os.path.exists(out) and os.path.samefile(inp, out):
        problems.append(f"--output {out}: is the --input file")
    elif os.path.isdir(settings_path(out)):
        problems.append(f"--output {out}: {settings_path(out)}, where the run's settings are kept, is a folder")

    base_label, adapter_labels = _labels(args)
    problem = _folder_problem(base_label, args.base, "config.json", "model")
    if problem:
        problems.append(problem)
    for label, path in adapter_labels:
        problem = _folder_problem(label, path, "adapter_config.json", "adapter")
        if problem:
            problems.append(problem)

    sizing = _sizing(args)
    static = "--static-batches" if args.static_batches else None  # (the flag that asks for static batches)
    if static is None and args.cache_implementation == "static":
        static = "--cache-implementation static"
    if args.continuous_batching and static:
        problems.append(f"--continuous-batching and {static}: give one of them")
    if args.static_batches:
        for flag, value in ((f, v) for f, v in sizing.items() if v is not None):
            problems.append(f"{flag} {value}: sizes continuous batching, which --static-batches turns off; give one")
    elif args.num_blocks is not None and args.cache_memory is not None:
        problems.append(f"--num-blocks {args.num_blocks} and --cache-memory {args.cache_memory}: give one of them")
    if args.cuda_graphs:
        graphs = "--cuda-graphs runs continuous batching's steps as CUDA graphs"
        if static:
            problems.append(f"--cuda-graphs and {static}: {graphs}; give one of them")
        if args.device_map:
            problems.append(f"--cuda-graphs and --device-map {args.device_map}: {graphs}, which cannot replay "
                            "accelerate's placement; leave one out")  # fmt: skip
        if args.backend == "torch":
            problems.append(f"--cuda-graphs and --backend torch: {graphs}, which need the Triton kernels")
    if args.varlen_attention and static:
        problems.append(f"--varlen-attention and {static}: it is continuous batching's attention; give one of them")
    if args.device and args.device_map:
        problems.append(f"--device {args.device} and --device-map {args.device_map}: give one of them")
    elif args.device:
        problem = _device_problem(args.device)
        if problem:
            problems.append(problem)
    return problems


def _sizing(args) -> dict:
    """The flags that size continuous batching, by name, as given (``None``: not given)."""
    return {"--max-batch-tokens": args.max_batch_tokens, "--num-blocks": args.num_blocks,
            "--cache-memory": args.cache_memory}  # fmt: skip


def _device_problem(name: str) -> str | None:
    """What is wrong with ``--device name`` here (``None``: nothing)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        return f"--device {name}: not a device (cpu, cuda, cuda:1, ...)"
    if device.type == "cuda" and not torch.cuda.is_available():
        return f"--device {name}: no CUDA device here (--device cpu runs on the CPU)"
    return None


def check_hub_args(args) -> list[str]:
    """``--base`` and ``--adapter`` values that are no local folder: each must be a hub repo (one request each)."""
    base_label, adapter_labels = _labels(args)
    wanted = [(base_label, args.base, "config.json")] + [(lb, p, "adapter_config.json") for lb, p in adapter_labels]
    missing = [(label, value, needed) for label, value, needed in wanted if not os.path.exists(value)]
    return [problem for problem in (_hub_problem(*m) for m in missing) if problem]


DEFAULT_BATCH_SIZE = 16  # rows per generate call of static batches


def _static_reason(args) -> str | None:
    """Why this run takes static batches though --static-batches is not given (``None``: it runs continuous batching,
    unless the loaded model's generation config asks for what continuous batching lacks; see
    :func:`batch.continuous_obstacle`)."""
    from .continuous import continuous_batching_available

    if not continuous_batching_available():
        import transformers

        return f"transformers {transformers.__version__} has none (it needs transformers 5 or later)"
    if args.cache_implementation == "static":
        return "--cache-implementation static is a static-batch option (transformers' compiled decode)"
    return None


# On a GPU static-cache batches run transformers' compiled decode, whose compile (one per batch shape) a long enough
# run pays back, and pay for each batch's longest answer. Measured on an H100 (the 1B layout, 32 adapters;
# docs/benchmarks.md, "The batch command"): lines of one --max-new-tokens (prompts of 140-236 tokens, 64 new tokens),
# continuous batching with eager steps 1687 tok/s against static-cache batches of 64 at 949 over 512 rows (their
# compiles included), 1184 against 2469 over 2048; uneven lines (1024, prompts of ~32-1024 tokens, limits of 16-512
# new tokens), continuous batching under CUDA graphs (the default on CUDA since) 1234 against 987. A run that asks
# for neither takes static-cache batches where every line has the same limit, from about the midpoint of the two
# even runs, counted in rows times --max-new-tokens, where continuous batching would attend with SDPA. Attending per
# request (attention.py), continuous batching under CUDA graphs ran the 2048 even lines at 1.58x static-cache batches in
# one run (4324 against 2732 tok/s), and the uneven ones at 3816-5243: it stays continuous batching.
STATIC_PAYS_TOKENS = 1024 * 64
AUTO_STATIC_DEVICES = ("cuda",)  # where the static cache's decode step is compiled
AUTO_STATIC_BATCH_SIZE = 64  # the static-cache batches' rows per generate call where the command picks them


def _auto_static(args, rows: list, device: torch.device, model) -> str | None:
    """Why a run that asked for neither continuous batching nor static batches takes static-cache batches (``None``:
    continuous batching): ``rows`` to do on a GPU, each of --max-new-tokens (no line with a limit of its own: uneven
    answers are continuous batching's case), past :data:`STATIC_PAYS_TOKENS`, on a model transformers compiles in
    full and without MoE expert LoRA (whose compiled path has not yet run on a GPU), where continuous batching would
    attend with SDPA's dense mask (not per request: :func:`attention.command_choice`)."""
    from . import attention
    from .model import csgmv_stats

    asked = args.static_batches or args.continuous_batching or args.cuda_graphs is not None or args.varlen_attention
    asked = asked or args.cache_implementation is not None
    sized = any(v is not None for v in _sizing(args).values())
    if asked or sized or device.type not in AUTO_STATIC_DEVICES or any(r.max_new_tokens for r in rows):
        return None
    if len(rows) * args.max_new_tokens < STATIC_PAYS_TOKENS:
        return None
    if not getattr(model.get_base_model(), "_can_compile_fullgraph", True) or csgmv_stats(model)["expert_layers"]:
        return None
    if args.varlen_attention is None and attention.command_choice(None, model)[0]:
        return None
    return (
        f"{len(rows)} rows x {args.max_new_tokens} new tokens on a GPU: past where compiled static-cache batches beat "
        "continuous batching on lines of one length limit (--continuous-batching keeps it)"
    )


def _graphs(args, model) -> bool:
    """Whether continuous batching runs its steps as CUDA graphs: as --cuda-graphs / --no-cuda-graphs say, else
    wherever the loaded ``model`` can replay them (:func:`continuous.graphs_refusal`: on CUDA, the Triton kernels, no
    layer offloaded) and no --device-map placed it (the checks refuse --cuda-graphs with one: accelerate's hooks)."""
    if args.cuda_graphs is not None:
        return args.cuda_graphs
    from .continuous import graphs_refusal

    return not args.device_map and graphs_refusal(model) is None


def generate_command(args, prog: str = "peft-csgmv generate") -> int:
    """``peft-csgmv generate``: see peft_csgmv/batch.py."""
    from . import attention, batch, identity

    def fail(problems: list[str]) -> int:
        for problem in problems:
            say(f"{prog}: error: {problem}")
        return 2

    problems = check_generate_args(args)
    if problems:
        return fail(problems)
    try:
        shard = batch.current_shard()
    except batch.ShardError as e:
        return fail([str(e)])
    if shard.world > 1:
        for flag, value in (("--device-map", args.device_map), ("--device", args.device)):
            if value:
                why = f"each process generates on its own device ({shard.device}: accelerate's choice)"
                return fail([f"{flag} with {shard.world} processes: {why}; leave {flag} out, or run one process"])
    adapters = dict(args.adapter)
    parsed = batch.read_input(args.input, adapters, args.prompt_key, args.adapter_key)
    if not parsed.lines:
        say("input has no lines: nothing to do")
        return 0
    if parsed.errors:
        say(batch.InputError(parsed.errors))
        if args.on_error == "stop":
            say("stopped before generating anything (use --on-error skip to skip bad lines)")
            return 2
    # Hub values are looked up first: the run's settings fingerprint a hub adapter's files.
    problems = check_hub_args(args)
    if problems:
        return fail(problems)
    try:
        settings = identity.run_settings(
            args.base,
            adapters,
            max_new_tokens=args.max_new_tokens,
            do_sample=args.do_sample,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            dtype=args.dtype,
            adapter_dtype=args.adapter_dtype,
        )
    except identity.SettingsError as e:
        return fail([str(e)])
    try:
        resume = batch.resume_state(args.output, parsed, overwrite=args.overwrite, settings=settings)
    except batch.OutputMismatch as e:
        return fail([f"--output {args.output}: {e}; give another --output, or --overwrite to start it afresh"])
    todo = [r for r in parsed.rows if r.line not in resume.done]
    first = shard.rank == 0
    notes = []
    if resume.stale:
        notes.append(f"{resume.stale} results dropped (their lines changed or are gone)")
    if resume.retry:
        notes.append(f"{resume.retry} error records from an earlier run (those lines are read again)")
    if shard.world > 1:
        notes.append(f"{shard.world} processes, each on its own share of the lines")
    static_reason = None if args.static_batches else _static_reason(args)
    if first:
        say(
            f"{parsed.lines} lines: {len(todo)} to generate, {len(resume.done)} already done, "
            f"{len(parsed.errors)} bad; {len(adapters)} adapters" + "".join(f"; {n}" for n in notes)
        )
        if static_reason and todo:
            say(f"static batches, not continuous batching: {static_reason}")
    # Every process has read the output and the parts before the first one rewrites them: all agree on what is done.
    shard.barrier()
    if first:
        batch.start_output(args.output, resume, parsed, error_records=bool(parsed.errors), settings=settings)
    shard.barrier()
    mine = shard.take(todo)
    if mine:
        device = str(shard.device) if shard.world > 1 else args.device
        model, tokenizer = batch.load_model(
            args.base,
            adapters,
            args.dtype,
            args.device_map,
            device,
            args.backend,
            adapter_dtype=args.adapter_dtype,
            max_resident_adapters=args.max_resident_adapters,
        )
        torch.manual_seed(args.seed)
        gen = dict(max_new_tokens=args.max_new_tokens, do_sample=args.do_sample)
        if args.do_sample:
            gen.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        continuous = None
        auto = _auto_static(args, mine, next(model.parameters()).device, model) if static_reason is None else None
        if auto is not None:
            static_reason = auto
            gen["cache_implementation"] = "static"
            if first:
                say(f"static-cache batches, not continuous batching: {auto}")
        if not args.static_batches and static_reason is None:
            static_reason = batch.continuous_obstacle(model, tokenizer, {r.adapter for r in mine}, **gen)
            if static_reason is None:
                varlen, varlen_note = attention.command_choice(args.varlen_attention, model)
                continuous = batch.Continuous(
                    max_batch_tokens=args.max_batch_tokens,
                    num_blocks=args.num_blocks,
                    cache_memory=args.cache_memory,
                    max_requests=args.batch_size,
                    seed=args.seed,
                    cuda_graphs=_graphs(args, model),
                    varlen_attention=varlen,
                )
                if varlen_note is not None and first:
                    say(varlen_note)
            elif first:
                say(f"static batches, not continuous batching: {static_reason}")
        if continuous is None and args.cache_implementation == "static":
            gen["cache_implementation"] = "static"
        out = batch.part_path(args.output, shard.rank, shard.world) if shard.world > 1 else args.output
        try:
            stats = batch.generate_rows(
                model,
                tokenizer,
                mine,
                out,
                batch_size=args.batch_size or (AUTO_STATIC_BATCH_SIZE if auto else DEFAULT_BATCH_SIZE),
                progress=not args.no_progress and first,
                settings=settings,
                continuous=continuous,
                **gen,
            )
        except batch.SizingError as e:
            return fail([str(e)])
        except batch.GenerationFailed as e:
            rerun = "what finished is in the output: rerun the same command to resume"
            say(f"{prog}: error: {e}; {rerun}")
            return 1
        who = f"process {shard.rank} of {shard.world}: " if shard.world > 1 else ""
        say(
            f"{who}wrote {stats['rows']} rows, {stats['new_tokens']} new tokens in {stats['seconds']:.1f} s "
            f"({stats['new_tokens'] / max(stats['seconds'], 1e-9):.1f} tok/s, "
            f"{'continuous batching' if continuous else 'static batches'}) to {out}"
        )
    shard.barrier()
    if first:
        batch.finish_output(args.output, parsed)
    return 0


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The command's parser and its sub-parsers by name."""
    from . import attention

    parser = argparse.ArgumentParser(prog="peft-csgmv", description=DESCRIPTION, formatter_class=_HelpFormatter)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="{demo,generate,serve,bench}")
    p_demo = sub.add_parser(
        "demo", help="run the demo (the default)", description=DESCRIPTION, formatter_class=_HelpFormatter
    )
    p_demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if there is one)")

    p_gen = sub.add_parser(
        "generate",
        help="generate for a JSONL file of prompts, each with its own adapter (resumable)",
        description=GENERATE_DESCRIPTION,
        formatter_class=_HelpFormatter,
    )
    p_gen.add_argument("--base", required=True, help="base model: a local folder or a hub id (required)")
    p_gen.add_argument(
        "--adapter",
        action="append",
        type=_adapter_arg,
        required=True,
        metavar="NAME=PATH",
        help="a LoRA adapter to load under NAME, from a local folder or a hub id; repeat for more (required)",
    )
    p_gen.add_argument(
        "--input",
        required=True,
        help='JSONL file, one {"prompt": ..., "adapter": NAME|null, "id": ...} a line (required)',
    )
    p_gen.add_argument(
        "--output", required=True, help="JSONL file for the results; an existing one is resumed (required)"
    )
    p_gen.add_argument(
        "--overwrite",
        action="store_true",
        help="start the output afresh, dropping what it holds, instead of resuming (also where its results were made "
        "with other settings)",
    )
    positive = _number(int, 1, what="1 or more")
    p_gen.add_argument(
        "--static-batches",
        action="store_true",
        help="run padded batches of --batch-size rows through generate(), grouped by prompt length, instead of "
        "continuous batching",
    )
    p_gen.add_argument(
        "--continuous-batching",
        action="store_true",
        help="run continuous batching where the command would take static-cache batches by itself (a long run on a "
        "GPU: see 'speed' above)",
    )
    p_gen.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continuous batching: run each step as transformers' CUDA graph, captured once per step size and "
        "replayed (default: on a CUDA device with the Triton kernels and no --device-map; on the CPU steps stay "
        "eager); --no-cuda-graphs: eager steps",
    )
    p_gen.add_argument(
        "--varlen-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="continuous batching: attend per request with torch's own flash kernel (CUDA, bf16/fp16, a model "
        "transformers runs with flash attention; for where the flash-attn package is missing) instead of SDPA's one "
        "dense mask over every running request's cache, and lift the cap of requests per step that mask needs "
        f"(default: {attention.command_default()}); --no-varlen-attention: SDPA's",
    )
    p_gen.add_argument(
        "--batch-size",
        type=positive,
        default=None,
        help=f"static batches: rows per generate call (default: {DEFAULT_BATCH_SIZE}); continuous batching: requests "
        f"per step at most (default: {DENSE_MASK_MAX_REQUESTS} on a GPU whose attention is SDPA or eager, where a "
        "step's attention grows with the square of its requests; else as many as --max-batch-tokens holds)",
    )
    p_gen.add_argument(
        "--max-batch-tokens",
        type=positive,
        default=None,
        metavar="N",
        help="continuous batching: tokens per step at most, prefill chunks and decode tokens together (default: "
        f"{CPU_MAX_BATCH_TOKENS} on a CPU; on a GPU transformers' choice, 8192)",
    )
    p_gen.add_argument(
        "--num-blocks",
        type=positive,
        default=None,
        metavar="N",
        help="continuous batching: blocks of 256 tokens in the paged KV cache (default: on a GPU, what --cache-memory "
        "holds; on a CPU, enough for the longest requests one step can hold, --max-batch-tokens of them, at full "
        "length)",
    )
    p_gen.add_argument(
        "--cache-memory",
        type=_number(float, 0.0, 1.0, low_open=True, what="a number in (0, 1]"),
        default=None,
        metavar="FRACTION",
        help="continuous batching: the share of the device's free memory, once the model is loaded, for the KV cache "
        "and the step's buffers (default: on a GPU transformers' choice, 0.9, 0.8 with sampling; on a CPU "
        "--num-blocks' default)",
    )
    p_gen.add_argument("--max-new-tokens", type=positive, default=128, help="new tokens per row at most")
    p_gen.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    p_gen.add_argument(
        "--temperature",
        type=_number(float, 0.0, low_open=True, what="a number above 0"),
        default=1.0,
        help="sampling temperature (with --do-sample)",
    )
    p_gen.add_argument(
        "--top-p",
        type=_number(float, 0.0, 1.0, low_open=True, what="a number in (0, 1]"),
        default=1.0,
        help="nucleus sampling: keep the likeliest tokens up to this probability mass (with --do-sample)",
    )
    p_gen.add_argument(
        "--top-k",
        type=_number(int, 0, what="0 or more"),
        default=50,
        help="sample among this many likeliest tokens, 0 for all (with --do-sample)",
    )
    p_gen.add_argument("--seed", type=int, default=0, help="random seed (torch.manual_seed) for sampling")
    p_gen.add_argument(
        "--cache-implementation",
        choices=["dynamic", "static"],
        default=None,
        help="static batches' KV cache: dynamic (eager decode), or static: transformers' static cache, whose decode "
        "step it compiles (on CUDA; one compile per shape: prompts are left-padded to the next power of two and a "
        "short last batch is filled, so a run compiles a few); static runs static batches (default: dynamic, where "
        "the command does not pick static-cache batches itself: see 'speed' above)",
    )
    p_gen.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp16", "fp32"],
        default="auto",
        help="dtype the base model is loaded in; auto: the checkpoint's own",
    )
    p_gen.add_argument(
        "--adapter-dtype",
        choices=["fp32", "model"],
        default="fp32",
        help="dtype of the adapters' weights: fp32 on a bf16 / fp16 model too, as PEFT keeps them by default "
        "(autocast_adapter_dtype=True: PEFT's numerics); model: the base model's dtype (autocast_adapter_dtype=False: "
        "half the adapter memory, faster)",
    )
    p_gen.add_argument(
        "--max-resident-adapters",
        type=positive,
        default=None,
        metavar="N",
        help="keep at most N adapters on the GPU, the others in host memory, brought in as batches need them "
        "(least recently used out); runs static batches, each with at most N distinct adapters, rows ordered by "
        "prompt length and adapter (default: every adapter on the GPU)",
    )
    p_gen.add_argument(
        "--device-map", default=None, help="accelerate device map, e.g. auto (default: none, the model on --device)"
    )
    p_gen.add_argument(
        "--device", default=None, help="without --device-map: cuda, cuda:1 or cpu (default: cuda if there is one)"
    )
    p_gen.add_argument(
        "--backend",
        choices=["auto", "triton", "torch"],
        default="auto",
        help="csgmv's LoRA kernels: triton (CUDA), torch (plain torch, any device); auto: triton on CUDA, else torch",
    )
    p_gen.add_argument(
        "--on-error",
        choices=["stop", "skip"],
        default="stop",
        help="bad input lines: stop before generating, or skip them with an error record (retried on the next run)",
    )
    p_gen.add_argument("--prompt-key", default="prompt", help="input field that holds the prompt")
    p_gen.add_argument("--adapter-key", default="adapter", help="input field that holds the adapter name")
    p_gen.add_argument("--no-progress", action="store_true", help="no progress bar")

    sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server, an adapter per request (options: peft-csgmv serve --help)",
        add_help=False,
    )  # fmt: skip
    sub.add_parser("bench", help="end-to-end benchmark against PEFT (options: peft-csgmv bench --help)", add_help=False)
    return parser, {"demo": p_demo, "generate": p_gen}


def main(argv: list[str] | None = None) -> int:
    from ._compat import restore_interrupts

    restore_interrupts()  # Ctrl-C raises KeyboardInterrupt again, handled below
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else "demo"
    try:
        if command == "bench":
            from .bench import main as bench_main

            return bench_main(argv[1:])
        if command == "serve":
            from .serve import main as serve_main

            return serve_main(argv[1:])
        parser, subparsers = build_parser()
        args = parser.parse_args(argv)
        command = args.command or "demo"
        if command == "demo":
            return 0 if demo(getattr(args, "device", None)) else 1
        return generate_command(args, subparsers["generate"].prog)
    except KeyboardInterrupt:
        return _interrupted(command)
    except Exception as exc:
        # Ctrl-C inside some of torch's own code (vmap, which transformers' masks use) raises KeyboardInterrupt there,
        # and torch's cleanup of that state then raises an error of its own while the interrupt is being handled: an
        # interrupt all the same.
        if not _during_interrupt(exc):
            raise
        return _interrupted(command)


def _interrupted(command: str) -> int:
    hint = ": rerun the same command to resume" if command == "generate" else ""
    say(f"\ninterrupted{hint}")
    return 130


def _during_interrupt(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while a ``KeyboardInterrupt`` was being handled (one in its chain of contexts)."""
    seen: set = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return True
        seen.add(id(exc))
        exc = exc.__context__ or exc.__cause__
    return False


if __name__ == "__main__":
    sys.exit(main())
