"""The simulated sampler: tokens are a deterministic function of (seed, position, the last
tokens of the context), so a test can predict every output through the whole stack. Greedy rows
ignore the seed, like argmax. EOS has a fixed probability per token once min_tokens are out, so
output lengths are geometric; other tokens come from the middle of the vocabulary, away from
special tokens.
"""

from __future__ import annotations

from pagedserve.services.common.step_plan import SampledSequence, TokenLogprob
from pagedserve.worker_svc.sampler import SeqSamplingState

_MASK_64 = (1 << 64) - 1
_CONTEXT_WINDOW = 4  # context tokens a draw depends on
_MUL = 0x9E3779B97F4A7C15


def _mix(seed: int, position: int, sample: int, context: list[int]) -> int:
    x = (seed * _MUL + position * 0xBF58476D1CE4E5B9 + sample) & _MASK_64
    for token in context:
        x = ((x ^ token) * _MUL) & _MASK_64
    x ^= x >> 31
    x = (x * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 29)


def sim_token(seed: int, position: int, context: list[int], sample: int, token_range: range,
              eos_token_id: int | None, eos_probability: float) -> tuple[int, float]:
    """(token id, logprob) of one draw; context: the tokens before `position` (the last few
    count). eos_token_id None: EOS is not allowed at this draw."""
    x = _mix(seed, position, sample, context[-_CONTEXT_WINDOW:])
    u = (x >> 11) / (1 << 53)  # uniform in [0, 1)
    logprob = -1.0 - 4.0 * ((x & 0xFFFF) / 0x10000)
    if eos_token_id is not None and u < eos_probability:
        return eos_token_id, logprob
    return token_range[(x >> 16) % len(token_range)], logprob


class SimSampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], eos_probability: float,
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.eos_probability = eos_probability
        self.seed = seed
        low = min(1000, vocab_size // 4)
        self.token_range = range(low, max(vocab_size - 1000, vocab_size * 3 // 4, low + 1))

    def __call__(self, logits: object, seqs: list[SeqSamplingState]) -> list[SampledSequence]:
        return [self._sample(s) for s in seqs]

    def _sample(self, s: SeqSamplingState) -> SampledSequence:
        sampling = s.sampling
        is_greedy = sampling.is_greedy and not sampling.use_beam_search
        seed = self.seed if is_greedy or s.seed is None else s.seed
        may_end = not sampling.ignore_eos and s.num_output_tokens >= sampling.min_tokens
        eos = self.eos_token_id if may_end else None
        position = len(s.token_ids)
        draws = [sim_token(seed, position, s.token_ids, j, self.token_range, eos,
                           self.eos_probability) for j in range(s.num_samples)]
        if sampling.use_beam_search:
            draws.sort(key=lambda d: -d[1])
        top_logprobs = []
        if sampling.logprobs is not None:
            top_logprobs = [self._top(token, logprob, sampling.logprobs)
                            for token, logprob in draws]
        return SampledSequence(seq_id=s.seq_id, token_ids=[t for t, _ in draws],
                               logprobs=[lp for _, lp in draws], top_logprobs=top_logprobs)

    def _top(self, token: int, logprob: float, num_top: int) -> list[TokenLogprob]:
        span = len(self.token_range)
        return [TokenLogprob(token, logprob)] + [
            TokenLogprob(self.token_range[(token - self.token_range.start + k) % span],
                         logprob - k) for k in range(1, num_top)][:num_top]
