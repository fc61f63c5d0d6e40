"""Requests as the scheduler sees them: a `SequenceGroup` per request, one `Sequence` per candidate.
With async scheduling, a sequence the in-flight step samples for ends in a placeholder token until
that step's output replaces it -- never across two engine steps."""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    # members are singletons compared by identity: object's hash (C) instead of Enum's (Python),
    # which every status lookup of every sequence paid, several times a step
    __hash__ = object.__hash__

    @property
    def is_finished(self) -> bool:
        return self in FINISH_REASONS


PLACEHOLDER_TOKEN_ID = -1

FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    SequenceStatus.FINISHED_ERROR: FinishReason.ERROR,
}
FINISHED_BY_REASON = {reason: status for status, reason in FINISH_REASONS.items()}


def derive_seed(seed: int | None, index: int) -> int | None:
    """Siblings need distinct seeds: the worker draws noise statelessly from (seed, position)."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(slots=True, eq=False)  # identity semantics: queues look groups up by `is`
class Sequence:
    seq_id: int
    token_ids: list[int]
    prompt_len: int
    index: int = 0  # which of the group's best_of candidates (the output index for n > 1)
    seed: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[TokenIdLogprob]] = field(default_factory=list)
    error: str | None = None
    # the worker's mirror: None = the worker does not know this sequence (send it whole)
    worker_block_ids: list[int] | None = None
    num_worker_tokens: int = 0
    num_emitted_tokens: int = 0
    is_finish_reported: bool = False
    has_placeholder: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status in FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    @property
    def is_known_to_worker(self) -> bool:
        return self.worker_block_ids is not None

    def add_placeholder(self) -> None:
        assert not self.has_placeholder, f"seq {self.seq_id} already has a placeholder"
        self.token_ids.append(PLACEHOLDER_TOKEN_ID)
        self.has_placeholder = True

    def drop_placeholder(self) -> None:
        if self.has_placeholder:
            self.token_ids.pop()
            self.has_placeholder = False

    def append_token(self, token_id: int, logprob: float,
                     top_logprobs: list[TokenIdLogprob] | None = None) -> None:
        self.token_ids.append(token_id)
        self.cumulative_logprob += logprob
        self.output_logprobs.append(logprob)
        if top_logprobs is not None:
            self.output_top_logprobs.append(top_logprobs)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """The token a step in flight draws for it is dropped with its placeholder."""
        self.drop_placeholder()
        self.status = FINISHED_BY_REASON[reason]
        self.error = error

    def fork(self, seq_id: int, index: int, seed: int | None) -> Sequence:
        """A child sharing everything computed so far (its blocks are forked by the caller)."""
        assert not self.has_placeholder, "forks happen on known tokens only"
        return Sequence(
            seq_id=seq_id, token_ids=list(self.token_ids), prompt_len=self.prompt_len, index=index,
            seed=seed, status=self.status, num_computed_tokens=self.num_computed_tokens,
            cumulative_logprob=self.cumulative_logprob,
            output_logprobs=list(self.output_logprobs),
            output_top_logprobs=list(self.output_top_logprobs),
            num_emitted_tokens=self.num_emitted_tokens)


@dataclass(slots=True)
class BeamHypothesis:
    """A finished beam: its sequence (and blocks) are gone."""

    token_ids: list[int]  # outputs only
    cumulative_logprob: float
    score: float  # cumulative_logprob / num_output_tokens ** length_penalty
    logprobs: list[float]
    top_logprobs: list[list[TokenIdLogprob]]
    finish_reason: FinishReason


@dataclass(slots=True, eq=False)
class SequenceGroup:
    request_id: str
    sampling: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower runs first
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    is_admitted: bool = False  # has held blocks at least once
    first_scheduled_time: float | None = None  # monotonic, at first admission
    first_token_time: float | None = None  # monotonic, when its first token was sampled
    has_forked: bool = False
    # positions 1.. of the prompt; None where the KV came from the prefix cache
    prompt_logprobs: list[list[TokenIdLogprob] | None] = field(default_factory=list)
    beam_hypotheses: list[BeamHypothesis] = field(default_factory=list)
    error: str | None = None
    num_reports: int = 0
    owner: str = ""  # who may abort it, besides an admin (the gateway's tag of its caller)
    is_paused: bool = False  # its consumer is behind: not scheduled, first preempted
    pooling_type: str = ""  # an embedding request ("last", "mean"): its prompt only, pooled
    embedding: list[float] | None = None  # the pooled vector, once its prompt is computed
    # beam search and best_of > n report only at the end, when the winners are known; a field,
    # not a property: every report asks it (sampling is frozen)
    is_streamed: bool = field(init=False)

    def __post_init__(self) -> None:
        sampling = self.sampling
        self.is_streamed = not self.is_beam_search and sampling.num_candidates == sampling.n

    @classmethod
    def from_prompt(cls, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    seq_id: int, priority: int = 0,
                    arrival_time: float | None = None) -> SequenceGroup:
        seq = Sequence(seq_id=seq_id, token_ids=list(prompt_token_ids),
                       prompt_len=len(prompt_token_ids), seed=derive_seed(sampling.seed, 0))
        return cls(request_id=request_id, sampling=sampling, seqs=[seq], priority=priority,
                   arrival_time=time.monotonic() if arrival_time is None else arrival_time)

    @classmethod
    def from_resumed(cls, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                     resumed: dict[int, list[int]], seq_ids: Iterator[int], priority: int = 0,
                     arrival_time: float | None = None) -> SequenceGroup:
        """The unfinished outputs of a request streamed elsewhere: one sequence per output index,
        already past its fork, each prefilled again over prompt + its output tokens."""
        prompt_len = len(prompt_token_ids)
        seqs = [Sequence(seq_id=next(seq_ids), token_ids=[*prompt_token_ids, *token_ids],
                         prompt_len=prompt_len, index=index,
                         seed=derive_seed(sampling.seed, index),
                         num_emitted_tokens=len(token_ids))
                for index, token_ids in sorted(resumed.items())]
        return cls(request_id=request_id, sampling=sampling, seqs=seqs, priority=priority,
                   arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                   has_forked=sampling.num_candidates > 1)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.seqs[0].token_ids[:self.seqs[0].prompt_len]

    @property
    def prompt_len(self) -> int:
        return self.seqs[0].prompt_len

    @property
    def is_collecting_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some positions are still owed: the first prefill
        reports them (a recompute would repeat them)."""
        return (self.sampling.prompt_logprobs is not None
                and len(self.prompt_logprobs) < self.prompt_len - 1)

    @property
    def is_beam_search(self) -> bool:
        return self.sampling.use_beam_search

    @property
    def beam_width(self) -> int:
        return self.sampling.num_candidates

    @property
    def is_finished(self) -> bool:
        for s in self.seqs:  # a loop, as is_decode_phase's below
            if s.status not in FINISH_REASONS:
                return False
        return True

    # the scheduler asks these of every running group in every step: the statuses and sampling
    # fields are read inline rather than through the properties, in loops rather than all()
    # over generators
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if s.status not in FINISH_REASONS]

    def is_decode_phase(self) -> bool:
        for s in self.seqs:
            if s.status not in FINISH_REASONS and len(s.token_ids) - s.num_computed_tokens != 1:
                return False
        return True

    def num_samples(self) -> int:
        sampling = self.sampling
        if sampling.use_beam_search:
            return 2 * sampling.num_candidates
        return 1 if self.has_forked else sampling.num_candidates

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        for seq in self.live_seqs():
            seq.finish(reason, error)
        if reason == FinishReason.ERROR:
            self.error = error
