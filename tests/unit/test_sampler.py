import math

import pytest
import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.logits_processor import apply_min_p, apply_top_k, apply_top_k_top_p
from pagedserve.worker_svc.penalties import apply_penalties
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState, prompt_logprobs

VOCAB = 12
EOS = 11
CPU = torch.device("cpu")


def seq(seq_id: int = 0, token_ids: list[int] | None = None, prompt_len: int | None = None,
        seed: int | None = None, num_samples: int = 1, **sampling) -> SeqSamplingState:
    token_ids = [1, 2, 3] if token_ids is None else token_ids
    return SeqSamplingState(
        seq_id=seq_id, sampling=SamplingParams(**sampling), token_ids=token_ids,
        prompt_len=len(token_ids) if prompt_len is None else prompt_len, seed=seed,
        num_samples=num_samples)


def sampler(vocab_size: int = VOCAB, seed: int = 0) -> Sampler:
    return Sampler(vocab_size=vocab_size, eos_token_ids=[EOS], device=CPU, seed=seed)


def kept(logits: torch.Tensor) -> set[int]:  # [vocab] → ids that are not -inf
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def full_logprobs(top: list) -> dict[int, float]:
    return {t.token_id: t.logprob for t in top}


# ---- masks on hand-made logits ----------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.30, 0.10, 0.50, 0.05])  # sorted: 3 (.5), 1 (.3), 2 (.1), 0/4 (.05)


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[0.0, 3.0, 1.0, 5.0, -1.0], [0.0, 3.0, 1.0, 5.0, -1.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 5]), torch.tensor([1.0, 1.0]))
    assert kept(out[0]) == {1, 3}
    assert torch.equal(out[1], logits[1])  # k = vocab is off
    assert torch.equal(out[0, [1, 3]], logits[0, [1, 3]])  # survivors unchanged


def test_partial_top_k_equals_the_sorted_one_ties_included():
    torch.manual_seed(9)
    logits = torch.randint(-3, 4, (6, 40)).float()  # many ties
    top_k = torch.tensor([1, 2, 5, 7, 40, 3])
    expected = apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(apply_top_k(logits.clone(), top_k, 40), expected)
    assert all(len(kept(row)) >= k for row, k in zip(expected, top_k.tolist(), strict=True))


@pytest.mark.parametrize(("top_p", "expected"), [
    (1e-8, {3}), (0.45, {3}), (0.75, {1, 3}), (0.85, {1, 2, 3}), (1.0, {0, 1, 2, 3, 4})])
def test_top_p_keeps_smallest_set_reaching_p(top_p, expected):
    logits = PROBS.log().unsqueeze(0)
    out = apply_top_k_top_p(logits, torch.tensor([5]), torch.tensor([top_p]))
    assert kept(out[0]) == expected


def test_top_p_is_measured_after_top_k():
    # top-k 3 renormalises .5/.3/.1 to .556/.333/.111: p=0.85 now stops before token 2
    logits = PROBS.log().unsqueeze(0)
    out = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.85]))
    assert kept(out[0]) == {1, 3}


@pytest.mark.parametrize(("min_p", "expected"), [
    (0.0, {0, 1, 2, 3, 4}), (0.15, {1, 2, 3}), (0.5, {1, 3}), (0.7, {3})])
def test_min_p_scales_with_the_top_probability(min_p, expected):
    out = apply_min_p(PROBS.log().unsqueeze(0), torch.tensor([min_p]))
    assert kept(out[0]) == expected


# ---- penalties -----------------------------------------------------------------------------------

def naive_penalties(logits: list[float], token_ids: list[int], prompt_len: int,
                    repetition: float, frequency: float, presence: float) -> list[float]:
    out = list(logits)
    outputs = token_ids[prompt_len:]
    for t in range(len(out)):
        if t in token_ids:
            out[t] = out[t] / repetition if out[t] > 0 else out[t] * repetition
        count = outputs.count(t)
        out[t] -= frequency * count + presence * (1.0 if count else 0.0)
    return out


