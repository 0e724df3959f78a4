"""``POST /v1/feedback``: what the user did with a completion, signed by the completion's token."""

from __future__ import annotations

from fastapi import APIRouter

from serving.api.deps import BoundedRoute, Caller, Handler
from serving.api.responses import ERRORS
from serving.schemas import FeedbackRequest, FeedbackResponse

router = APIRouter(route_class=BoundedRoute, tags=["feedback"])


@router.post("/v1/feedback", response_model=FeedbackResponse, responses=ERRORS, summary="Record feedback")
async def create_feedback(body: FeedbackRequest, key_id: Caller, handler: Handler) -> FeedbackResponse:
    """Refused with 403 when the token is forged, expired, already used, or was issued to another key."""
    return handler.feedback(key_id, body)
