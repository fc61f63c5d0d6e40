"""The FastAPI app of the OpenAI-compatible door. `build_app` makes it; other features add their
routes to the app it returns (they stay behind the API key unless listed in OPEN_PATHS)."""

from __future__ import annotations

import importlib.metadata
import inspect

from fastapi import FastAPI, Request
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.gateway.config import HttpConfig
from pagedserve.services.gateway.openai.chat import create_chat_completion
from pagedserve.services.gateway.openai.completions import create_completion
from pagedserve.services.gateway.openai.convert import chat_messages, chat_options
from pagedserve.services.gateway.openai.embeddings import (
    EmbeddingRequest,
    EmbeddingResponse,
    create_embedding,
)
from pagedserve.services.gateway.openai.errors import install_error_handlers
from pagedserve.services.gateway.openai.http_span import HttpTracing
from pagedserve.services.gateway.openai.middleware import ApiKeyGuard, ArrivalTime, BodyLimit
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    VersionResponse,
)
from pagedserve.services.gateway.openai.serving import OpenAIServing
from pagedserve.services.gateway.validation import GenerateInput
from pagedserve.services.rpc.tracing import is_tracing_on
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response

OPEN_PATHS = ("/health", "/metrics")
# FastAPI's own request spans (0.165 on) would be a second SERVER span beside HttpTracing's
_NO_FASTAPI_TRACING = ({"telemetry": {"tracing": False}}
                       if "telemetry" in inspect.signature(FastAPI).parameters else {})


def build_app(serving: OpenAIServing, api_key: str = "",
              max_request_body_bytes: int | None = None, admin_token: str = "",
              registry: CollectorRegistry | None = None) -> FastAPI:
    """`registry`: the gateway's metrics, served on /metrics as vLLM's API server does."""
    if max_request_body_bytes is None:
        max_request_body_bytes = HttpConfig().max_request_body_bytes
    app = FastAPI(title="pagedserve OpenAI-compatible API", docs_url=None, redoc_url=None,
                  openapi_url=None, **_NO_FASTAPI_TRACING)
    install_error_handlers(app)
    frontend = serving.frontend

    @app.get("/health")
    async def health() -> Response:
        """200 while a scheduler replica serves and this gateway takes requests, else 503."""
        is_ready = not frontend.admission.is_draining and bool(frontend.replicas.serving())
        return Response(status_code=200 if is_ready else 503)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=_package_version())

    if registry is not None:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=serving.model_name, root=frontend.info.model,
                                         max_model_len=frontend.info.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(serving, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(serving, body, request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
        return await create_embedding(serving, body, request)

    _add_tokenize_routes(app, serving)

    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes)
    if api_key:
        app.add_middleware(ApiKeyGuard, api_key=api_key, open_paths=OPEN_PATHS,
                           admin_token=admin_token)
    if is_tracing_on():
        app.add_middleware(HttpTracing, model=serving.model_name)
    app.add_middleware(ArrivalTime)  # the outermost
    return app


def _add_tokenize_routes(app: FastAPI, serving: OpenAIServing) -> None:
    frontend = serving.frontend

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        """A generation prompt's limits, admission and the tokenize threads, either way."""
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("prompt or messages must be set, not both nor neither",
                                 reason=Reason.PROMPT_MISSING, field="prompt")
        if body.messages is not None:
            token_ids = await frontend.tokenize(
                GenerateInput(messages=chat_messages(body.messages), chat=chat_options(body)))
        else:
            token_ids = await frontend.tokenize(GenerateInput(
                text=body.prompt, add_special_tokens=body.add_special_tokens))
        return TokenizeResponse(count=len(token_ids), max_model_len=frontend.info.max_model_len,
                                tokens=token_ids)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        return DetokenizeResponse(prompt=await frontend.detokenize(body.tokens, "tokens"))


def _package_version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"
