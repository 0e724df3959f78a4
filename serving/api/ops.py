"""The model list and the operations endpoints: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from serving.api.deps import BoundedRoute, Caller, Handler
from serving.api.responses import ERRORS
from serving.schemas import Health, ModelList, Readiness

router = APIRouter(route_class=BoundedRoute)


@router.get("/v1/models", response_model=ModelList, responses=ERRORS, tags=["models"], summary="List models")
async def list_models(key_id: Caller, handler: Handler) -> ModelList:
    """The model name (routed by the canary split) and each live version as ``name@version``."""
    return handler.models()


@router.get("/healthz", response_model=Health, tags=["operations"], summary="Liveness")
async def healthz() -> Health:
    return Health()


@router.get("/readyz", response_model=Readiness, tags=["operations"], summary="Readiness",
            responses={503: {"model": Readiness, "description": "No version loaded yet, or stopping."}})
async def readyz(handler: Handler, response: Response) -> Readiness:
    ready = handler.readiness()
    if ready.status != "ready":
        response.status_code = 503
    return ready


@router.get("/metrics", response_class=PlainTextResponse, tags=["operations"], summary="Prometheus metrics")
async def metrics(handler: Handler) -> Response:
    page, content_type = handler.prometheus()
    return Response(page, media_type=content_type)
