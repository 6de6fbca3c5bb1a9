"""BatchPlan: how the tokens of one forward are grouped by adapter slot.

A layer sees ``rows`` rows of ``tokens_per_row`` tokens each, flattened row-major into ``rows * tokens_per_row``
tokens. Every row uses one adapter slot (or none: a base row, slot ``-1``). The plan

1. sorts the tokens by slot with a stable sort, base tokens last (``permutation[p]`` is the original index of the
   token at permuted position ``p``);
2. cuts each run of one slot into chunks of at most ``chunk_size`` tokens (a *segment*), each with one slot;
3. leaves base tokens out of every segment, so no kernel touches them.

Worked example (``tokens_per_row = 2``, ``chunk_size = 16``)::

    row slots        [ 1, -1,  0,  1]          (row 1 is a base row)
    token slots      [1, 1, -1, -1, 0, 0, 1, 1]
    permutation      [4, 5, 0, 1, 6, 7, 2, 3]  (slot 0 first, then slot 1, base last)
    seg_indptr       [0, 2, 6]                 (tokens 0..1 of the permuted order, then 2..5)
    seg_slot         [0, 1]

With ``chunk_size = 3`` the run of slot 1 (four tokens) would be cut into two segments: ``seg_indptr [0, 2, 5, 6]``,
``seg_slot [0, 1, 1]``.

A row may use its slot for its last tokens only (``row_tokens``: aLoRA, whose adapter applies from the invocation
tokens on; the tokens before them are base tokens of an adapter row). The same rows with ``row_tokens [1, 2, 2, 1]``
(row 0 keeps its slot for its last token only, row 3 likewise; row 1 is a base row whatever it says)::

    token slots      [-1, 1, -1, -1, 0, 0, -1, 1]
    permutation      [4, 5, 1, 7, 0, 2, 3, 6]  (slot 0, then slot 1, then every base token)
    seg_indptr       [0, 2, 4]
    seg_slot         [0, 1]

Everything is computed on the host from the per-row slot list (which the caller knows without touching the device)
and copied to the device in one non-blocking transfer, so building a plan never waits on the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import torch

MIN_CHUNK_SIZE = 16


def chunk_size_for(num_tokens: int, run_lengths: Sequence[int] = ()) -> int:
    """Segment length (the kernels' row tile) for a batch of ``num_tokens`` tokens whose adapter runs have
    ``run_lengths`` tokens each.

    By batch size first: small batches get short chunks (less padding work per program), large batches long ones
    (fewer programs, better weight reuse): 16 below 64 tokens, 32 below 256, else 128. Then it follows the runs: a
    tile longer than the runs it covers computes masked rows (128 adapters of 64 tokens each in a 128-row tile: half
    of every program), so the chunk is the longest power of two, at most the batch-size chunk and at least
    ``MIN_CHUNK_SIZE``, whose masked rows are at most a quarter of the rows the programs cover. On the H200 (bf16, all
    real layer shapes) this made the expand 1.4–1.6× faster for 128 runs of 64 tokens (chunk 64 against 128) and
    1.5–3.3× for 32 runs of 16 tokens (16 against 128); see ``benchmarks/tune_kernels.py``.
    """
    if num_tokens >= 256:
        chunk = 128
    elif num_tokens >= 64:
        chunk = 32
    else:
        return MIN_CHUNK_SIZE
    used = sum(run_lengths)
    while chunk > MIN_CHUNK_SIZE and run_lengths:
        covered = sum(-(-n // chunk) for n in run_lengths) * chunk
        if 4 * (covered - used) <= covered:
            break
        chunk //= 2
    return chunk


def aligned_parts(num_tokens: int, num_segments: int) -> tuple[int, int, int]:
    """``(seg_indptr's start, seg_slot's start, length)`` in int32 elements of a plan's one buffer ``[permutation
    (num_tokens) | seg_indptr (num_segments + 1) | seg_slot (num_segments)]``, each part starting on 16 bytes. Triton
    compiles a kernel per alignment of its pointer arguments: a plan whose parts sit at 16-byte boundaries, as a
    CUDA graph's copies of them do, keeps one compiled kernel for both (and lets it load them aligned)."""
    indptr_at = -(-num_tokens // 4) * 4
    slot_at = -(-(indptr_at + num_segments + 1) // 4) * 4
    return indptr_at, slot_at, slot_at + num_segments


def aligned_tail(num_tokens: int, seg_indptr: list[int], seg_slot: list[int]) -> list[int]:
    """What follows the permutation in a plan's one buffer, laid out as :func:`aligned_parts` says: zeros up to
    ``seg_indptr``'s start, ``seg_indptr``, zeros up to ``seg_slot``'s start, ``seg_slot``."""
    indptr_at, slot_at, _ = aligned_parts(num_tokens, len(seg_slot))
    return [0] * (indptr_at - num_tokens) + seg_indptr + [0] * (slot_at - indptr_at - len(seg_indptr)) + seg_slot


def upload(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for it: on CUDA one copy from pinned memory queued on the current stream
    (a copy from pageable memory would wait for every kernel queued before it)."""
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def write_buffer(buf: torch.Tensor, host: torch.Tensor) -> None:
    """Rewrite a device buffer (a plan's, a stack's per-slot vectors) in place from ``host`` (on CUDA one copy from
    pinned memory, queued on the current stream: it runs after the kernels queued before it, which may still read the
    old contents, and ``host`` may change at once)."""
    if buf.device.type == "cuda":
        buf.copy_(host.pin_memory(), non_blocking=True)
    else:
        buf.copy_(host)


@dataclasses.dataclass(frozen=True, eq=False)
class BatchPlan:
    """Token grouping shared by every patched layer that sees the same ``(rows, tokens_per_row)`` shape.

    Attributes:
        rows, tokens_per_row: the shape this plan was built for; ``num_tokens = rows * tokens_per_row``.
        chunk_size: the most tokens a segment holds; the kernels' row tile.
        num_segments: number of segments (host int: it sizes the kernel grid).
        permutation: ``(num_tokens,)`` int32 on the device; adapter tokens grouped by slot, base tokens last.
        seg_indptr: ``(num_segments + 1,)`` int32 on the device; segment ``s`` is
            ``permutation[seg_indptr[s]:seg_indptr[s + 1]]``.
        seg_slot: ``(num_segments,)`` int32 on the device; the slot of each segment (never ``-1``).
        runs: host-side ``(slot, start, end)`` for each maximal run of one slot in the permuted order (base tokens
            excluded); the torch backend works from these, the Triton backend from the segments.
    """

    rows: int
    tokens_per_row: int
    chunk_size: int
    num_segments: int
    permutation: torch.Tensor
    seg_indptr: torch.Tensor
    seg_slot: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]

    @property
    def num_tokens(self) -> int:
        return self.rows * self.tokens_per_row

    @property
    def is_empty(self) -> bool:
        """True when no token uses an adapter (an all-base batch): layers skip the kernels entirely."""
        return self.num_segments == 0

    @classmethod
    def build(
        cls,
        row_slots: Sequence[int],
        tokens_per_row: int,
        device: torch.device | str = "cpu",
        chunk_size: int | None = None,
        row_tokens: Sequence[int] | None = None,
    ) -> "BatchPlan":
        """Build the plan for ``len(row_slots)`` rows of ``tokens_per_row`` tokens.

        Args:
            row_slots: slot of each row, ``-1`` for a base row (host ints).
            tokens_per_row: tokens in every row (the layer input is ``rows × tokens_per_row × features``).
            device: where the index tensors live (the layer's device).
            chunk_size: override the segment length (default: :func:`chunk_size_for` of the token count and runs).
            row_tokens: how many of each row's last tokens use its slot (0 to ``tokens_per_row``; the earlier ones are
                base tokens); ``None``: every token of every row.
        """
        rows = len(row_slots)
        if rows == 0 or tokens_per_row <= 0:
            raise ValueError(f"a plan needs at least one row and one token per row, got {rows} × {tokens_per_row}")
        if row_tokens is not None:
            if len(row_tokens) != rows or any(not 0 <= k <= tokens_per_row for k in row_tokens):
                raise ValueError(f"row_tokens must hold {rows} counts from 0 to {tokens_per_row}, got {row_tokens}")
            if all(k == tokens_per_row for k in row_tokens):
                row_tokens = None  # (every token keeps its row's slot: the plain plan)
            else:
                row_slots = [s if k else -1 for s, k in zip(row_slots, row_tokens)]

        # Stable order of rows by slot, base rows last. Sorting rows (not tokens) is enough: every row has the same
        # number of tokens, and a stable token sort would keep each row's tokens together in order anyway.
        order = sorted(range(rows), key=lambda i: (row_slots[i] < 0, row_slots[i]))
        runs: list[tuple[int, int, int]] = []
        pos = 0
        i = 0
        while i < rows and row_slots[order[i]] >= 0:
            slot = row_slots[order[i]]
            j = i
            while j < rows and row_slots[order[j]] == slot:
                j += 1
            used = (j - i) * tokens_per_row if row_tokens is None else sum(row_tokens[order[r]] for r in range(i, j))
            runs.append((slot, pos, pos + used))
            pos = runs[-1][2]
            i = j

        if row_tokens is not None:
            # Each adapter row's last tokens in the slot runs, then every base token (base rows whole, and the leading
            # tokens of rows that keep their slot for their last tokens only), in row order.
            perm: list[int] | torch.Tensor = []
            for r in order:
                if row_slots[r] < 0:
                    break
                end = (r + 1) * tokens_per_row
                perm.extend(range(end - row_tokens[r], end))
            for r in range(rows):
                start = r * tokens_per_row
                perm.extend(range(start, start + tokens_per_row - (row_tokens[r] if row_slots[r] >= 0 else 0)))
        elif tokens_per_row == 1:
            perm = order
        else:  # (a long permutation: expanded with tensor ops)
            order_t = torch.tensor(order, dtype=torch.int32)[:, None] * tokens_per_row
            perm = (order_t + torch.arange(tokens_per_row, dtype=torch.int32)).view(-1)
        return cls._assemble(rows, tokens_per_row, perm, runs, chunk_size, device)

    @classmethod
    def from_token_slots(
        cls, token_slots: Sequence[int], device: torch.device | str = "cpu", chunk_size: int | None = None
    ) -> "BatchPlan":
        """The plan of one row of packed tokens (a continuous-batching step: each scheduled request's prefill chunk or
        decode token, back to back): token ``i`` uses slot ``token_slots[i]`` (``-1``: a base token). The tokens are
        sorted by slot with a stable sort, base tokens last, as :meth:`build` sorts rows::

            token_slots      [2, 2, -1, 0, 0, 0, 2]
            permutation      [3, 4, 5, 0, 1, 6, 2]
            seg_indptr       [0, 3, 6]        (chunk 16)
            seg_slot         [0, 2]
        """
        num_tokens = len(token_slots)
        if num_tokens == 0:
            raise ValueError("a plan needs at least one token")
        slots = torch.as_tensor(token_slots, dtype=torch.int64)
        key = torch.where(slots < 0, torch.iinfo(torch.int64).max, slots)
        perm = torch.argsort(key, stable=True).to(torch.int32)
        values, counts = torch.unique_consecutive(key[perm.long()], return_counts=True)
        runs: list[tuple[int, int, int]] = []
        pos = 0
        for slot, count in zip(values.tolist(), counts.tolist()):
            if slot == torch.iinfo(torch.int64).max:
                break
            runs.append((slot, pos, pos + count))
            pos += count
        return cls._assemble(1, num_tokens, perm, runs, chunk_size, device)

    @classmethod
    def _assemble(cls, rows: int, tokens_per_row: int, perm, runs: list, chunk_size: int | None, device) -> "BatchPlan":
        """The plan of ``perm`` (every token's index in the permuted order: a list or an int32 tensor) whose
        ``runs`` ``(slot, start, end)`` are cut into segments of at most ``chunk_size`` tokens (default:
        :func:`chunk_size_for`), in one device buffer."""
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        num_tokens = rows * tokens_per_row
        chunk = chunk_size if chunk_size is not None else chunk_size_for(num_tokens, [e - s for _, s, e in runs])
        seg_lens: list[int] = []
        seg_slot: list[int] = []
        for slot, start, end in runs:
            full, rest = divmod(end - start, chunk)
            seg_lens.extend([chunk] * full)
            if rest:
                seg_lens.append(rest)
            seg_slot.extend([slot] * (full + (1 if rest else 0)))

        num_segments = len(seg_slot)
        # One host buffer, one transfer: [permutation | seg_indptr | seg_slot], each part 16-byte aligned (see
        # aligned_parts). Built from Python lists (a tensor op costs microseconds of overhead; a plan is built on every
        # call with new ids); only a long permutation is expanded with tensor ops.
        indptr_at, slot_at, _ = aligned_parts(num_tokens, num_segments)
        tail = aligned_tail(num_tokens, list(itertools.accumulate(seg_lens, initial=0)), seg_slot)
        if isinstance(perm, torch.Tensor):
            host = torch.cat([perm, torch.tensor(tail, dtype=torch.int32)])
        else:
            host = torch.tensor(perm + tail, dtype=torch.int32)

        dev = upload(host, device)
        return cls(
            rows=rows,
            tokens_per_row=tokens_per_row,
            chunk_size=chunk,
            num_segments=num_segments,
            permutation=dev[:num_tokens],
            seg_indptr=dev[indptr_at : indptr_at + num_segments + 1],
            seg_slot=dev[slot_at:],
            runs=tuple(runs),
        )
