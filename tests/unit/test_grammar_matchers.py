"""Structured outputs in the worker: the compile cache, one matcher per sequence derived from its
output tokens (replayed after preemption or a rebuild, rolled back, copied at a fork), and the
bitmask the sampler applies."""

import functools
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.worker_svc.grammar_cache import GrammarCache, llguidance_tokenizer
from pagedserve.worker_svc.grammar_matchers import GrammarMatchers
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.token_bitmask import TokenBitmask

EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def vocab_size(hf_tokenizer):
    return len(hf_tokenizer)


@pytest.fixture(scope="module")
def cache(smollm2_dir, vocab_size):
    cache = GrammarCache(functools.partial(llguidance_tokenizer, str(smollm2_dir), vocab_size,
                                           [EOS]))
    yield cache
    cache.shutdown()


@pytest.fixture()
def matchers(cache, vocab_size):
    return GrammarMatchers(cache, vocab_size, [EOS])


def _seq(seq_id, outputs, params, request_id="r"):
    return CachedSequence(seq_id=seq_id, request_id=request_id, token_ids=PROMPT + list(outputs),
                          prompt_len=len(PROMPT), block_table=[0], num_computed_tokens=0,
                          sampling=SamplingParams(structured_outputs=params), seed=None,
                          num_samples=1)


def _allowed(mask: TokenBitmask, row: int, vocab_size: int) -> set[int]:
    logits = TokenBitmask(list(range(len(mask.rows))), mask.bits).apply(
        torch.zeros(len(mask.rows), vocab_size))
    return set(torch.nonzero(logits[row] == 0).flatten().tolist())


def _mask_after(matchers, seq, vocab_size):
    return _allowed(matchers.bitmask([seq], {seq.seq_id: seq}), 0, vocab_size)


def test_a_schema_allows_each_token_of_valid_json_and_then_only_eos(matchers, hf_tokenizer,
                                                                    vocab_size):
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    seq = _seq(0, [], params)
    for token in ids:
        assert token in _mask_after(matchers, seq, vocab_size)
        seq.token_ids.append(token)
    assert _mask_after(matchers, seq, vocab_size) == {EOS}


def test_a_token_outside_the_grammar_is_masked(matchers, hf_tokenizer, vocab_size):
    allowed = _mask_after(matchers, _seq(0, [], StructuredOutputsParams(json_object=True)),
                          vocab_size)
    assert hf_tokenizer.encode("{", add_special_tokens=False)[0] in allowed
    assert hf_tokenizer.encode("Hello", add_special_tokens=False)[0] not in allowed
    assert EOS not in allowed


@pytest.mark.parametrize("outputs_after", ["same", "shorter", "different"])
def test_a_resent_sequence_gets_the_mask_of_its_outputs(matchers, hf_tokenizer, vocab_size,
                                                        outputs_after):
    """Preemption, a scheduler takeover or a rebuilt worker send the sequence whole again: the
    mask follows the outputs it arrives with, as a fresh matcher's would."""
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Bo", "age": 31}', add_special_tokens=False)
    seq = _seq(0, ids[:6], params)
    _mask_after(matchers, seq, vocab_size)
    resent_outputs = {"same": ids[:6], "shorter": ids[:3],
                      "different": hf_tokenizer.encode('{"age": 4', add_special_tokens=False)}
    resent = _seq(0, resent_outputs[outputs_after], params)
    got = _mask_after(matchers, resent, vocab_size)
    fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
    assert got == _mask_after(fresh, _seq(0, resent_outputs[outputs_after], params), vocab_size)


def test_a_seq_id_taken_by_another_request_gets_its_own_grammar(matchers, hf_tokenizer,
                                                               vocab_size):
    """A scheduler that takes a worker over numbers its sequences from 0 again: a sequence of
    another request under a seq_id the worker still has a matcher for (the old scheduler's,
    left after ClearState) is masked by its own constraint, not by the old one rolled back."""
    old = _seq(0, hf_tokenizer.encode('{"name": "Di', add_special_tokens=False),
               StructuredOutputsParams(json_schema=SCHEMA))
    _mask_after(matchers, old, vocab_size)
    choice = StructuredOutputsParams(choice=("yes", "no"))
    new = _seq(0, [], choice, request_id="after-takeover")
    fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
    assert _mask_after(matchers, new, vocab_size) == _mask_after(fresh, _seq(0, [], choice),
                                                                 vocab_size)


