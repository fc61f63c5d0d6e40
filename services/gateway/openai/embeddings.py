"""POST /v1/embeddings (OpenAI's, as vLLM serves it): one vector per input, each input a
prompt-only request through the same schedulers as the generations (Frontend.embed). The pooling
(last token or mean, L2-normalized) is the engine's `--pooling-type`."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import uuid
from typing import Any, Literal

import numpy as np
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.outputs import Usage
from pagedserve.services.gateway.limits import (
    check_num_prompts,
    check_num_token_ids,
    check_token_ids_bytes,
)
from pagedserve.services.gateway.openai.generation import Submission, http_caller
from pagedserve.services.gateway.openai.http_span import record_request, record_usage
from pagedserve.services.gateway.openai.protocol import UsageInfo, now_s
from pagedserve.services.gateway.openai.request_fields import (
    REFUSED_EMBEDDING_FIELDS,
    check_undeclared_fields,
)
from pagedserve.services.gateway.openai.serving import OpenAIServing
from pagedserve.services.gateway.validation import EMBED_SAMPLING, GenerateInput
from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request

_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


class EmbeddingRequest(BaseModel):
    """Undeclared fields: request_fields.py."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    priority: int = 0
    # vLLM's extras
    request_id: str | None = None
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    additional_data: Any = None  # vLLM carries it along unread; so does this


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the little-endian float32 bytes


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now_s)
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


def embedding_inputs(value: str | list[Any], serving: OpenAIServing) -> list[GenerateInput]:
    """One input per prompt, their sizes checked by their lengths before any id is read."""
    frontend = serving.frontend
    if isinstance(value, str):
        return [GenerateInput(text=value)]
    if not value:
        raise InvalidRequest("input must not be empty, got []", reason=Reason.PROMPT_EMPTY,
                             field="input")
    if all(_is_token_id(t) for t in value):
        check_num_token_ids("input", len(value), frontend.info)
        return [GenerateInput(token_ids=tuple(value))]
    check_num_prompts(len(value), EMBED_SAMPLING, frontend.limits, frontend.info)
    if all(isinstance(p, str) for p in value):
        return [GenerateInput(text=p) for p in value]
    if all(isinstance(p, list) for p in value):
        for i, ids in enumerate(value):
            check_num_token_ids(f"input[{i}]", len(ids), frontend.info)
        check_token_ids_bytes("input", sum(len(ids) for ids in value), frontend.limits)
        if all(_is_token_id(t) for ids in value for t in ids):
            return [GenerateInput(token_ids=tuple(ids)) for ids in value]
    text = repr(value)
    raise InvalidRequest(f"input must be {_INPUT_SHAPES}, got "
                         f"{text if len(text) <= 80 else text[:80] + '...'}",
                         reason=Reason.INVALID_PROMPT, field="input")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_unsupported(body: EmbeddingRequest) -> None:
    check_undeclared_fields(body, REFUSED_EMBEDDING_FIELDS)
    if body.dimensions is not None:
        raise InvalidRequest(f"dimensions={body.dimensions} is not supported: the model's "
                             "embeddings are its full hidden size (no Matryoshka truncation)",
                             field="dimensions")
    if body.truncate_prompt_tokens is not None:
        raise InvalidRequest(f"truncate_prompt_tokens={body.truncate_prompt_tokens} is not "
                             "supported for embeddings", field="truncate_prompt_tokens")
    if body.normalize is False:
        raise InvalidRequest("normalize=false is not supported: embeddings are L2-normalized",
                             field="normalize")


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


async def create_embedding(serving: OpenAIServing, body: EmbeddingRequest,
                           request: Request) -> EmbeddingResponse:
    serving.check_model(body.model)
    _check_unsupported(body)
    request_id = body.request_id or f"embd-{uuid.uuid4().hex}"
    record_request(request_id)
    inputs = embedding_inputs(body.input, serving)
    inputs = [dataclasses.replace(
        one, sampling=EMBED_SAMPLING, priority=body.priority,
        add_special_tokens=body.add_special_tokens if one.text is not None else None,
        request_id=request_id if len(inputs) == 1 else f"{request_id}-{i}")
        for i, one in enumerate(inputs)]
    frontend = serving.frontend
    submission = await Submission.open(frontend, inputs, request)
    try:
        caller = http_caller(request)
        vectors = await asyncio.gather(*(frontend.embed(p, caller) for p in submission.prepared))
    finally:
        submission.close()
    num_prompt_tokens = sum(len(p.prompt_token_ids) for p in submission.prepared)
    record_usage(Usage(num_prompt_tokens, 0))
    return EmbeddingResponse(
        id=request_id, model=serving.model_name,
        data=[EmbeddingData(index=i, embedding=_encode(v, body.encoding_format))
              for i, v in enumerate(vectors)],
        usage=UsageInfo(prompt_tokens=num_prompt_tokens, total_tokens=num_prompt_tokens))
