"""A client of the public gRPC API: Client (blocking) and AsyncClient (asyncio), typed results,
deadlines, retries that honour the server's RetryInfo, and ClientError with the rich details."""

from pagedserve.client.aio import AsyncClient, AsyncStream
from pagedserve.client.errors import ClientError, FieldViolation
from pagedserve.client.retry import RetryPolicy
from pagedserve.client.sync import Client, Stream
from pagedserve.client.types import (
    Completion,
    CompletionOutput,
    Embedding,
    ModelInfo,
    StreamDelta,
    Tokenized,
)
from pagedserve.services.common.outputs import TokenLogprob, Usage

__all__ = ["AsyncClient", "AsyncStream", "Client", "ClientError", "Completion",
           "CompletionOutput", "Embedding", "FieldViolation", "ModelInfo", "RetryPolicy", "Stream",
           "StreamDelta", "TokenLogprob", "Tokenized", "Usage"]
