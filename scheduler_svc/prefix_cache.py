"""Automatic prefix caching: full, computed GPU blocks named by a hash chained over everything
before them, so equal hashes mean equal whole prefixes. Unreferenced cached blocks wait in an LRU
evictor, reclaimed only when the free list is empty. Hit counters are in tokens."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """SHA-256, not `hash`: a collision would silently serve one prompt another's KV, and tuple
    hashes are easy to collide on purpose."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int,
                       parent_hash: BlockHash | None = None,
                       first_block: int = 0) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    for i in range(first_block, num_blocks):
        parent_hash = hash_block_tokens(parent_hash, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent_hash)
    return hashes


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

    def evict(self) -> int:
        block_id, _ = self._evictor.popitem(last=False)
        del self._block_by_hash[self._hash_by_block.pop(block_id)]
        return block_id
