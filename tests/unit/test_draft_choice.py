"""The choice of a step's drafts: the number of draft positions that gives the most expected
tokens per second, with a draft model's cost per position, the host's time a step with drafts
cannot overlap, and none at all where speculation loses."""

from __future__ import annotations

import pytest
from pagedserve.scheduler_svc.draft_choice import StepCosts, choose_drafts


def _geometric(rate: float, num_drafts: int = 4) -> list[float]:
    return [rate ** (j + 1) for j in range(num_drafts)]


@pytest.mark.parametrize(("draft_fixed_s", "rate", "kept"), [
    (0.004, 0.5, [0]),  # a position costs more than half a 7 ms step: no speculation
    (0.0005, 0.8, [4]),  # cheap positions, drafts likely kept: all four
    (0.0017, 0.7, [2]),  # in between: the third position adds less than it costs
])
def test_a_single_sequence_drafts_as_many_positions_as_pay(draft_fixed_s, rate, kept):
    costs = StepCosts(fixed_s=0.007, per_token_s=0.0, draft_fixed_s=draft_fixed_s)
    assert choose_drafts([_geometric(rate)], 1, 1.0, costs) == kept


def test_the_hosts_time_turns_speculation_off_where_steps_run_ahead():
    """Batch 16 on a memory-bound device: the drafts pay against the worker's step alone, but
    a step with drafts also waits for the host's 4 ms that running ahead would overlap; without
    run-ahead the host's time is paid either way and more positions pay."""
    rates = [_geometric(0.7)] * 16
    worker = dict(fixed_s=0.0075, per_token_s=1e-5, draft_fixed_s=0.0017, draft_per_seq_s=1e-5)
    assert choose_drafts(rates, 16, 16.0, StepCosts(**worker)) == [2] * 16
    host = dict(host_s=0.004, worker_host_s=0.0008)
    assert choose_drafts(rates, 16, 16.0, StepCosts(**worker, **host)) == [0] * 16
    assert choose_drafts(rates, 16, 16.0, StepCosts(**worker, **host, runs_ahead=False)) == [3] * 16


def test_prompt_tokens_counted_as_progress_keep_a_mixed_step_short():
    """The same four decoding sequences draft beside nothing, not beside a 600-token prompt
    chunk whose step the drafts would make longer."""
    rates = [_geometric(0.8)] * 4
    costs = StepCosts(fixed_s=0.014, per_token_s=1e-5, draft_fixed_s=0.002)
    assert choose_drafts(rates, 4, 4.0, costs) == [4] * 4
    assert choose_drafts(rates, 604, 604.0, costs) == [0] * 4


def test_without_draft_costs_each_draft_is_kept_while_it_pays_for_its_token():
    """n-gram lookup: positions cost nothing; on a compute-bound step (a token a quarter of the
    fixed part) the sequences whose drafts are kept verify four, the others none."""
    rates = [_geometric(0.95)] * 2 + [_geometric(0.1)] * 2
    costs = StepCosts(fixed_s=0.040, per_token_s=0.010)
    assert choose_drafts(rates, 4, 4.0, costs) == [4, 4, 0, 0]
    free = StepCosts(fixed_s=0.040, per_token_s=0.0)
    assert choose_drafts(rates, 4, 4.0, free) == [4] * 4


def test_sequences_with_fewer_drafts_keep_what_they_have():
    costs = StepCosts(fixed_s=0.007, per_token_s=0.0, draft_fixed_s=0.0005)
    assert choose_drafts([_geometric(0.9, 1), [], _geometric(0.9, 3)], 3, 3.0,
                         costs) == [1, 0, 3]
