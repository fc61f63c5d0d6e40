"""Sampler. vLLM V1's order: allowed ids → bad words → min_tokens → logit bias → penalties →
temperature → top-k/top-p → min-p; logprobs are of the processed logits. Random rows race
argmax(probs / Exponential(1)), with no host sync; a seeded draw's noise comes from (seed, length,
sample index) alone (seeded_noise.py), so it survives batching and preemption; an unseeded draw's
from a generator seeded with the engine's seed, so a fresh engine repeats it for the same steps."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, TokenIdLogprob
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.logits_processor import (
    add_logit_bias,
    apply_min_p,
    apply_top_k,
    apply_top_k_top_p,
    bad_word_tokens,
    keep_only,
    mask_tokens,
)
from pagedserve.worker_svc.penalties import PenaltyCounts
from pagedserve.worker_svc.seeded_noise import SeededNoise, draw_keys
from pagedserve.worker_svc.token_bitmask import TokenBitmask

_PROMPT_LOGPROBS_CHUNK = 1024  # rows per log_softmax, bounds the extra memory of long prompts


class HostSamples(NamedTuple):
    """A step's draws on the host: single samples (one token, no top logprobs) packed, as
    StepOutput carries them, and the others one SampledSequence each."""

    outputs: list[SampledSequence]
    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class PendingSamples(Protocol):
    """A step's draws once launched: `token_ids` stays on the device, where the next step's
    inputs read it; result() waits for the draws and brings them to the host, one
    SampledSequence a sequence; host_samples() the same, packed where it can."""

    token_ids: torch.Tensor  # [num_samples_total] int64; seq i's draws at offsets[i]:offsets[i+1]
    offsets: list[int]

    def result(self) -> list[SampledSequence]: ...

    def host_samples(self) -> HostSamples: ...


class SamplingState(Protocol):
    """What the sampler reads of a sequence: a SeqSamplingState, or the worker's mirror of a
    sequence without drafts (CachedSequence), read at launch only."""

    seq_id: int
    sampling: SamplingParams
    token_ids: list[int]
    prompt_len: int
    seed: int | None
    num_samples: int

    @property
    def num_output_tokens(self) -> int: ...


@dataclass(slots=True)
class SeqSamplingState:
    seq_id: int
    sampling: SamplingParams
    token_ids: list[int]  # prompt + outputs so far (before this step's sample)
    prompt_len: int
    seed: int | None  # per-sequence seed derived by the scheduler; None = unseeded
    num_samples: int  # 1; best_of when a group forks after its prompt; 2*beam_width for beams

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len


def _has_penalty(sampling: SamplingParams) -> bool:
    return (sampling.repetition_penalty != 1.0 or sampling.frequency_penalty != 0.0
            or sampling.presence_penalty != 0.0)


def _on_rows(logits: torch.Tensor, rows: list[int],
             fn: Callable[[torch.Tensor, list[int]], torch.Tensor]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:
        return fn(logits, rows)
    index = to_device(rows, torch.long, logits.device)
    logits[index] = fn(logits[index], rows)
    return logits


@dataclass(slots=True)
class _TokenEdits:
    mask_rows: list[int] = field(default_factory=list)
    mask_ids: list[int] = field(default_factory=list)
    allowed_rows: list[int] = field(default_factory=list)
    allowed_ids: list[int] = field(default_factory=list)
    bias_rows: list[int] = field(default_factory=list)
    bias_ids: list[int] = field(default_factory=list)
    biases: list[float] = field(default_factory=list)


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 seed: int | None = None) -> None:
        """`seed`: the engine's, for the draws of rows without a seed of their own, so that a
        fresh engine repeats them for the same steps; None = a random one."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)  # unseeded rows' noise
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._seeded_noise = SeededNoise(vocab_size, self.device)
        self._penalties = PenaltyCounts(vocab_size, self.device)

    def __call__(self, logits: torch.Tensor, seqs: list[SamplingState],
                 token_bitmask: TokenBitmask | None = None) -> list[SampledSequence]:
        return self.launch(logits, seqs, token_bitmask).result()

    def launch(
        self,
        logits: torch.Tensor,  # [num_seqs, >= vocab_size] float32; row i ↔ seqs[i]
        seqs: list[SamplingState],
        token_bitmask: TokenBitmask | None = None,  # structured outputs' allowed tokens
    ) -> PendingSamples:
        """Queues the draws on the device; nothing waits for them."""
        self._verify(logits, seqs)
        if not seqs:
            none = torch.empty(0, dtype=torch.long, device=self.device)
            return _DeviceSamples([], [0], none, none.float(), [], None, None)
        logits = logits[:, :self.vocab_size]
        if token_bitmask is not None:
            logits = token_bitmask.apply(logits)
        processed, random_rows = self._process(logits, seqs)  # [num_seqs, vocab_size]

        num_samples = [s.num_samples for s in seqs]
        offsets = list(itertools.accumulate(num_samples, initial=0))
        greedy_rows = [i for i, s in enumerate(seqs)
                       if s.sampling.is_greedy and not s.sampling.use_beam_search]
        beam_rows: list[int] = []
        if len(greedy_rows) < len(seqs):
            beam_rows = [i for i, s in enumerate(seqs) if s.sampling.use_beam_search]
        top_rows = [i for i, s in enumerate(seqs) if s.sampling.logprobs]

        logprobs = torch.log_softmax(processed, dim=-1)  # [num_seqs, vocab_size]
        if len(greedy_rows) == len(seqs) and offsets[-1] == len(seqs):
            sampled = processed.argmax(dim=-1)  # [num_seqs]; fast path: nothing to scatter
        else:
            sampled = torch.empty(offsets[-1], dtype=torch.long, device=self.device)
            if greedy_rows:
                # n > 1 greedy candidates are n copies of the argmax (vLLM V1)
                expanded = [i for i in greedy_rows for _ in range(num_samples[i])]
                greedy_ids = processed[self._tensor(expanded, torch.long)].argmax(dim=-1)
                self._put(sampled, [offsets[i] + j for i in greedy_rows
                                    for j in range(num_samples[i])], greedy_ids)
            if beam_rows:
                self._sample_beams(sampled, logprobs, seqs, beam_rows, offsets)
            if random_rows:
                self._sample_random(sampled, logprobs, seqs, random_rows, offsets)
        if offsets[-1] == len(seqs):  # a sample a row: no row index to copy to the device
            sampled_logprobs = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        else:
            sample_rows = [i for i, k in enumerate(num_samples) for _ in range(k)]
            # [num_samples_total]
            sampled_logprobs = logprobs[self._tensor(sample_rows, torch.long), sampled]

        top_values = top_ids = None
        if top_rows:
            max_top = min(max(seqs[i].sampling.logprobs for i in top_rows), self.vocab_size)
            # [num_top_rows, max_top], descending
            top_values, top_ids = logprobs[self._tensor(top_rows, torch.long)].topk(max_top)
        return _DeviceSamples(seqs, offsets, sampled, sampled_logprobs, top_rows, top_values,
                              top_ids)

    def logprobs(
        self,
        logits: torch.Tensor,  # [num_seqs, >= vocab_size]; row i ↔ seqs[i]
        seqs: list[SamplingState],
    ) -> torch.Tensor:  # [num_seqs, vocab_size]
        """The log-distribution each row's draw comes from (every processing step applied)."""
        self._verify(logits, seqs)
        processed, _ = self._process(logits[:, :self.vocab_size], seqs)
        return torch.log_softmax(processed, dim=-1)

    def _verify(self, logits: torch.Tensor, seqs: list[SamplingState]) -> None:
        if logits.dim() != 2 or logits.shape[0] != len(seqs):
            raise ValueError(f"logits must be [num_seqs={len(seqs)}, vocab], "
                             f"got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than "
                             f"vocab_size={self.vocab_size}")
        for s in seqs:
            if s.num_samples < 1:
                raise ValueError(f"seq {s.seq_id}: num_samples must be >= 1, got {s.num_samples}")
            if s.sampling.use_beam_search:
                if s.num_samples > self.vocab_size:
                    raise ValueError(f"seq {s.seq_id}: num_samples={s.num_samples} exceeds "
                                     f"vocab_size={self.vocab_size}")
            if not 0 <= s.prompt_len <= len(s.token_ids):
                raise ValueError(f"seq {s.seq_id}: prompt_len={s.prompt_len} outside "
                                 f"[0, {len(s.token_ids)}]")

    def _process(self, logits: torch.Tensor,
                 seqs: list[SamplingState]) -> tuple[torch.Tensor, list[int]]:
        """The processed logits [num_seqs, vocab_size] and the rows drawn at random."""
        penalty_rows = [i for i, s in enumerate(seqs) if _has_penalty(s.sampling)]
        edits = self._token_edits(seqs)
        mask_rows, mask_ids = edits.mask_rows, edits.mask_ids
        allowed_rows, bias_rows = edits.allowed_rows, edits.bias_rows
        random_rows = [i for i, s in enumerate(seqs) if not s.sampling.is_greedy]
        has_temperature = any(seqs[i].sampling.temperature != 1.0 for i in random_rows)
        top_rows = [i for i in random_rows if 0 < seqs[i].sampling.top_k < self.vocab_size
                    or seqs[i].sampling.top_p < 1.0]
        min_p_rows = [i for i in random_rows if seqs[i].sampling.min_p > 0.0]
        if not (penalty_rows or mask_rows or allowed_rows or bias_rows or has_temperature
                or top_rows or min_p_rows):
            return logits.float(), random_rows

        processed = logits.to(torch.float32, copy=True)  # [num_seqs, vocab_size]
        # vLLM V1's order: allowed ids, bad words, min_tokens, logit bias, then penalties
        keep_only(processed, allowed_rows, edits.allowed_ids)
        mask_tokens(processed, mask_rows, mask_ids)
        add_logit_bias(processed, bias_rows, edits.bias_ids, edits.biases)
        if penalty_rows:
            processed = _on_rows(processed, penalty_rows, lambda sub, rows: self._penalties.apply(
                sub,
                [seqs[i] for i in rows],
                [seqs[i].sampling.repetition_penalty for i in rows],
                [seqs[i].sampling.frequency_penalty for i in rows],
                [seqs[i].sampling.presence_penalty for i in rows]))
        if has_temperature:
            # dividing a greedy or temperature-1 row by 1.0 leaves it bit for bit unchanged
            temperatures = [1.0 if s.sampling.is_greedy else s.sampling.temperature for s in seqs]
            processed.div_(self._column(temperatures))
        if top_rows:
            top_k = [self._top_k(seqs[i].sampling) for i in top_rows]
            if any(seqs[i].sampling.top_p < 1.0 for i in top_rows):
                top_p = [seqs[i].sampling.top_p for i in top_rows]
                processed = _on_rows(processed, top_rows, lambda sub, _: apply_top_k_top_p(
                    sub, self._tensor(top_k, torch.long), self._tensor(top_p, torch.float32)))
            else:
                processed = _on_rows(processed, top_rows, lambda sub, _: apply_top_k(
                    sub, self._tensor(top_k, torch.long), max(top_k)))
        if min_p_rows:
            processed = _on_rows(processed, min_p_rows, lambda sub, rows: apply_min_p(
                sub, self._tensor([seqs[i].sampling.min_p for i in rows], torch.float32)))
        return processed, random_rows

    def _token_edits(self, seqs: list[SamplingState]) -> _TokenEdits:
        """Per row: tokens hidden (min_tokens, bad words), kept (allowed ids), biased."""
        edits = _TokenEdits()
        for i, s in enumerate(seqs):
            sampling = s.sampling
            is_short = sampling.min_tokens and s.num_output_tokens < sampling.min_tokens
            if not is_short and not sampling.has_token_constraints:
                continue  # most rows: nothing to hide, keep or bias
            hidden: set[int] = set()
            if is_short:
                hidden.update(sampling.stop_token_ids)
                if not sampling.ignore_eos:
                    hidden.update(self.eos_token_ids)
            if sampling.has_token_constraints:
                hidden.update(bad_word_tokens(s.token_ids[s.prompt_len:],
                                              sampling.bad_words_token_ids))
                allowed = sampling.allowed_token_ids or ()
                edits.allowed_rows.extend([i] * len(allowed))
                edits.allowed_ids.extend(allowed)
                for token_id, bias in sampling.logit_bias:
                    edits.bias_rows.append(i)
                    edits.bias_ids.append(token_id)
                    edits.biases.append(bias)
            hidden_ids = sorted(t for t in hidden if t < self.vocab_size)
            edits.mask_rows.extend([i] * len(hidden_ids))
            edits.mask_ids.extend(hidden_ids)
        return edits

    def _top_k(self, sampling: SamplingParams) -> int:
        return sampling.top_k if 0 < sampling.top_k < self.vocab_size else self.vocab_size

    def _sample_beams(self, sampled: torch.Tensor, logprobs: torch.Tensor,
                      seqs: list[SamplingState], rows: list[int], offsets: list[int]) -> None:
        max_k = max(seqs[i].num_samples for i in rows)
        index = self._tensor(rows, torch.long)
        _, top_ids = logprobs[index].topk(max_k, dim=-1)  # [num_beam_rows, max_k], descending
        positions, sources = [], []
        for b, i in enumerate(rows):
            for j in range(seqs[i].num_samples):
                positions.append(offsets[i] + j)
                sources.append(b * max_k + j)
        self._put(sampled, positions, top_ids.flatten()[self._tensor(sources, torch.long)])

    def race(self, probs: torch.Tensor, num_unseeded: int, keys: list[int]) -> torch.Tensor:
        """argmax(probs / Exponential(1)) of each row, a draw from it: [num_draws]. probs
        [num_draws, vocab_size] (unnormalized is fine) is overwritten; the first num_unseeded
        rows take noise from the engine-seeded generator, the others from their keys
        (draw_keys)."""
        if num_unseeded:
            self._divide(probs[:num_unseeded], torch.empty_like(probs[:num_unseeded]).exponential_(
                generator=self._generator))
        if keys:
            self._divide(probs[num_unseeded:],
                         self._seeded_noise.exponential(self._tensor(keys, torch.long)))
        return probs.argmax(dim=-1)

    def uniforms(self, num_unseeded: int, keys: list[int]) -> torch.Tensor:
        """[num_unseeded + len(keys)] float64 in [0, 1): the first from the engine-seeded
        generator, the others from their keys (draw_keys)."""
        unseeded = torch.rand(num_unseeded, dtype=torch.float64, device=self.device,
                              generator=self._generator)
        if not keys:
            return unseeded
        return torch.cat([unseeded, self._seeded_noise.uniforms(self._tensor(keys, torch.long))])

    def _sample_random(self, sampled: torch.Tensor, logprobs: torch.Tensor,
                       seqs: list[SamplingState], rows: list[int], offsets: list[int]) -> None:
        # unseeded rows first: each kind of noise fills one contiguous slice
        rows = sorted(rows, key=lambda i: seqs[i].seed is not None)
        seeded = [seqs[i] for i in rows if seqs[i].seed is not None]
        expanded = [i for i in rows for _ in range(seqs[i].num_samples)]
        positions = [offsets[i] + j for i in rows for j in range(seqs[i].num_samples)]
        probs = logprobs[self._tensor(expanded, torch.long)].exp()  # [num_draws, vocab_size]
        keys = draw_keys([s.seed for s in seeded], [len(s.token_ids) for s in seeded],
                         [s.num_samples for s in seeded])
        self._put(sampled, positions, self.race(probs, len(expanded) - len(keys), keys))

    @staticmethod
    def _divide(probs: torch.Tensor, noise: torch.Tensor) -> None:  # [num_draws, vocab_size]
        # a noise of exactly 0 would turn a masked token's 0 / 0 into NaN
        probs.div_(noise.clamp_min_(torch.finfo(noise.dtype).tiny))

    def _put(self, sampled: torch.Tensor, positions: list[int], values: torch.Tensor) -> None:
        sampled[self._tensor(positions, torch.long)] = values

    def _tensor(self, values: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)

    def _column(self, values: list[float]) -> torch.Tensor:  # [num_rows, 1]
        return self._tensor(values, torch.float32).unsqueeze(1)


