"""What the routers share about responses: the documented error and stream bodies, and how a finished
completion is sent (its headers, and its events recorded once the body is out)."""

from __future__ import annotations

from typing import Any

from fastapi import BackgroundTasks, Response

from serving.api.handler import Reply
from serving.schemas import ChatResponse, CompletionResponse, ErrorResponse

_ERROR_CODES = {401: "Missing or invalid API key.", 403: "Feedback refused.", 404: "Unknown model or version.",
                413: "Body or prompt too large.", 422: "Invalid JSON, schema or limit.",
                429: "Rate limited (see Retry-After).", 503: "Overloaded or unavailable (see Retry-After)."}
ERRORS: dict[int | str, dict[str, Any]] = {code: {"model": ErrorResponse, "description": text}
                                           for code, text in _ERROR_CODES.items()}
STREAM: dict[int | str, dict[str, Any]] = {200: {"content": {"text/event-stream": {
    "schema": {"type": "string", "description": "With `stream: true`: `data: <chunk JSON>` events, then "
               "`data: [DONE]`."}}}}}


def send(reply: Reply, response: Response, background: BackgroundTasks) -> CompletionResponse | ChatResponse:
    """The reply's body for FastAPI to serialise; its headers and its ``after`` go with the response."""
    response.headers.update(reply.headers)
    background.add_task(reply.after)
    return reply.body
