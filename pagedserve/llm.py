"""LLM: offline batch generation on the in-process engine.

    llm = LLM(model="/path/to/model", enable_prefix_caching=True)
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
    vectors = [o.outputs.embedding for o in llm.embed(["Hello", "Paris"])]

A stop string finishes its output in the engine at once (LLMEngine.finish_sequence: its blocks
freed, its siblings going on), as the gateway does over SubmitStream; beam search and best_of > n
rank their candidates only at the end, so there a stop string cuts the chosen outputs' text.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from pagedserve.llm_engine import LLMEngine, engine_config_from_kwargs
from pagedserve.services.common.config import default_model_dir
from pagedserve.services.common.errors import InvalidRequest, NotFound
from pagedserve.services.common.gc_tuning import raised_thresholds
from pagedserve.services.common.outputs import FinishReason, RequestOutput
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.text.sampling_text import truncated_prompt, with_bad_words_token_ids
from pagedserve.services.text.text_stream import TextStream
from pagedserve.services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]
Message = Mapping[str, str]


@dataclass(slots=True)
class LLMCompletion:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # of each token in token_ids
    top_logprobs: list[list[TokenIdLogprob]] = field(default_factory=list)  # if asked
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(slots=True)
class LLMOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: list[LLMCompletion]
    num_cached_tokens: int = 0
    prompt_logprobs: list[list[TokenIdLogprob] | None] | None = None


@dataclass(frozen=True, slots=True)
class EmbeddingOutput:
    embedding: list[float]  # [hidden_size], L2-normalized


@dataclass(frozen=True, slots=True)
class EmbeddingRequestOutput:
    request_id: str
    prompt: str | None  # None when the prompt was given as token ids
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput


class _Request:
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 sampling: SamplingParams, tokenizer: Tokenizer) -> None:
        self.output = LLMOutput(request_id=request_id, prompt=prompt,
                                prompt_token_ids=prompt_token_ids, outputs=[])
        self.text = TextStream(prompt_token_ids, sampling, tokenizer, decode_logprobs=False)
        self.completions: dict[int, LLMCompletion] = {}
        self.is_finished = False

    def update(self, report: RequestOutput) -> list[int]:
        """Take one engine report; returns the indices a stop string ended before the engine
        did."""
        if report.prompt_logprobs is not None:
            self.output.prompt_logprobs = report.prompt_logprobs
        self.output.num_cached_tokens = report.num_cached_tokens
        engine_outputs = {c.index: c for c in report.outputs}
        for delta in self.text.on_output(report):
            engine_output = engine_outputs.get(delta.index)
            if engine_output is None:  # the prompt-logprobs delta of an empty report
                continue
            out = self.completions.setdefault(delta.index, LLMCompletion(index=delta.index))
            num_kept = len(delta.token_ids)
            out.text += delta.text
            out.token_ids += delta.token_ids
            for logprob in engine_output.logprobs[:num_kept]:
                out.cumulative_logprob += logprob
                out.logprobs.append(logprob)
            out.top_logprobs += engine_output.top_logprobs[:num_kept]
            if delta.finish_reason is not None:
                out.finish_reason, out.error = delta.finish_reason, delta.error
        if report.finished:
            self.is_finished = True
            self.output.outputs = [self.completions[i] for i in sorted(self.completions)]
        return self.text.take_stopped()


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs`: flat engine options, named as the CLI flags (block_size, dtype, seed, ...)."""
        config = engine_config_from_kwargs(model=model or default_model_dir(), **kwargs)
        self.tokenizer = Tokenizer.from_pretrained(config.model.tokenizer_path)
        self.engine = LLMEngine(config)
        self._request_ids = itertools.count()

    def close(self) -> None:
        """Gives the engine's device memory back (llm_engine.LLMEngine.close); so does leaving a
        `with LLM(...) as llm:` block, or deleting the LLM."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: str | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[LLMOutput]:
        """Outputs come back in input order."""
        return self._run(self._encode(prompts), sampling_params, use_tqdm)

    def embed(self, prompts: str | Sequence[Prompt],
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One vector per prompt, in input order: its final hidden states pooled as the
        engine's pooling_type says (last token by default), L2-normalized. Each prompt is a
        prompt-only request batched with the rest; nothing is generated."""
        encoded = self._encode(prompts)
        embeddings: dict[str, list[float]] = {}
        request_ids = [str(next(self._request_ids)) for _ in encoded]
        try:
            for request_id, (_, ids) in zip(request_ids, encoded, strict=True):
                self.engine.add_request(request_id, ids, SamplingParams(max_tokens=1),
                                        is_pooling=True)
            with tqdm(total=len(encoded), desc="Embedding", unit="req",
                      disable=not use_tqdm) as progress, raised_thresholds():
                while self.engine.has_unfinished_requests():
                    for report in self.engine.step():
                        if not report.finished:
                            continue
                        if report.embedding is None:
                            raise RuntimeError(f"embedding request {report.request_id} failed: "
                                               f"{report.outputs[0].error if report.outputs else ''}")
                        embeddings[report.request_id] = report.embedding
                        progress.update(1)
        finally:
            for request_id in request_ids:
                if request_id not in embeddings and self.engine.has_unfinished_requests():
                    with contextlib.suppress(NotFound):
                        self.engine.abort_request(request_id)
        return [EmbeddingRequestOutput(request_id, prompt, ids,
                                       EmbeddingOutput(embeddings[request_id]))
                for request_id, (prompt, ids) in zip(request_ids, encoded, strict=True)]

    def _encode(self, prompts: str | Sequence[Prompt]) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        return [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p))
                for p in prompts]

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool = True) -> list[LLMOutput]:
        """One conversation (a list of {"role", "content"} messages) or a list of them."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.render_chat(conversation, add_generation_prompt)
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._run(encoded, sampling_params, use_tqdm)

    def _run(self, encoded: list[tuple[str | None, list[int]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None,
             use_tqdm: bool) -> list[LLMOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(encoded)
        if len(sampling_params) != len(encoded):
            raise InvalidRequest(f"sampling_params has {len(sampling_params)} entries for "
                                 f"{len(encoded)} prompts")
        requests: dict[str, _Request] = {}
        try:
            for (prompt, ids), sampling in zip(encoded, sampling_params, strict=True):
                ids = truncated_prompt(ids, sampling)
                sampling = with_bad_words_token_ids(sampling, self.tokenizer)
                if sampling.structured_outputs is not None:
                    sampling.structured_outputs.verify()
                request_id = str(next(self._request_ids))
                self.engine.add_request(request_id, ids, sampling)
                requests[request_id] = _Request(request_id, prompt, ids, sampling,
                                                self.tokenizer)
            self._step_until_done(requests, use_tqdm)
        finally:
            for request_id, request in requests.items():
                if not request.is_finished:  # an error or an interrupt: leave nothing behind
                    self.engine.abort_request(request_id)
        return [request.output for request in requests.values()]

    def _step_until_done(self, requests: dict[str, _Request], use_tqdm: bool) -> None:
        with tqdm(total=len(requests), desc="Generating", unit="req",
                  disable=not use_tqdm) as progress, raised_thresholds():
            while self.engine.has_unfinished_requests():
                reports = self.engine.step()
                while reports:
                    report = reports.pop()
                    request = requests[report.request_id]
                    for index in request.update(report):
                        final = self.engine.finish_sequence(report.request_id, index)
                        if final is not None:
                            reports.append(final)
                    if report.finished:
                        progress.update(1)
