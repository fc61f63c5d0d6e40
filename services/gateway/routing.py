"""Which replica serves a request: prefix affinity on a consistent-hash ring bounded by load,
least loaded, or round robin. Pure decisions over a snapshot of the replicas; the replica set
owns the snapshot.

Affinity keys a prompt by its first full KV blocks, so requests sharing a system prompt or the
earlier turns of a chat meet the blocks that replica's prefix cache already holds. A replica
joining or leaving moves only the keys of its own arcs of the ring. The load bound is that of
consistent hashing with bounded loads: the preferred replica is taken while it would carry at
most ceil(`max_imbalance` times the mean load), else the least loaded one.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

NUM_VIRTUAL_NODES = 64  # ring points per replica: evens out the arcs of a few replicas


class Reason:
    """Why a replica was picked: the `reason` label of the routing metric."""

    AFFINITY = "affinity"
    OVERLOADED = "overloaded"  # affinity's preferred replica was over the bound
    SHORT_PROMPT = "short_prompt"  # no full block to key by: least loaded
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    address: str
    num_requests: int  # running + waiting, as the gateway last knew it


@dataclass(frozen=True, slots=True)
class Decision:
    address: str
    reason: str


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int) -> int | None:
    """A hash of the prompt's first full blocks (at most max_blocks); None when the prompt
    has no full block (nothing a prefix cache could share)."""
    num_blocks = min(len(prompt_token_ids) // block_size, max_blocks)
    if num_blocks == 0:
        return None
    return _hash64(array("I", prompt_token_ids[:num_blocks * block_size]).tobytes())


class HashRing:
    def __init__(self, addresses: Sequence[str] = ()) -> None:
        points = sorted((_hash64(f"{address}#{i}".encode()), address)
                        for address in addresses for i in range(NUM_VIRTUAL_NODES))
        self._hashes = [h for h, _ in points]
        self._addresses = [a for _, a in points]
        self.members = frozenset(addresses)

    def lookup(self, key: int) -> str | None:
        if not self._hashes:
            return None
        i = bisect.bisect_left(self._hashes, key) % len(self._hashes)
        return self._addresses[i]


class Router:
    """Not thread-safe (the gateway's event loop only)."""

    def __init__(self, policy: str, max_imbalance: float, prefix_blocks: int) -> None:
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.prefix_blocks = prefix_blocks
        self._ring = HashRing()
        self._turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], prompt_token_ids: Sequence[int],
               block_size: int) -> Decision:
        """`candidates`: the serving replicas, at least one."""
        assert candidates, "choose needs a serving replica"
        if self.policy == "round-robin":
            ordered = sorted(candidates, key=lambda c: c.address)
            return Decision(ordered[next(self._turn) % len(ordered)].address, Reason.ROUND_ROBIN)
        if self.policy == "least-loaded":
            return Decision(self._least_loaded(candidates).address, Reason.LEAST_LOADED)
        key = prefix_key(prompt_token_ids, max(block_size, 1), self.prefix_blocks)
        if key is None:
            return Decision(self._least_loaded(candidates).address, Reason.SHORT_PROMPT)
        addresses = frozenset(c.address for c in candidates)
        if addresses != self._ring.members:
            self._ring = HashRing(sorted(addresses))
        preferred = next(c for c in candidates if c.address == self._ring.lookup(key))
        total = sum(c.num_requests for c in candidates) + 1
        if preferred.num_requests + 1 <= math.ceil(self.max_imbalance * total / len(candidates)):
            return Decision(preferred.address, Reason.AFFINITY)
        return Decision(self._least_loaded(candidates).address, Reason.OVERLOADED)

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """Ties go round robin, so an idle set is still spread."""
        fewest = min(c.num_requests for c in candidates)
        tied = sorted((c for c in candidates if c.num_requests == fewest), key=lambda c: c.address)
        return tied[next(self._turn) % len(tied)]