def test_a_fork_starts_from_its_parents_matcher(matchers, hf_tokenizer, vocab_size):
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Cy", "age": 5}', add_special_tokens=False)
    parent, child = _seq(0, ids[:4], params), _seq(1, ids[:5], params)
    mask = matchers.bitmask([parent, child], {0: parent, 1: child})
    fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
    assert _allowed(mask, 1, vocab_size) == _mask_after(fresh, _seq(1, ids[:5], params),
                                                        vocab_size)
    # the parent's own matcher did not move with its copy
    assert _allowed(mask, 0, vocab_size) == _mask_after(fresh, _seq(0, ids[:4], params),
                                                        vocab_size)


def test_matchers_of_sequences_gone_from_the_mirror_are_dropped(matchers, vocab_size):
    seq = _seq(0, [], StructuredOutputsParams(choice=("yes", "no")))
    matchers.bitmask([seq], {0: seq})
    assert len(matchers) == 1
    other = _seq(1, [], StructuredOutputsParams(choice=("yes", "no")))
    matchers.bitmask([other], {1: other})
    assert len(matchers) == 1


def test_equal_constraints_compile_once(matchers):
    num_cached = len(matchers.cache)
    one = matchers.cache.get(StructuredOutputsParams(json_schema={"type": "array"}))
    same = matchers.cache.get(StructuredOutputsParams(json_schema='{"type": "array"}'))
    assert one is same and len(matchers.cache) == num_cached + 1
    assert matchers.cache.get(StructuredOutputsParams(regex="a+")) is not one


def test_a_choice_ends_after_one_of_its_strings(matchers, hf_tokenizer, vocab_size):
    params = StructuredOutputsParams(choice=("yes", "no"))
    seq = _seq(0, hf_tokenizer.encode("no", add_special_tokens=False), params)
    assert _mask_after(matchers, seq, vocab_size) == {EOS}


def test_unconstrained_rows_keep_their_logits_and_greedy_picks_an_allowed_token():
    bits = torch.zeros(1, 1, dtype=torch.int32)
    bits[0, 0] = 1 << 5  # only token 5
    logits = torch.arange(32, dtype=torch.float32).repeat(2, 1)  # argmax 31 on both rows
    seqs = [SeqSamplingState(seq_id=i, sampling=SamplingParams(temperature=0.0),
                             token_ids=[0], prompt_len=1, seed=None, num_samples=1)
            for i in range(2)]
    sampled = Sampler(32, [], torch.device("cpu"))(logits, seqs, TokenBitmask([1], bits))
    assert [s.token_ids for s in sampled] == [[31], [5]]


