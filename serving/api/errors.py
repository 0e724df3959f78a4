"""The error contract: every refusal is OpenAI's ``{"error": {...}}`` body, counted by route and status.

401 bad key, 403 refused feedback token, 404 unknown model, 413 body or prompt too large, 422 invalid
JSON or schema (with details), 429 rate limited and 503 overloaded (both with ``Retry-After``). A 500
means a bug in the gateway, never a client mistake.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from policy.sampling import ContextTooLong
from serving.engines.base import EngineClosed
from serving.schemas import ErrorDetail, ErrorResponse

log = logging.getLogger("serving.api")


class APIError(HTTPException):
    """A refusal with OpenAI's error fields. An ``HTTPException``, so that FastAPI passes it through from
    anywhere in a request (body reading included) to :func:`install_error_handlers`."""

    def __init__(self, status: int, message: str, type_: str, code: str | None = None,
                 retry_after: float | None = None, details: list | None = None, param: str | None = None):
        super().__init__(status_code=status, detail=message)
        self.status, self.message, self.type, self.code = status, message, type_, code
        self.retry_after, self.details, self.param = retry_after, details, param

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, code=self.code,
                                               param=self.param, details=self.details))

    def response(self) -> JSONResponse:
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, int(self.retry_after + 0.999)))
        return JSONResponse(self.body().model_dump(exclude_none=True), status_code=self.status, headers=headers)


def invalid_body(errors: list[dict[str, Any]]) -> APIError:
    """422 for a body that is not JSON or does not fit the request schema; ``param`` names the first
    offending field (as the request model spells it, without FastAPI's leading ``body``)."""
    details = []
    for e in errors:
        loc = list(e.get("loc", ()))
        if loc[:1] == ["body"]:
            loc = loc[1:]
        if e.get("type") == "json_invalid":
            loc = []  # FastAPI puts the character offset there, not a field
        msg = e.get("msg", "invalid body")
        if e.get("type") == "json_invalid" and "error" in e.get("ctx", {}):
            msg = f"invalid JSON: {e['ctx']['error']}"
        details.append({"loc": loc, "msg": msg, "type": e.get("type", "invalid")})
    first = details[0] if details else {"loc": [], "msg": "invalid body"}
    where = ".".join(str(p) for p in first["loc"]) or "body"
    return APIError(422, f"{where}: {first['msg']}", "invalid_request_error", "invalid_body", details=details,
                    param=where)


def engine_error(err: BaseException) -> APIError:
    """The HTTP answer to an engine failure; anything unexpected is re-raised (a bug: answered 500)."""
    if isinstance(err, TimeoutError):
        return APIError(503, "timed out waiting for the engine", "server_overloaded", "timeout", retry_after=5)
    if isinstance(err, EngineClosed):
        return APIError(503, str(err), "server_unavailable", "unavailable", retry_after=5)
    if isinstance(err, ContextTooLong):
        return APIError(413, str(err), "invalid_request_error", "context_length_exceeded")
    raise err


def route_label(request: Request) -> str:
    """The matched route's path template (bounded label values), else the raw path."""
    route = request.scope.get("route")
    return getattr(route, "path", None) or request.url.path


def install_error_handlers(app: FastAPI, metrics) -> None:
    async def api_error(request: Request, err: APIError) -> JSONResponse:
        metrics.requests.labels(route_label(request), str(err.status)).inc()
        return err.response()

    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        return await api_error(request, invalid_body(list(err.errors())))

    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        # Starlette's own refusals (unknown path, wrong method, unreadable body) in the same shape.
        return await api_error(request, APIError(err.status_code, str(err.detail), "invalid_request_error"))

    async def unexpected(request: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        metrics.requests.labels(route_label(request), "500").inc()
        return APIError(500, "internal error", "server_error").response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)
