"""Adapter slots: one model-wide name → slot registry, and per-layer stacked LoRA weights.

Every adapter gets one slot index, the same in every layer. A layer's :class:`LoraStack` holds

* ``a``: ``(capacity, r_max, in_features)`` — ``lora_A`` of each slot, zero-padded to the layer's largest rank;
* ``b``: ``(capacity, out_features, r_max)`` — ``lora_B`` of each slot, zero-padded likewise;
* ``ranks``: ``(capacity,)`` int32 — the slot's rank in this layer, ``0`` where the adapter does not target the layer
  (or the slot is free); the kernels do no work for rank-0 slots;
* ``scalings``: ``(capacity,)`` fp32 — PEFT's ``layer.scaling[name]`` (``lora_alpha / r``, or ``lora_alpha / √r``
  with rsLoRA, with ``rank_pattern`` / ``alpha_pattern`` already applied by PEFT).

Stacked dtype: by default the adapters' own (PEFT keeps them in fp32 on a bf16/fp16 model, ``autocast_adapter_dtype``;
the stacks then hold fp32 and the kernels compute PEFT's numerics: fp32 products for fp32 activations, TF32 for
half-precision ones, whose own rounding is far coarser). ``enable_csgmv(model, dtype=torch.bfloat16)`` stacks in the
model's dtype instead (half the bytes, bf16 products: the numerics of PEFT with ``autocast_adapter_dtype=False``).
Host copies of ranks and scalings serve the torch backend without a device sync.

DoRA adapters add ``mag``: ``(capacity, out_features)`` fp32, the per-output scale ``magnitude / ‖W + scaling·B·A‖``
of each slot (1 for plain LoRA slots), and ``bias``: the base layer's bias in fp32 (zeros for none); both exist only
once a layer holds a DoRA adapter. ``lora_bias``: ``(capacity, out_features)`` fp32, each slot's ``lora_B`` bias
(PEFT's ``lora_bias=True``; zeros elsewhere), once a layer holds such an adapter.

Slots are added and cleared one at a time (``set_slot`` / ``clear_slot``); capacity and ``r_max`` grow by
reallocation when needed, so loading or deleting one adapter never restacks the others.
"""

from __future__ import annotations

import torch
from torch import nn


class SlotRegistry:
    """Model-wide adapter name → slot index. Freed slots are reused."""

    def __init__(self) -> None:
        self.names: list[str | None] = []  # slot -> name (None: free)
        self.index: dict[str, int] = {}

    @property
    def capacity(self) -> int:
        return len(self.names)

    def add(self, name: str) -> int:
        if name in self.index:
            return self.index[name]
        try:
            slot = self.names.index(None)
            self.names[slot] = name
        except ValueError:
            slot = len(self.names)
            self.names.append(name)
        self.index[name] = slot
        return slot

    def remove(self, name: str) -> int:
        slot = self.index.pop(name)
        self.names[slot] = None
        return slot