def test_penalties_match_the_direct_formula():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    token_ids = [[1, 2, 2, 5, 5, 5, 7], [4, 4, 0, 9, 9, 0, 0, 3], [6]]
    prompt_lens = [3, 2, 1]
    params = [(1.3, 0.5, 0.25), (0.8, -0.7, 1.5), (2.0, 1.0, 1.0)]
    expected = torch.tensor([naive_penalties(logits[i].tolist(), token_ids[i], prompt_lens[i], *p)
                             for i, p in enumerate(params)])
    out = apply_penalties(logits.clone(), token_ids, prompt_lens, *map(list, zip(*params, strict=True)))
    torch.testing.assert_close(out, expected)
    # the prompt-only row: repetition hits token 6, frequency/presence hit nothing
    assert (out[2] != logits[2]).nonzero().flatten().tolist() == [6]


# ---- the sampler -------------------------------------------------------------------------------

def test_greedy_is_argmax_with_its_logprob():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    out = sampler()(logits, [seq(i, temperature=0.0) for i in range(4)])
    assert [o.token_ids for o in out] == [[t] for t in logits.argmax(-1).tolist()]
    assert [o.seq_id for o in out] == [0, 1, 2, 3]
    expected = logits.log_softmax(-1).max(-1).values.tolist()
    for o, lp in zip(out, expected, strict=True):
        assert o.logprobs == pytest.approx([lp], abs=1e-5)
        assert o.top_logprobs == []


def test_padded_columns_are_never_sampled():
    logits = torch.zeros(2, VOCAB + 4)
    logits[:, VOCAB:] = 100.0  # padding beyond the model's vocabulary
    logits[:, 5] = 1.0
    out = sampler()(logits, [seq(0, temperature=0.0), seq(1, seed=3, top_k=1)])
    assert [o.token_ids for o in out] == [[5], [5]]


def test_logprobs_are_log_softmax_of_processed_logits():
    torch.manual_seed(2)
    logits = torch.randn(3, VOCAB) * 2
    rows = [
        seq(0, [1, 2, 3, 3, 8], prompt_len=3, seed=5, temperature=0.7, top_k=6, top_p=0.9,
            min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
            logprobs=VOCAB),
        # greedy: penalties apply, temperature does not
        seq(1, [4, 4, 0], prompt_len=1, temperature=0.0, repetition_penalty=1.5,
            presence_penalty=0.5, logprobs=VOCAB),
        seq(2, seed=9, temperature=2.0, logprobs=VOCAB),
    ]
    out = sampler()(logits.clone(), rows)

    expected = []
    for i, s in enumerate(rows):
        p = s.sampling
        x = torch.tensor(naive_penalties(logits[i].tolist(), s.token_ids, s.prompt_len,
                                         p.repetition_penalty, p.frequency_penalty,
                                         p.presence_penalty))
        if not p.is_greedy:
            x = x / p.temperature
            order = x.argsort(descending=True).tolist()
            masked = set(order[p.top_k:]) if p.top_k > 0 else set()
            probs = x.masked_fill(torch.tensor([t in masked for t in range(VOCAB)]),
                                  -math.inf).softmax(-1)
            mass = 0.0
            for t in order:  # top-p: keep the most probable tokens until the mass reaches p
                if mass >= p.top_p:
                    masked.add(t)
                mass += probs[t].item()
            x = x.masked_fill(torch.tensor([t in masked for t in range(VOCAB)]), -math.inf)
            probs = x.softmax(-1)
            x = x.masked_fill(probs < p.min_p * probs.max(), -math.inf)
        expected.append(x.log_softmax(-1))

    for o, exp in zip(out, expected, strict=True):
        got = full_logprobs(o.top_logprobs[0])
        assert len(got) == VOCAB
        torch.testing.assert_close(torch.tensor([got[t] for t in range(VOCAB)]), exp)
        assert o.logprobs[0] == pytest.approx(exp[o.token_ids[0]].item(), abs=1e-5)
        assert math.isfinite(o.logprobs[0])  # never samples a masked token
    assert out[1].token_ids == [int(expected[1].argmax())]
    assert not logits.isinf().any()


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0  # a stop token
    logits[:, 2] = 8.0
    rows = [
        seq(0, [1, 1, 5], prompt_len=2, temperature=0.0, min_tokens=2, stop_token_ids=[7],
            logprobs=3),
        seq(1, [1, 1, 5, 5], prompt_len=2, temperature=0.0, min_tokens=2, stop_token_ids=[7]),
        seq(2, [1, 1, 5], prompt_len=2, temperature=0.0, min_tokens=2, stop_token_ids=[7],
            ignore_eos=True),
        seq(3, [1, 1, 5], prompt_len=2, seed=0, min_tokens=2, stop_token_ids=[7], top_k=3),
    ]
    out = sampler()(logits, rows)
    assert out[0].token_ids == [2]  # 1 output < min_tokens: EOS and stop id 7 hidden
    top = full_logprobs(out[0].top_logprobs[0])
    assert list(top)[0] == 2 and EOS not in top and 7 not in top
    assert out[1].token_ids == [EOS]  # min_tokens reached: nothing hidden
    assert out[2].token_ids == [EOS]  # ignore_eos keeps EOS; only the stop id is hidden
    assert out[3].token_ids[0] not in (EOS, 7)  # random rows too


