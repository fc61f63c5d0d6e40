"""Which replica serves a request: prefix affinity (by the prompts routed before, else on a
consistent-hash ring) bounded by load, least loaded, or round robin. Pure decisions over a snapshot
of the replicas; the replica set owns the snapshot.

Affinity guesses where a prompt's earlier blocks went: a prompt that goes on past every branch
point of what this gateway routed before (a chat's next turn: its history) follows the replica that
got the deepest of its blocks. A prompt that branches off a known prefix (a new chat of a shared
system prompt) goes to the replica that last got that prefix, unless it got clearly more blocks
from this gateway than another: then to the one that got the fewest. So the chats of one system
prompt spread over the replicas and keep their caches about even, each chat then staying on its
own. A prompt with no known branch point is placed on the ring by its first `prefix_blocks` full
blocks, which every gateway agrees on; a replica joining or leaving moves only the keys of its own
arcs of the ring. The load bound is that of consistent hashing with bounded loads: the preferred
replica is taken while it would carry at most ceil(`max_imbalance` times the mean load), else the
least loaded one. The replicas' KV events (kv_index.py) correct the guess: a replica that holds
more of the prompt's leading blocks than the guessed one and than the prefix the prompt shares
with other chats is preferred (a block in host memory counting less than one on the GPU), unless
it is busier than the guessed one.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.services.common.block_hash import BlockHash, hash_block_tokens
from pagedserve.services.gateway.kv_index import KVIndex
from pagedserve.services.gateway.prefix_index import PrefixIndex, chained_block_hashes

NUM_VIRTUAL_NODES = 64  # ring points per replica: evens out the arcs of a few replicas
MAX_INDEXED_BLOCKS = 256  # a prompt's blocks that routing hashes: deeper ones tell no chats apart
# a new chat joins the replica that last got its shared prefix (no prefill of it) while that one
# got at most this factor of the blocks the emptiest got
SHARED_PREFIX_SLACK = 1.1


class Reason:
    """Why a replica was picked: the `reason` label of the routing metric."""

    AFFINITY = "affinity"
    HELD_BLOCKS = "held_blocks"  # affinity, the KV events overruling the gateway's own guess
    OVERLOADED = "overloaded"  # affinity's preferred replica was over the bound
    SHORT_PROMPT = "short_prompt"  # no full block to key by: least loaded
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass(frozen=True, slots=True)
class Candidate:
    address: str
    num_requests: int  # running + waiting, as the gateway last knew it
    num_gpu_blocks: int = 0  # its KV cache, 0 = not known


@dataclass(frozen=True, slots=True)
class Decision:
    address: str
    reason: str


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int) -> int | None:
    """A hash of the prompt's first full blocks (at most max_blocks); None when the prompt
    has no full block (nothing a prefix cache could share)."""
    hashes = chained_block_hashes(prompt_token_ids, block_size, max_blocks)
    return hashes[-1] if hashes else None


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

    def __init__(self, policy: str, max_imbalance: float, prefix_blocks: int,
                 index_blocks: int = 65536, use_kv_events: bool = True,
                 offload_weight: float = 0.5) -> None:
        self.policy = policy
        self.max_imbalance = max_imbalance
        self.prefix_blocks = prefix_blocks
        self.index = PrefixIndex(index_blocks)
        self.use_kv_events = use_kv_events
        self.kv_index = KVIndex(offload_weight)
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
        hashes = chained_block_hashes(prompt_token_ids, max(block_size, 1), MAX_INDEXED_BLOCKS)
        if not hashes:
            return Decision(self._least_loaded(candidates).address, Reason.SHORT_PROMPT)
        preferred = self._preferred(candidates, hashes)
        holder = self._holder(candidates, prompt_token_ids, block_size, hashes, preferred)
        decision = self._bounded(candidates, holder or preferred,
                                 Reason.HELD_BLOCKS if holder else Reason.AFFINITY)
        cache_blocks = [c.num_gpu_blocks for c in candidates]
        self.index.record(hashes, decision.address, sum(cache_blocks) if all(cache_blocks) else None)
        return decision

    def _holder(self, candidates: Sequence[Candidate], prompt_token_ids: Sequence[int],
                block_size: int, hashes: list[int], guess: str) -> str | None:
        """The replica whose KV events say it holds the most of the prompt's leading blocks
        (tiers weighted), where that is more than the `guess` of the gateway's own memory holds
        and than the prefix the prompt shares with others (a new chat of a system prompt many
        replicas hold still spreads as the memory spreads it), and it is no busier than the
        guess. None: keep the guess."""
        live = [c.address for c in candidates if self.kv_index.is_live(c.address)]
        if not self.use_kv_events or not live:
            return None
        scores = dict.fromkeys(live, 0.0)
        matching = list(live)
        parent: BlockHash | None = None
        # a block short of the whole prompt, as the prefix cache matches
        num_blocks = min((len(prompt_token_ids) - 1) // block_size, MAX_INDEXED_BLOCKS)
        for i in range(num_blocks):
            parent = hash_block_tokens(parent, prompt_token_ids[i * block_size:(i + 1) * block_size])
            still = []
            for address in matching:
                weight = self.kv_index.weight(address, parent)
                if weight:
                    scores[address] += weight
                    still.append(address)
            if not still:
                break
            matching = still
        best = max(scores.values())
        addresses = frozenset(c.address for c in candidates)
        num_shared = self.index.match(hashes, addresses).num_shared_blocks
        if best <= max(scores.get(guess, 0.0), num_shared):
            return None
        tied = [c for c in candidates if scores.get(c.address) == best]
        holder = tied[0].address if len(tied) == 1 else self._preferred(tied, hashes)
        # blocks this gateway's memory lacks are often the oldest their replica holds (the memory
        # forgets what the replicas evict first): a busier replica evicts them for the turns
        # queued ahead before it admits this one, and the chat then stays there
        load = {c.address: c.num_requests for c in candidates}
        return holder if load[holder] <= load[guess] else None

    def _preferred(self, candidates: Sequence[Candidate], hashes: list[int]) -> str:
        addresses = frozenset(c.address for c in candidates)
        match = self.index.match(hashes, addresses)
        if match.address is not None and match.num_blocks > match.num_shared_blocks:
            return match.address
        if match.num_shared_blocks:
            num_blocks = self.index.num_blocks_by_address
            emptiest = min(sorted(addresses), key=lambda a: num_blocks[a])
            holder = match.address
            if holder is not None and num_blocks[holder] <= SHARED_PREFIX_SLACK * num_blocks[emptiest]:
                return holder
            return emptiest
        if addresses != self._ring.members:
            self._ring = HashRing(sorted(addresses))
        address = self._ring.lookup(hashes[min(self.prefix_blocks, len(hashes)) - 1])
        assert address is not None
        return address

    def _bounded(self, candidates: Sequence[Candidate], address: str, reason: str) -> Decision:
        preferred = next(c for c in candidates if c.address == address)
        total = sum(c.num_requests for c in candidates) + 1
        if preferred.num_requests + 1 <= math.ceil(self.max_imbalance * total / len(candidates)):
            return Decision(preferred.address, reason)
        return Decision(self._least_loaded(candidates).address, Reason.OVERLOADED)

    def _least_loaded(self, candidates: Sequence[Candidate]) -> Candidate:
        """Ties go round robin, so an idle set is still spread."""
        fewest = min(c.num_requests for c in candidates)
        tied = sorted((c for c in candidates if c.num_requests == fewest), key=lambda c: c.address)
        return tied[next(self._turn) % len(tied)]
