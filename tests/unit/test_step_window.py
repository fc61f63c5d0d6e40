"""The scheduler's window of steps in flight (scheduler_svc/step_window.py), its rules one by
one with the real scheduler and a hand-played worker: what may be sent behind a step, what
advancing and taking in do to the sequences, and what a failure does to the step behind."""

from __future__ import annotations

from concurrent.futures import Future

from pagedserve.scheduler_svc.sequence import PLACEHOLDER_TOKEN_ID, SequenceGroup
from pagedserve.scheduler_svc.step_window import SentStep, StepWindow
from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import GREEDY, Harness

BEST_OF = SamplingParams(n=2, best_of=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
BEAM = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=4,
                      ignore_eos=True)


def _sender(h: Harness, sent: list[SentStep]):
    def send() -> SentStep | None:
        out = h.scheduler.schedule()
        if out.plan is None:
            return None
        sent.append(SentStep(out, []))
        return sent[-1]
    return send


def test_a_step_is_sent_behind_one_that_draws_one_token_per_sequence():
    h, sent = Harness(), []
    seq = h.add("a", 5).seqs[0]
    window = StepWindow(is_async=True)
    window.fill(_sender(h, sent))
    assert len(window) == 2 and sent[0].is_advanced and not sent[1].is_advanced
    # the prefill counts as computed, its token as a placeholder: the plan behind decodes it
    assert seq.num_computed_tokens == 5 and seq.token_ids[-1] == PLACEHOLDER_TOKEN_ID
    assert sent[1].scheduled.scheduled[0].num_scheduled_tokens == 1
    window.send_behind(_sender(h, sent))
    assert len(sent) == 2  # never a third


def test_a_waiting_prompt_goes_behind_the_step_drawing_a_sequences_last_token_in_its_blocks():
    """max_tokens=4: the prefill draws the first token, three decodes the rest. The step behind
    the last decode is not a fifth decode of "a" (its token would be dropped) but the waiting
    prompt "b", in the blocks "a" leaves: the workers run it after the step in flight, so "b"
    does not wait one step more for the finish of "a" to be taken in."""
    h, sent = Harness(num_gpu_blocks=2), []
    a = h.add("a", 5).seqs[0]
    h.add("b", 5)  # no room beside "a" (two blocks each) until "a" ends
    window = StepWindow(is_async=True)
    send = _sender(h, sent)
    window.fill(send)
    blocks_of_a = h.bm.block_table(a.seq_id)
    reports = []
    while not any(r.finished for r in reports):
        window.fill(send)
        reports = h.processor.report(h.take_in(window.pop_oldest()))
    assert [[item.group.request_id for item in s.scheduled.scheduled] for s in sent] == [
        ["a"], ["a"], ["a"], ["a"], ["b"]]
    assert a.num_output_tokens == 4 and a.is_finished
    behind = sent[-1].scheduled.plan
    assert sorted(behind.new_seqs[0].block_ids) == sorted(blocks_of_a)
    assert behind.finished_seq_ids == [a.seq_id]  # the workers drop "a" with the plan of "b"
    h.take_in(window.pop_oldest())
    assert h.groups["b"].seqs[0].num_output_tokens == 1


def test_blocks_freed_for_a_waiting_prompt_keep_the_prefix_the_step_in_flight_computes():
    """A one-token request's prefill draws its last token; its prompt's full blocks stay in
    the prefix cache when a waiting prompt takes the rest of its room behind that step."""
    h, sent = Harness(num_gpu_blocks=3, enable_prefix_caching=True), []
    one_token = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    h.add("a", 8, one_token)
    h.scheduler.add_group(SequenceGroup.from_prompt("b", list(range(200, 208)), one_token,
                                                    next(h.seq_ids)))  # no token of "a"
    window = StepWindow(is_async=True)
    send = _sender(h, sent)
    window.fill(send)
    assert [[item.group.request_id for item in s.scheduled.scheduled] for s in sent] == [
        ["a"], ["b"]]
    while window:
        h.take_in(window.pop_oldest())
    h.add("c", 8, one_token)  # the prompt of "a" again
    h.run_to_end()
    assert h.groups["c"].num_cached_tokens == 4  # the block "b" did not take


def test_nothing_is_sent_behind_a_step_that_forks_or_picks_beams():
    for sampling in (BEST_OF, BEAM):
        h, sent = Harness(), []
        h.add("a", 5, sampling)
        window = StepWindow(is_async=True)
        window.fill(_sender(h, sent))
        assert len(window) == 1 and not sent[0].is_advanced
        assert sent[0].has_forks_or_beams


def test_without_async_scheduling_steps_run_one_at_a_time():
    h, sent = Harness(), []
    h.add("a", 5)
    window = StepWindow(is_async=False)
    window.fill(_sender(h, sent))
    assert len(window) == 1 and not sent[0].is_advanced


def test_taking_a_step_in_counts_its_tokens_once_and_drops_its_placeholder():
    for is_async in (True, False):
        h, sent = Harness(), []
        seq = h.add("a", 5).seqs[0]
        window = StepWindow(is_async)
        window.fill(_sender(h, sent))
        h.take_in(window.pop_oldest())
        assert seq.num_computed_tokens == 5
        assert len(seq.token_ids) == 6 and PLACEHOLDER_TOKEN_ID not in seq.token_ids


def test_an_advanced_step_with_nothing_behind_it_is_not_advanced_again():
    h, sent = Harness(), []
    group = h.add("a", 5)
    send = _sender(h, sent)

    def send_then_pause() -> SentStep | None:
        step = send()
        group.is_paused = True  # its consumer is behind: nothing to plan behind this step
        return step

    window = StepWindow(is_async=True)
    window.fill(send_then_pause)
    assert len(window) == 1 and sent[0].is_advanced
    group.is_paused = False
    window.fill(send)
    assert len(sent) == 1 and group.seqs[0].num_computed_tokens == 5
    h.take_in(window.pop_oldest())
    assert group.seqs[0].num_computed_tokens == 5 and len(group.seqs[0].token_ids) == 6


def test_a_failed_step_takes_the_steps_behind_it_along():
    h, sent = Harness(), []
    seqs = [h.add(f"r{i}", 5, GREEDY).seqs[0] for i in range(2)]
    window = StepWindow(is_async=True)
    window.fill(_sender(h, sent))
    behind = Future()
    behind.set_exception(RuntimeError("refused: its predecessor failed"))
    sent[1].futures.append(behind)
    failed = window.pop_oldest()
    assert window.fail(failed) == sent and not window
    for seq in seqs:
        assert PLACEHOLDER_TOKEN_ID not in seq.token_ids and len(seq.token_ids) == 5