def test_beam_rows_return_the_top_tokens_best_first():
    torch.manual_seed(3)
    logits = torch.randn(2, VOCAB)
    rows = [seq(0, temperature=0.0, use_beam_search=True, best_of=3, num_samples=6),
            seq(1, temperature=0.0, use_beam_search=True, best_of=2, num_samples=4)]
    out = sampler()(logits, rows)
    logprobs = logits.log_softmax(-1)
    for o, row, k in zip(out, logprobs, (6, 4), strict=True):
        values, ids = row.topk(k)
        assert o.token_ids == ids.tolist()
        assert o.logprobs == pytest.approx(values.tolist(), abs=1e-5)


def test_top_logprobs_have_n_sorted_entries_per_token():
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB)
    rows = [seq(0, seed=1, num_samples=3, logprobs=4), seq(1, seed=2, logprobs=0),
            seq(2, seed=3)]
    out = sampler()(logits, rows)
    assert len(out[0].top_logprobs) == 3
    for top in out[0].top_logprobs:
        values = [t.logprob for t in top]
        assert len(top) == 4 and values == sorted(values, reverse=True)
        assert [t.token_id for t in top] == logits[0].topk(4).indices.tolist()
    assert out[1].top_logprobs == [[]]
    assert out[2].top_logprobs == []


def test_seeded_sampling_repeats_whatever_the_batch():
    torch.manual_seed(5)
    logits = torch.randn(3, VOCAB)
    a = seq(0, [1, 2, 3], seed=1234, num_samples=8)
    b = seq(1, [4, 5], seed=99, temperature=0.8, top_p=0.9)
    c = seq(2, [7], temperature=1.3)  # unseeded: consumes the sampler's generator
    s = sampler()
    alone = s(logits[:1], [a])[0].token_ids
    mixed = s(logits, [a, b, c])
    reordered = s(logits.flip(0), [c, b, a])
    assert mixed[0].token_ids == alone == reordered[2].token_ids
    assert mixed[1].token_ids == reordered[1].token_ids
    # a fresh sampler (a restarted or preempted worker) replays the same tokens
    assert sampler()(logits[:1], [a])[0].token_ids == alone
    # the noise depends on the sequence's length and seed, not on a call counter
    longer = seq(0, [1, 2, 3, 4], seed=1234, num_samples=8)
    other_seed = seq(0, [1, 2, 3], seed=1235, num_samples=8)
    assert s(logits[:1], [longer])[0].token_ids != alone
    assert s(logits[:1], [other_seed])[0].token_ids != alone