@pytest.mark.parametrize(("params", "field"), [
    (StructuredOutputsParams(json_schema="{not json"), "structured_outputs.json_schema"),
    (StructuredOutputsParams(json_schema={"type": "object", "if": {}}),
     "structured_outputs.json_schema"),
    (StructuredOutputsParams(regex="[a-"), "structured_outputs.regex"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (StructuredOutputsParams(choice=()), "structured_outputs.choice"),
])
def test_a_constraint_that_cannot_compile_is_refused_naming_the_field(params, field):
    with pytest.raises(InvalidRequest) as raised:
        params.verify()
    assert raised.value.violations[0].field == field


def test_the_gateway_compiles_a_repeated_constraint_once(monkeypatch):
    """Requests repeating one constraint are checked by its first compile; each refusal is its
    own error object."""
    from llguidance import LLMatcher

    compiles = []
    validate = LLMatcher.validate_grammar_with_warnings
    monkeypatch.setattr(LLMatcher, "validate_grammar_with_warnings",
                        lambda grammar: compiles.append(grammar) or validate(grammar))
    good = StructuredOutputsParams(regex="[0-9]{1,7} repeated")
    bad = StructuredOutputsParams(regex="[0-9 repeated")
    for _ in range(3):
        good.verify()
    errors = []
    for _ in range(2):
        with pytest.raises(InvalidRequest) as raised:
            bad.verify()
        errors.append(raised.value)
    assert len(compiles) == 2
    assert errors[0] is not errors[1] and str(errors[0]) == str(errors[1])


def test_exactly_one_constraint_kind():
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams(regex="a", json_object=True)
    schema = StructuredOutputsParams(json_schema={"b": 1, "a": 2}).json_schema
    assert list(json.loads(schema)) == ["b", "a"]  # the order of the output's keys


def test_a_mask_is_never_built_while_the_previous_token_is_still_on_the_device(matchers):
    """Run-ahead: step n+1 may be launched before step n's draw reaches the host, but its mask
    waits for it (two draws outstanding = the one before this step's is missing)."""
    seq = _seq(0, [], StructuredOutputsParams(choice=("yes", "no")))
    with pytest.raises(AssertionError, match="previous token"):
        matchers.bitmask([seq], {0: seq}, drawing={0: 2})
    assert matchers.bitmask([seq], {0: seq}, drawing={0: 1}) is not None


def test_a_bitmask_masks_exactly_the_tokens_whose_bits_are_clear():
    vocab_size, num_words = 70, 3  # the last word half used; bit 31 is int32's sign bit
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (2, num_words), dtype=torch.int32,
                         generator=generator)
    logits = torch.randn(3, vocab_size, generator=generator)
    masked = TokenBitmask([2, 0], bits).apply(logits)
    for row, mask_row in ((2, 0), (0, 1)):
        for t in range(vocab_size):
            is_allowed = (int(bits[mask_row, t // 32]) >> (t % 32)) & 1
            assert masked[row, t] == (logits[row, t] if is_allowed else float("-inf"))
    assert torch.equal(masked[1], logits[1])  # a row without a mask is left alone


def test_a_resent_sequence_whose_matcher_had_failed_starts_over(matchers, hf_tokenizer,
                                                                 vocab_size):
    """Its old matcher cannot roll back; the resent outputs get a fresh one (the step failed)."""
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Di', add_special_tokens=False)
    outside = ids[:2] + hf_tokenizer.encode("Hello", add_special_tokens=False)
    assert _mask_after(matchers, _seq(0, outside, params), vocab_size) == {EOS}
    fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
    assert (_mask_after(matchers, _seq(0, ids, params), vocab_size)
            == _mask_after(fresh, _seq(0, ids, params), vocab_size))


def test_each_steps_mask_is_its_own_rows_whatever_the_step_before_held(matchers, hf_tokenizer,
                                                                       vocab_size):
    """The rows' buffer is kept from step to step: a row that held a wide mask and now holds a
    finished sequence, or fewer or more rows than before, carries nothing of the step before."""
    schema, choice = StructuredOutputsParams(json_object=True), StructuredOutputsParams(
        choice=("yes", "no"))
    no = hf_tokenizer.encode("no", add_special_tokens=False)
    steps = [[_seq(0, [], schema), _seq(1, [], choice)],
             [_seq(1, no, choice)],
             [_seq(1, no, choice), _seq(0, [], schema), _seq(2, [], choice)]]
    for seqs in steps:
        mask = matchers.bitmask(seqs, {s.seq_id: s for s in seqs})
        for row, seq in enumerate(seqs):
            fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
            assert _allowed(mask, row, vocab_size) == _mask_after(fresh, seq, vocab_size)
    assert _allowed(mask, 0, vocab_size) == {EOS}


def test_a_batchs_rows_each_hold_their_own_sequences_mask(matchers, hf_tokenizer, vocab_size):
    """A batch mixing live rows at different states with ended ones (finished, or outputs that
    left the grammar): each row holds exactly its own sequence's mask."""
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Ed", "age": 40}', add_special_tokens=False)
    outside = ids[:2] + hf_tokenizer.encode("Hello", add_special_tokens=False)
    seqs = [_seq(i, outside if i % 7 == 3 else ids[:i % (len(ids) + 1)], params)
            for i in range(32)]
    mask = matchers.bitmask(seqs, {s.seq_id: s for s in seqs})
    ended = {row for row, s in enumerate(seqs) if len(s.token_ids) - len(PROMPT) == len(ids)
             or row % 7 == 3}
    assert len(ended) >= 5
    for row, seq in enumerate(seqs):
        fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
        allowed = _allowed(mask, row, vocab_size)
        assert allowed == _mask_after(fresh, seq, vocab_size)
        assert (allowed == {EOS}) == (row in ended)


def test_rows_built_ahead_are_the_rows_built_in_place(matchers, hf_tokenizer, vocab_size):
    """The next step's rows start on their own thread once the step before is on the host; the
    step that samples them, in another order and with a sequence more, gets each row as if it
    had been built in place."""
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Flo", "age": 62}', add_special_tokens=False)
    seqs = [_seq(i, ids[:i % (len(ids) + 1)], params) for i in range(24)]
    matchers.mask_ahead(seqs)
    sampled = seqs[::-1] + [_seq(24, ids[:3], params)]
    mask = matchers.bitmask(sampled, {s.seq_id: s for s in sampled})
    fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
    assert torch.equal(mask.bits, fresh.bitmask(sampled, {s.seq_id: s for s in sampled}).bits)


@pytest.mark.parametrize("change", ["grew", "resent shorter", "resent different"])
def test_a_sequence_changed_after_its_row_was_built_ahead_gets_the_mask_of_its_outputs(
        matchers, hf_tokenizer, vocab_size, change):
    """A token added to the mirror entry (a fork's), or the sequence sent whole again
    (preemption, a takeover) between the row built ahead and the step that samples it: the
    row follows the outputs the step has, not the ones it was built from."""
    params = StructuredOutputsParams(json_schema=SCHEMA)
    ids = hf_tokenizer.encode('{"name": "Gus", "age": 8}', add_special_tokens=False)
    seq, other = _seq(0, ids[:6], params), _seq(1, ids[:2], params)  # '{"name": "Gus'
    matchers.mask_ahead([seq, other])
    if change == "grew":
        seq.token_ids.append(ids[6])  # '",': the string ends
    else:
        seq = _seq(0, ids[:3] if change == "resent shorter" else
                   hf_tokenizer.encode('{"age": 1', add_special_tokens=False), params)
    mask = matchers.bitmask([seq, other], {0: seq, 1: other})
    for row, s in enumerate((seq, other)):
        fresh = GrammarMatchers(matchers.cache, vocab_size, [EOS])
        assert _allowed(mask, row, vocab_size) == _mask_after(fresh, s, vocab_size)



def _asked_at_once(cache: GrammarCache, params: StructuredOutputsParams, num_threads: int):
    barrier = threading.Barrier(num_threads)

    def ask(_):
        barrier.wait()
        return cache.get(params)

    with ThreadPoolExecutor(num_threads) as pool:
        return list(pool.map(ask, range(num_threads)))


def test_threads_asking_for_one_new_constraint_share_one_compile():
    """The model thread and the thread building masks ahead both ask the cache: a constraint
    asked at once by both is compiled once, and both wait for the same grammar."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads trade the GIL between any two bytecodes
    try:
        for attempt in range(20):
            cache = GrammarCache(lambda: None)
            cache._compile = lambda params: params
            futures = _asked_at_once(cache, StructuredOutputsParams(regex=f"a{attempt}"), 8)
            cache.shutdown()
            assert len({id(f) for f in futures}) == 1, f"attempt {attempt}"
    finally:
        sys.setswitchinterval(switch_interval)


def test_a_workers_matchers_read_the_tokenizer_before_the_first_constraint(monkeypatch):
    """Read at the first constraint, the tokenizer held that step ~1 s (SmolLM2's)."""
    read = threading.Event()

    def tokenizer(*args):
        read.set()

    monkeypatch.setattr("pagedserve.worker_svc.grammar_matchers.llguidance_tokenizer", tokenizer)
    matchers = GrammarMatchers.for_model("/no/such/model", 64, [0])
    try:
        assert read.wait(5)
        assert len(matchers.cache) == 0
    finally:
        matchers.shutdown()
