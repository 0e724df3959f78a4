"""``POST /v1/chat/completions`` (OpenAI's chat completions API, with ``stream`` as server-sent events)."""

from __future__ import annotations

from fastapi import APIRouter, BackgroundTasks, Response
from fastapi.responses import StreamingResponse

from serving.api.deps import BoundedRoute, Caller, Handler, Started
from serving.api.responses import ERRORS, STREAM, send
from serving.schemas import ChatRequest, ChatResponse

router = APIRouter(route_class=BoundedRoute, tags=["chat"])


@router.post("/v1/chat/completions", response_model=ChatResponse, responses={**STREAM, **ERRORS},
             summary="Answer a conversation")
async def create_chat_completion(body: ChatRequest, key_id: Caller, handler: Handler, t_start: Started,
                                 response: Response, background: BackgroundTasks):
    """The messages are rendered with the model's chat template (or joined by newlines when it has
    none); choices carry ``completion_id`` and ``feedback_token`` as in ``/v1/completions``."""
    if body.stream:
        return StreamingResponse(await handler.stream(key_id, body, t_start), media_type="text/event-stream")
    return send(await handler.chat(key_id, body, t_start), response, background)