def test_unseeded_rows_draw_from_the_engine_seed_not_torchs_global_generator():
    """vLLM's engine seed: a fresh engine repeats its unseeded draws for the same steps."""
    logits = torch.zeros(1, VOCAB)
    rows = [seq(temperature=1.0, num_samples=32)]
    torch.manual_seed(1)
    first = sampler(seed=3)(logits, rows)[0].token_ids
    first_uniforms = sampler(seed=3).uniforms(4, []).tolist()  # the rejection sampler's
    torch.manual_seed(2)  # whatever the global generator holds
    assert sampler(seed=3)(logits, rows)[0].token_ids == first
    assert sampler(seed=3).uniforms(4, []).tolist() == first_uniforms
    assert sampler(seed=4)(logits, rows)[0].token_ids != first
    assert sampler(seed=4).uniforms(4, []).tolist() != first_uniforms


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 4 degrees of freedom: P(chi2 > 30) ≈ 5e-6; a wrong distribution lands in the hundreds
CHI2_BOUND = 30.0


@pytest.mark.parametrize("seed", [None, 77])
def test_sampling_follows_the_distribution(seed):
    torch.manual_seed(6)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    num_samples = 20_000
    out = sampler(5)(probs.log().unsqueeze(0), [seq(seed=seed, num_samples=num_samples)])[0]
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=5).float()
    assert chi_square(counts, probs) < CHI2_BOUND
    assert out.logprobs[:3] == pytest.approx(probs.log()[out.token_ids[:3]].tolist(), abs=1e-5)


def test_temperature_and_top_k_reshape_the_distribution():
    torch.manual_seed(7)
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0001])
    out = sampler(6)(probs.log().unsqueeze(0),
                     [seq(num_samples=20_000, temperature=0.5, top_k=5)])[0]
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=6).float()
    assert counts[5] == 0
    sharpened = probs[:5] ** 2 / (probs[:5] ** 2).sum()  # temperature 0.5 squares the odds
    assert chi_square(counts[:5], sharpened) < CHI2_BOUND


def test_many_seeded_rows_follow_the_distribution():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    rows = [seq(i, seed=i) for i in range(4000)]
    out = sampler(5)(probs.log().expand(len(rows), 5), rows)
    counts = torch.bincount(torch.tensor([o.token_ids[0] for o in out]), minlength=5).float()
    assert chi_square(counts, probs) < CHI2_BOUND


def test_greedy_candidates_are_copies_of_the_argmax():
    logits = torch.tensor([[0.0] * (VOCAB - 1) + [0.5], [0.0, 2.0] + [0.0] * (VOCAB - 2)])
    out = sampler()(logits, [seq(0, temperature=0.0, num_samples=3),
                             seq(1, temperature=0.0)])
    assert out[0].token_ids == [VOCAB - 1] * 3
    assert len(set(out[0].logprobs)) == 1
    assert out[1].token_ids == [1]


def test_bad_num_samples_is_rejected():
    with pytest.raises(ValueError, match="num_samples must be >= 1"):
        sampler()(torch.zeros(1, VOCAB), [seq(num_samples=0)])
    with pytest.raises(ValueError, match="columns"):
        sampler()(torch.zeros(1, VOCAB - 1), [seq()])


def test_prompt_logprobs_give_target_then_top_n():
    torch.manual_seed(8)
    logits = torch.randn(4, VOCAB + 2)
    targets = [3, 0, 7, 11]
    entries = prompt_logprobs(logits, targets, num_top=3, vocab_size=VOCAB)
    logprobs = logits[:, :VOCAB].log_softmax(-1)
    assert len(entries) == 4
    for entry, row, target in zip(entries, logprobs, targets, strict=True):
        assert entry[0].token_id == target
        assert entry[0].logprob == pytest.approx(row[target].item(), abs=1e-5)
        values, ids = row.topk(3)
        assert [t.token_id for t in entry[1:]] == ids.tolist()
        assert [t.logprob for t in entry[1:]] == pytest.approx(values.tolist(), abs=1e-5)
    assert [len(e) for e in prompt_logprobs(logits[:, :VOCAB], targets, num_top=0)] == [1] * 4