def layer_adapters(layer: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The adapters a PEFT LoRA Linear or Embedding layer holds: name → (A ``(r, in)``, B ``(out, r)``) weights
    (for an embedding, ``in`` is the vocabulary: PEFT's ``lora_embedding_A`` / ``lora_embedding_B``)."""
    if layer.lora_embedding_A:
        return {name: (layer.lora_embedding_A[name], layer.lora_embedding_B[name]) for name in layer.lora_embedding_A}
    return {name: (layer.lora_A[name].weight, layer.lora_B[name].weight) for name in layer.lora_A.keys()}


def weights_device(layer: nn.Module) -> torch.device:
    """Where a PEFT layer's adapter weights live (its stack follows them, never a call's inputs)."""
    for held in (layer.lora_A, layer.lora_embedding_A):
        for value in held.values():
            return value.device if isinstance(value, torch.Tensor) else next(value.parameters()).device
    weight = getattr(layer.get_base_layer(), "weight", None)
    return weight.device if weight is not None else next(layer.parameters()).device


# The stack's device tensors. Each is marked as a static address when it is (re)allocated: compiled code takes it as a
# graph input that a CUDA graph reads in place (not copied in on every replay), guarded by identity, so a reallocated
# stack recompiles instead of reading freed memory.
_TENSORS = frozenset(("a", "b", "ranks", "scalings", "mag", "bias", "lora_bias"))


class LoraStack:
    """Stacked LoRA weights of one layer (see the module docstring for the layout)."""

    def __setattr__(self, name: str, value) -> None:
        if name in _TENSORS and isinstance(value, torch.Tensor):
            torch._dynamo.mark_static_address(value)
        object.__setattr__(self, name, value)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        capacity: int,
        r_max: int,
        dtype: torch.dtype,
        device: torch.device,
        embedding: bool = False,
    ) -> None:
        self.embedding = embedding  # an embedding layer: A is gathered by token id instead of multiplied
        self.in_features = in_features
        self.out_features = out_features
        self.dtype = dtype
        self.device = device
        self.a = torch.zeros((capacity, r_max, in_features), dtype=dtype, device=device)
        self.b = torch.zeros((capacity, out_features, r_max), dtype=dtype, device=device)
        self.ranks = torch.zeros(capacity, dtype=torch.int32, device=device)
        self.scalings = torch.zeros(capacity, dtype=torch.float32, device=device)
        self.ranks_host = [0] * capacity
        self.scalings_host = [0.0] * capacity
        self.sources: dict[int, nn.Module] = {}  # slot -> the lora_A module its weights came from
        # slot -> PEFT's (lora_A, lora_B) weights that are views into this stack (see set_slot's ``share``)
        self.shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.lora_bias: torch.Tensor | None = (
            None  # (capacity, out) fp32 lora_B bias, once a lora_bias adapter is stacked
        )
        self.scaling_src: dict | None = None  # the layer's ``scaling`` dict the stack was built from
        self.mag: torch.Tensor | None = None  # (capacity, out) fp32 DoRA scale, once a DoRA adapter is stacked
        self.bias: torch.Tensor | None = None  # (out,) fp32 base bias, with mag

    @property
    def capacity(self) -> int:
        return self.a.shape[0]

    @property
    def r_max(self) -> int:
        return self.a.shape[1]

    @property
    def nbytes(self) -> int:
        """Device memory held by this stack."""
        tensors = (self.a, self.b, self.ranks, self.scalings, self.mag, self.bias, self.lora_bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def ensure_capacity(self, capacity: int) -> None:
        """Make room for slots ``0 .. capacity-1`` (new slots have rank 0)."""
        self._grow(capacity, 0)

    def _grow(self, capacity: int, r_max: int) -> None:
        if capacity <= self.capacity and r_max <= self.r_max:
            return
        capacity, r_max = max(capacity, self.capacity), max(r_max, self.r_max)
        a = torch.zeros((capacity, r_max, self.in_features), dtype=self.dtype, device=self.device)
        b = torch.zeros((capacity, self.out_features, r_max), dtype=self.dtype, device=self.device)
        a[: self.capacity, : self.r_max] = self.a
        b[: self.capacity, :, : self.r_max] = self.b
        self.a, self.b = a, b
        self._point_shared()
        extra = capacity - len(self.ranks_host)
        if extra > 0:
            if self.mag is not None:
                self.mag = torch.cat([self.mag, self.mag.new_ones(extra, self.out_features)])
            if self.lora_bias is not None:
                self.lora_bias = torch.cat([self.lora_bias, self.lora_bias.new_zeros(extra, self.out_features)])
            self.ranks = torch.cat([self.ranks, self.ranks.new_zeros(extra)])
            self.scalings = torch.cat([self.scalings, self.scalings.new_zeros(extra)])
            self.ranks_host += [0] * extra
            self.scalings_host += [0.0] * extra

    def set_slot(
        self,
        slot: int,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        scaling: float,
        source=None,
        dora: tuple[torch.Tensor, torch.Tensor | None] | None = None,
        lora_bias: torch.Tensor | None = None,
        share: bool = False,
    ) -> None:
        """Copy one adapter's ``lora_A`` ``(r, in)`` and ``lora_B`` ``(out, r)`` weights into ``slot``; for DoRA,
        ``dora = (mag (out,), base bias (out,) or None)``; ``lora_bias``: ``lora_B``'s bias ``(out,)``, if any.

        ``share``: ``lora_a`` / ``lora_b`` are PEFT's parameters, of this stack's dtype and device: afterwards they are
        views into the slot (``.data`` re-pointed), so the adapter is stored once, and PEFT's forward, merges, saves
        and in-place edits all work on the stack's memory (:meth:`release_shared` gives them their own again)."""
        r = lora_a.shape[0]
        if lora_a.shape[1] != self.in_features or lora_b.shape != (self.out_features, r):
            raise ValueError(
                f"adapter weights A {tuple(lora_a.shape)} / B {tuple(lora_b.shape)} do not fit a layer of "
                f"{self.in_features} → {self.out_features} features"
            )
        self._grow(slot + 1, r)
        self._release(slot)
        with torch.no_grad():
            # Copies first: the sources may be views of this very slot (a restack of shared weights).
            a_val = lora_a.detach().to(device=self.device, dtype=self.dtype, copy=True)
            b_val = lora_b.detach().to(device=self.device, dtype=self.dtype, copy=True)
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.a[slot, :r] = a_val
            self.b[slot, :, :r] = b_val
            self.ranks[slot] = r
            self.scalings[slot] = float(scaling)
        self.ranks_host[slot] = r
        self.scalings_host[slot] = float(scaling)
        self.sources[slot] = source
        if share:
            self.shared[slot] = (lora_a, lora_b)
            self._point_shared(slot)
        if dora is not None:
            mag, bias = dora
            if self.mag is None:
                self.mag = torch.ones((self.capacity, self.out_features), dtype=torch.float32, device=self.device)
                self.bias = torch.zeros(self.out_features, dtype=torch.float32, device=self.device)
            with torch.no_grad():
                self.mag[slot] = mag.detach().to(device=self.device, dtype=torch.float32)
                if bias is not None:
                    self.bias.copy_(bias.detach().float())
        elif self.mag is not None:
            self.mag[slot] = 1.0
        if lora_bias is not None and self.lora_bias is None:
            self.lora_bias = torch.zeros((self.capacity, self.out_features), dtype=torch.float32, device=self.device)
        if self.lora_bias is not None:
            with torch.no_grad():
                if lora_bias is None:
                    self.lora_bias[slot] = 0.0
                else:
                    self.lora_bias[slot] = lora_bias.detach().to(device=self.device, dtype=torch.float32)

    def _point_shared(self, only: int | None = None) -> None:
        """Re-point the shared parameters (of ``only``, or of every slot) at their views of the current tensors."""
        for slot, (pa, pb) in self.shared.items():
            if only is None or slot == only:
                r = pa.shape[0]
                pa.data, pb.data = self.a[slot, :r], self.b[slot, :, :r]

    def _release(self, slot: int) -> None:
        """Give a shared slot's parameters their own memory again (a copy of their values)."""
        pair = self.shared.pop(slot, None)
        if pair is not None:
            for p in pair:
                p.data = p.data.clone()

    def forget(self, slot: int) -> None:
        """Stop sharing ``slot`` with PEFT's parameters, leaving them as they are (views of the slot until the caller
        moves them; the host tier moves them to host memory at once)."""
        self.shared.pop(slot, None)
        self.sources.pop(slot, None)

    def release_shared(self) -> None:
        """Every shared parameter owns its memory again (``disable_csgmv``, a layer unpatched or restacked)."""
        for slot in list(self.shared):
            self._release(slot)

    @property
    def shared_bytes(self) -> int:
        """Bytes of PEFT's adapter weights that live in this stack instead of a second copy."""
        return sum(p.numel() * p.element_size() for pair in self.shared.values() for p in pair)

    def clear_slot(self, slot: int) -> None:
        """Make ``slot`` a no-op in this layer (rank 0); its weight rows are zeroed."""
        if slot >= self.capacity:
            return
        self._release(slot)
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()
            self.ranks[slot] = 0
            self.scalings[slot] = 0.0
            if self.mag is not None:
                self.mag[slot] = 1.0
            if self.lora_bias is not None:
                self.lora_bias[slot] = 0.0
        self.ranks_host[slot] = 0
        self.scalings_host[slot] = 0.0
        self.sources.pop(slot, None)

    def to(self, device: torch.device) -> "LoraStack":
        """Move the stack (after the model was moved). Every tensor is copied before any is replaced, so a copy
        that fails leaves the stack as it was."""
        moved = {n: getattr(self, n).to(device) for n in sorted(_TENSORS) if getattr(self, n) is not None}
        for n, t in moved.items():
            setattr(self, n, t)
        self.device = torch.device(device)
        self._point_shared()  # PEFT's parameters were moved on their own: back to one copy, the stack's
        return self
