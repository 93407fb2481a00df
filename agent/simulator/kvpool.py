"""The KV-cache block pool of a paged-attention engine.

Capacity: ``(memory * gpu_memory_utilization - weights - activation reserve)`` bytes
divided by the bytes of one block (``block_size`` tokens x K and V x layers). A request
holds ``ceil(tokens / block_size)`` blocks; shared-prefix blocks, once computed, are held
by the cache for the rest of the run (a simplification of an evictable prefix cache:
they are never evicted, so they count as used).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ridgeline.probes.errors import InputError


@dataclass
class KvPool:
    total_blocks: int
    block_size: int = 16
    used_blocks: int = 0
    prefix_blocks: int = 0

    @classmethod
    def sized(cls, memory_bytes: float, weight_bytes: float, kv_bytes_per_token: float, *,
              gpu_memory_utilization: float = 0.9, activation_reserve_bytes: float = 2e9,
              block_size: int = 16, kv_cache_bytes: float | None = None) -> "KvPool":
        budget = kv_cache_bytes if kv_cache_bytes is not None else \
            memory_bytes * gpu_memory_utilization - weight_bytes - activation_reserve_bytes
        blocks = int(budget // (kv_bytes_per_token * block_size))
        if blocks < 1:
            raise InputError(f"no room for a KV cache: {memory_bytes / 1e9:.1f} GB x {gpu_memory_utilization} "
                             f"minus {weight_bytes / 1e9:.1f} GB of weights leaves {budget / 1e9:.2f} GB")
        return cls(total_blocks=blocks, block_size=block_size)

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks - self.prefix_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.total_blocks * self.block_size

    @property
    def usage_ratio(self) -> float:
        return (self.used_blocks + self.prefix_blocks) / self.total_blocks

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def try_allocate(self, n: int) -> bool:
        if n <= self.free_blocks:
            self.used_blocks += n
            return True
        return False

    def free(self, n: int) -> None:
        self.used_blocks -= n
        assert self.used_blocks >= 0, "freed more KV blocks than allocated"
