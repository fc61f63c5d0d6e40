"""The worker's sequence mirror (StepPlan deltas) and the flattened batch built from it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest, NotFound
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepPlan,
)
from pagedserve.worker_svc.model_input import _block_tables, build_model_input
from pagedserve.worker_svc.sequence_mirrors import SequenceMirrors

GREEDY = SamplingParams(temperature=0.0)


def _new(seq_id: int, token_ids: list[int], block_ids: list[int], num_computed: int,
         num_scheduled: int, **kw) -> NewSequence:
    return NewSequence(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=token_ids,
                       prompt_len=kw.pop("prompt_len", len(token_ids)), block_ids=block_ids,
                       num_computed_tokens=num_computed, num_scheduled_tokens=num_scheduled,
                       sampling=kw.pop("sampling", GREEDY), **kw)


def test_deltas_update_tokens_and_block_tables():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    scheduled = mirrors.apply(StepPlan(1, 1, new_seqs=[_new(0, [1, 2, 3, 4, 5], [7, 8], 0, 5),
                                                     _new(1, [9, 9], [3], 0, 2, num_samples=2)]))
    # one sample: the worker appends it itself; two (a fork): the scheduler sends its choice
    mirrors.mark_computed(scheduled)
    mirrors.append_drawn(scheduled, [SampledSequence(0, [6], [-0.1]),
                                     SampledSequence(1, [4, 5], [-0.2, -0.3])])
    assert mirrors.seqs[0].token_ids == [1, 2, 3, 4, 5, 6] and mirrors.seqs[1].token_ids == [9, 9]
    scheduled = mirrors.apply(StepPlan(1, 2, running_seqs=[
        RunningSequence(0, new_token_ids=[], block_ids_start=2, block_ids=[],
                        num_scheduled_tokens=1),
        RunningSequence(1, new_token_ids=[4], block_ids_start=0, block_ids=[11],
                        num_scheduled_tokens=1)]))
    seq0, seq1 = mirrors.seqs[0], mirrors.seqs[1]
    assert seq0.token_ids == [1, 2, 3, 4, 5, 6] and seq0.block_table == [7, 8]
    assert seq1.token_ids == [9, 9, 4]
    assert seq1.block_table == [11]  # copy-on-write replaced block 0 of the table
    assert [s.num_scheduled_tokens for s in scheduled] == [1, 1]
    mirrors.apply(StepPlan(1, 3, finished_seq_ids=[0], preempted_seq_ids=[1, 42]))
    assert len(mirrors) == 0


def test_unknown_running_sequence_and_overscheduling_are_refused():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    with pytest.raises(NotFound, match="seq_id 5"):
        mirrors.apply(StepPlan(1, 1, running_seqs=[RunningSequence(5, [], 0, [], 1)]))
    with pytest.raises(InvalidRequest, match="num_scheduled_tokens=4"):
        mirrors.apply(StepPlan(1, 1, new_seqs=[_new(0, [1, 2, 3], [0], 0, 4)]))
    with pytest.raises(InvalidRequest, match="cannot hold 5 tokens"):
        mirrors.apply(StepPlan(1, 1, new_seqs=[_new(1, [1] * 5, [0], 0, 5)]))
    with pytest.raises(InvalidRequest, match="max_model_len=64"):
        mirrors.apply(StepPlan(1, 1, new_seqs=[_new(2, [1] * 65, list(range(17)), 0, 65)]))


def test_flattened_batch_puts_prefills_first_and_maps_slots():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    decode = _new(0, [1, 2, 3, 4, 5, 6], [9, 2], 5, 1)  # decode at position 5
    chunk = _new(1, list(range(10, 20)), [4, 6, 1], 3, 5)  # prefill chunk, positions 3..7
    prompt_lp = _new(2, [30, 31, 32], [5], 0, 2,
                     sampling=SamplingParams(temperature=0.0, prompt_logprobs=1))
    scheduled = mirrors.apply(StepPlan(1, 1, new_seqs=[decode, chunk, prompt_lp]))
    assert [s.seq_id for s in scheduled] == [1, 2, 0]
    model_input = build_model_input(scheduled, 4, torch.device("cpu"))
    meta = model_input.meta
    assert model_input.input_ids.tolist() == [13, 14, 15, 16, 17, 30, 31, 6]
    assert model_input.positions.tolist() == [3, 4, 5, 6, 7, 0, 1, 5]
    assert meta.slot_mapping.tolist() == [4 * 4 + 3, 6 * 4, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3,
                                          5 * 4, 5 * 4 + 1, 2 * 4 + 1]
    assert meta.query_start_loc.tolist() == [0, 5, 7, 8]
    assert meta.seq_lens.tolist() == [8, 2, 6]
    assert meta.block_tables.tolist() == [[4, 6], [5, 0], [9, 2]]
    assert (meta.num_prefills, meta.num_prefill_tokens, meta.max_query_len) == (2, 7, 5)
    # only the decode reaches the end of its tokens; seq 2's positions 0, 1 predict prompt tokens 1, 2
    assert [s.seq_id for s in model_input.sample_seqs] == [0]
    span = model_input.prompt_logprob_spans[0]
    assert (span.seq.seq_id, span.start, span.target_ids) == (2, 1, [31, 32])
    assert model_input.logits_indices.tolist() == [7, 5, 6]


def test_running_deltas_with_bad_ids_or_tokens_behind_a_draw_are_refused_untouched():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    scheduled = mirrors.apply(StepPlan(1, 1, new_seqs=[_new(0, [1, 2, 3], [7], 0, 3)]))
    mirrors.mark_computed(scheduled)  # seq 0 is drawing its 4th token
    bad = [(RunningSequence(0, [], 1, [99], 1), "block_ids must be in \\[0, 50\\)"),
           (RunningSequence(0, [70], 1, [], 1), "new_token_ids must be in \\[0, 64\\)"),
           (RunningSequence(0, [5], 1, [], 1), "has not drawn yet")]
    for delta, message in bad:
        with pytest.raises(InvalidRequest, match=message):
            mirrors.check(StepPlan(1, 2, running_seqs=[delta]), num_gpu_blocks=50, vocab_size=64)
    assert mirrors.seqs[0].token_ids == [1, 2, 3] and mirrors.seqs[0].block_table == [7]
    # a plain decode behind the draw: nothing to check but its lengths
    decode = RunningSequence(0, [], 1, [8], 1)
    mirrors.check(StepPlan(1, 2, running_seqs=[decode]), num_gpu_blocks=50, vocab_size=64)
    scheduled = mirrors.apply(StepPlan(1, 2, running_seqs=[decode]), is_checked=True)
    model_input = build_model_input(scheduled, 4, torch.device("cpu"), drawn={0: 3})
    assert model_input.input_ids.tolist() == [0] and model_input.drawn_rows == [(0, 3)]
    assert model_input.meta.block_tables.tolist() == [[7]]


def test_draws_of_steps_launched_ahead_append_in_order_and_skip_a_sequence_sent_again():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    first = mirrors.apply(StepPlan(1, 1, new_seqs=[_new(0, [1, 2, 3], [7], 0, 3),
                                                   _new(1, [5, 6], [8], 0, 2)]))
    mirrors.mark_computed(first)
    # step 2 is launched before step 1's draws reach the host: two tokens of each being drawn
    second = mirrors.apply(StepPlan(1, 2, running_seqs=[RunningSequence(0, [], 1, [], 1),
                                                        RunningSequence(1, [], 1, [], 1)]))
    mirrors.mark_computed(second)
    assert mirrors.drawing == {0: 2, 1: 2}
    mirrors.append_drawn(first, [SampledSequence(0, [10], [-0.1]), SampledSequence(1, [11], [-0.1])])
    assert mirrors.drawing == {0: 1, 1: 1}
    # seq 1 is sent whole again (preempted and recomputed) before step 2 finishes
    mirrors.apply(StepPlan(1, 3, new_seqs=[_new(1, [5, 6, 11, 12], [9, 3], 0, 4)]))
    mirrors.append_drawn(second, [SampledSequence(0, [20], [-0.1]),
                                  SampledSequence(1, [21], [-0.1])])
    assert mirrors.drawing == {}
    assert mirrors.seqs[0].token_ids == [1, 2, 3, 10, 20]
    assert mirrors.seqs[1].token_ids == [5, 6, 11, 12]  # the scheduler's, not the stale draw


def test_block_tables_pad_short_rows_and_ignore_blocks_past_the_tokens():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    scheduled = mirrors.apply(StepPlan(1, 1, new_seqs=[
        _new(0, list(range(9)), [3, 1, 4, 15, 9], 8, 1),  # 9 tokens: 3 of its 5 blocks
        _new(1, [7], [2], 0, 1),
        _new(2, list(range(16)), [6, 5, 8, 11], 15, 1)]))
    meta = build_model_input(scheduled, 4, torch.device("cpu")).meta
    assert meta.block_tables.tolist() == [[3, 1, 4, 0], [2, 0, 0, 0], [6, 5, 8, 11]]
    assert meta.slot_mapping.tolist() == [4 * 4, 2 * 4, 11 * 4 + 3]


def _decoding_mirrors() -> SequenceMirrors:
    """Two sequences whose next step decodes: 0 after its 5 tokens in blocks [7, 8], 1 after
    its 4 in [3] (full: its decode needs a block more)."""
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    scheduled = mirrors.apply(StepPlan(1, 1, new_seqs=[_new(0, [1, 2, 3, 4, 5], [7, 8], 0, 5),
                                                     _new(1, [9, 9, 9, 9], [3], 0, 4)]))
    mirrors.mark_computed(scheduled)
    mirrors.append_drawn(scheduled, [SampledSequence(0, [6], [-0.1]),
                                     SampledSequence(1, [5], [-0.2])])
    return mirrors


@pytest.mark.parametrize("is_packed", [False, True])
def test_packed_plain_decodes_apply_as_their_running_sequences(is_packed):
    mirrors = _decoding_mirrors()
    mirrors.seqs[0].block_table.append(12)  # a block the scheduler took back: start=2 cuts it
    decodes = [RunningSequence(0, [], 2, [], 1), RunningSequence(1, [], 1, [14], 1)]
    plan = (StepPlan(1, 2, running_seqs=decodes[1:], decode_seq_ids=[0],
                     decode_block_ids_start=[2]) if is_packed
            else StepPlan(1, 2, running_seqs=decodes[1:] + decodes[:1]))
    mirrors.check(plan, num_gpu_blocks=16, vocab_size=50)
    scheduled = mirrors.apply(plan, is_checked=True)
    assert [s.seq_id for s in scheduled] == [1, 0]
    assert mirrors.seqs[0].block_table == [7, 8] and mirrors.seqs[1].block_table == [3, 14]
    assert [(s.num_scheduled_tokens, s.num_samples) for s in scheduled] == [(1, 1), (1, 1)]
    model_input = build_model_input(scheduled, 4, torch.device("cpu"))
    assert model_input.input_ids.tolist() == [5, 6]
    assert model_input.meta.slot_mapping.tolist() == [14 * 4, 8 * 4 + 1]


@pytest.mark.parametrize("seq_ids, starts, error, match", [
    ([5], [0], NotFound, "seq_id 5"),
    ([1], [1], InvalidRequest, "cannot hold 5 tokens"),  # its full block and no new one
    ([0], [3], InvalidRequest, r"block_ids_start=3 outside \[0, 2\]"),
    ([0, 0], [2, 2], InvalidRequest, "each sequence once"),
    ([0], [], InvalidRequest, "one entry per decode_seq_ids entry, got 0 for 1"),
])
def test_packed_decodes_that_cannot_apply_are_refused_untouched(seq_ids, starts, error, match):
    mirrors = _decoding_mirrors()
    plan = StepPlan(1, 2, decode_seq_ids=seq_ids, decode_block_ids_start=starts)
    with pytest.raises(error, match=match):
        mirrors.check(plan, num_gpu_blocks=16, vocab_size=50)
    assert mirrors.seqs[0].block_table == [7, 8] and mirrors.seqs[1].num_scheduled_tokens == 0


def test_a_packed_decode_of_a_sequence_dropped_in_its_step_is_refused():
    mirrors = _decoding_mirrors()
    with pytest.raises(NotFound, match="seq_id 0"):
        mirrors.check(StepPlan(1, 2, finished_seq_ids=[0], decode_seq_ids=[0],
                               decode_block_ids_start=[2]))


@pytest.mark.parametrize("seed", range(4))
def test_block_table_rows_follow_every_delta_and_give_the_flattened_tables(seed):
    """New sequences (sent whole again too), appended, replaced and trimmed tails, finishes,
    preemptions and a clear, more sequences than the rows and longer tables than the columns it
    starts with: each sequence's row holds its table, and a step's tables gathered from the rows
    equal those flattened from the lists."""
    rng = random.Random(seed)
    block_size, max_model_len = 4, 64
    mirrors = SequenceMirrors(block_size, max_model_len)

    def blocks(num: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(num)]

    for step_id in range(1, 200):
        known = list(mirrors.seqs.values())
        dropped = rng.sample([s.seq_id for s in known], k=min(len(known), rng.randrange(3)))
        new_seqs = []
        for seq_id in rng.sample(range(150), k=rng.randrange(6)):
            if seq_id in dropped:
                continue
            num_tokens = rng.randrange(1, max_model_len)
            new_seqs.append(_new(seq_id, [1] * num_tokens, blocks(
                -(-num_tokens // block_size) + rng.randrange(8)), num_tokens - 1, 1))
        sent = {s.seq_id for s in new_seqs} | set(dropped)
        running = []
        for seq in known:
            if seq.seq_id in sent:
                continue
            start = rng.randrange(len(seq.block_table) + 1)
            needed = -(-len(seq.token_ids) // block_size)
            ids = blocks(max(needed - start, 0) + rng.randrange(3))
            running.append(RunningSequence(seq.seq_id, [], start, ids, 1))
        if step_id % 97 == 0:
            mirrors.clear()
            running = []
        finished = dropped[:1]
        scheduled = mirrors.apply(StepPlan(1, step_id, new_seqs=new_seqs, running_seqs=running,
                                           finished_seq_ids=finished,
                                           preempted_seq_ids=dropped[1:]))
        for seq in mirrors.seqs.values():
            row = mirrors.block_rows.table[seq.block_row, :len(seq.block_table)]
            assert row.tolist() == seq.block_table
        assert len({s.block_row for s in mirrors.seqs.values()}) == len(mirrors.seqs)
        seq_lens = np.array([s.num_computed_tokens + 1 for s in scheduled])
        assert np.array_equal(_block_tables(scheduled, seq_lens, block_size, mirrors.block_rows),
                              _block_tables(scheduled, seq_lens, block_size, None))
