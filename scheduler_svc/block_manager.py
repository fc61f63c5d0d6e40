"""The block space manager: every sequence's block table, on the GPU or swapped to the CPU.
Forked sequences share blocks by reference count and split them by copy-on-write; blocks held
only by the prefix cache are evictable and count as free.

The worker runs a step's cache operations in the order swap out, swap in, copy, so a scheduler
that frees, swaps out, swaps in and appends in that order never reuses a block before its data
has moved."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field

from pagedserve.scheduler_svc.block_pool import BlockPool, Device
from pagedserve.scheduler_svc.host_tier import HostTier
from pagedserve.scheduler_svc.kv_event_log import KVEventLog
from pagedserve.scheduler_svc.prefix_cache import (
    BlockHash,
    PrefixCache,
    hash_block_tokens,
    hash_prompt_blocks,
)
from pagedserve.services.common.cdiv import cdiv

logger = logging.getLogger(__name__)


class AllocStatus(enum.Enum):
    OK = enum.auto()  # fits now
    LATER = enum.auto()  # fits once running sequences free blocks
    NEVER = enum.auto()  # does not fit even in an empty pool


@dataclass(slots=True)
class _SeqBlocks:
    block_ids: list[int]  # physical ids on `device`
    num_tokens: int  # tokens the block table was sized for
    device: Device = Device.GPU
    # hashes of the leading full blocks known to be computed
    block_hashes: list[BlockHash] = field(default_factory=list)
    # leading blocks none replaced or dropped since `take_block_table` last read the table
    num_stable_blocks: int = 0


@dataclass(slots=True)
class KvImport:
    """Blocks a transfer from a prefill replica fills: `block_ids` new, for the chain's last
    hashes; `held_block_ids`, cached already, for the first ones."""

    block_hashes: list[BlockHash]
    held_block_ids: list[int]
    block_ids: list[int]


class BlockManager:
    def __init__(self, block_size: int, num_gpu_blocks: int, num_cpu_blocks: int,
                 watermark: float = 0.01, enable_prefix_caching: bool = False,
                 num_offload_blocks: int = 0) -> None:
        """`num_offload_blocks`: the host tier's CPU blocks, numbered after the swap space's."""
        assert block_size >= 1 and 0.0 <= watermark < 1.0, (block_size, watermark)
        self.block_size = block_size
        self.watermark = watermark
        # blocks kept free at admission so running sequences can still grow
        self.watermark_blocks = int(watermark * num_gpu_blocks)
        self.gpu_pool = BlockPool(Device.GPU, num_gpu_blocks)
        self.cpu_pool = BlockPool(Device.CPU, num_cpu_blocks)
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # what the GPU prefix cache holds, for the gateways' routers (no events without it)
        self.kv_events = KVEventLog(block_size)
        self.host_tier = (HostTier(num_cpu_blocks, num_offload_blocks, block_size, self.kv_events)
                          if enable_prefix_caching and num_offload_blocks else None)
        self._seqs: dict[int, _SeqBlocks] = {}

    @property
    def num_gpu_blocks(self) -> int:
        return self.gpu_pool.num_blocks

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    @property
    def num_free_gpu_blocks(self) -> int:
        """Evictable prefix-cache blocks included."""
        num_evictable = self.prefix_cache.num_evictable_blocks if self.prefix_cache else 0
        return self.gpu_pool.num_free_blocks + num_evictable

    @property
    def num_free_cpu_blocks(self) -> int:
        return self.cpu_pool.num_free_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.prefix_cache is not None

    @property
    def prefix_cache_queries(self) -> int:
        return self.prefix_cache.num_queried_tokens if self.prefix_cache else 0

    @property
    def prefix_cache_hits(self) -> int:
        return self.prefix_cache.num_hit_tokens if self.prefix_cache else 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache.hit_rate if self.prefix_cache else 0.0

    def has_seq(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seqs[seq_id].block_ids)

    def take_block_table(self, seq_id: int) -> tuple[list[int], int]:
        """The block table itself (the caller must not change it) and how many of its leading
        blocks stayed in place since the last call: a copy of the table taken then still equals
        it up to there. Usually all of them: a decoding sequence only appends."""
        seq = self._seqs[seq_id]
        num_stable = seq.num_stable_blocks
        seq.num_stable_blocks = len(seq.block_ids)
        return seq.block_ids, num_stable

    def is_swapped(self, seq_id: int) -> bool:
        return self._seqs[seq_id].device is Device.CPU

    def num_tokens(self, seq_id: int) -> int:
        return self._seqs[seq_id].num_tokens

    def can_allocate(self, token_ids: list[int], use_prefix_cache: bool = True) -> AllocStatus:
        if cdiv(len(token_ids), self.block_size) > self.num_gpu_blocks - self.watermark_blocks:
            return AllocStatus.NEVER
        num_taken = self.num_blocks_taken(token_ids, use_prefix_cache)
        if self.num_free_gpu_blocks - num_taken >= self.watermark_blocks:
            return AllocStatus.OK
        return AllocStatus.LATER

    def num_blocks_taken(self, token_ids: list[int], use_prefix_cache: bool = True) -> int:
        """A hit on an evictable block costs a free block just as a new block does."""
        _, hit_block_ids = self._match_prefix(token_ids, use_prefix_cache)
        gpu_hits = [b for b in hit_block_ids if b is not None]
        num_evictable_hits = sum(1 for b in gpu_hits if self.gpu_pool.ref_counts[b] == 0)
        return cdiv(len(token_ids), self.block_size) - len(gpu_hits) + num_evictable_hits

    def allocate(self, seq_id: int, token_ids: list[int], use_prefix_cache: bool = True) -> int:
        """Returns num_cached_tokens. `use_prefix_cache` False: every token is computed (prompt
        logprobs need the logits of every position), though the blocks are still cached after."""
        assert seq_id not in self._seqs, f"seq {seq_id} already has blocks"
        assert token_ids, "a sequence has at least one token"
        hit_hashes, hit_block_ids = self._match_prefix(token_ids, use_prefix_cache)
        # claim the hits first so that allocating the rest cannot evict them
        for block_hash, block_id in zip(hit_hashes, hit_block_ids, strict=True):
            if block_id is None:
                assert self.host_tier is not None
                self.host_tier.pin(block_hash)
                continue
            if self.gpu_pool.ref_counts[block_id] == 0:
                assert self.prefix_cache is not None
                self.prefix_cache.unpark(block_id)
            self.gpu_pool.incref(block_id)
        block_ids: list[int] = []
        for block_hash, block_id in zip(hit_hashes, hit_block_ids, strict=True):
            if block_id is None:
                assert self.host_tier is not None
                block_id = self._allocate_gpu_block()
                self.host_tier.onload(block_hash, block_id)
            block_ids.append(block_id)
        block_ids += [self._allocate_gpu_block()
                      for _ in range(cdiv(len(token_ids), self.block_size) - len(hit_block_ids))]
        self._seqs[seq_id] = _SeqBlocks(block_ids=block_ids, num_tokens=len(token_ids),
                                        block_hashes=hit_hashes)
        num_cached_tokens = len(hit_block_ids) * self.block_size
        if self.prefix_cache is not None:
            self.prefix_cache.record_query(len(token_ids), num_cached_tokens)
            self._register(block_ids, hit_hashes, 0)  # the blocks copied back from the host
        return num_cached_tokens

    def fork(self, parent_seq_id: int, child_seq_id: int) -> None:
        assert child_seq_id not in self._seqs, f"seq {child_seq_id} already has blocks"
        parent = self._seqs[parent_seq_id]
        pool = self._pool(parent.device)
        for block_id in parent.block_ids:
            pool.incref(block_id)
        self._seqs[child_seq_id] = _SeqBlocks(
            block_ids=list(parent.block_ids), num_tokens=parent.num_tokens,
            device=parent.device, block_hashes=list(parent.block_hashes))

    def can_append_slots(self, seq_ids: list[int], num_new_tokens: list[int]) -> bool:
        """Counts every copy-on-write; a group sharing a block may over-count by one."""
        assert len(seq_ids) == len(num_new_tokens), (len(seq_ids), len(num_new_tokens))
        num_needed = 0
        has_shared = bool(self.gpu_pool.num_shared_blocks)
        for seq_id, num_new in zip(seq_ids, num_new_tokens, strict=True):
            seq = self._seqs[seq_id]
            num_total = seq.num_tokens + num_new
            num_needed += max(0, cdiv(num_total, self.block_size) - len(seq.block_ids))
            if has_shared:
                num_needed += len(self._shared_written_blocks(seq, num_total))
        return not num_needed or num_needed <= self.num_free_gpu_blocks

    def can_append_decodes(self, num_seqs: int) -> bool:
        """Room for one more token in each of `num_seqs` sequences whose tables hold their
        earlier tokens (as append_slots and trim leave them): the token takes a new block or a
        copy of the shared block it writes, never both, and a sibling's copy leaves the block
        to the other sharer alone."""
        return num_seqs <= self.num_free_gpu_blocks

    def append_slots(self, seq_id: int, num_total_tokens: int) -> list[tuple[int, int]]:
        """Returns the (src, dst) copy-on-write pairs of the shared blocks this step writes."""
        seq = self._seqs[seq_id]
        assert seq.device is Device.GPU, f"seq {seq_id} is swapped out"
        assert num_total_tokens >= 1, num_total_tokens
        blocks_to_copy: list[tuple[int, int]] = []
        if self.gpu_pool.num_shared_blocks:
            for i in self._shared_written_blocks(seq, num_total_tokens):
                src = seq.block_ids[i]
                dst = self._allocate_gpu_block()
                remaining = self.gpu_pool.decref(src)
                assert remaining >= 1, (src, remaining)
                seq.block_ids[i] = dst
                seq.num_stable_blocks = min(seq.num_stable_blocks, i)
                blocks_to_copy.append((src, dst))
        if num_total_tokens > len(seq.block_ids) * self.block_size:
            for _ in range(cdiv(num_total_tokens, self.block_size) - len(seq.block_ids)):
                seq.block_ids.append(self._allocate_gpu_block())
        if num_total_tokens > seq.num_tokens:
            seq.num_tokens = num_total_tokens
        return blocks_to_copy

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """The slots past num_tokens go back (rejected speculative tokens): whole blocks past the
        last one needed are freed. Their KV was never hashed: only computed tokens are."""
        seq = self._seqs[seq_id]
        num_blocks = cdiv(num_tokens, self.block_size)
        assert len(seq.block_hashes) <= num_blocks <= len(seq.block_ids), (
            seq_id, num_tokens, len(seq.block_hashes), len(seq.block_ids))
        while len(seq.block_ids) > num_blocks:
            self._drop_reference(seq.device, seq.block_ids.pop())
        seq.num_stable_blocks = min(seq.num_stable_blocks, num_blocks)
        seq.num_tokens = num_tokens

    def _shared_written_blocks(self, seq: _SeqBlocks, num_total_tokens: int) -> list[int]:
        """Written positions start at the old end of the table, or at the last token: those below
        are computed (or will be by whoever shares them). Callers skip it while no block is
        shared, as in the usual decode."""
        first_written = min(seq.num_tokens, num_total_tokens - 1)
        end = min(len(seq.block_ids), cdiv(num_total_tokens, self.block_size))
        ref_counts = self.gpu_pool.ref_counts
        return [i for i in range(first_written // self.block_size, end)
                if ref_counts[seq.block_ids[i]] > 1]

    def free(self, seq_id: int) -> None:
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            return
        # tail first: the evictor then drops a prefix's last blocks before the blocks they chain on
        for block_id in reversed(seq.block_ids):
            self._drop_reference(seq.device, block_id)

    def reset_prefix_cache(self) -> None:
        """Every sequence must be freed first: a block in use would stay named by its hash."""
        assert not self._seqs, "free every sequence before resetting the prefix cache"
        if self.prefix_cache is not None:
            for block_id in self.prefix_cache.clear():
                self.gpu_pool.free(block_id)
            if self.host_tier is not None:
                self.host_tier.clear()
            self.kv_events.cleared()

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return len(self._unique_blocks(seq_ids, Device.GPU)) <= self.num_free_cpu_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """(gpu, cpu) pairs, each shared block once; CPU copies are never in the prefix cache."""
        return self._move(seq_ids, Device.GPU, Device.CPU)

    def can_swap_in(self, seq_ids: list[int]) -> bool:
        num_required = len(self._unique_blocks(seq_ids, Device.CPU))
        return self.num_free_gpu_blocks - num_required >= self.watermark_blocks

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """(cpu, gpu) pairs, each shared block once."""
        mapping = self._move(seq_ids, Device.CPU, Device.GPU)
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            self._register(seq.block_ids, seq.block_hashes, 0)
        return mapping

    def _unique_blocks(self, seq_ids: list[int], device: Device) -> set[int]:
        block_ids: set[int] = set()
        for seq_id in seq_ids:
            seq = self._seqs[seq_id]
            assert seq.device is device, f"seq {seq_id} is on {seq.device.value}, not {device.value}"
            block_ids.update(seq.block_ids)
        return block_ids

    def _move(self, seq_ids: list[int], src_device: Device,
              dst_device: Device) -> list[tuple[int, int]]:
        dst_pool = self._pool(dst_device)
        mapping: dict[int, int] = {}  # src block -> dst block, insertion order = copy order
        for seq_id in dict.fromkeys(seq_ids):
            seq = self._seqs[seq_id]
            assert seq.device is src_device, f"seq {seq_id} is on {seq.device.value}"
            for i, src in enumerate(seq.block_ids):
                dst = mapping.get(src)
                if dst is None:
                    dst = mapping[src] = (self._allocate_gpu_block() if dst_device is Device.GPU
                                          else dst_pool.allocate())
                else:
                    dst_pool.incref(dst)
                seq.block_ids[i] = dst
                # sequences outside `seq_ids` may still hold src; it is freed with its last ref
                self._drop_reference(src_device, src)
            seq.device = dst_device
            seq.num_stable_blocks = 0
        return list(mapping.items())

    def mark_computed(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Call after the step that computed them ran; full blocks enter the prefix cache."""
        if self.prefix_cache is None:
            return
        seq = self._seqs[seq_id]
        assert seq.device is Device.GPU, f"seq {seq_id} is swapped out"
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        assert num_full <= len(seq.block_ids), (num_full, len(seq.block_ids))
        num_hashed = len(seq.block_hashes)
        if num_full <= num_hashed:
            return
        parent_hash = seq.block_hashes[-1] if seq.block_hashes else None
        new_hashes = hash_prompt_blocks(token_ids, self.block_size, num_full, parent_hash,
                                        first_block=num_hashed)
        seq.block_hashes.extend(new_hashes)
        self._register(seq.block_ids, seq.block_hashes, num_hashed)

    def take_host_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's (gpu, cpu) offloads and (cpu, gpu) onloads since the last call: the
        step being planned carries them."""
        return self.host_tier.take_copies() if self.host_tier is not None else ([], [])

    def forget_host_copies(self, offloads: list[tuple[int, int]],
                           onloads: list[tuple[int, int]]) -> None:
        """A failed step's tier copies may not have run: the blocks they filled are forgotten on
        both tiers, so no later hit reads them."""
        if self.host_tier is None:
            return
        assert self.prefix_cache is not None
        self.host_tier.forget({cpu for _, cpu in offloads})
        for _, gpu in onloads:
            block_hash = self.prefix_cache.forget(gpu)
            if block_hash is None:
                continue
            self.kv_events.removed([block_hash])
            if self.gpu_pool.ref_counts[gpu] == 0:  # it was parked
                self.gpu_pool.free(gpu)

    def pin_prefix(self, token_ids: list[int]) -> list[int]:
        """An export for a decode replica: the device blocks holding the prompt's leading full
        blocks (as `_match_prefix` matches, up to the first block not on the device), each held
        by one more reference so that it is not evicted until `unpin`."""
        hashes, block_ids = self._match_prefix(token_ids)
        pinned: list[int] = []
        for block_id in block_ids:
            if block_id is None:
                break
            if self.gpu_pool.ref_counts[block_id] == 0:
                assert self.prefix_cache is not None
                self.prefix_cache.unpark(block_id)
            self.gpu_pool.incref(block_id)
            pinned.append(block_id)
        return pinned

    def unpin(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            self._drop_reference(Device.GPU, block_id)

    def reserve_import(self, token_ids: list[int], num_offered_blocks: int) -> KvImport | None:
        """Device blocks for the prompt's leading full blocks that a prefill replica offers and
        the prefix cache lacks, held (with the cached blocks before them) until `adopt_import`
        or `cancel_import`. None: nothing is missing, or taking them would leave fewer free
        blocks than the watermark."""
        if self.prefix_cache is None:
            return None
        num_blocks = min(num_offered_blocks, (len(token_ids) - 1) // self.block_size)
        hashes = hash_prompt_blocks(token_ids, self.block_size, max(num_blocks, 0))
        held: list[int] = []
        for block_hash in hashes:
            block_id = self.prefix_cache.lookup(block_hash)
            if block_id is None:
                break
            if self.gpu_pool.ref_counts[block_id] == 0:
                self.prefix_cache.unpark(block_id)
            self.gpu_pool.incref(block_id)
            held.append(block_id)
        num_new = len(hashes) - len(held)
        if not num_new or self.num_free_gpu_blocks - num_new < self.watermark_blocks:
            self.unpin(held)
            return None
        return KvImport(hashes, held, [self._allocate_gpu_block() for _ in range(num_new)])

    def adopt_import(self, kv_import: KvImport) -> None:
        """The new blocks hold their KV now: they enter the prefix cache (stored events) and
        wait in it, evictable, for the request. A hash cached meanwhile keeps its block; the
        duplicate is freed."""
        self._register(kv_import.held_block_ids + kv_import.block_ids, kv_import.block_hashes,
                       len(kv_import.held_block_ids))
        self.cancel_import(kv_import)

    def cancel_import(self, kv_import: KvImport) -> None:
        """Every block goes back: the new ones, unnamed, to the free list."""
        self.unpin(kv_import.block_ids)
        self.unpin(kv_import.held_block_ids)

    def _match_prefix(self, token_ids: list[int], use_prefix_cache: bool = True
                      ) -> tuple[list[BlockHash], list[int | None]]:
        """Stops one block short of an exact full hit: the last token's logits are needed.
        A hit's block id is None when only the host tier holds it."""
        if self.prefix_cache is None or not use_prefix_cache:
            return [], []
        hashes: list[BlockHash] = []
        block_ids: list[int | None] = []
        parent_hash: BlockHash | None = None
        for i in range((len(token_ids) - 1) // self.block_size):
            parent_hash = hash_block_tokens(
                parent_hash, token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.prefix_cache.lookup(parent_hash)
            if block_id is None and not (self.host_tier and self.host_tier.holds(parent_hash)):
                break
            hashes.append(parent_hash)
            block_ids.append(block_id)
        return hashes, block_ids

    def _register(self, block_ids: list[int], block_hashes: list[BlockHash], first: int) -> None:
        """Caches the blocks from index `first` on; each run of them new to the cache is one
        stored event."""
        if first >= len(block_hashes):
            return
        assert self.prefix_cache is not None
        run: list[BlockHash] = []
        run_parent: BlockHash | None = None
        for i in range(first, len(block_hashes)):
            if self.prefix_cache.register(block_ids[i], block_hashes[i]):
                if not run:
                    run_parent = block_hashes[i - 1] if i else None
                run.append(block_hashes[i])
            elif run:
                self.kv_events.stored(run, run_parent)
                run = []
        self.kv_events.stored(run, run_parent)

    def _pool(self, device: Device) -> BlockPool:
        return self.gpu_pool if device is Device.GPU else self.cpu_pool

    def _allocate_gpu_block(self) -> int:
        if self.gpu_pool.num_free_blocks or self.prefix_cache is None:
            return self.gpu_pool.allocate()
        assert self.prefix_cache.num_evictable_blocks, "no free gpu block"
        block_id, block_hash = self.prefix_cache.evict()
        if self.host_tier is not None:
            self.host_tier.offload(block_hash, block_id, self.kv_events.parent(block_hash))
        self.kv_events.removed([block_hash])
        self.gpu_pool.incref(block_id)
        return block_id

    def _drop_reference(self, device: Device, block_id: int) -> None:
        pool = self._pool(device)
        if pool.decref(block_id):
            return
        if device is Device.GPU and self.prefix_cache and self.prefix_cache.is_cached(block_id):
            self.prefix_cache.park(block_id)
        else:
            pool.free(block_id)