def test_greedy_rows_do_not_depend_on_the_batch():
    torch.manual_seed(10)
    logits = torch.randn(3, VOCAB)
    greedy = seq(0, [1, 5, 5], prompt_len=1, temperature=0.0, frequency_penalty=0.4, logprobs=2)
    others = [seq(1, seed=1, temperature=0.6, top_p=0.5, min_p=0.1),
              seq(2, temperature=0.0, use_beam_search=True, best_of=2, num_samples=4)]
    alone = sampler()(logits[:1], [greedy])[0]
    batched = sampler()(logits, [greedy, *others])[0]
    assert batched == alone


# ---- per-sequence token constraints: logit bias, allowed ids, bad words -----------------------


def test_logit_bias_moves_the_greedy_choice_of_its_row_only():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 1.0
    out = sampler()(logits.clone(), [seq(0, temperature=0.0, logit_bias={7: 5.0, 3: -2.0}),
                                     seq(1, temperature=0.0)])
    assert [o.token_ids for o in out] == [[7], [3]]
    # the logprob is of the biased distribution
    biased = logits[0].clone()
    biased[7] += 5.0
    biased[3] -= 2.0
    assert out[0].logprobs[0] == pytest.approx(biased.log_softmax(-1)[7].item(), abs=1e-6)


def test_allowed_token_ids_keep_only_those_tokens_in_their_row():
    torch.manual_seed(3)
    rows = [seq(i, seed=i, allowed_token_ids=[2, 5]) for i in range(50)] + [seq(50, seed=1)]
    out = sampler()(torch.randn(1, VOCAB).expand(51, VOCAB).clone(), rows)
    assert {o.token_ids[0] for o in out[:50]} <= {2, 5}
    greedy = sampler()(torch.arange(VOCAB, dtype=torch.float32).unsqueeze(0),
                       [seq(temperature=0.0, allowed_token_ids=[4], logprobs=2)])[0]
    assert greedy.token_ids == [4] and greedy.logprobs == [0.0]


def test_a_bad_word_loses_its_last_token_once_the_output_ends_with_its_prefix():
    logits = torch.zeros(3, VOCAB)
    logits[:, 6] = 3.0  # greedy wants 6
    words = [[4, 5, 6], [9]]
    prompt = [4, 5]  # a prompt that ends with the prefix does not count: outputs only
    out = sampler()(logits, [
        seq(0, token_ids=prompt + [1, 4, 5], prompt_len=2, temperature=0.0,
            bad_words_token_ids=words),
        seq(1, token_ids=prompt + [1, 4], prompt_len=2, temperature=0.0,
            bad_words_token_ids=words),
        seq(2, token_ids=prompt, prompt_len=2, temperature=0.0, bad_words_token_ids=words)])
    assert out[0].token_ids != [6]
    assert out[1].token_ids == [6] and out[2].token_ids == [6]
    one_token = sampler()(torch.eye(VOCAB)[9:10] * 5, [seq(temperature=0.0,
                                                           bad_words_token_ids=[[9]])])[0]
    assert one_token.token_ids != [9]


@pytest.mark.parametrize("second, is_packed", [
    (dict(temperature=0.8), True),
    (dict(temperature=0.0, logprobs=0), False),
    (dict(n=2, temperature=1.0, num_samples=2), False),
])
def test_host_samples_pack_a_step_of_single_samples(second, is_packed):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(0))
    seqs = [seq(0, temperature=0.0), seq(1, seed=3, **second)]
    pending = sampler().launch(logits, seqs)
    expected = pending.result()
    outputs, seq_ids, token_ids, logprobs = pending.host_samples()
    if is_packed:  # the same draws as result()'s, without a SampledSequence each
        assert outputs == [] and seq_ids == [0, 1]
        assert token_ids == [s.token_ids[0] for s in expected]
        assert logprobs == [s.logprobs[0] for s in expected]
    else:  # a row with more to say than one token: every row as result() gives it
        assert (outputs, seq_ids, token_ids, logprobs) == (expected, [], [], [])
