"""Admission by cost: every request's worst case is known before any per-output work, so one
request cannot make the gateway, or the replica behind it, do unbounded work."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.services.common.errors import FieldViolation, InvalidRequest, Reason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.gateway.validation import (
    GenerateInput,
    ServedModel,
    check_context_length,
)

_BYTES_PER_TOKEN_ID = 4  # the size of a token id on every wire we take them from, at most


def _require_at_most(name: str, value: int, limit: int, limit_name: str, field: str) -> None:
    if value > limit:
        raise InvalidRequest(f"{name} must be at most {limit_name}={limit}, got {value}",
                             reason=Reason.LIMIT_EXCEEDED, field=field,
                             metadata={"value": str(value), "limit": str(limit),
                                       "limit_name": limit_name})


def max_num_seqs(limits: RequestLimitsConfig, info: ServedModel) -> tuple[int, str]:
    if info.max_num_seqs and info.max_num_seqs < limits.max_num_seqs_per_request:
        return info.max_num_seqs, "max_num_seqs"
    return limits.max_num_seqs_per_request, "max_num_seqs_per_request"


def _num_bytes(strings: list[str]) -> int:
    return sum(len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))
               for s in strings)


def bytes_by_field(request: GenerateInput) -> dict[str, int]:
    """The request's size in bytes, by the field that holds them."""
    sizes = {"sampling.stop": _num_bytes(list(request.sampling.stop)),
             "sampling.stop_token_ids":
                 len(request.sampling.stop_token_ids) * _BYTES_PER_TOKEN_ID}
    if request.text is not None:
        sizes["text"] = _num_bytes([request.text])
    if request.messages is not None:
        sizes["messages"] = _num_bytes([s for m in request.messages for s in (m.role, m.content)])
    if request.token_ids is not None:
        sizes["token_ids"] = len(request.token_ids) * _BYTES_PER_TOKEN_ID
    return sizes


def check_list_lengths(stop: Sequence[str], stop_token_ids: Sequence[int],
                       limits: RequestLimitsConfig) -> None:
    """Before the sampling parameters are built (each of their lists is scanned)."""
    _require_at_most("the number of stop strings", len(stop), limits.max_stop_strings,
                     "max_stop_strings", "sampling.stop")
    _require_at_most("the number of stop token ids", len(stop_token_ids),
                     limits.max_stop_token_ids, "max_stop_token_ids", "sampling.stop_token_ids")


def check_num_token_ids(field: str, num_token_ids: int, info: ServedModel) -> None:
    """Before the ids are scanned or decoded: no sequence of the model is max_model_len long."""
    if num_token_ids >= info.max_model_len:
        raise InvalidRequest(f"{field} must hold fewer than max_model_len={info.max_model_len} "
                             f"token ids, got {num_token_ids}", reason=Reason.PROMPT_TOO_LONG,
                             field=field, metadata={"value": str(num_token_ids),
                                                    "limit": str(info.max_model_len - 1)})


def check_token_ids_bytes(field: str, num_token_ids: int, limits: RequestLimitsConfig) -> None:
    """Token ids counted against max_request_bytes by their number alone."""
    _require_at_most("the request's size in bytes", num_token_ids * _BYTES_PER_TOKEN_ID,
                     limits.max_request_bytes, "max_request_bytes", field)


def check_num_prompts(num_prompts: int, sampling: SamplingParams, limits: RequestLimitsConfig,
                      info: ServedModel) -> None:
    """A request of many prompts runs best_of sequences for each: all of them count against the
    per-request limit, as if one prompt asked for them all."""
    seq_limit, seq_limit_name = max_num_seqs(limits, info)
    num_seqs = num_prompts * sampling.num_candidates
    if num_seqs > seq_limit:
        raise InvalidRequest(
            f"the number of sequences, {num_prompts} prompts x best_of={sampling.num_candidates}, "
            f"must be at most {seq_limit_name}={seq_limit}, got {num_seqs}",
            reason=Reason.LIMIT_EXCEEDED, field="prompt",
            metadata={"value": str(num_seqs), "limit": str(seq_limit),
                      "limit_name": seq_limit_name})


