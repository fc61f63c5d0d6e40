"""A client's request checked against the served model and turned into prompt token ids."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.text.tokenizer import Tokenizer

MAX_REQUEST_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """Exactly one of text, token_ids, messages is set."""

    request_id: str = ""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: int = 0


@dataclass(frozen=True, slots=True)
class ModelInfo:
    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    # the replica's capacity (0 = not reported)
    block_size: int = 0
    num_gpu_blocks: int = 0
    max_num_seqs: int = 0


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    # time.monotonic() when the request reached the gateway: latency metrics count from here
    arrival_s: float = field(default_factory=time.monotonic)


def prompt_token_ids(request: GenerateInput, tokenizer: Tokenizer, info: ModelInfo) -> list[int]:
    if request.text is not None:
        if not request.text:
            raise InvalidRequest("prompt text must not be empty, got ''")
        _check_prompt_chars("prompt text", len(request.text), tokenizer, info)
        return tokenizer.encode(request.text, add_special_tokens=True)
    if request.messages is not None:
        if not info.has_chat_template:
            raise InvalidRequest(f"prompt messages need a chat template, but model "
                                 f"{info.model!r} has none; send text or token_ids")
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        _check_prompt_chars("the messages' content", sum(len(m["content"]) for m in messages),
                            tokenizer, info)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if request.token_ids is not None:
        token_ids = list(request.token_ids)
        if not token_ids:
            raise InvalidRequest("prompt token_ids must not be empty, got []")
        bad = [t for t in token_ids if not 0 <= t < info.vocab_size][:8]
        if bad:
            raise InvalidRequest(
                f"prompt token_ids must be in [0, vocab_size={info.vocab_size}), got {bad}")
        return token_ids
    raise InvalidRequest("prompt must be set: one of text, token_ids or messages")


def _check_prompt_chars(what: str, num_chars: int, tokenizer: Tokenizer,
                        info: ModelInfo) -> None:
    """Refuses, before tokenizing it (hundreds of bytes of memory a token), text that cannot
    encode to max_model_len tokens or fewer: no token spans more than max_token_chars characters
    (twice that, for normalizers that merge characters)."""
    limit = 2 * info.max_model_len * tokenizer.max_token_chars
    if num_chars > limit:
        raise InvalidRequest(
            f"{what} must be at most {limit} characters (max_model_len={info.max_model_len} "
            f"tokens of at most {tokenizer.max_token_chars} characters, twice), got {num_chars}")


def check_request(request: GenerateInput, info: ModelInfo) -> str:
    """Returns the request id, a fresh one if unset."""
    request_id = request.request_id or uuid.uuid4().hex
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                             f"got {len(request_id)}")
    request.sampling.verify_for_model(info.vocab_size)
    return request_id


def prepared_request(request: GenerateInput, request_id: str, token_ids: list[int],
                     info: ModelInfo, arrival_s: float | None = None) -> PreparedRequest:
    sampling = request.sampling
    num_tokens = len(token_ids) + sampling.max_tokens
    if num_tokens > info.max_model_len:
        raise InvalidRequest(
            f"prompt ({len(token_ids)} tokens) + max_tokens ({sampling.max_tokens}) must be at "
            f"most max_model_len={info.max_model_len}, got {num_tokens}")
    return PreparedRequest(request_id=request_id, prompt_token_ids=token_ids, sampling=sampling,
                           priority=request.priority,
                           arrival_s=time.monotonic() if arrival_s is None else arrival_s)


def prepare_request(request: GenerateInput, tokenizer: Tokenizer, info: ModelInfo
                    ) -> PreparedRequest:
    """In the caller's thread (tests, tools); the Frontend tokenizes in its thread pool."""
    request_id = check_request(request, info)
    return prepared_request(request, request_id, prompt_token_ids(request, tokenizer, info), info)
