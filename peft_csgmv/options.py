"""csgmv's switches, and the one place that reads them from the environment.

:class:`Options` holds a model's launch-path choices; ``enable_csgmv`` builds it once (:meth:`Options.from_env`) and
hands it to the model's executor, so a switch changed after enabling takes effect at the next ``enable_csgmv``. The
process-wide switches of the kernels and the compile workers (read when a kernel variant is first chosen or compiled)
come through :func:`env`. Every variable is listed in :data:`SWITCHES`; each is a developer's switch for comparing
paths (benchmarks), never needed for correct results.
"""

from __future__ import annotations

import dataclasses
import os

SWITCHES = {
    # Per model, read when it is enabled (Options):
    "PEFT_CSGMV_FUSED_DECODE": "1: compiled decode-sized LoRA layers as one fused launch (default 0)",
    "PEFT_CSGMV_BESIDE": "0: compiled LoRA after its base product; 1: beside it on every device (default: on CUDA)",
    "PEFT_CSGMV_BESIDE_MIN_MIB": "only layers whose base weight holds this many MiB run beside it (16 on CUDA)",
    "PEFT_CSGMV_GROUPS": "0: no sibling groups; beside: groups run beside their base products (default 1)",
    # Process-wide, read when used:
    "PEFT_CSGMV_COMPILE_AHEAD": "0: compile every kernel where it is first launched; N: on N threads (default: a "
    "worker process for compiled code, threads for eager calls)",
    "PEFT_CSGMV_PDL": "0: no programmatic dependent launch (default 1 on Hopper)",
    "PEFT_CSGMV_TRITON_LAUNCH": "1: Triton's own launch path instead of the lean one (default 0)",
    "PEFT_CSGMV_DECODE_TILES": "decode tile overrides, e.g. shrink_per_sm=2,expand_block_n=256",
    "TRITON_INTERPRET": "Triton's own: 1 runs the kernels in its interpreter (the CPU tests)",
}


def env(name: str, default: str = "") -> str:
    """The environment's value of switch ``name`` (one of :data:`SWITCHES`), or ``default``."""
    if name not in SWITCHES:
        raise KeyError(f"{name} is not one of csgmv's switches")
    return os.environ.get(name, default)


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter (``TRITON_INTERPRET=1``)."""
    return env("TRITON_INTERPRET", "0") == "1"


@dataclasses.dataclass(frozen=True)
class Options:
    """A model's launch-path choices (see :data:`SWITCHES`); the defaults are what the environment says when unset.

    Attributes:
        fused_decode: compiled code runs each decode-sized LoRA layer as one fused launch (the expand computing the A
            product itself, ``kernels.fused_fits``); off until a GPU shows it faster.
        beside: where compiled code runs a plain Linear layer's decode-sized LoRA beside its base product
            (``ops.lora_linear``, a side stream on CUDA): ``"cuda"`` (CUDA devices; faster on the H200's 8B layout, a
            tie on the 1B one), ``"always"`` (CPU tests), ``"never"``.
        beside_min_bytes: only layers whose base weight holds at least this many bytes run beside it: a short base
            product ends before its LoRA does, and the fork and join then cost more than they hide (H200, static
            cache: 1B 0.59 -> 0.71x the base model with a 16 MiB floor; 8B a tie). 0 with ``PEFT_CSGMV_BESIDE=1``.
        groups: sibling groups (layers that read the same input tensor one after another, learned from the first
            eager call with ids, run by compiled code as one op per group; H200, static cache, 32 distinct: 1B
            +3..9%, 8B +6..7%): ``"on"``, ``"off"``, or ``"beside"``: layers that run beside their base product join
            groups too, and a group whose members' base weights hold ``beside_min_bytes`` together runs beside its base
            products (``ops.lora_group_linear``; it lowered the GPU time of compiled 1B blocks but varied more from run
            to run, and full static-cache generates did not show it faster).
    """

    fused_decode: bool = False
    beside: str = "cuda"
    beside_min_bytes: int = 16 * 2**20
    groups: str = "on"

    @classmethod
    def from_env(cls) -> "Options":
        beside = {"0": "never", "1": "always"}.get(env("PEFT_CSGMV_BESIDE"), "cuda")
        floor = env("PEFT_CSGMV_BESIDE_MIN_MIB") or ("16" if beside == "cuda" else "0")
        groups = {"0": "off", "beside": "beside"}.get(env("PEFT_CSGMV_GROUPS", "1"), "on")
        return cls(
            fused_decode=env("PEFT_CSGMV_FUSED_DECODE", "0") == "1",
            beside=beside,
            beside_min_bytes=int(float(floor) * 2**20),
            groups=groups,
        )