class _DeviceSamples:
    """The draws' host copies are queued behind them (pinned, non-blocking on CUDA), so result()
    waits for the device once, for everything."""

    def __init__(self, seqs: list[SamplingState], offsets: list[int],
                 sampled: torch.Tensor,  # [num_samples_total]
                 sampled_logprobs: torch.Tensor,  # [num_samples_total]
                 top_rows: list[int],
                 top_values: torch.Tensor | None,  # [num_top_rows, max_top]
                 top_ids: torch.Tensor | None) -> None:  # [num_top_rows, max_top]
        self.token_ids = sampled
        self.offsets = offsets
        self._seqs = seqs  # their seq_id and sampling only: neither changes after the launch
        self._top_rows = top_rows
        self._event: torch.cuda.Event | None = None
        self._host = [sampled, sampled_logprobs, top_values, top_ids]
        if sampled.device.type == "cuda":
            self._host = [None if t is None else t.to("cpu", non_blocking=True)
                          for t in self._host]
            self._event = torch.cuda.Event()
            self._event.record()

    def host_samples(self) -> HostSamples:
        seqs = self._seqs
        if self.offsets[-1] != len(seqs) or any(s.sampling.logprobs is not None for s in seqs):
            return HostSamples(self.result(), [], [], [])
        token_ids, logprobs = self._host_lists()  # a sample a row, no top logprobs
        return HostSamples([], [s.seq_id for s in seqs], token_ids, logprobs)

    def _host_lists(self) -> tuple[list[int], list[float]]:
        if self._event is not None:
            self._event.synchronize()
        return self._host[0].tolist(), self._host[1].tolist()

    def result(self) -> list[SampledSequence]:
        seqs, offsets, top_rows = self._seqs, self.offsets, self._top_rows
        token_ids, logprobs = self._host_lists()
        _, _, top_values, top_ids = self._host
        tops: dict[int, list[TokenIdLogprob]] = {}
        if top_rows:
            for i, ids, values in zip(top_rows, top_ids.tolist(), top_values.tolist(), strict=True):
                n = seqs[i].sampling.logprobs
                tops[i] = [TokenIdLogprob(t, v) for t, v in zip(ids[:n], values[:n], strict=True)]
        outputs = []
        for i, seq in enumerate(seqs):
            start, end = offsets[i], offsets[i + 1]
            top_logprobs = [] if seq.sampling.logprobs is None else [
                list(tops.get(i, [])) for _ in range(end - start)]
            outputs.append(SampledSequence(seq_id=seq.seq_id, token_ids=token_ids[start:end],
                                           logprobs=logprobs[start:end],
                                           top_logprobs=top_logprobs))
        return outputs


