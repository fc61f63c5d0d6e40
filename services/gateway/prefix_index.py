"""The gateway's memory of which replica it last sent each prompt prefix to, block by block: the
affinity router's guess of where a prompt's earlier blocks are cached.

A prefix is named, like in the prefix cache, by a hash chained over its full blocks. Each entry
remembers the replica that last got a prompt through it and whether prompts went on from it in
more than one way (a branch point: a system prompt shared by several chats). Bounded: the least
recently routed entries are forgotten first, past a capacity the router sets to what the serving
replicas' KV caches hold together, so that the blocks it remembers per replica follow what the
replicas still keep (a chat that ended is forgotten about when its blocks would be evicted).
Of one prompt, the deepest blocks are forgotten first, as a replica evicts them (a finished
sequence releases its blocks last to first): a chat whose history lost its tail to pressure is
still known by its head, which its replica still holds, instead of looking new and moving off
it (forgetting its first own block would break the chain at that block, the rest unreachable).
A guess only: the replicas evict on their own, and each gateway knows only the prompts it routed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def chained_block_hashes(prompt_token_ids: Sequence[int], block_size: int,
                         max_blocks: int) -> list[int]:
    """One hash per full block (the first max_blocks at most), each over every token before it."""
    hashes: list[int] = []
    parent = b""
    for i in range(min(len(prompt_token_ids) // block_size, max_blocks)):
        parent = hashlib.blake2b(
            parent + array("I", prompt_token_ids[i * block_size:(i + 1) * block_size]).tobytes(),
            digest_size=8).digest()
        hashes.append(int.from_bytes(parent, "little"))
    return hashes


@dataclass(slots=True)
class _Entry:
    address: str  # the replica that last got a prompt through this prefix
    next_hash: int | None = None  # the block that followed it, while only one did
    is_branch: bool = False  # prompts went on from it with different blocks


@dataclass(frozen=True, slots=True)
class Match:
    num_blocks: int  # leading blocks of the prompt this gateway routed before
    address: str | None  # the replica that last got the deepest of them
    num_shared_blocks: int  # leading blocks up to the prompt's deepest branch point


class PrefixIndex:
    """Not thread-safe (the gateway's event loop only)."""

    def __init__(self, capacity: int) -> None:
        assert capacity >= 1, capacity
        self.capacity = capacity
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.num_blocks_by_address: Counter[str] = Counter()  # what each replica last got

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, hashes: Sequence[int], addresses: frozenset[str]) -> Match:
        """The deepest known prefix of `hashes` on one of `addresses`, and where the prompt
        leaves a prefix that others went on from differently (or, at the end of what is known,
        one that a different block followed)."""
        num_blocks, address, num_shared = 0, None, 0
        for depth, block_hash in enumerate(hashes, start=1):
            entry = self._entries.get(block_hash)
            if entry is None:
                break
            num_blocks = depth
            if entry.address in addresses:
                address = entry.address
            following = hashes[depth] if depth < len(hashes) else None
            if entry.is_branch or (entry.next_hash is not None and following is not None
                                   and entry.next_hash != following):
                num_shared = depth
        return Match(num_blocks, address, num_shared)

    def record(self, hashes: Sequence[int], address: str, capacity: int | None = None) -> None:
        """`address` got a prompt with these blocks; `capacity` bounds the entries below the
        index's own capacity."""
        entries = self._entries
        for depth, block_hash in enumerate(hashes):
            entry = entries.get(block_hash)
            if entry is None:
                entry = entries[block_hash] = _Entry(address)
            else:
                self.num_blocks_by_address[entry.address] -= 1
                entry.address = address
            self.num_blocks_by_address[address] += 1
            if depth + 1 < len(hashes):
                following = hashes[depth + 1]
                if entry.next_hash is None:
                    entry.next_hash = following
                elif entry.next_hash != following:
                    entry.is_branch = True
        for block_hash in reversed(hashes):  # deepest least recent: forgotten first
            entries.move_to_end(block_hash)
        limit = self.capacity if capacity is None else min(self.capacity, capacity)
        while len(entries) > limit:
            self.num_blocks_by_address[entries.popitem(last=False)[1].address] -= 1
