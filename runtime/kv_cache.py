"""Static per-sequence caches indexed by position: the KV cache (one K and one V tensor per layer) and the
drafter's feature store.

Rejected draft slots are simply overwritten by the next step; only an accepted path that
is not already contiguous (a tree branch) is moved, in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KVCache:
    k: list[Tensor]  # per layer [1, kv_heads, max_len, head_dim]
    v: list[Tensor]

    @classmethod
    def allocate(cls, layers: int, kv_heads: int, head_dim: int, max_len: int, dtype, device) -> KVCache:
        shape = (1, kv_heads, max_len, head_dim)
        return cls(
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
            [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)],
        )

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    @property
    def nbytes_per_token(self) -> int:
        t = self.k[0]
        return 2 * len(self.k) * t.shape[1] * t.shape[3] * t.element_size()

    def keep(self, start: int, slots: Tensor) -> None:
        """Move slots (absolute, ascending) to start, start+1, ...: the accepted path survives."""
        n = slots.numel()
        if n == 0 or bool((slots == torch.arange(start, start + n, device=slots.device)).all()):
            return
        for t in (*self.k, *self.v):
            t[:, :, start : start + n] = t[:, :, slots]  # advanced indexing copies first: overlap is safe

    def read(self, start: int, end: int) -> list[Tensor]:
        """Copies of slots [start, end) of every K and V tensor (for the prefix cache)."""
        return [t[:, :, start:end].clone() for t in (*self.k, *self.v)]

    def write(self, start: int, blocks: list[Tensor]) -> None:
        """Inverse of read: put saved K/V slices back at slot start."""
        n = blocks[0].shape[2]
        for t, b in zip((*self.k, *self.v), blocks, strict=True):
            t[:, :, start : start + n] = b


@dataclass
class FeatureStore:
    """Per position, the target feature a drafter reads (EAGLE, P-EAGLE). It has KVCache's slot interface
    (max_len, read, write), so the prefix cache saves and restores it with the KV caches."""

    features: Tensor  # [max_len, hidden]

    @classmethod
    def allocate(cls, max_len: int, hidden: int, dtype, device) -> FeatureStore:
        return cls(torch.zeros(max_len, hidden, dtype=dtype, device=device))

    @property
    def max_len(self) -> int:
        return self.features.shape[0]

    def read(self, start: int, end: int) -> list[Tensor]:
        return [self.features[start:end].clone()]

    def write(self, start: int, blocks: list[Tensor]) -> None:
        (b,) = blocks
        self.features[start : start + b.shape[0]] = b


SlotCache = KVCache | FeatureStore  # what the prefix cache saves and restores, slot by slot
