"""`pagedserve.Client`: the public API over a blocking gRPC channel.

    with Client("127.0.0.1:50051") as client:
        print(client.generate("The capital of France is", max_tokens=8, temperature=0).text)
        for delta in client.stream("Once upon a time", max_tokens=32):
            print(delta.text, end="")
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import grpc

from pagedserve.client import types
from pagedserve.client.channel import connection, sync_channel
from pagedserve.client.errors import client_error
from pagedserve.client.retry import DEFAULT_RETRY, Deadline, RetryPolicy, retry_delay_s
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.v1 import gateway_pb2_grpc


class Stream:
    """The deltas of one streamed request, as they come. Cancelling it (cancel, close, leaving
    its `with`) cancels the call, which aborts the request on the server."""

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

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> types.StreamDelta:
        while not self._is_cancelled:
            try:
                msg = next(self._call)
            except grpc.RpcError as e:
                if self._is_cancelled:
                    break
                error = client_error(e, self._num_attempts)
                delay_s = (None if self._has_output else
                           retry_delay_s(self._retry, error, self._deadline, "GenerateStream"))
                if delay_s is None:
                    raise error from None
                time.sleep(delay_s)
                self._num_attempts += 1
                self._call = self._start(self._deadline.remaining_s())
                continue
            self._has_output = True
            return types.stream_delta_from_proto(msg)
        raise StopIteration

    def cancel(self) -> None:
        self._is_cancelled = True
        self._call.cancel()

    close = cancel

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cancel()


class Client:
    """One channel to a gateway. `timeout_s` is each call's default deadline (a stream's covers
    the whole stream, retries included); `retry=None` never retries."""

    def __init__(self, address: str, *, api_key: str | None = None, tls: bool = False,
                 tls_ca: str | Path | None = None, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, timeout_s: float | None = None,
                 retry: RetryPolicy | None = DEFAULT_RETRY,
                 options: tuple[tuple[str, object], ...] = ()) -> None:
        self._conn = connection(address, api_key=api_key, tls=tls, tls_ca=tls_ca,
                                tls_cert=tls_cert, tls_key=tls_key, options=options)
        self._channel = sync_channel(self._conn)
        self._generation = gateway_pb2_grpc.GenerationServiceStub(self._channel)
        self._models = gateway_pb2_grpc.ModelServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._retry = retry

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _deadline(self, timeout_s: float | None) -> Deadline:
        return Deadline(self._timeout_s if timeout_s is None else timeout_s)

    def _unary(self, method: str, rpc: Callable[..., Any], request: Any,
               timeout_s: float | None) -> Any:
        deadline = self._deadline(timeout_s)
        num_attempts = 1
        while True:
            try:
                return rpc(request, timeout=deadline.remaining_s(), metadata=self._conn.metadata)
            except grpc.RpcError as e:
                error = client_error(e, num_attempts)
                delay_s = retry_delay_s(self._retry, error, deadline, method)
                if delay_s is None:
                    raise error from None
                time.sleep(delay_s)
                num_attempts += 1

    def generate(self, prompt: types.Prompt, *, sampling: SamplingParams | None = None,
                 request_id: str | None = None, priority: int = 0,
                 timeout_s: float | None = None, **sampling_kwargs: Any) -> types.Completion:
        """Every output, whole; sampling as a SamplingParams or its fields as keywords."""
        request = types.generate_request(prompt, None, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        return types.completion_from_proto(
            self._unary("Generate", self._generation.Generate, request, timeout_s))

    def stream(self, prompt: types.Prompt, *, sampling: SamplingParams | None = None,
               request_id: str | None = None, priority: int = 0,
               timeout_s: float | None = None, **sampling_kwargs: Any) -> Stream:
        request = types.generate_request(prompt, None, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        return self._stream(request, timeout_s)

    def _stream(self, request: Any, timeout_s: float | None) -> Stream:
        request = types.stream_request(request)

        def start(remaining_s: float | None) -> Any:
            return self._generation.GenerateStream(request, timeout=remaining_s,
                                                   metadata=self._conn.metadata)

        return Stream(start, request.request_id, self._retry, self._deadline(timeout_s))

    @overload
    def chat(self, messages: types.Messages, *, stream: Literal[False] = ...,
             **kwargs: Any) -> types.Completion: ...

    @overload
    def chat(self, messages: types.Messages, *, stream: Literal[True],
             **kwargs: Any) -> Stream: ...

    def chat(self, messages: types.Messages, *, stream: bool = False,
             sampling: SamplingParams | None = None, request_id: str | None = None,
             priority: int = 0, timeout_s: float | None = None,
             **sampling_kwargs: Any) -> types.Completion | Stream:
        """The messages rendered with the model's chat template; stream=True: a Stream."""
        request = types.generate_request(None, messages, types.sampling_params(
            sampling, sampling_kwargs), request_id, priority)
        if stream:
            return self._stream(request, timeout_s)
        return types.completion_from_proto(
            self._unary("Generate", self._generation.Generate, request, timeout_s))

    def tokenize(self, prompt: str | None = None, *, messages: types.Messages | None = None,
                 timeout_s: float | None = None) -> types.Tokenized:
        request = types.tokenize_request(prompt, messages)
        return types.tokenized_from_proto(
            self._unary("Tokenize", self._generation.Tokenize, request, timeout_s))

    def embed(self, prompt: types.Prompt, *, request_id: str | None = None, priority: int = 0,
              timeout_s: float | None = None) -> types.Embedding:
        """The prompt's embedding (the server's pooling, L2-normalized)."""
        return types.embedding_from_proto(self._unary(
            "Embed", self._generation.Embed, types.embed_request(prompt, request_id, priority),
            timeout_s))

    def abort(self, request_id: str, *, timeout_s: float | None = None) -> None:
        """Ends a live request (its stream ends with finish_reason ABORT); NOT_FOUND if it is
        unknown or already finished."""
        self._unary("Abort", self._generation.Abort, types.abort_request(request_id), timeout_s)

    def model_info(self, *, timeout_s: float | None = None) -> types.ModelInfo:
        return types.model_info_from_proto(self._unary(
            "GetModelInfo", self._models.GetModelInfo, types.model_info_request(), timeout_s))
