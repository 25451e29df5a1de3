"""The decoding KV cache: preallocated, one filled length per layer, O(1) rollback; and host ints to the device."""

from __future__ import annotations

import torch
from torch import Tensor

from layerskip_core.models import ModelSpec

MIN_CAPACITY = 256
"""Smallest KV-cache capacity the runner's cache pool hands out."""


def capacity_bucket(length: int) -> int:
    """Capacity of the pooled cache for ``length`` positions: the next power of two, at least ``MIN_CAPACITY``.

    Few distinct capacities mean few static forwards (and CUDA graphs) per runner; powers of two are multiples
    of 64, so the memory-efficient attention kernel needs no padded copy of the attention mask.
    """
    return max(MIN_CAPACITY, 1 << max(0, length - 1).bit_length())


def ints_to_device(values: list[int], device: torch.device) -> Tensor:
    """(n,) long tensor of host ints on ``device``; on CUDA copied from pinned memory without a host sync."""
    t = torch.tensor(values, dtype=torch.long)  # (n,)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class KVCache:
    """Preallocated keys/values for all layers, with a per-layer filled length.

    ``k[l, :, :lengths[l]]`` holds the keys of layer ``l``. Rollback is O(1): only the
    length moves; rows past it are garbage that the next write overwrites. A model with sliding-window layers also
    keeps each slot's RoPE position (``pos``): a verification tree's rows or a re-run window sit at slots other than
    their positions, and a window is a distance in positions. Every position stays in the cache (nothing a window
    hides is dropped): memory grows with the context as for full attention.
    """

    def __init__(self, spec: ModelSpec, capacity: int, dtype: torch.dtype, device: torch.device):
        shape = (spec.num_layers, spec.num_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # (L, Hkv, S_max, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # (L, Hkv, S_max, D)
        self.lengths = [0] * spec.num_layers
        windowed = any(w is not None for w in spec.layer_windows)
        self.pos = torch.zeros(spec.num_layers, capacity, dtype=torch.long, device=device) if windowed else None
        """(L, S_max) the position of each slot's key per layer (models with sliding windows only; else None)."""

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    def rollback(self, length: int, start: int = 0, end: int | None = None) -> None:
        """Truncate layers ``[start, end)`` to ``length`` slots (never extends them)."""
        for layer in range(start, self.num_layers if end is None else end):
            if self.lengths[layer] > length:
                self.lengths[layer] = length

    def reset(self) -> None:
        self.lengths = [0] * self.num_layers

    def compact(self, src: list[int], dst: list[int]) -> None:
        """Move the rows at slots ``src`` to slots ``dst`` in every layer (tree path compaction)."""
        if src == dst:
            return
        s = ints_to_device(src, self.k.device)  # (n,), pinned copies: no host sync
        d = ints_to_device(dst, self.k.device)  # (n,)
        self.k[:, :, d] = self.k[:, :, s]  # gather first, then scatter: safe for overlaps
        self.v[:, :, d] = self.v[:, :, s]
        if self.pos is not None:
            self.pos[:, d] = self.pos[:, s]


class CachePool:
    """Empty caches by ``capacity_bucket`` size, handed out and taken back, so the static forwards and CUDA
    graphs kept per cache are built once per capacity, not once per generation."""

    def __init__(self):
        self.free: dict[int, list[KVCache]] = {}
        """Free caches by capacity."""

    def take(self, capacity: int) -> KVCache | None:
        """A free cache of exactly ``capacity`` slots, reset, or None when there is none."""
        free = self.free.get(capacity, [])
        cache = free.pop() if free else None
        if cache is not None:
            cache.reset()
        return cache

    def give_back(self, cache: KVCache) -> None:
        free = self.free.setdefault(cache.capacity, [])
        if all(c is not cache for c in free):
            free.append(cache)

    def capacities(self) -> dict[int, int]:
        """{capacity: free caches}."""
        return {c: len(v) for c, v in sorted(self.free.items())}
