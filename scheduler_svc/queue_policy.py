"""The order of the queues: FCFS (arrival time) or priority (lower `priority` first, then
arrival); which group a preemption picks (a paused one first); and, under the priority policy,
the running groups a waiting group displaces."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from operator import attrgetter

from pagedserve.scheduler_svc.block_manager import AllocStatus, BlockManager
from pagedserve.scheduler_svc.sequence import SequenceGroup

_PRIORITY_RANK = attrgetter("priority", "arrival_time")


def rank(group: SequenceGroup, policy: str) -> tuple[float, ...]:
    """Lower runs first."""
    if policy == "priority":
        return _PRIORITY_RANK(group)
    return (group.arrival_time,)


def preemption_key(group: SequenceGroup, policy: str) -> tuple[float, ...]:
    """Higher is preempted first: a paused group (its consumer is behind, so its KV blocks idle),
    then the lowest-ranked."""
    return (float(group.is_paused), *rank(group, policy))


def sort_queue(queue: deque[SequenceGroup], policy: str) -> None:
    """By rank, with C-level keys (every queue, every step): a 1-tuple orders as its item."""
    if len(queue) < 2:
        return
    ordered = sorted(queue, key=_PRIORITY_RANK if policy == "priority"
                     else attrgetter("arrival_time"))
    queue.clear()
    queue.extend(ordered)


def outranks_swapped(group: SequenceGroup, swapped: deque[SequenceGroup], policy: str) -> bool:
    """A waiting group may take room only ahead of every swapped group that could run (they hold
    KV on the CPU and would starve otherwise); under FCFS they are older than any new prompt."""
    ranks = [rank(g, policy) for g in swapped if not g.is_paused]
    return not ranks or rank(group, policy) < min(ranks)


def preempt_for_priority(waiting: deque[SequenceGroup], running: deque[SequenceGroup],
                         swapped: deque[SequenceGroup], block_manager: BlockManager,
                         max_num_seqs: int, preempt: Callable[[SequenceGroup], None]) -> bool:
    """Claim room for each waiting group in order, preempting (by recompute, so the victims wait
    behind it) the sorted running groups that rank below it, lowest first. Stops at the first
    group that gets no room: those after it rank lower still. Returns whether any was."""
    bm = block_manager

    def lacks_room(num_blocks: int, num_seqs: int) -> bool:
        return num_blocks > bm.num_free_gpu_blocks - bm.watermark_blocks or num_seqs > max_num_seqs

    has_preempted = False
    num_claimed_blocks = 0
    num_claimed_seqs = sum(len(g.live_seqs()) for g in running)
    for group in list(waiting):
        if not outranks_swapped(group, swapped, "priority"):
            break
        live = group.live_seqs()
        if group.is_paused:
            continue  # not admitted until its consumer catches up
        if any(bm.can_allocate(s.token_ids) is AllocStatus.NEVER for s in live):
            continue  # rejected at admission; no one makes room for it
        num_blocks = sum(bm.num_blocks_taken(s.token_ids) for s in live)
        while (running and rank(running[-1], "priority") > rank(group, "priority")
               and lacks_room(num_claimed_blocks + num_blocks, num_claimed_seqs + len(live))):
            victim = running.pop()
            num_claimed_seqs -= len(victim.live_seqs())
            preempt(victim)
            has_preempted = True
        if lacks_room(num_claimed_blocks + num_blocks, num_claimed_seqs + len(live)):
            break
        num_claimed_blocks += num_blocks
        num_claimed_seqs += len(live)
    return has_preempted
