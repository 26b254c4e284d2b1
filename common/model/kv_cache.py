"""A preallocated KV cache addressed by slot.

Slot i holds the keys and values of whatever token was written there; the committed sequence lives in
slots [0, length) and a tree under construction in the slots after it. Keeping only an index copy
(`move`) as the way to reshape it means pruning never allocates and the buffers can be compiled against.
One slot past `capacity` is scratch: a compiled forward pads its batch with rows that write there, and
no attention ever reads it.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from torch import Tensor

POOL_KEEP = 2  # free caches kept per capacity: a burst's others go back to the allocator


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"KV cache capacity must be positive, got {capacity}")
        # One tensor per layer, not one stacked tensor: a compiled graph then writes new slots in
        # place, where a write through a view of a stacked input is done as a copy of the whole cache.
        shape = (num_kv_heads, capacity + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.capacity = capacity
        self.scratch_slot = capacity
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def move(self, src: Tensor, dst: Tensor) -> None:
        """Copy slots `src` onto slots `dst` for every layer (sources are read before any write)."""
        src, dst = src.to(self.k[0].device), dst.to(self.k[0].device)
        for layer in (*self.k, *self.v):
            layer[:, dst] = layer[:, src]

    def copy_prefix(self, source: KVCache, length: int) -> None:
        """Slots [0, length) of `source` become this cache's committed ones: a prefix two sessions
        share, copied at memory speed (a 1.5B bf16 model's 28 KiB a token) instead of computed."""
        if not 0 <= length <= min(source.length, self.capacity):
            raise ValueError(f"cannot copy {length} slots from a cache holding {source.length}")
        for mine, theirs in zip((*self.k, *self.v), (*source.k, *source.v), strict=True):
            mine[:, :length].copy_(theirs[:, :length])
        self.length = length

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.capacity:
            raise ValueError(f"cache length {length} outside [0, {self.capacity}]")
        self.length = min(self.length, length)


class KVCachePool:
    """Caches of sessions that ended, lent to the next. A new cache is zeroed memory: a 1.5B bf16
    model's 58 MiB at 2048 tokens took 20-140 ms to allocate on the EPYC's huge pages, on the core
    that runs every session's passes, at every chat turn. A cache comes back once its session is
    garbage, never while a pass may still hold that session; its old slots need no clearing, since
    a session attends only to the slots it wrote. At most `keep` wait per capacity."""

    def __init__(self, make: Callable[[int], KVCache], keep: int = POOL_KEEP) -> None:
        self._make = make
        self._keep = keep
        self._free: dict[int, list[KVCache]] = {}
        # Re-entrant: a collection that an allocation under the lock sets off may end a session,
        # whose cache then comes back on this thread.
        self._lock = threading.RLock()

    def lend(self, owner: object, capacity: int) -> KVCache:
        with self._lock:
            free = self._free.get(capacity)
            cache = free.pop() if free else None
        if cache is None:
            cache = self._make(capacity)
        cache.length = 0
        weakref.finalize(owner, self._give_back, cache)
        return cache

    def free(self, capacity: int) -> int:
        with self._lock:
            return len(self._free.get(capacity, ()))

    def _give_back(self, cache: KVCache) -> None:
        with self._lock:
            free = self._free.setdefault(cache.capacity, [])
            if len(free) < self._keep:
                free.append(cache)
