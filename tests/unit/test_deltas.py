"""The StepPlan deltas keep the scheduler's copy of each worker mirror's block table up to date
in place: appended blocks and copy-on-write replacements both reach it, and the lists a plan
carries are never that copy."""

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.deltas import sequence_deltas
from pagedserve.scheduler_svc.sequence import SequenceGroup, SequenceStatus
from pagedserve.services.common.sampling_params import SamplingParams

BS = 4


def _plan(group, bm, num_tokens=1):
    seq = group.seqs[-1]
    return sequence_deltas([(group, seq, num_tokens, 1, True, [])], bm)


def test_a_known_sequence_sends_its_changed_blocks_and_its_mirror_copy_follows():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    group = SequenceGroup.from_prompt("r", [1, 2, 3, 4], SamplingParams(max_tokens=8), 0)
    seq = group.seqs[0]
    seq.status = SequenceStatus.RUNNING
    bm.allocate(0, seq.token_ids)
    new_seqs, _ = _plan(group, bm, num_tokens=4)
    new_seqs[0].block_ids.append(99)  # the plan's list is its own
    assert seq.worker_block_ids == bm.block_table(0) and len(seq.worker_block_ids) == 1

    seq.num_computed_tokens = 4
    seq.append_token(5, 0.0)
    bm.append_slots(0, 5)
    _, running = _plan(group, bm)
    assert (running[0].block_ids_start, running[0].block_ids) == (1, bm.block_table(0)[1:])
    running[0].block_ids.append(99)
    assert seq.worker_block_ids == bm.block_table(0) and len(seq.worker_block_ids) == 2

    _, running = _plan(group, bm)  # nothing changed: an empty tail
    assert (running[0].block_ids_start, running[0].block_ids) == (2, [])

    child = seq.fork(1, 1, None)  # sharing both blocks: writing the last one copies it
    bm.fork(0, 1)
    group.seqs.append(child)
    child.worker_block_ids = list(seq.worker_block_ids)
    copies = bm.append_slots(1, 6)
    assert copies and bm.block_table(1)[1] != seq.worker_block_ids[1]
    _, running = _plan(group, bm)
    assert (running[0].block_ids_start, running[0].block_ids) == (1, bm.block_table(1)[1:])
    assert child.worker_block_ids == bm.block_table(1)
    assert seq.worker_block_ids == bm.block_table(0)
