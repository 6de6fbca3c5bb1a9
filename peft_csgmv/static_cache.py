"""One static KV cache kept across ``generate(..., cache_implementation="static")`` calls with ids.

transformers (from the 5.x release that added ``_prepare_static_cache``) makes a new ``StaticCache`` for every
``generate``; earlier releases kept one on the model (``self._cache``, reset for the next call that fits it). Its
tensors are static inputs of the compiled decode step, so on CUDA a cache at new addresses makes inductor's CUDA-graph
trees record the step's graph again at the first decode step of every call, and keep the old graph, which every later
step checks first (docs/benchmarks.md: 30 ms per call for the 1B base model, 84 ms with csgmv's side-stream layers).

:class:`KeptStaticCache` does for csgmv's calls what transformers did before: while a call with ids runs, the
transformers model's ``_prepare_static_cache`` (an instance attribute, removed when the call ends) hands out the cache
of the last call when transformers would have made one of the same kind and size (same batch rows, same length after
transformers' own ``max(this call, the previous calls)`` rule, same dtype and device), reset; otherwise it drops the
kept one first (its memory is free for the new one) and keeps what transformers makes. Results are those of a fresh
cache (``reset`` zeroes it, as a new one starts). What changes: the last call's cache stays allocated after the call
(``csgmv_stats(model)["static_cache_bytes"]``; ``enable_csgmv(..., keep_static_cache=False)`` turns it off,
``disable_csgmv`` frees it). A call whose output carries the cache (``return_dict_in_generate=True``) gives it to the
caller: it is not kept, nor is the cache of a call that fails. Calls without ids, releases that keep their own cache,
encoder-decoder models and other cache implementations are left to transformers as they are.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator


class KeptStaticCache:
    """The static cache of csgmv's last ``generate`` call, for the next call that fits it (see the module docstring)."""

    def __init__(self) -> None:
        self.cache = None
        self.key: tuple | None = None

    def drop(self) -> None:
        self.cache, self.key = None, None

    @property
    def nbytes(self) -> int:
        """Device bytes of the kept cache's tensors (0 without one)."""
        if self.cache is None:
            return 0
        total = 0
        for layer in getattr(self.cache, "layers", ()):
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if t is not None and hasattr(t, "nbytes"):
                    total += t.nbytes
        return total

    def _key(self, model, bound: inspect.BoundArguments) -> tuple | None:
        args = bound.arguments
        if args.get("cache_implementation") != "static" or getattr(model.config, "is_encoder_decoder", False):
            return None
        batch, length = args.get("batch_size"), args.get("max_cache_len")
        if not isinstance(batch, int) or not isinstance(length, int):
            return None
        # transformers sizes the cache max(this call's length, the previous calls'), to avoid a recompile: so do we.
        length = max(length, getattr(model, "_previous_max_cache_length", -1))
        chunked = args.get("prefill_chunk_size") is not None
        return (batch, length, chunked, model.dtype, model.device)

    @contextlib.contextmanager
    def lend(self, model) -> Iterator[None]:
        """For one ``generate`` call of ``model`` (the transformers model under the ``PeftModel``): its static cache is
        the kept one where it fits. The caller reports the call's output to :meth:`returned`."""
        original = getattr(type(model), "_prepare_static_cache", None)
        if original is None or "_prepare_static_cache" in model.__dict__:
            yield  # a release that keeps its own cache (or someone else's patch): transformers as it is
            return
        signature = inspect.signature(original)

        def prepare(*args, **kwargs):
            try:
                bound = signature.bind(model, *args, **kwargs)
            except TypeError:
                bound = None
            key = None if bound is None else self._key(model, bound)
            if key is not None and key == self.key and self.cache is not None:
                self.cache.reset()
                return self.cache
            self.drop()  # the old cache's memory is free for the new one
            cache = original(model, *args, **kwargs)
            if key is not None:
                self.cache, self.key = cache, key
            return cache

        model.__dict__["_prepare_static_cache"] = prepare
        try:
            yield
        except BaseException:
            self.drop()  # half-written by a failed call: the next call starts from a new one, as transformers does
            raise
        finally:
            model.__dict__.pop("_prepare_static_cache", None)

    def returned(self, output) -> None:
        """A call's output that carries the kept cache (``return_dict_in_generate``) hands it to the caller."""
        if self.cache is not None and any(
            getattr(output, name, None) is self.cache for name in ("cache", "past_key_values")
        ):
            self.drop()
