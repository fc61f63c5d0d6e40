"""The StepPlan deltas keep the scheduler's copy of each worker mirror's block table up to date
in place: appended blocks and copy-on-write replacements both reach it, and the lists a plan
carries are never that copy."""

import random

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.deltas import sequence_deltas
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence
from pagedserve.scheduler_svc.sequence import SequenceGroup, SequenceStatus
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import RunningSequence

BS = 4


def _plan(group, bm, num_tokens=1):
    seq = group.seqs[-1]
    return sequence_deltas([ScheduledSequence(group, seq, num_tokens, 1, True)], bm)


def _running(deltas):
    """The one known sequence's delta, a packed plain decode as its RunningSequence."""
    if deltas.decode_seq_ids:
        assert not deltas.running_seqs and len(deltas.decode_seq_ids) == 1
        return RunningSequence(deltas.decode_seq_ids[0], [], deltas.decode_block_ids_start[0],
                               [], 1)
    running, = deltas.running_seqs
    return running


def test_a_known_sequence_sends_its_changed_blocks_and_its_mirror_copy_follows():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    group = SequenceGroup.from_prompt("r", [1, 2, 3, 4], SamplingParams(max_tokens=8), 0)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.allocate(0, seq.token_ids)
    new_seqs = _plan(group, bm, num_tokens=4).new_seqs
    new_seqs[0].block_ids.append(99)  # the plan's list is its own
    assert seq.worker_block_ids == bm.block_table(0) and len(seq.worker_block_ids) == 1

    seq.num_computed_tokens = 4
    seq.append_token(5, 0.0)
    bm.append_slots(0, 5)
    running = _plan(group, bm).running_seqs
    assert (running[0].block_ids_start, running[0].block_ids) == (1, bm.block_table(0)[1:])
    running[0].block_ids.append(99)
    assert seq.worker_block_ids == bm.block_table(0) and len(seq.worker_block_ids) == 2

    running = _plan(group, bm).running_seqs  # nothing changed: an empty tail
    assert (running[0].block_ids_start, running[0].block_ids) == (2, [])

    child = seq.fork(1, 1, None)  # sharing both blocks: writing the last one copies it
    bm.fork(0, 1)
    group.seqs.append(child)
    child.worker_block_ids = list(seq.worker_block_ids)
    copies = bm.append_slots(1, 6)
    assert copies and bm.block_table(1)[1] != seq.worker_block_ids[1]
    running = _plan(group, bm).running_seqs
    assert (running[0].block_ids_start, running[0].block_ids) == (1, bm.block_table(1)[1:])
    assert child.worker_block_ids == bm.block_table(1)
    assert seq.worker_block_ids == bm.block_table(0)


def _reference_start(old: list[int], new: list[int]) -> int:
    """The first index where two block tables differ, compared in full."""
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return i
    return min(len(old), len(new))


def test_deltas_match_a_full_compare_through_copies_trims_and_swaps():
    """The block manager's count of blocks left in place lets a delta skip the compare; every
    change it may miss would show here as a mirror that no longer equals the table."""
    rng = random.Random(0)
    bm = BlockManager(BS, 64, 64, watermark=0.0)
    group = SequenceGroup.from_prompt("r", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=99), 0)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.allocate(0, seq.token_ids)
    _plan(group, bm, num_tokens=6)
    seq.num_computed_tokens = 6
    mirror = bm.block_table(0)  # what a worker holds
    next_seq_id = 1
    kinds = set()
    for _ in range(300):
        kind = rng.choice(["decode", "drafts", "share", "swap"])
        if kind == "decode":
            seq.append_token(7, 0.0)
            bm.append_slots(0, len(seq.token_ids))
            seq.num_computed_tokens = len(seq.token_ids) - 1
        elif kind == "drafts":  # slots for drafts, then all but one rejected
            num_drafts = rng.randint(1, 2 * BS)
            bm.append_slots(0, len(seq.token_ids) + num_drafts)
            bm.trim(0, len(seq.token_ids))
        elif kind == "share":  # a fork shares the last block: writing into it copies it
            bm.fork(0, next_seq_id)
            bm.append_slots(0, len(seq.token_ids) + 1)
            bm.free(next_seq_id)
            next_seq_id += 1
        else:  # out and back in: every block moves, the mirror is dropped
            bm.swap_out([0])
            bm.swap_in([0])
            seq.worker_block_ids = None
        before = None if seq.worker_block_ids is None else list(seq.worker_block_ids)
        deltas = _plan(group, bm, num_tokens=1)
        table = bm.block_table(0)
        if before is None:
            assert deltas.new_seqs[0].block_ids == table
            mirror = list(table)
        else:
            delta = _running(deltas)
            assert delta.block_ids_start == _reference_start(before, table), kind
            mirror[delta.block_ids_start:] = delta.block_ids
            kinds.add(kind)
        assert mirror == table == seq.worker_block_ids
    assert kinds == {"decode", "drafts", "share"}


def test_a_decode_goes_packed_while_the_mirror_needs_nothing_else():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    group = SequenceGroup.from_prompt("r", [1, 2, 3], SamplingParams(max_tokens=8), 0)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.allocate(0, seq.token_ids)
    _plan(group, bm, num_tokens=3)
    seq.num_computed_tokens = 3

    def decode_step(num_samples=1):
        seq.append_token(7, 0.0)  # what the worker appended itself
        bm.append_slots(0, len(seq.token_ids))
        seq.num_computed_tokens = len(seq.token_ids) - 1
        return sequence_deltas([ScheduledSequence(group, seq, 1, num_samples, True)], bm)

    first = decode_step()  # 4 tokens fill the first block: nothing new for the worker
    assert (first.running_seqs, first.decode_seq_ids, first.decode_block_ids_start) == (
        [], [0], [1])
    grown, = decode_step().running_seqs  # the 5th takes a second block
    assert grown == RunningSequence(0, [], 1, bm.block_table(0)[1:], 1)
    assert decode_step().decode_block_ids_start == [2]
    sampling_two, = decode_step(num_samples=2).running_seqs
    assert sampling_two == RunningSequence(0, [], 2, [], 1, 2)
    seq.num_worker_tokens -= 1  # a token the worker does not hold yet goes with the delta
    with_token, = _plan(group, bm).running_seqs
    assert with_token == RunningSequence(0, [7], 2, [], 1)
    chunk, = _plan(group, bm, num_tokens=2).running_seqs  # a prompt's next chunk
    assert chunk == RunningSequence(0, [], 2, [], 2)