def prompt_logprobs(
    logits: torch.Tensor,  # [num_positions, >= vocab_size]; row j predicts target_ids[j]
    target_ids: list[int],
    num_top: int,
    vocab_size: int | None = None,  # drop padded columns beyond it; None = every column
) -> list[list[TokenIdLogprob]]:
    """Per position: the target, then the num_top best; of the raw logits, as vLLM reports them."""
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(f"logits must be [len(target_ids)={len(target_ids)}, vocab], "
                         f"got {tuple(logits.shape)}")
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    if vocab_size is not None:
        logits = logits[:, :vocab_size]
    num_top = min(num_top, logits.shape[1])
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    entries: list[list[TokenIdLogprob]] = []
    for start in range(0, len(target_ids), _PROMPT_LOGPROBS_CHUNK):
        end = start + _PROMPT_LOGPROBS_CHUNK
        logprobs = torch.log_softmax(logits[start:end].float(), dim=-1)  # [chunk, vocab_size]
        chunk_targets = targets[start:end]
        target_logprobs = logprobs.gather(1, chunk_targets.unsqueeze(1)).squeeze(1).tolist()
        if num_top > 0:
            top_values, top_ids = logprobs.topk(num_top, dim=-1)  # [chunk, num_top]
            tops = zip(top_ids.tolist(), top_values.tolist(), strict=True)
        else:
            tops = (([], []) for _ in target_logprobs)
        for target, logprob, (ids, values) in zip(chunk_targets.tolist(), target_logprobs, tops,
                                                  strict=True):
            entries.append([TokenIdLogprob(target, logprob)]
                           + [TokenIdLogprob(t, v) for t, v in zip(ids, values, strict=True)])
    return entries
