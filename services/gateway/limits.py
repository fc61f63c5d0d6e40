"""Admission by cost: every request's worst case is known before any per-output work, so one
request cannot make the gateway, or the replica behind it, do unbounded work."""

from __future__ import annotations

from pagedserve.services.common.config import RequestLimitsConfig
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.validation import GenerateInput, ModelInfo

_BYTES_PER_TOKEN_ID = 4  # the size of a token id on every wire we take them from, at most


def _require_at_most(name: str, value: int, limit: int, limit_name: str) -> None:
    if value > limit:
        raise InvalidRequest(f"{name} must be at most {limit_name}={limit}, got {value}")


def max_num_seqs(limits: RequestLimitsConfig, info: ModelInfo) -> tuple[int, str]:
    if info.max_num_seqs and info.max_num_seqs < limits.max_num_seqs_per_request:
        return info.max_num_seqs, "max_num_seqs"
    return limits.max_num_seqs_per_request, "max_num_seqs_per_request"


def request_bytes(request: GenerateInput) -> int:
    strings: list[str] = list(request.sampling.stop)
    if request.text is not None:
        strings.append(request.text)
    for message in request.messages or ():
        strings += (message.role, message.content)
    num_token_ids = len(request.token_ids or ()) + len(request.sampling.stop_token_ids)
    size = num_token_ids * _BYTES_PER_TOKEN_ID
    for s in strings:
        size += len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))
    return size


def check_request_cost(request: GenerateInput, limits: RequestLimitsConfig,
                       info: ModelInfo) -> None:
    """Before tokenization; cheap whatever the request asks."""
    sampling = request.sampling
    seq_limit, seq_limit_name = max_num_seqs(limits, info)
    _require_at_most("n", sampling.n, seq_limit, seq_limit_name)
    if sampling.best_of is not None:
        _require_at_most("best_of", sampling.best_of, seq_limit, seq_limit_name)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(sampling, name)
        if value is not None:
            _require_at_most(name, value, limits.max_logprobs, "max_logprobs")
    _require_at_most("the number of stop strings", len(sampling.stop), limits.max_stop_strings,
                     "max_stop_strings")
    for i, stop in enumerate(sampling.stop):
        _require_at_most(f"the length of stop[{i}]", len(stop), limits.max_stop_string_chars,
                         "max_stop_string_chars")
    if request.messages is not None:
        _require_at_most("the number of messages", len(request.messages),
                         limits.max_chat_messages, "max_chat_messages")
    _require_at_most("the request's size in bytes", request_bytes(request),
                     limits.max_request_bytes, "max_request_bytes")
    if sampling.max_tokens >= info.max_model_len:
        raise InvalidRequest(f"max_tokens must be below max_model_len={info.max_model_len} (the "
                             f"prompt needs at least one token), got {sampling.max_tokens}")
    if request.token_ids is not None:
        num_tokens = len(request.token_ids) + sampling.max_tokens
        if num_tokens > info.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(request.token_ids)} tokens) + max_tokens ({sampling.max_tokens}) "
                f"must be at most max_model_len={info.max_model_len}, got {num_tokens}")


def num_blocks_at_most(num_prompt_tokens: int, sampling: SamplingParams, block_size: int) -> int:
    """The prompt's full blocks are shared by every sequence (forks copy only a partly filled
    block); the rest is each one's."""
    num_shared = num_prompt_tokens // block_size
    num_total = num_prompt_tokens + sampling.max_tokens
    num_own = (num_total + block_size - 1) // block_size - num_shared
    return num_shared + sampling.num_candidates * num_own


def check_fits_replica(num_prompt_tokens: int, sampling: SamplingParams, info: ModelInfo) -> None:
    """Refused now rather than failed after its prefill."""
    if not (info.block_size and info.num_gpu_blocks):
        return
    num_blocks = num_blocks_at_most(num_prompt_tokens, sampling, info.block_size)
    if num_blocks > info.num_gpu_blocks:
        raise InvalidRequest(
            f"best_of={sampling.num_candidates} sequences of prompt ({num_prompt_tokens} tokens) "
            f"+ max_tokens ({sampling.max_tokens}) need {num_blocks} KV-cache blocks of "
            f"{info.block_size} tokens; the replica has num_gpu_blocks={info.num_gpu_blocks}: "
            "lower n, best_of or max_tokens")
