"""One request's engine outputs as text deltas, for the gateway and the offline LLM: per output
index, incremental detokenization, then stop strings. A stop string ends its index with STOP and
drops the tokens after the one that completed it; `take_stopped` names the indices a stop string
ended before the engine did, which the caller finishes in the engine (`finish_sequence`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.common.outputs import (
    FinishReason,
    RequestOutput,
    SequenceDelta,
    TokenLogprob,
    Usage,
)
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.text.detokenizer import IncrementalDetokenizer
from pagedserve.services.text.stop_strings import StopStringMatcher
from pagedserve.services.text.tokenizer import Tokenizer


@dataclass(slots=True)
class TextDelta:
    """One output's new text inside the gateway, before it becomes a response (the client reads
    its wire form as pagedserve.client.StreamDelta)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per token, if asked
    finish_reason: FinishReason | None = None
    cumulative_logprob: float = 0.0
    error: str | None = None
    usage: Usage | None = None  # on the request's last delta
    prompt_logprobs: list[list[TokenLogprob]] | None = None  # on the first delta, if asked


@dataclass(slots=True)
class _IndexState:
    detokenizer: IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    num_tokens: int = 0
    is_finished: bool = False


class TextStream:
    """Not thread-safe."""

    def __init__(self, prompt_token_ids: list[int], sampling: SamplingParams,
                 tokenizer: Tokenizer, decode_logprobs: bool = True) -> None:
        """`decode_logprobs=False`: the deltas carry no logprobs (the caller reads the engine's)."""
        self._tokenizer = tokenizer
        self._is_beam_search = sampling.use_beam_search
        self._wants_logprobs = decode_logprobs and sampling.logprobs is not None
        self._indices = [
            _IndexState(IncrementalDetokenizer(tokenizer, prompt_token_ids,
                                               sampling.skip_special_tokens),
                        StopStringMatcher(sampling.stop, sampling.include_stop_str_in_output))
            for _ in range(sampling.n)]
        self._num_prompt_tokens = len(prompt_token_ids)
        self._num_cached_tokens = 0
        self._has_sent_prompt_logprobs = False
        self._stopped: list[int] = []
        self._num_unfinished = sampling.n  # read once or twice per event: a count, not a scan

    @property
    def is_finished(self) -> bool:
        return not self._num_unfinished

    def is_output_finished(self, index: int) -> bool:
        return self._indices[index].is_finished

    def take_stopped(self) -> list[int]:
        """The indices a stop string ended since the last call while the engine still runs
        them."""
        stopped, self._stopped = self._stopped, []
        return stopped

    @property
    def usage(self) -> Usage:
        return Usage(prompt_tokens=self._num_prompt_tokens,
                     completion_tokens=sum(s.num_tokens for s in self._indices),
                     cached_tokens=self._num_cached_tokens)

    def on_output(self, output: RequestOutput) -> list[TextDelta]:
        self._num_prompt_tokens = output.num_prompt_tokens or self._num_prompt_tokens
        self._num_cached_tokens = output.num_cached_tokens
        deltas = []
        for completion in output.outputs:
            delta = self._on_completion(completion)
            if delta is not None:
                deltas.append(delta)
        if output.finished and self._is_beam_search:
            # the completions at once, the best first: under structured outputs there may be
            # fewer than n, and the others never come
            for state in self._indices:
                state.is_finished = True
            self._num_unfinished = 0
        if output.prompt_logprobs is not None and not self._has_sent_prompt_logprobs:
            self._has_sent_prompt_logprobs = True
            if not deltas:
                deltas.append(TextDelta(index=0))
            deltas[0].prompt_logprobs = [self._decoded(p or []) for p in output.prompt_logprobs]
        if deltas and not self._num_unfinished:
            deltas[-1].usage = self.usage
        return deltas

    def _on_completion(self, completion: SequenceDelta) -> TextDelta | None:
        if not 0 <= completion.index < len(self._indices):
            raise ValueError(f"output index {completion.index} outside [0, {len(self._indices)})")
        state = self._indices[completion.index]
        if state.is_finished:
            return None  # a stop string ended it; steps in flight before its finish still report
        finish_reason = None
        if not state.stop_matcher.has_stops:  # nothing to cut: the tokens decode in one go
            token_ids = list(completion.token_ids)
            text = state.detokenizer.push(token_ids) if token_ids else ""
        else:
            text, token_ids = "", []
            for token_id in completion.token_ids:  # one at a time: the cut falls between tokens
                token_ids.append(token_id)
                piece, is_stopped = state.stop_matcher.push(state.detokenizer.push([token_id]))
                text += piece
                if is_stopped:
                    finish_reason = FinishReason.STOP
                    if completion.finish_reason is None:
                        self._stopped.append(completion.index)
                    break
        if finish_reason is None and completion.finish_reason is not None:
            tail, is_stopped = state.stop_matcher.push(state.detokenizer.flush())
            text += tail if is_stopped else tail + state.stop_matcher.flush()
            finish_reason = FinishReason.STOP if is_stopped else completion.finish_reason
        state.num_tokens += len(token_ids)
        if finish_reason is not None:
            state.is_finished = True
            self._num_unfinished -= 1
        elif not (text or token_ids):
            return None
        delta = TextDelta(index=completion.index, text=text, token_ids=token_ids,
                          finish_reason=finish_reason,
                          cumulative_logprob=completion.cumulative_logprob,
                          error=completion.error if finish_reason == FinishReason.ERROR else None)
        if self._wants_logprobs:
            delta.logprobs = [TokenLogprob(t, lp, self._token_text(t))
                              for t, lp in zip(token_ids, completion.logprobs, strict=False)]
            delta.top_logprobs = [self._decoded(c)
                                  for c in completion.top_logprobs[:len(token_ids)]]
        return delta

    def _decoded(self, candidates: list[TokenIdLogprob]) -> list[TokenLogprob]:
        return [TokenLogprob(c.token_id, c.logprob, self._token_text(c.token_id))
                for c in candidates]

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode_token(token_id, skip_special_tokens=False)
