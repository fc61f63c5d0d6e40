"""The name of a full KV block: a hash chained over every token before it, so equal hashes mean
equal whole prefixes. The prefix cache keys its blocks by it and a replica's KV events carry it,
so a gateway can tell which replica holds a prompt's blocks by hashing the prompt the same way."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

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
