"""Continuous batching's attention over each request's own tokens where the flash-attn package is missing.

transformers' continuous batching packs every running request's tokens into one row per step. With a flash attention
implementation it attends per request (``cu_seq_lens_q`` / ``cu_seq_lens_k``, the varlen call); with SDPA or eager
attention it builds one dense mask over every running request's cached tokens, so a step's attention grows with the
product of its tokens and all running requests' lengths (docs/benchmarks.md). transformers switches to flash attention
by itself only where the flash-attn package (or a hub kernel) is there.

:func:`varlen_attention` gives a model, for the time of one continuous-batching run, an attention implementation that
transformers treats as a flash one (its name holds "flash": no dense mask, the varlen arguments) and that runs torch's
own flash kernel (``aten._flash_attention_forward``, shipped in CUDA builds of torch) on the packed row, causal with
each request's queries aligned to the end of its keys (a decode token or a prefill chunk after its cached tokens).
The implementation is registered with transformers' public ``AttentionInterface`` / ``AttentionMaskInterface`` and set
on the model's configs directly (``set_attn_implementation`` would look for the flash-attn package); the model's own
implementation is back when the run ends. It runs (:func:`refusal` says why not) on a CUDA device that has torch's
flash kernel, in half precision, for a model whose attention transformers runs with flash attention
(``_supports_flash_attn``), that has no sliding window, logit soft-capping or attention sinks, and whose attention is
SDPA or eager today (a model already on a flash implementation keeps it).

Each step gathers every running request's cached keys and values, a size that grows through a run; under CUDA graphs
each captured size keeps its gather in the graphs' memory pool, and with the caching allocator's fixed segments those
pools fragmented until an H100 ran out of memory on 1024 uneven requests (docs/benchmarks.md). While a run attends this
way the allocator grows its segments in place (``expandable_segments``), unless the user configured the allocator
(``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``): with them that run finished."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
from typing import Iterator

import torch

from ._compat import transformers_model

# No "2" or "3" after "flash": transformers' decode fast path (flash_attn_with_kvcache) is for flash-attn 2 and 3 only.
BASE_NAME = "csgmv_flash_varlen"

# Whether the batch command and the server attend this way without being asked (--varlen-attention), wherever
# refusal() finds nothing against it (--no-varlen-attention: SDPA's): on, since the batch command ran it on an H100
# over 1024 uneven lines at 2.8-3.7x SDPA's speed (docs/benchmarks.md).
COMMAND_DEFAULT = True

ALLOCATOR_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")  # the user's own allocator settings: left alone
_segments_lock = threading.Lock()
_segments_users = 0  # runs attending this way now, each with the allocator's segments expandable


def implementation_name() -> str:
    """The name the model's configs carry while :func:`varlen_attention` runs: transformers releases before 5.19 run
    continuous batching only on ``"paged|<implementation>"`` names (later ones take the name as it is and warn about
    the prefix)."""
    import transformers
    from packaging.version import Version

    return ("paged|" if Version(transformers.__version__).release < (5, 19) else "") + BASE_NAME


def flash_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q: int, max_k: int, scale: float | None) -> torch.Tensor:
    """Causal attention of packed requests: ``query`` ``(Tq, H, D)``, ``key`` / ``value`` ``(Tk, Hkv, D)`` (``H`` a
    multiple of ``Hkv``), request ``i``'s queries ``cu_seq_q[i]:cu_seq_q[i+1]`` against its keys
    ``cu_seq_k[i]:cu_seq_k[i+1]``, the queries the last of its tokens. Any strides (a last dimension that is not
    contiguous is copied first). Returns ``(Tq, H, D)``; rows past ``cu_seq_q[-1]`` (a padded step's) are not
    written."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    return torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, 0.0, True, False, scale=scale
    )[0]


def _forward(module, query, key, value, attention_mask, scaling=None, dropout: float = 0.0, **kwargs):
    """transformers' attention call in a continuous-batching step: ``query`` ``(1, H, Tq, D)``, ``key`` / ``value``
    ``(1, Hkv, Tk, D)``: the step's requests back to back, their cached tokens before their new ones where the
    attention layer updated the paged cache before the call (transformers 5.24 and later); earlier releases hand the
    cache to the attention (``cache``), which updates it and reads the keys back, as their own attention functions do
    (5.19 to 5.23: ``update(..., kwargs=)``, which also picks the layer's lengths; before: ``update(..., read_index,
    write_index)``, ``(Tk, Hkv, D)`` back). Run on the CPU under 5.17, 5.19, 5.22, 5.23, 5.24 and 5.25."""
    if kwargs.get("cu_seq_lens_q") is None or kwargs.get("cu_seq_lens_k") is None:
        raise RuntimeError(
            f"attention {BASE_NAME!r} runs only inside continuous batching (peft_csgmv.attention.varlen_attention)"
        )
    if kwargs.get("block_table") is not None:  # (transformers' decode fast path: flash-attn 2 and 3 only)
        raise RuntimeError(f"attention {BASE_NAME!r} takes no block table: set max_blocks_per_request=0")
    cache = kwargs.pop("cache", None)
    if cache is None or _updates_kwargs(type(cache)):
        if cache is not None:  # ((1, Hkv, Tk, D) back, the layer's lengths picked in kwargs)
            key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
        k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)
    else:
        k, v = cache.update(
            key_states=key, value_states=value, layer_idx=module.layer_idx,
            read_index=kwargs["read_index"], write_index=kwargs["write_index"],
        )  # fmt: skip
    cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"]
    max_q = kwargs.get("max_length_q", kwargs.get("max_seqlen_q"))
    max_k = kwargs.get("max_length_k", kwargs.get("max_seqlen_k"))
    if isinstance(cu_k, dict):  # (per layer type; refusal() leaves full attention only)
        cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
    q = query[0].transpose(0, 1)
    out = flash_varlen(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k), scaling)
    return out.unsqueeze(0), None


