"""The HTTP app: OpenAI-compatible routes (:mod:`serving.api`) over a :class:`serving.gateway.Gateway`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from serving.api import chat, completions, feedback, ops
from serving.api.errors import install_error_handlers
from serving.api.handler import GatewayHandler
from serving.gateway import Gateway


def create_app(settings, gateway: Gateway | None = None) -> FastAPI:
    """The FastAPI app. Without ``gateway`` one is built from settings and started with the app."""
    own = gateway is None
    gw = gateway or Gateway(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if own:
            await asyncio.to_thread(gw.start)
        yield
        if own:
            await asyncio.to_thread(gw.stop)

    app = FastAPI(title="rtrl gateway", version="1", lifespan=lifespan,
                  description="OpenAI-compatible completions whose every choice can be answered with feedback "
                              "(`completion_id`, `feedback_token`); what is served and the feedback become "
                              "events for online training.")
    app.state.gateway = gw
    app.state.handler = GatewayHandler(gw)
    install_error_handlers(app, gw.metrics)
    for router in (completions.router, chat.router, feedback.router, ops.router):
        app.include_router(router)
    return app
