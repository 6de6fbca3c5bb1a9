"""Both launches of one patched layer, bound once per plan.

Within one plan (one forward, or all decode steps of a ``generate``), a layer's shrink and expand launches differ from
call to call only in ``x`` and ``y``: the stacks, the plan's tensors, the workspace, every integer and every tile
choice are the same. :class:`BoundLayer` keeps the two compiled kernels and their argument lists with everything else
filled in, so a call costs two compiled-kernel launches and a handful of identity checks instead of re-deriving the
tiles, strides and launch-cache keys. The layers build it on a plan's second use (a plan used once, as when the ids
change every call, never pays for it), right after that call went through :func:`~peft_csgmv.kernels.shrink` and
:func:`~peft_csgmv.kernels.expand`, and use it while :meth:`BoundLayer.fits` holds: same stack tensors, and
``x``/``y`` with the dtype, strides and 16-byte alignment the kernels were specialized for (a view with other strides
does not fit; one at another storage offset fits when its alignment is the same, as its address is passed with the
offset in it). Every tensor argument is passed as its device address (an int), which Triton's launcher takes as it is;
a tensor would cost a ``data_ptr()`` call and a driver query of the pointer per argument per launch. The binding keeps
the tensors behind those addresses alive.
"""

from __future__ import annotations

import torch

from . import launch
from .common import block_size
from .expand import _launch_expand, expand_launch_args, expand_tiles
from .shrink import _launch_shrink, shrink_launch_args, shrink_tiles


def _ptrs(args) -> tuple:
    """Tensors as their device addresses: Triton's launcher takes an int as it is, where a tensor costs a
    ``data_ptr()`` call and a driver query of the pointer on every launch."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


class BoundLayer:
    """A patched layer's shrink + expand for one plan; see the module docstring."""

    # Whether this Triton's compiled-kernel launcher takes the arguments bound launches pass: off for good (Triton's
    # own launch path) once one raises ``TypeError``. A fact of the installed Triton, not of a model or a call.
    direct = True

    __slots__ = (
        "tensors", "x_dtype", "x_stride", "x_aligned", "y_dtype", "y_stride", "y_aligned", "device", "t",
        "s_run", "s_grid", "s_fn", "s_meta", "s_tail", "e_run", "e_grid", "e_fn", "e_meta", "e_head", "e_tail",
    )  # fmt: skip

    @classmethod
    def bind(cls, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, stack, plan) -> "BoundLayer | None":
        """Bind the launches that ``shrink(x, stack.a, …, plan, t)`` and ``expand(t, stack.b, …, y)`` just made;
        ``None`` where the direct launch path is off or the kernels are not compiled for these arguments."""
        if plan.num_segments == 0 or launch.interpreting():
            return None
        # shrink/expand copy strided per-slot vectors and tables first; a binding would keep the copy's address.
        for v in (stack.ranks, stack.scalings, stack.mag, stack.bias, stack.lora_bias):
            if v is not None and not v.is_contiguous():
                return None
        k = x.shape[1]
        block_m = block_size(plan.chunk_size)
        block_k, split, k_per_split, s_opts = shrink_tiles(block_m, plan.num_segments, k, x.device)
        if (t.shape[0] if t.dim() == 3 else 1) != split:
            return None
        s_grid, s_args, s_cx, s_opts = shrink_launch_args(
            x, stack.a, stack.ranks, plan, t, split, k_per_split, block_k, s_opts
        )
        has_dora, has_lora_bias = stack.mag is not None, stack.lora_bias is not None
        mag, bias = (stack.mag, stack.bias) if has_dora else (stack.scalings, stack.scalings)
        lora_bias = stack.lora_bias if has_lora_bias else stack.scalings
        block_n, e_opts = expand_tiles(block_m, plan.num_segments, stack.b.shape[2])
        e_grid, e_args, e_cx, e_opts = expand_launch_args(
            t, stack.b, stack.ranks, stack.scalings, plan, y, mag, bias, lora_bias, has_dora, has_lora_bias, block_n,
            e_opts,
        )  # fmt: skip
        shrink_k = _launch_shrink.compiled_for(s_args, s_cx, s_opts)
        expand_k = _launch_expand.compiled_for(e_args, e_cx, e_opts)
        if shrink_k is None or expand_k is None:
            return None
        self = cls()
        # The tensors behind the addresses below stay referenced here (and by the plan) while the binding lives.
        self.tensors = (stack.a, stack.b, stack.ranks, stack.scalings, stack.mag, stack.bias, stack.lora_bias)
        self.t = t
        self.x_dtype, self.x_stride, self.x_aligned = x.dtype, x.stride(), x.data_ptr() & 15 == 0
        self.y_dtype, self.y_stride, self.y_aligned = y.dtype, y.stride(), y.data_ptr() & 15 == 0
        self.device = x.get_device()
        self.s_run, self.s_grid, self.s_fn = shrink_k.run, s_grid, shrink_k.function
        self.s_meta, self.s_tail = shrink_k.packed_metadata, _ptrs((*s_args[1:], *s_cx.values()))
        self.e_run, self.e_grid, self.e_fn = expand_k.run, e_grid, expand_k.function
        self.e_meta, self.e_head = expand_k.packed_metadata, _ptrs(e_args[:2])
        self.e_tail = _ptrs((*e_args[4:], *e_cx.values()))  # e_args[2:4]: y, and y again as the (in-place) out
        return self

    def _stack_fits(self, s) -> bool:
        a, b, ranks, scalings, mag, bias, lora_bias = self.tensors
        return (
            s.a is a
            and s.b is b
            and s.ranks is ranks
            and s.scalings is scalings
            and s.mag is mag
            and s.bias is bias
            and s.lora_bias is lora_bias
        )

    def _fits(self, x: torch.Tensor, y: torch.Tensor, stack, x_ptr: int, y_ptr: int) -> bool:
        return (
            self._stack_fits(stack)
            and x.dtype is self.x_dtype
            and y.dtype is self.y_dtype
            and x.stride() == self.x_stride
            and y.stride() == self.y_stride
            and (x_ptr & 15 == 0) is self.x_aligned
            and (y_ptr & 15 == 0) is self.y_aligned
            and not launch._hooks_installed()
        )

    def fits(self, x: torch.Tensor, y: torch.Tensor, stack) -> bool:
        """Whether this binding launches exactly what ``shrink``/``expand`` would for these arguments now."""
        return self._fits(x, y, stack, x.data_ptr(), y.data_ptr())

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """Launch both kernels (the caller has checked :meth:`fits`)."""
        self._launch(x.data_ptr(), y.data_ptr())

    def run_if_fits(self, x: torch.Tensor, y: torch.Tensor, stack) -> bool:
        """:meth:`fits` and, if so, the launches, reading each address once; ``False`` when it does not fit."""
        x_ptr, y_ptr = x.data_ptr(), y.data_ptr()
        if not self._fits(x, y, stack, x_ptr, y_ptr):
            return False
        self._launch(x_ptr, y_ptr)
        return True

    def _launch(self, x_ptr: int, y_ptr: int) -> None:
        stream = launch._driver.active.get_current_stream(self.device)
        self.s_run(*self.s_grid, stream, self.s_fn, self.s_meta, None, None, None, x_ptr, *self.s_tail)
        e_fn, e_meta = self.e_fn, self.e_meta
        self.e_run(*self.e_grid, stream, e_fn, e_meta, None, None, None, *self.e_head, y_ptr, y_ptr, *self.e_tail)
