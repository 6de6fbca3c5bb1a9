"""MoePlan: how the routed (token, expert) pairs of one MoE layer are grouped by (expert, adapter slot).

A MoE layer sees ``T`` tokens; its router picks ``top_k`` experts for each (``top_k_index``, ``(T, top_k)``). Pair
``p = t * top_k + j`` is token ``t`` routed to expert ``top_k_index[t, j]``: the order of transformers'
``top_k_index.reshape(-1)``, which its batched and grouped experts implementations use. Every token has one adapter
slot (or none: a base token, slot ``-1``); its pairs take that slot. The plan

1. sorts the pairs by expert, and within an expert by slot, base pairs after the adapter pairs of their expert, with a
   stable sort (``permutation[q]`` is the pair at sorted position ``q``); pairs routed to no expert of this layer
   (``expert < 0`` or ``>= num_experts``: expert-parallel sentinels) come last;
2. cuts each run of one (expert, slot) into chunks of at most ``chunk_size`` pairs (a *segment*, one slot, one
   expert), and leaves base pairs and unrouted pairs out of every segment, so no kernel touches them.

The sorted order keeps every expert's pairs together (``expert_offsets[e]`` is where expert ``e``'s pairs end, as the
``offs`` of ``torch.nn.functional.grouped_mm``), so one permutation serves the base experts' grouped product and the
LoRA kernels.

Worked example (``num_experts = 3``, ``num_slots = 2``, ``top_k = 2``, ``chunk_size = 16``)::

    token slots      [1, -1, 0, 1]                       (token 1 is a base token)
    top_k_index      [[0, 2], [2, 1], [2, 0], [0, 1]]
    pairs p          0  1  2  3  4  5  6  7              (p = 2 * token + j)
      expert         0  2  2  1  2  0  0  1
      slot           1  1 -1 -1  0  0  1  1
    permutation      [5, 0, 6, 7, 3, 4, 1, 2]            (expert 0: slot 0, slot 1 | expert 1: slot 1, base |
                                                          expert 2: slot 0, slot 1, base)
    expert_offsets   [3, 5, 8]
    seg_start        [0, 1, 3, 5, 6, 0]
    seg_end          [1, 3, 4, 6, 7, 0]
    seg_slot         [0, 1, 1, 0, 1, -1]
    seg_expert       [0, 0, 1, 2, 2, 0]

Five live segments, e.g. segment 1 = sorted positions 1..2 = pairs 0 and 6 (tokens 0 and 3, slot 1, expert 0). The
segment arrays have a length fixed by the shapes alone (:func:`max_segments`: here ``8 // 16 + min(8, 3 * 2) = 6``),
so the last one is empty (``seg_start == seg_end``, slot ``-1``): its kernel programs exit at once. With
``chunk_size = 1`` every live segment holds one pair: the run of (expert 0, slot 1) becomes ``[1, 2)`` and ``[2, 3)``
(six live segments of ``8 // 1 + 6 = 14``).

Everything is computed with tensor operations on ``top_k_index``'s device, without waiting for it and with shapes
that depend on ``T``, ``top_k``, ``num_experts``, ``num_slots`` and the chunk size only: the router's choice is device
data, and a plan built this way can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import torch

from .plan import MIN_CHUNK_SIZE

MAX_CHUNK_SIZE = 64


def moe_chunk_size(num_pairs: int, num_groups: int) -> int:
    """Segment length (the kernels' row tile) for ``num_pairs`` routed pairs spread over about ``num_groups`` (expert,
    slot) groups: the smallest power of two that holds a group of the mean size, from ``MIN_CHUNK_SIZE`` to
    ``MAX_CHUNK_SIZE``. Not yet tuned on a GPU."""
    mean = -(-num_pairs // max(1, min(num_pairs, num_groups)))
    return min(MAX_CHUNK_SIZE, max(MIN_CHUNK_SIZE, 1 << (mean - 1).bit_length()))


def max_segments(num_pairs: int, num_experts: int, num_slots: int, chunk_size: int) -> int:
    """The most segments a plan of these shapes can have (the length of its segment arrays, the kernels' grid): a
    group of ``c`` pairs makes ``ceil(c / chunk) <= floor(c / chunk) + 1`` segments, so all of them at most
    ``floor(pairs / chunk)`` plus one per non-empty (expert, slot) group."""
    return num_pairs // chunk_size + min(num_pairs, num_experts * num_slots)


@dataclasses.dataclass(frozen=True, eq=False)
class MoePlan:
    """The routed pairs of one MoE layer's step grouped by (expert, slot); see the module docstring.

    Attributes:
        num_tokens, top_k: the shape of the router's ``top_k_index``; ``num_pairs = num_tokens * top_k``.
        num_experts, num_slots: the layer's experts and the slots of its adapter stacks.
        chunk_size: the most pairs a segment holds; the kernels' row tile.
        num_segments: the length of the segment arrays (host int: it sizes the kernel grid), :func:`max_segments`;
            the segments past the live ones are empty.
        permutation: ``(num_pairs,)`` int32; the pair at each sorted position (expert-major, then slot, base pairs
            after their expert's adapter pairs, unrouted pairs last).
        expert_offsets: ``(num_experts,)`` int32; expert ``e``'s pairs are sorted positions
            ``expert_offsets[e - 1]:expert_offsets[e]`` (``0`` for ``e = 0``).
        seg_start, seg_end: ``(num_segments,)`` int32; segment ``s`` is sorted positions ``seg_start[s]:seg_end[s]``
            (empty for the segments past the live ones).
        seg_slot: ``(num_segments,)`` int32; the slot of each segment (``-1`` for an empty one).
        seg_expert: ``(num_segments,)`` int32; the expert of each segment (``0`` for an empty one).
    """

    num_tokens: int
    top_k: int
    num_experts: int
    num_slots: int
    chunk_size: int
    num_segments: int
    permutation: torch.Tensor
    expert_offsets: torch.Tensor
    seg_start: torch.Tensor
    seg_end: torch.Tensor
    seg_slot: torch.Tensor
    seg_expert: torch.Tensor

    @property
    def num_pairs(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def device(self) -> torch.device:
        return self.permutation.device

    @functools.cached_property
    def kernel_arrays(self) -> tuple[torch.Tensor, ...]:
        """``permutation``, ``seg_start``, ``seg_end``, ``seg_slot``, ``seg_expert`` as the MoE kernels read them
        (densely: a strided one copied), worked out once per plan (its four launches read them)."""
        from .kernels.common import dense

        return tuple(dense(v) for v in (self.permutation, self.seg_start, self.seg_end, self.seg_slot, self.seg_expert))

    @classmethod
    def build(
        cls,
        token_slot: Sequence[int] | torch.Tensor,
        top_k_index: torch.Tensor,
        num_experts: int,
        num_slots: int,
        chunk_size: int | None = None,
    ) -> "MoePlan":
        """Build the plan of one step of one MoE layer.

        Args:
            token_slot: ``(T,)`` slot of each token (``-1``: a base token), host ints or an integer tensor (moved to
                ``top_k_index``'s device); slots must be below ``num_slots`` (host ints are checked, a tensor is not:
                checking it would wait for the device).
            top_k_index: ``(T, top_k)`` integer tensor, the router's experts of each token; its device is the plan's.
                Entries outside ``[0, num_experts)`` route the pair nowhere (no kernel work).
            num_experts: the layer's experts.
            num_slots: the slots of the layer's adapter stacks.
            chunk_size: override the segment length (default: :func:`moe_chunk_size` of the pairs and the (expert,
                slot) groups they can fall into).
        """
        if top_k_index.dim() != 2:
            raise ValueError(f"top_k_index must be (tokens, top_k), got shape {tuple(top_k_index.shape)}")
        num_tokens = top_k_index.shape[0]
        if num_experts < 1 or num_slots < 1:
            raise ValueError(f"a MoE plan needs experts and slots, got {num_experts} experts, {num_slots} slots")
        device = top_k_index.device
        if isinstance(token_slot, torch.Tensor):
            if token_slot.shape != (num_tokens,):
                raise ValueError(f"token_slot {tuple(token_slot.shape)} does not fit top_k_index ({num_tokens} tokens)")
            slots = token_slot.to(device=device, dtype=torch.int64, non_blocking=True)
            groups = torch.where(slots < 0, num_slots, slots)
            used_slots = num_slots
        else:
            if len(token_slot) != num_tokens or any(not -1 <= s < num_slots for s in token_slot):
                raise ValueError(f"token_slot must hold {num_tokens} slots in -1..{num_slots - 1}, got {token_slot}")
            groups = torch.tensor([num_slots if s < 0 else s for s in token_slot], dtype=torch.int64)
            groups = groups.to(device, non_blocking=True)
            used_slots = len({s for s in token_slot if s >= 0})
        return cls.from_groups(groups, top_k_index, num_experts, num_slots, chunk_size, used_slots)

    @classmethod
    def from_groups(
        cls,
        token_group: torch.Tensor,
        top_k_index: torch.Tensor,
        num_experts: int,
        num_slots: int,
        chunk_size: int | None = None,
        used_slots: int | None = None,
        tables: tuple | None = None,
    ) -> "MoePlan":
        """:meth:`build` from each token's *group slot*: ``token_group`` ``(T,)`` int64 on ``top_k_index``'s device,
        the token's slot, or ``num_slots`` for a base token (:func:`token_groups`; a call makes it once for all its
        MoE layers). Not checked (a layer's fast path). ``used_slots``: how many slots the tokens use, for the default
        chunk (``num_slots`` when not known on the host). ``tables``: :func:`plan_tables` of these shapes, where the
        caller holds them (compiled code: a :class:`~peft_csgmv.mapping.StaticMoePlan`'s, at fixed addresses);
        else from a cache.

        On CUDA, eagerly, for a step of at most :data:`~peft_csgmv.kernels.moe_plan.MAX_PAIRS` routed pairs (decode):
        one Triton launch (:func:`~peft_csgmv.kernels.moe_plan.moe_plan_arrays`), the same arrays. Else about twenty
        device ops, no host sync: the group key of each pair (one ``add``; a ``clamp`` and a
        ``remainder`` send unrouted pairs to the last group), one stable sort, one ``searchsorted`` of the sorted keys
        for every expert's end and every adapter group's start and end, the segments each adapter group needs and
        their running sum, one ``searchsorted`` for each segment's group, and gathers of the group's rows (the
        constant tables come from :func:`_tables`, made once per shape and device)."""
        num_tokens, top_k = top_k_index.shape
        num_pairs = num_tokens * top_k
        if chunk_size is None:
            chunk_size = moe_chunk_size(num_pairs, num_experts * (num_slots if used_slots is None else used_slots))
        elif chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        num_segments = max_segments(num_pairs, num_experts, num_slots, chunk_size)
        if tables is None and _fused(top_k_index.device, num_pairs, num_experts, num_slots):
            from .kernels.moe_plan import moe_plan_arrays

            permutation, expert_offsets, segments = moe_plan_arrays(
                token_group, top_k_index, num_experts, num_slots, chunk_size, num_segments
            )
            seg_start, seg_end, seg_slot, seg_expert = segments.unbind(0)
        else:
            permutation, expert_offsets, seg_start, seg_end, seg_slot, seg_expert = _plan_ops(
                token_group, top_k_index, num_experts, num_slots, chunk_size, num_segments, tables
            )
        return cls(
            num_tokens=num_tokens,
            top_k=top_k,
            num_experts=num_experts,
            num_slots=num_slots,
            chunk_size=chunk_size,
            num_segments=num_segments,
            permutation=permutation,
            expert_offsets=expert_offsets,
            seg_start=seg_start,
            seg_end=seg_end,
            seg_slot=seg_slot,
            seg_expert=seg_expert,
        )

    def segments(self) -> list[tuple[int, int, int, int]]:
        """``(slot, expert, start, end)`` of each live segment, on the host (waits for the device: for references,
        tests and debugging, not for the kernels' path)."""
        rows = zip(self.seg_slot.tolist(), self.seg_expert.tolist(), self.seg_start.tolist(), self.seg_end.tolist())
        return [(slot, expert, start, end) for slot, expert, start, end in rows if end > start]


def _plan_ops(token_group, top_k_index, num_experts: int, num_slots: int, chunk: int, segments: int, tables) -> tuple:
    """:meth:`MoePlan.from_groups`'s arrays by torch ops (see its docstring): permutation, expert offsets, segment
    starts, ends, slots and experts."""
    num_tokens, top_k = top_k_index.shape
    num_pairs = num_tokens * top_k
    if tables is None:
        tables = _tables(top_k_index.device, num_experts, num_slots, segments, chunk)
    bounds, group_slot, group_expert, seg_index, seg_offsets = tables
    adapter_groups = num_experts * num_slots
    width = num_slots + 1

    # Group key of each pair: expert * (S + 1) + slot, base pairs in their expert's last group (slot S); pairs
    # routed to no expert of the layer (expert < 0 or >= E) in one group after every expert's, E * (S + 1):
    # clamped to -1 or E * (S + 1), and -1 taken modulo E * (S + 1) + 1.
    key = torch.add(token_group.view(num_tokens, 1), top_k_index, alpha=width).reshape(num_pairs)
    key = key.clamp_(-1, num_experts * width).remainder_(num_experts * width + 1)
    sorted_key, permutation = torch.sort(key, stable=True)
    # Sorted positions where each expert's pairs end, and where each adapter group's start and end (each group
    # (e, s) is g = e * S + s; one more, empty, group past them: the segments past the live ones point at it).
    found = torch.searchsorted(sorted_key, bounds, out_int32=True)
    expert_offsets = found[:num_experts]
    starts = found[num_experts : num_experts + adapter_groups + 1]
    ends = found[num_experts + adapter_groups + 1 :]
    group_segments = (ends - starts + (chunk - 1)) // chunk
    segments_end = torch.cumsum(group_segments, 0, dtype=torch.int32)  # segments of groups 0..g
    # Group g's segment s covers sorted positions first[g] + s * chunk up to one chunk more, cut to the group's end.
    first = torch.sub(starts, segments_end - group_segments, alpha=chunk)
    table = torch.stack([first, ends, group_slot, group_expert])  # (4, E·S + 1)

    # Segment s belongs to the first group whose segments end past s; the segments past the last live one to the
    # empty group (start and end 0: first[g] + s * chunk >= 0 there, and is cut to 0).
    group = torch.searchsorted(segments_end[:adapter_groups], seg_index, right=True, out_int32=True)
    rows = table[:, group]  # (4, M): first, end, slot, expert of each segment's group
    start_end = torch.minimum(rows[:1] + seg_offsets, rows[1:2])  # (2, M)
    return permutation.to(torch.int32), expert_offsets, start_end[0], start_end[1], rows[2], rows[3]


# Whether :meth:`MoePlan.from_groups` takes the one-launch path on the CPU too, where the Triton interpreter runs it
# (tests, benchmarks/count_moe_ops.py); on CUDA it always does where the step fits.
FUSED_ON_CPU = False


def _fused(device: torch.device, num_pairs: int, num_experts: int, num_slots: int) -> bool:
    """Whether a plan of these shapes on ``device`` is built in one launch (eager code only: compiled code traces
    the torch ops, which its compiler fuses)."""
    if torch.compiler.is_compiling():
        return False
    if device.type != "cuda":
        from .options import interpreting

        if not (FUSED_ON_CPU and interpreting()):
            return False
    from .kernels.moe_plan import fits

    return fits(num_pairs, num_experts, num_slots)


def token_groups(token_slot: torch.Tensor, num_slots: int) -> torch.Tensor:
    """Each token's group slot for :meth:`MoePlan.from_groups`: its slot, or ``num_slots`` for a base token (``-1``),
    ``(T,)`` int64 on ``token_slot``'s device (two device ops; a call makes it once for all its MoE layers)."""
    slots = token_slot.to(torch.int64)
    return torch.where(slots < 0, num_slots, slots)


def plan_tables(device: torch.device, num_experts: int, num_slots: int, num_segments: int, chunk_size: int) -> tuple:
    """The constant tensors a plan of these shapes reads (see :func:`_tables`), made once per shape and device."""
    return _tables(device, num_experts, num_slots, num_segments, chunk_size)


@functools.lru_cache(maxsize=256)
def _tables(device: torch.device, num_experts: int, num_slots: int, num_segments: int, chunk_size: int) -> tuple:
    """The constant tensors a plan of these shapes reads, on ``device`` (made there with device ops once, no copy
    from the host: a layer never waits):

    - ``bounds`` ``(E + 2 * (E * S + 1),)`` int64, the keys ``searchsorted`` finds: where each expert's groups end
      (``(e + 1) * (S + 1)``), where each adapter group starts (``e * (S + 1) + s``) then ``0`` for the empty group,
      where each ends (``e * (S + 1) + s + 1``) then ``0``;
    - ``slot``, ``expert`` ``(E * S + 1,)`` int32, the slot and expert of each adapter group (``-1`` and ``0`` for
      the empty one);
    - ``index`` ``(M,)`` int32, each segment's index ``s``, and ``offsets`` ``(2, M)`` int32, ``s * chunk`` and
      ``(s + 1) * chunk``.
    """
    with torch.inference_mode(False):  # (plain tensors, whatever mode the first call runs in)
        return _make_tables(device, num_experts, num_slots, num_segments, chunk_size)


def _make_tables(device: torch.device, num_experts: int, num_slots: int, num_segments: int, chunk_size: int) -> tuple:
    width, groups = num_slots + 1, num_experts * num_slots
    i64 = dict(dtype=torch.int64, device=device)
    g = torch.arange(groups + 1, **i64)
    expert, slot = g // num_slots, g % num_slots
    group_start = expert * width + slot
    group_start[-1] = 0
    bounds = torch.cat([torch.arange(1, num_experts + 1, **i64) * width, group_start, group_start + 1])
    bounds[-1] = 0
    slot[-1], expert[-1] = -1, 0
    s = torch.arange(num_segments, dtype=torch.int32, device=device)
    offsets = torch.stack([s * chunk_size, (s + 1) * chunk_size])
    return bounds, slot.to(torch.int32), expert.to(torch.int32), s, offsets