def check_request_cost(request: GenerateInput, limits: RequestLimitsConfig,
                       info: ServedModel) -> None:
    """Before tokenization; cheap whatever the request asks."""
    sampling = request.sampling
    seq_limit, seq_limit_name = max_num_seqs(limits, info)
    _require_at_most("n", sampling.n, seq_limit, seq_limit_name, "sampling.n")
    if sampling.best_of is not None:
        _require_at_most("best_of", sampling.best_of, seq_limit, seq_limit_name,
                         "sampling.best_of")
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sampling, name)
        if value is not None:
            _require_at_most(name, value, limits.max_logprobs, "max_logprobs", f"sampling.{name}")
    check_list_lengths(sampling.stop, sampling.stop_token_ids, limits)
    for i, stop in enumerate(sampling.stop):
        _require_at_most(f"the length of stop[{i}]", len(stop), limits.max_stop_string_chars,
                         "max_stop_string_chars", f"sampling.stop[{i}]")
    _check_token_constraints(sampling, limits, info)
    if request.messages is not None:
        _require_at_most("the number of messages", len(request.messages),
                         limits.max_chat_messages, "max_chat_messages", "messages")
    sizes = bytes_by_field(request)
    _require_at_most("the request's size in bytes", sum(sizes.values()),
                     limits.max_request_bytes, "max_request_bytes", max(sizes, key=sizes.get))
    if sampling.max_tokens >= info.max_model_len:
        raise InvalidRequest(f"max_tokens must be below max_model_len={info.max_model_len} (the "
                             f"prompt needs at least one token), got {sampling.max_tokens}",
                             reason=Reason.MAX_TOKENS_TOO_LARGE, field="sampling.max_tokens",
                             metadata={"value": str(sampling.max_tokens),
                                       "limit": str(info.max_model_len - 1)})
    if request.token_ids is not None:
        num_kept = len(request.token_ids)
        if sampling.truncate_prompt_tokens is not None:
            num_kept = min(num_kept, sampling.truncate_prompt_tokens)
        check_context_length(request, num_kept, info.max_model_len)


def _check_token_constraints(sampling: SamplingParams, limits: RequestLimitsConfig,
                             info: ServedModel) -> None:
    """Bad words are bounded as stop strings are (each is tokenized); id lists by the vocabulary."""
    _require_at_most("the number of bad words", len(sampling.bad_words), limits.max_stop_strings,
                     "max_stop_strings", "sampling.bad_words")
    for i, word in enumerate(sampling.bad_words):
        _require_at_most(f"the length of bad_words[{i}]", len(word), limits.max_stop_string_chars,
                         "max_stop_string_chars", f"sampling.bad_words[{i}]")
    _require_at_most("the number of allowed token ids", len(sampling.allowed_token_ids or ()),
                     info.vocab_size, "vocab_size", "sampling.allowed_token_ids")
    if sampling.truncate_prompt_tokens is not None:
        _require_at_most("truncate_prompt_tokens", sampling.truncate_prompt_tokens,
                         info.max_model_len, "max_model_len", "sampling.truncate_prompt_tokens")


def check_prompts_cost(requests: Sequence[GenerateInput], limits: RequestLimitsConfig,
                       info: ServedModel) -> None:
    """The cost of one client request of several prompts (they share its sampling parameters):
    each prompt's, and their sequences and bytes together."""
    check_request_cost(requests[0], limits, info)
    check_num_prompts(len(requests), requests[0].sampling, limits, info)
    num_bytes = sum(bytes_by_field(requests[0]).values())
    for request in requests[1:]:
        num_bytes += sum(n for f, n in bytes_by_field(request).items()
                         if not f.startswith("sampling."))
    _require_at_most("the request's size in bytes", num_bytes, limits.max_request_bytes,
                     "max_request_bytes", "prompt")
    for request in requests[1:]:
        check_request_cost(request, limits, info)


def num_blocks_at_most(num_prompt_tokens: int, sampling: SamplingParams, block_size: int) -> int:
    """The prompt's full blocks are shared by every sequence (forks copy only a partly filled
    block); the rest is each one's."""
    num_shared = num_prompt_tokens // block_size
    num_total = num_prompt_tokens + sampling.max_tokens
    num_own = (num_total + block_size - 1) // block_size - num_shared
    return num_shared + sampling.num_candidates * num_own


def check_fits_replica(num_prompt_tokens: int, sampling: SamplingParams, info: ServedModel) -> None:
    """Refused now rather than failed after its prefill."""
    if not (info.block_size and info.num_gpu_blocks):
        return
    num_blocks = num_blocks_at_most(num_prompt_tokens, sampling, info.block_size)
    if num_blocks > info.num_gpu_blocks:
        message = (
            f"best_of={sampling.num_candidates} sequences of prompt ({num_prompt_tokens} tokens) "
            f"+ max_tokens ({sampling.max_tokens}) need {num_blocks} KV-cache blocks of "
            f"{info.block_size} tokens; the replica has num_gpu_blocks={info.num_gpu_blocks}: "
            "lower n, best_of or max_tokens")
        fields = ["sampling.max_tokens"]
        if sampling.num_candidates > 1:
            fields.append("sampling.n" if sampling.best_of is None else "sampling.best_of")
        raise InvalidRequest(message, reason=Reason.KV_CACHE_TOO_SMALL,
                             violations=[FieldViolation(f, message) for f in fields],
                             metadata={"value": str(num_blocks),
                                       "limit": str(info.num_gpu_blocks)})
