"""`pagedserve.AsyncClient`: the public API over a grpc.aio channel, for asyncio programs.

    async with AsyncClient("127.0.0.1:50051") as client:
        async for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")

Cancelling the task that reads a stream cancels the call, which aborts the request."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import grpc

from pagedserve.client import types
from pagedserve.client.channel import aio_channel, connection
from pagedserve.client.errors import client_error
from pagedserve.client.retry import DEFAULT_RETRY, Deadline, RetryPolicy, retry_delay_s
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.v1 import gateway_pb2_grpc


class AsyncStream:
    """As Stream, with `async for`; cancel() or aclose() (or leaving `async with`) cancels."""

    def __init__(self, start: Callable[[float | None], Any], request_id: str,
                 retry: RetryPolicy | None, deadline: Deadline) -> None:
        self.request_id = request_id
        self._start = start
        self._retry = retry
        self._deadline = deadline
        self._call = start(deadline.remaining_s())
        self._num_attempts = 1
        self._has_output = False
        self._is_cancelled = False

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> types.StreamDelta:
        while not self._is_cancelled:
            try:
                msg = await self._call.read()
            except asyncio.CancelledError:
                self._call.cancel()
                task = asyncio.current_task()
                if self._is_cancelled and task is not None and not task.cancelling():
                    break  # cancel() from another task, not a cancellation of this one
                raise
            except grpc.RpcError as e:
                if self._is_cancelled:
                    break
                error = client_error(e, self._num_attempts)
                delay_s = (None if self._has_output else
                           retry_delay_s(self._retry, error, self._deadline, "GenerateStream"))
                if delay_s is None:
                    raise error from None
                await asyncio.sleep(delay_s)
                self._num_attempts += 1
                self._call = self._start(self._deadline.remaining_s())
                continue
            if msg is grpc.aio.EOF:
                break
            self._has_output = True
            return types.stream_delta_from_proto(msg)
        raise StopAsyncIteration

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.cancel()


class AsyncClient:
    """As Client; make it inside the event loop that uses it."""

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, timeout_s: float | None = None,
                 retry: RetryPolicy | None = DEFAULT_RETRY,
                 options: tuple[tuple[str, object], ...] = ()) -> None:
        self._conn = connection(address, api_key=api_key, tls=tls, tls_ca=tls_ca,
                                tls_cert=tls_cert, tls_key=tls_key, options=options)
        self._channel = aio_channel(self._conn)
        self._generation = gateway_pb2_grpc.GenerationServiceStub(self._channel)
        self._models = gateway_pb2_grpc.ModelServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._retry = retry

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    def _deadline(self, timeout_s: float | None) -> Deadline:
        return Deadline(self._timeout_s if timeout_s is None else timeout_s)

    async def _unary(self, method: str, rpc: Callable[..., Any], request: Any,
                     timeout_s: float | None) -> Any:
        deadline = self._deadline(timeout_s)
        num_attempts = 1
        while True:
            try:
                return await rpc(request, timeout=deadline.remaining_s(),
                                 metadata=self._conn.metadata)
            except grpc.RpcError as e:
                error = client_error(e, num_attempts)
                delay_s = retry_delay_s(self._retry, error, deadline, method)
                if delay_s is None:
                    raise error from None
                await asyncio.sleep(delay_s)
                num_attempts += 1

    async def generate(self, prompt: types.Prompt, *, sampling: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0,
                       timeout_s: float | None = None,
                       **sampling_kwargs: Any) -> types.Completion:
        request = types.generate_request(prompt, None, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        return types.completion_from_proto(
            await self._unary("Generate", self._generation.Generate, request, timeout_s))

    def stream(self, prompt: types.Prompt, *, sampling: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0,
               timeout_s: float | None = None, **sampling_kwargs: Any) -> AsyncStream:
        request = types.generate_request(prompt, None, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        return self._stream(request, timeout_s)

    def _stream(self, request: Any, timeout_s: float | None) -> AsyncStream:
        request = types.stream_request(request)

        def start(remaining_s: float | None) -> Any:
            return self._generation.GenerateStream(request, timeout=remaining_s,
                                                   metadata=self._conn.metadata)

        return AsyncStream(start, request.request_id, self._retry, self._deadline(timeout_s))

    @overload
    async def chat(self, messages: types.Messages, *, stream: Literal[False] = ...,
                   **kwargs: Any) -> types.Completion: ...

    @overload
    async def chat(self, messages: types.Messages, *, stream: Literal[True],
                   **kwargs: Any) -> AsyncStream: ...

    async def chat(self, messages: types.Messages, *, stream: bool = False,
                   sampling: SamplingParams | None = None, request_id: str | None = None,
                   priority: int = 0, timeout_s: float | None = None,
                   **sampling_kwargs: Any) -> types.Completion | AsyncStream:
        """stream=True: `async for delta in await client.chat(messages, stream=True)`."""
        request = types.generate_request(None, messages, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        if stream:
            return self._stream(request, timeout_s)
        return types.completion_from_proto(
            await self._unary("Generate", self._generation.Generate, request, timeout_s))

    async def tokenize(self, prompt: str | None = None, *,
                       messages: types.Messages | None = None,
                       timeout_s: float | None = None) -> types.Tokenized:
        request = types.tokenize_request(prompt, messages)
        return types.tokenized_from_proto(
            await self._unary("Tokenize", self._generation.Tokenize, request, timeout_s))

    async def embed(self, prompt: types.Prompt, *, request_id: str | None = None,
                    priority: int = 0, timeout_s: float | None = None) -> types.Embedding:
        """The prompt's embedding (the server's pooling, L2-normalized)."""
        return types.embedding_from_proto(await self._unary(
            "Embed", self._generation.Embed, types.embed_request(prompt, request_id, priority),
            timeout_s))

    async def abort(self, request_id: str, *, timeout_s: float | None = None) -> None:
        await self._unary("Abort", self._generation.Abort, types.abort_request(request_id),
                          timeout_s)

    async def model_info(self, *, timeout_s: float | None = None) -> types.ModelInfo:
        return types.model_info_from_proto(await self._unary(
            "GetModelInfo", self._models.GetModelInfo, types.model_info_request(), timeout_s))
