"""The simulated sampler: tokens are a deterministic function of (seed, position, the last
tokens of the context), so a test can predict every output through the whole stack. Greedy rows
ignore the seed, like argmax. EOS has a fixed probability per token once min_tokens are out, so
output lengths are geometric; other tokens come from the middle of the vocabulary, away from
special tokens. A constrained row's draw that its grammar's mask refuses becomes the next allowed
token after it (a function of the draw, so still predictable), so constrained outputs follow
their grammar.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.services.common.step_plan import SampledSequence, TokenIdLogprob
from pagedserve.worker_svc.sampler import HostSamples, SamplingState
from pagedserve.worker_svc.token_bitmask import TokenBitmask

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


@dataclass(slots=True)
class _DrawnSamples:
    """Drawn on the host at launch; the runner's fence stands for the device's time."""

    token_ids: torch.Tensor  # [num_samples_total] int64
    offsets: list[int]
    drawn: HostSamples

    def result(self) -> list[SampledSequence]:
        drawn = self.drawn
        return drawn.outputs + [SampledSequence(seq_id, [token_id], [logprob])
                                for seq_id, token_id, logprob in zip(
                                    drawn.seq_ids, drawn.token_ids, drawn.logprobs, strict=True)]

    def host_samples(self) -> HostSamples:
        return self.drawn


class SimSampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], eos_probability: float,
                 seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else None
        self.eos_probability = eos_probability
        self.seed = seed
        low = min(1000, vocab_size // 4)
        self.token_range = range(low, max(vocab_size - 1000, vocab_size * 3 // 4, low + 1))

    def __call__(self, logits: object, seqs: list[SamplingState]) -> list[SampledSequence]:
        """sim_token for every draw, the hash of a whole step at once in numpy."""
        tokens, logprobs, num_samples = self._draws(seqs)
        out, row = [], 0
        for s, n in zip(seqs, num_samples, strict=True):
            if n == 1 and s.sampling.logprobs is None:
                out.append(SampledSequence(s.seq_id, tokens[row:row + 1], logprobs[row:row + 1]))
            else:
                out.append(self._sampled(s, list(zip(tokens[row:row + n], logprobs[row:row + n],
                                                     strict=True))))
            row += n
        return out

    def _draws(self, seqs: list[SamplingState]) -> tuple[list[int], list[float], list[int]]:
        """(tokens, logprobs) of every draw, sequence after sequence, and each one's count."""
        seeds, positions, num_samples, contexts, eos_ok = [], [], [], [], []
        for s in seqs:
            sampling = s.sampling
            seeds.append(self._seed(s))
            positions.append(len(s.token_ids))
            num_samples.append(s.num_samples)
            contexts.append(s.token_ids[-_CONTEXT_WINDOW:])
            eos_ok.append(self.eos_token_id is not None and not sampling.ignore_eos
                          and s.num_output_tokens >= sampling.min_tokens)
        is_distinct = [not (s.sampling.is_greedy and not s.sampling.use_beam_search) for s in seqs]
        tokens, logprobs = self._draw(seeds, positions, num_samples, contexts, eos_ok,
                                      is_distinct)
        return tokens, logprobs, num_samples

    def _seed(self, s: SamplingState) -> int:
        is_greedy = s.sampling.is_greedy and not s.sampling.use_beam_search
        return (self.seed if is_greedy or s.seed is None else s.seed) & _MASK_64

    def uniform(self, s: SamplingState, stream: int) -> float:
        """A number in [0, 1) of the draw's seed, position and context, as the draws are, in a
        stream of its own (a simulated draft model's choices)."""
        x = _mix(self._seed(s) ^ stream, len(s.token_ids), 0, s.token_ids[-_CONTEXT_WINDOW:])
        return (x >> 11) / (1 << 53)

    def another_token(self, token: int) -> int:
        """A token other than `token` that a draw can give."""
        span = self.token_range
        return span[(token - span.start + 1) % len(span)] if token in span else span.start

    def launch(self, logits: object, seqs: list[SamplingState],
               token_bitmask: TokenBitmask | None = None) -> _DrawnSamples:
        if token_bitmask is None and all(s.num_samples == 1 and s.sampling.logprobs is None
                                         for s in seqs):  # single samples: packed
            tokens, logprobs, _ = self._draws(seqs)
            return _DrawnSamples(torch.tensor(tokens, dtype=torch.long),
                                 list(range(len(seqs) + 1)),
                                 HostSamples([], [s.seq_id for s in seqs], tokens, logprobs))
        sampled = self(logits, seqs)
        if token_bitmask is not None:
            for k, row in enumerate(token_bitmask.rows):
                sampled[row] = self._allowed(sampled[row], token_bitmask.bits[k].numpy(),
                                             seqs[row].sampling.logprobs)
        offsets = list(itertools.accumulate((len(s.token_ids) for s in sampled), initial=0))
        token_ids = torch.tensor([t for s in sampled for t in s.token_ids], dtype=torch.long)
        return _DrawnSamples(token_ids, offsets, HostSamples(sampled, [], [], []))

    def _allowed(self, s: SampledSequence, words: np.ndarray,
                 num_top: int | None) -> SampledSequence:
        """words: the row's bitmask [num_words] int32."""
        if all((int(words[t >> 5]) >> (t & 31)) & 1 for t in s.token_ids):
            return s
        is_allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:self.vocab_size]
        token_ids = []
        for t in s.token_ids:
            if not is_allowed[t]:
                after = is_allowed[t:].argmax()
                t = t + int(after) if is_allowed[t + after] else int(is_allowed.argmax())
            token_ids.append(t)
        top_logprobs = ([self._top(t, lp, num_top) for t, lp in zip(token_ids, s.logprobs,
                                                                      strict=True)]
                        if num_top is not None else s.top_logprobs)
        return dataclasses.replace(s, token_ids=token_ids, top_logprobs=top_logprobs)

    def _draw(self, seeds: list[int], positions: list[int], num_samples: list[int],
              contexts: list[list[int]], eos_ok: list[bool],
              is_distinct: list[bool]) -> tuple[list[int], list[float]]:
        """_mix and sim_token for each sequence's draws; uint64 arithmetic wraps as & _MASK_64
        does there."""
        counts = np.array(num_samples, dtype=np.int64)
        starts = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=starts[1:])
        sample = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], counts)
        sample *= np.repeat(np.array(is_distinct, dtype=np.int64), counts)  # greedy: n copies
        x = (np.repeat(np.array(seeds, dtype=np.uint64), counts) * np.uint64(_MUL)
             + np.repeat(np.array(positions, dtype=np.uint64), counts)
             * np.uint64(0xBF58476D1CE4E5B9) + sample.astype(np.uint64))
        window = np.zeros((len(counts), _CONTEXT_WINDOW), dtype=np.uint64)
        for i, context in enumerate(contexts):
            if context:
                window[i, _CONTEXT_WINDOW - len(context):] = context
        lengths = np.repeat(np.fromiter(map(len, contexts), np.int64, len(contexts)), counts)
        window = np.repeat(window, counts, axis=0)
        mul = np.uint64(_MUL)
        for k in range(_CONTEXT_WINDOW):  # oldest first; a short context starts later
            x = np.where(lengths >= _CONTEXT_WINDOW - k, (x ^ window[:, k]) * mul, x)
        x ^= x >> np.uint64(31)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(29)
        u = (x >> np.uint64(11)).astype(np.float64) / (1 << 53)
        logprobs = -1.0 - 4.0 * ((x & np.uint64(0xFFFF)).astype(np.float64) / 0x10000)
        span = np.uint64(len(self.token_range))
        tokens = ((x >> np.uint64(16)) % span).astype(np.int64) + self.token_range.start
        if self.eos_token_id is not None:
            is_eos = np.repeat(np.array(eos_ok, dtype=bool), counts) & (u < self.eos_probability)
            tokens[is_eos] = self.eos_token_id
        return tokens.tolist(), logprobs.tolist()

    def _sampled(self, s: SamplingState, draws: list[tuple[int, float]]) -> SampledSequence:
        sampling = s.sampling
        if sampling.use_beam_search:
            draws.sort(key=lambda d: -d[1])
        top_logprobs = []
        if sampling.logprobs is not None:
            top_logprobs = [self._top(token, logprob, sampling.logprobs)
                            for token, logprob in draws]
        return SampledSequence(seq_id=s.seq_id, token_ids=[t for t, _ in draws],
                               logprobs=[lp for _, lp in draws], top_logprobs=top_logprobs)

    def _top(self, token: int, logprob: float, num_top: int) -> list[TokenIdLogprob]:
        span = len(self.token_range)
        return [TokenIdLogprob(token, logprob)] + [
            TokenIdLogprob(self.token_range[(token - self.token_range.start + k) % span],
                           logprob - k) for k in range(1, num_top)][:num_top]
