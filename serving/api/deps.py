"""FastAPI dependencies shared by the routers: the handler, the caller (API key, then rate limit), and
the route class that bounds request bodies and marks when the gateway's time on a request starts."""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from serving.api.errors import APIError
from serving.api.handler import GatewayHandler

START_KEY = "rtrl.t_start"


def get_handler(request: Request) -> GatewayHandler:
    return request.app.state.handler


Handler = Annotated[GatewayHandler, Depends(get_handler)]
bearer = HTTPBearer(auto_error=False, description="An API key from `rtrl keys add`.")


def api_key(handler: Handler, cred: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)]) -> str:
    """The caller's key id (401 without a valid key)."""
    return handler.authenticate(cred.credentials if cred else None)


def rate_limited(handler: Handler, key_id: Annotated[str, Depends(api_key)]) -> str:
    """The caller's key id once its rate limit admits the request (429 otherwise)."""
    return handler.admit(key_id)


Caller = Annotated[str, Depends(rate_limited)]


def started(request: Request) -> float:
    """When :class:`BoundedRoute` took the request (so body parsing counts as the gateway's time)."""
    return request.scope.get(START_KEY) or time.perf_counter()


Started = Annotated[float, Depends(started)]


class BoundedBodyRequest(Request):
    """A request whose body is refused with 413 past ``serving.max_request_bytes``, while it is read:
    a declared length over the limit is refused before reading anything."""

    async def body(self) -> bytes:
        if not hasattr(self, "_body"):
            limit = self.app.state.handler.serving.max_request_bytes
            declared = self.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise APIError(413, f"request body of {declared} bytes exceeds the {limit}-byte limit",
                               "invalid_request_error", "request_too_large")
            chunks, size = [], 0
            async for chunk in self.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the {limit}-byte limit", "invalid_request_error",
                                   "request_too_large")
                chunks.append(chunk)
            self._body = b"".join(chunks)
        return self._body


class BoundedRoute(APIRoute):
    """The routers' route class: bodies are read through :class:`BoundedBodyRequest`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            request.scope[START_KEY] = time.perf_counter()
            return await handle(BoundedBodyRequest(request.scope, request.receive))

        return bounded
