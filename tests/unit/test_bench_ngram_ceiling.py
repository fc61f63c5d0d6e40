"""The n-gram ceiling's replay counts a step per verification, each keeping the drafts that equal
the output and one token more."""

from __future__ import annotations

from bench.ngram_ceiling import replay_steps


def test_an_output_copied_from_the_prompt_takes_a_step_per_k_plus_one_tokens():
    prompt = [7, 8, 1, 2, 3, 4, 5, 6, 9]
    output = [1, 2, 3, 4, 5, 6]
    # [1] and [1, 2] match nothing before them; from [1, 2] on each step keeps 2 drafts + 1
    assert replay_steps(prompt, output, num_tokens=2, min_n=2, max_n=4).num_steps == 4
    assert replay_steps(prompt, output, num_tokens=4, min_n=2, max_n=4).num_steps == 3


def test_an_output_that_matches_nothing_takes_a_step_per_token():
    assert replay_steps([1, 2, 3], [4, 5, 6, 7], num_tokens=4, min_n=1, max_n=4).num_steps == 4


def test_a_wrong_draft_keeps_only_the_prefix_before_it():
    prompt = [1, 2, 3, 4]
    # after [1, 2] the lookup proposes [3, 4]: 3 is kept, 4 is not (the output says 9), so
    # the step ends at 9 and [3, 9] then matches nothing
    assert replay_steps(prompt, [1, 2, 3, 9, 5], num_tokens=2, min_n=2,
                        max_n=2) == (4, 2, 1)
