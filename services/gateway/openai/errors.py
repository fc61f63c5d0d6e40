"""OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`, and the one mapping from
the error taxonomy (and FastAPI's own failures) to HTTP status codes. `code` is the error's
reason, the same string gRPC clients read in ErrorInfo; `param` its first field, by the OpenAI
body's names; a status worth retrying carries a Retry-After header."""

from __future__ import annotations

import json
import logging
import math
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pagedserve.services.common.errors import (
    InvalidRequest,
    NotFound,
    Overloaded,
    PagedServeError,
    Reason,
    Unavailable,
)
from pagedserve.services.gateway.openai.protocol import ErrorInfo, ErrorResponse
from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

_TO_STATUS: tuple[tuple[type[BaseException], HTTPStatus, str], ...] = (
    (InvalidRequest, HTTPStatus.BAD_REQUEST, "invalid_request_error"),
    (NotFound, HTTPStatus.NOT_FOUND, "not_found_error"),
    (Overloaded, HTTPStatus.TOO_MANY_REQUESTS, "rate_limit_error"),
    (Unavailable, HTTPStatus.SERVICE_UNAVAILABLE, "service_unavailable_error"),
)
_TYPE_BY_STATUS = {
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "invalid_request_error",
    HTTPStatus.METHOD_NOT_ALLOWED: "invalid_request_error",
    **{status: kind for _, status, kind in _TO_STATUS},
}
_REASON_BY_STATUS = {
    HTTPStatus.UNAUTHORIZED: Reason.UNAUTHENTICATED,
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: Reason.LIMIT_EXCEEDED,
    HTTPStatus.NOT_FOUND: Reason.NOT_FOUND,
}
# the gateway's GenerateInput fields that an OpenAI body names otherwise
_PROMPT_FIELDS = ("text", "token_ids")


class ModelNotFound(NotFound):
    default_reason = Reason.MODEL_NOT_FOUND


def openai_param(path: str) -> str:
    """A GenerateInput field path as the OpenAI body names it: sampling parameters sit at the
    top level, and text or token ids are the `prompt`."""
    path = path.removeprefix("sampling.")
    for name in _PROMPT_FIELDS:
        if path == name or path.startswith(f"{name}["):
            return "prompt" + path[len(name):]
    return path


def error_body(status: HTTPStatus, message: str, param: str | None = None,
               code: str | None = None) -> ErrorResponse:
    kind = _TYPE_BY_STATUS.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param,
                                         code=None if code is None else str(code)))


def error_response(status: HTTPStatus, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code).model_dump(), status_code=status)


def status_of(exc: BaseException) -> tuple[HTTPStatus, str]:
    for error_type, status, _ in _TO_STATUS:
        if isinstance(exc, error_type):
            return status, str(exc)
    logger.error("unexpected error in an HTTP handler", exc_info=exc)
    if isinstance(exc, PagedServeError):  # its message is written for clients
        return HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc}"
    return HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (its cause is in the gateway's log)"


def error_for(exc: BaseException) -> ErrorResponse:
    status, message = status_of(exc)
    if not isinstance(exc, PagedServeError):
        return error_body(status, message, code=Reason.INTERNAL)
    param = openai_param(exc.violations[0].field) if exc.violations else None
    return error_body(status, message, param, exc.reason)


def response_for(exc: BaseException) -> JSONResponse:
    response = JSONResponse(error_for(exc).model_dump(), status_code=status_of(exc)[0])
    retry_after_s = exc.retry_after_s if isinstance(exc, (Overloaded, Unavailable)) else None
    if retry_after_s is not None:
        response.headers["Retry-After"] = str(math.ceil(retry_after_s))
    return response


def _param_of(loc: tuple[int | str, ...]) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role'; pydantic's union branch tags
    ('str', 'list[str]', ...) are not fields and end the path."""
    path = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif "[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"):
            break
        else:
            path += f".{part}" if path else part
    return path or "body"


def _validation_message(exc: RequestValidationError) -> tuple[str, str]:
    first = exc.errors()[0]
    param = _param_of(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return "body", f"the body must be valid JSON: {first.get('msg', '')}"
    value = first.get("input")
    shown = json.dumps(value, default=str)[:80] if first.get("type") != "missing" else "nothing"
    return param, f"{param}: {first.get('msg', 'invalid value')}, got {shown}"


def install_error_handlers(app: FastAPI) -> None:
    """Every failure answers in OpenAI's shape: bad bodies 400 (not FastAPI's 422)."""

    async def on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        param, message = _validation_message(exc)
        return error_response(HTTPStatus.BAD_REQUEST, message, param, Reason.INVALID_BODY)

    async def on_http(request: Request, exc: HTTPException) -> JSONResponse:
        status = HTTPStatus(exc.status_code)
        message = exc.detail if isinstance(exc.detail, str) else status.phrase
        if status == HTTPStatus.NOT_FOUND:
            message = f"no route {request.method} {request.url.path}"
        fallback = Reason.INTERNAL if status >= 500 else Reason.INVALID_REQUEST
        return error_response(status, message, code=_REASON_BY_STATUS.get(status, fallback))

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(PagedServeError, on_error)
    app.add_exception_handler(Exception, on_error)
