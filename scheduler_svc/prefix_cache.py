"""Automatic prefix caching: full, computed GPU blocks named by the hash of everything before them.

A block's hash chains its parent's: `hash_block_tokens(parent_hash, block_tokens)`, so equal hashes
mean equal whole prefixes, not just equal blocks, and a lookup walks a prompt block by block until
the first miss. A cached block stays in the hash map while sequences hold it and after the last
one lets go; unreferenced cached blocks wait in an LRU evictor and count as free. They are only
reclaimed when the free list is empty, least recently released first.

Hit-rate counters are in tokens: `num_queried_tokens` counts every token of every prompt looked up
at allocation, `num_hit_tokens` the tokens among them whose KV was reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chained hash of one full block. SHA-256 rather than Python's `hash`: a collision would
    silently serve one prompt another prompt's KV, and tuple hashes are easy to collide on purpose."""
    digest = hashlib.sha256(parent_hash or b"")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int, num_blocks: int,
                       parent_hash: BlockHash | None = None,
                       first_block: int = 0) -> list[BlockHash]:
    """Chained hashes of full blocks `first_block .. num_blocks - 1` of `token_ids`."""
    hashes: list[BlockHash] = []
    for i in range(first_block, num_blocks):
        parent_hash = hash_block_tokens(parent_hash, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent_hash)
    return hashes


class PrefixCache:
    """The hash → block map, the LRU evictor of unreferenced cached blocks, and hit counters.
    Block ids are GPU block ids; reference counts live in the GPU `BlockPool`."""

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
        """Name a full, computed block by its hash. A hash already cached by another block keeps
        that block (the newcomer stays private and goes to the free list when released)."""
        if block_hash in self._block_by_hash or block_id in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        return True

    def park(self, block_id: int) -> None:
        """A cached block lost its last reference: keep its KV, evictable, most recently used."""
        assert block_id in self._hash_by_block and block_id not in self._evictor, block_id
        self._evictor[block_id] = None

    def unpark(self, block_id: int) -> None:
        """A parked block is reused by a prefix hit; it is no longer evictable."""
        del self._evictor[block_id]

    def clear(self) -> list[int]:
        """Forget every cached block (their KV is gone); returns the unreferenced ones, which
        go back to the free list. Hit counters are kept."""
        parked = list(self._evictor)
        self._block_by_hash.clear()
        self._hash_by_block.clear()
        self._evictor.clear()
        return parked

    def evict(self) -> int:
        """Reclaim the least recently released cached block; its hash is forgotten."""
        block_id, _ = self._evictor.popitem(last=False)
        del self._block_by_hash[self._hash_by_block.pop(block_id)]
        return block_id
