"""Prompt lookup: what the n-gram proposer drafts from a sequence's own tokens."""

from __future__ import annotations

from pagedserve.scheduler_svc.ngram_proposer import propose_ngram


def test_drafts_the_tokens_after_the_latest_earlier_occurrence_of_the_suffix():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert propose_ngram(tokens, 2, 2, 4) == [7, 8]


def test_the_longest_suffix_wins_over_a_later_shorter_match():
    # [6, 2, 3] matches at the start; [2, 3] alone matches later, followed by 9
    tokens = [6, 2, 3, 4, 5, 2, 3, 9, 6, 2, 3]
    assert propose_ngram(tokens, 2, 2, 3) == [4, 5]
    assert propose_ngram(tokens, 2, 2, 2) == [9, 6]


def test_no_draft_without_an_earlier_match_of_at_least_min_tokens():
    assert propose_ngram([1, 2, 3, 4, 5], 3, 2, 4) == []
    assert propose_ngram([1, 2, 3, 4, 5, 3], 3, 2, 4) == []  # one token repeats: below min
    assert propose_ngram([1, 2, 3, 4, 5, 3], 3, 1, 4) == [4, 5, 3]
    assert propose_ngram([7], 3, 1, 4) == []


def test_drafts_stop_at_the_known_tokens_and_at_the_asked_number():
    tokens = [1, 2, 8, 1, 2]
    assert propose_ngram(tokens, 5, 2, 2) == [8, 1, 2]
    assert propose_ngram(tokens, 1, 2, 2) == [8]


def test_byte_patterns_spanning_two_tokens_are_not_matches():
    # packed little-endian, 0x01000000 then 0, 0 hold the bytes 00 00 00 01 | 00 00 00 00 | ...:
    # [1, 0]'s pattern 01 00 00 00 00 00 00 00 occurs inside them unaligned
    straddling = 0x01000000
    assert propose_ngram([straddling, 0, 0, 7, 1, 0], 2, 2, 2) == []
    assert propose_ngram([1, 0, 9, straddling, 0, 0, 7, 1, 0], 1, 2, 2) == [9]


def test_a_spec_factor_drafts_in_proportion_to_how_far_back_the_match_agrees():
    # [3, 4] occurred after [9, 1, 2]; the sequence ends [0, 1, 2, 3, 4]: 4 tokens agree,
    # past prompt_lookup_max = 2
    tokens = [9, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 2, 3, 4]
    assert propose_ngram(tokens, 8, 2, 2) == [5, 6, 7, 8, 0, 1, 2, 3]
    assert propose_ngram(tokens, 8, 2, 2, spec_factor=1.0) == [5, 6, 7, 8]
    assert propose_ngram(tokens, 8, 2, 2, spec_factor=1.5) == [5, 6, 7, 8, 0, 1]
    assert propose_ngram(tokens, 8, 2, 2, spec_factor=0.5) == [5, 6]
    assert propose_ngram(tokens, 3, 2, 2, spec_factor=2.0) == [5, 6, 7]


def test_a_short_match_drafts_few_tokens_under_a_spec_factor():
    # only [2, 3] agrees (1 came before it there, 0 here): a phrase, not a copied passage
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 0, 2, 3]
    assert propose_ngram(tokens, 8, 2, 4) == [4, 5, 6, 7, 8, 0, 2, 3]
    assert propose_ngram(tokens, 8, 2, 4, spec_factor=1.0) == [4, 5]


def test_the_matched_length_stops_at_the_sequence_start():
    assert propose_ngram([2, 3, 4, 5, 2, 3], 8, 2, 4, spec_factor=2.0) == [4, 5, 2, 3]
    assert propose_ngram([2, 3, 4, 5, 2, 3], 8, 2, 4, spec_factor=1.0) == [4, 5]
