"""Run the gateway: :class:`GatewayServer` (uvicorn in a background thread, for tests, simulated users
and the demo) and :func:`serve_forever` (the `rtrl serve` command)."""

from __future__ import annotations

import logging
import threading
import time

from serving.app import create_app
from serving.gateway import Gateway

log = logging.getLogger("serving.server")


def uvicorn_options() -> dict:
    """httptools and uvloop when installed (they are dependencies): the C HTTP parser and event loop cut
    per-request server time; uvicorn's pure-Python h11 / asyncio remain the fallback."""
    import importlib.util

    opts = {}
    if importlib.util.find_spec("httptools") is not None:
        opts["http"] = "httptools"
    if importlib.util.find_spec("uvloop") is not None:
        opts["loop"] = "uvloop"
    return opts


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class GatewayServer:
    """``GatewayServer(settings).start()`` loads the production version, serves on ``.url``; ``.stop()``."""

    def __init__(self, settings, *, port: int | None = None, gateway: Gateway | None = None) -> None:
        self.settings = settings
        self.host = settings.serving.host
        self.port = port if port is not None else _free_port(self.host)
        self.gateway = gateway or Gateway(settings)
        self._server = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> GatewayServer:
        import uvicorn

        if not self.gateway.started:
            self.gateway.start()
        app = create_app(self.settings, self.gateway)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=10, **uvicorn_options())
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="gateway-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                self.gateway.stop()
                raise RuntimeError(f"the gateway server did not start on {self.url}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway server did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.gateway.stop()

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(settings) -> None:
    """Blocking server for `rtrl serve` (Ctrl-C / SIGTERM stops it, flushing events)."""
    import uvicorn

    s = settings.serving
    gateway = Gateway(settings)
    gateway.start()
    app = create_app(settings, gateway)
    port = s.port or _free_port(s.host)
    log.warning("rtrl gateway on http://%s:%d (engine %s, serving %s)", s.host, port, s.engine,
                gateway.engine.versions())
    print(f"rtrl gateway listening on http://{s.host}:{port}", flush=True)
    try:
        uvicorn.run(app, host=s.host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=10, **uvicorn_options())
    finally:
        gateway.stop()
