"""Both launches of one patched layer, bound once per plan.

Within one plan (one forward, or all decode steps of a ``generate``), a layer's shrink and expand launches differ from
call to call only in ``x`` and ``y``: the stacks, the plan's tensors, the workspace, every integer and every tile
choice are the same. :class:`BoundLayer` keeps the two compiled kernels and their argument lists with everything else
filled in, so a call costs two compiled-kernel launches and a handful of identity checks instead of re-deriving the
tiles, strides and launch-cache keys. It is built after the layer's first call with a plan (which went through
:func:`~peft_csgmv.kernels.shrink` and :func:`~peft_csgmv.kernels.expand`, compiling what was needed) and used only
while :meth:`BoundLayer.fits` holds: same stack tensors, and ``x``/``y`` with the dtype, strides and 16-byte alignment
the kernels were specialized for.
"""

from __future__ import annotations

import torch

from . import launch
from .expand import _launch_expand, expand_launch_args, expand_tiles
from .shrink import _block, _launch_shrink, shrink_launch_args, shrink_tiles


def _layout(t: torch.Tensor) -> tuple:
    return t.dtype, t.stride(), t.data_ptr() & 15 == 0


class BoundLayer:
    """A patched layer's shrink + expand for one plan; see the module docstring."""

    __slots__ = (
        "tensors", "x_layout", "y_layout", "device", "t", "b",
        "s_run", "s_grid", "s_fn", "s_meta", "s_tail", "e_run", "e_grid", "e_fn", "e_meta", "e_tail",
    )  # fmt: skip

    @classmethod
    def bind(cls, x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, stack, plan) -> "BoundLayer | None":
        """Bind the launches that ``shrink(x, stack.a, …, plan, t)`` and ``expand(t, stack.b, …, y)`` just made;
        ``None`` where the direct launch path is off or the kernels are not compiled for these arguments."""
        if plan.num_segments == 0 or launch._interpreting():
            return None
        k = x.shape[1]
        block_m = _block(plan.chunk_size)
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
        self.tensors = (stack.a, stack.b, stack.ranks, stack.scalings, stack.mag, stack.bias, stack.lora_bias)
        self.x_layout, self.y_layout = _layout(x), _layout(y)
        self.device = x.get_device()
        self.t, self.b = t, stack.b
        self.s_run, self.s_grid, self.s_fn = shrink_k.run, s_grid, shrink_k.function
        self.s_meta, self.s_tail = shrink_k.packed_metadata, (*s_args[1:], *s_cx.values())
        self.e_run, self.e_grid, self.e_fn = expand_k.run, e_grid, expand_k.function
        self.e_meta, self.e_tail = expand_k.packed_metadata, (*e_args[3:], *e_cx.values())
        return self

    def fits(self, x: torch.Tensor, y: torch.Tensor, stack) -> bool:
        """Whether this binding launches exactly what ``shrink``/``expand`` would for these arguments now."""
        s = stack
        a, b, ranks, scalings, mag, bias, lora_bias = self.tensors
        return (
            s.a is a
            and s.b is b
            and s.ranks is ranks
            and s.scalings is scalings
            and s.mag is mag
            and s.bias is bias
            and s.lora_bias is lora_bias
            and _layout(x) == self.x_layout
            and _layout(y) == self.y_layout
            and not launch._hooks_installed()
        )

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        stream = launch._driver.active.get_current_stream(self.device)
        self.s_run(*self.s_grid, stream, self.s_fn, self.s_meta, None, None, None, x, *self.s_tail)
        self.e_run(*self.e_grid, stream, self.e_fn, self.e_meta, None, None, None, self.t, self.b, y, *self.e_tail)