@functools.cache
def _updates_kwargs(cache_type) -> bool:
    """Whether this paged cache's ``update`` takes the call's keyword arguments (and updates them in place)."""
    return "kwargs" in inspect.signature(cache_type.update).parameters


def _configs(model) -> list:
    """The configs of ``model`` (a transformers model) that carry an attention implementation: its own and its
    sub-models' (a multimodal model's text config)."""
    found, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen and hasattr(config, "_attn_implementation"):
            seen.add(id(config))
            found.append(config)
    return found


def refusal(model) -> str | None:
    """Why :func:`varlen_attention` cannot run for ``model`` (a ``PeftModel`` or a transformers model), or ``None``:
    the model's own attention first (what it computes), then where it runs."""
    base = transformers_model(model)
    config = base.config
    if not getattr(base, "_supports_flash_attn", False):
        return f"transformers does not run {type(base).__name__} with flash attention"
    impl = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if impl not in ("sdpa", "eager", "paged|sdpa", "paged|eager"):
        return f"the model's attention is {impl!r} already"
    for c in _configs(base):
        window = getattr(c, "sliding_window", None)
        if window is not None and getattr(c, "use_sliding_window", True) is not False:
            return "the model has a sliding window"
        if getattr(c, "attn_logit_softcapping", None) is not None:
            return "the model soft-caps attention logits"
        if any(t not in (None, "full_attention") for t in getattr(c, "layer_types", None) or ()):
            return "the model has layers of other attention types"
    if any(getattr(m, "sinks", None) is not None for m in base.modules()):
        return "the model has attention sinks"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim > 256 or head_dim % 8:
        return f"torch's flash kernel takes a head size of at most 256, a multiple of 8, not {head_dim}"
    param = next(base.parameters(), None)
    if param is None or param.device.type != "cuda":
        return "it runs on a CUDA device"
    if base.dtype not in (torch.float16, torch.bfloat16):
        return f"torch's flash kernel takes float16 or bfloat16, not {base.dtype}"
    if not torch.backends.cuda.is_flash_attention_available() or torch.cuda.get_device_capability(param.device)[0] < 8:
        return "this torch build or GPU has no flash attention kernel"
    return None


def command_choice(asked: bool | None, model) -> tuple[bool, str | None]:
    """Whether a continuous-batching run of the batch command or the server attends per request, and the line it
    says about it (``None``: nothing to say). ``asked``: ``--varlen-attention`` (True), ``--no-varlen-attention``
    (False) or neither (None: :data:`COMMAND_DEFAULT` where :func:`refusal` finds nothing against it, quietly
    otherwise)."""
    if asked is False or (asked is None and not COMMAND_DEFAULT):
        return False, None
    why = refusal(model)
    if why is not None:
        return False, (f"--varlen-attention left out, SDPA's attention instead: {why}" if asked else None)
    return True, (None if asked else "attention per request by torch's flash kernel (--no-varlen-attention: SDPA's)")


def command_default() -> str:
    """What the batch command's and the server's help say a run naming neither flag does."""
    return "on where it can run" if COMMAND_DEFAULT else "off"


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    for name in (BASE_NAME, "paged|" + BASE_NAME):
        AttentionInterface.register(name, _forward)
        # (what a flash implementation's mask is: none, or the padding of a 2-D mask)
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def _set_expandable(on: bool) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)  # (newer torch; the older name warns there)
    (setter or torch.cuda.memory._set_allocator_settings)(f"expandable_segments:{on}")


@contextlib.contextmanager
def expandable_segments(device: torch.device) -> Iterator[None]:
    """The CUDA caching allocator grows its segments in place for new memory while the block runs (fixed segments
    again after the last such block ends), unless ``device`` is not a CUDA device, the user configured the allocator
    (:data:`ALLOCATOR_ENV`) or it is not the native one. Memory already held keeps its segments."""
    global _segments_users
    own = device.type == "cuda" and not any(os.environ.get(k) for k in ALLOCATOR_ENV)
    own = own and torch.cuda.memory.get_allocator_backend() == "native"
    if own:
        with _segments_lock:
            if _segments_users == 0:
                _set_expandable(True)
            _segments_users += 1
    try:
        yield
    finally:
        if own:
            with _segments_lock:
                _segments_users -= 1
                if _segments_users == 0:
                    _set_expandable(False)


@contextlib.contextmanager
def varlen_attention(model) -> Iterator[None]:
    """``model`` (a ``PeftModel`` or a transformers model) attends with :func:`flash_varlen` per request while the
    block runs, its own implementation back after; only for continuous batching (``generate_batch``, a manager), where
    transformers passes each request's lengths; the allocator's segments expandable meanwhile
    (:func:`expandable_segments`). Raises ``ValueError`` with :func:`refusal`'s reason, changing nothing, where it
    cannot run."""
    why = refusal(model)
    if why is not None:
        raise ValueError(f"varlen attention: {why}")
    _register()
    base = transformers_model(model)
    configs = _configs(base)
    before = [c._attn_implementation for c in configs]
    name = implementation_name()
    try:
        for c in configs:
            c._attn_implementation = name
        with expandable_segments(next(base.parameters()).device):
            yield
    finally:
        for c, impl in zip(configs, before):
            c._attn_implementation = impl
