"""Automatic prefix caching: full, computed GPU blocks named by a hash chained over everything
before them, so equal hashes mean equal whole prefixes. Unreferenced cached blocks wait in an LRU
evictor, reclaimed only when the free list is empty. Hit counters are in tokens."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from pagedserve.services.common.block_hash import (
    BlockHash,
    hash_block_tokens,
    hash_prompt_blocks,
)

__all__ = ["BlockHash", "PrefixCache", "hash_block_tokens", "hash_prompt_blocks"]


class PrefixCache:
    """Reference counts live in the GPU `BlockPool`."""

    def __init__(self) -> None:
        self._block_by_hash: dict[BlockHash, int] = {}
        self._hash_by_block: dict[int, BlockHash] = {}
        # unreferenced cached blocks, least recently released first
        self._evictor: OrderedDict[int, None] = OrderedDict()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_by_hash)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictor)

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def record_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        assert 0 <= num_hit_tokens <= num_queried_tokens
        self.num_queried_tokens += num_queried_tokens
        self.num_hit_tokens += num_hit_tokens

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._block_by_hash.get(block_hash)

    def cached_blocks(self) -> Iterator[tuple[BlockHash, int]]:
        return iter(self._block_by_hash.items())

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_by_block

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictor

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """A hash already cached keeps its block; the newcomer stays private."""
        if block_hash in self._block_by_hash or block_id in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """A cached block lost its last reference: keep its KV, evictable."""
        assert block_id in self._hash_by_block and block_id not in self._evictor, block_id
        self._evictor[block_id] = None

    def unpark(self, block_id: int) -> None:
        del self._evictor[block_id]

    def clear(self) -> list[int]:
        """Returns the unreferenced blocks, for the free list; hit counters are kept."""
        parked = list(self._evictor)
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        self._evictor.clear()
        return parked

    def forget(self, block_id: int) -> BlockHash | None:
        """Unnames a block whose KV may be wrong; a parked one leaves the evictor."""
        block_hash = self._hash_by_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_by_hash[block_hash]
            self._evictor.pop(block_id, None)
        return block_hash

    def evict(self) -> tuple[int, BlockHash]:
        block_id, _ = self._evictor.popitem(last=False)
        block_hash = self._hash_by_block.pop(block_id)
        del self._block_by_hash[block_hash]
        return block_id, block_hash
