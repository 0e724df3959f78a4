"""``POST /v1/completions`` (OpenAI's completions API, with ``stream`` as server-sent events)."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Response
from fastapi.responses import StreamingResponse

from serving.api.deps import BoundedRoute, Caller, Handler, Started
from serving.api.responses import ERRORS, STREAM, send
from serving.schemas import CompletionRequest, CompletionResponse

router = APIRouter(route_class=BoundedRoute, tags=["completions"])


@router.post("/v1/completions", response_model=CompletionResponse, responses={**STREAM, **ERRORS},
             summary="Complete one or more prompts")
async def create_completion(body: CompletionRequest, key_id: Caller, handler: Handler, t_start: Started,
                            response: Response, background: BackgroundTasks):
    """Each choice carries ``completion_id`` and ``feedback_token`` (for ``POST /v1/feedback``); the
    response's ``model`` names the version that served it (``name@version``)."""
    if body.stream:
        return StreamingResponse(await handler.stream(key_id, body, t_start), media_type="text/event-stream")
    return send(await handler.complete(key_id, body, t_start), response, background)
