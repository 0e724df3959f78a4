"""Run the gateway: :class:`GatewayServer` (uvicorn in a background thread, for tests, simulated users
and the demo) and :func:`serve_forever` (the `rtrl serve` command)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import signal
import socket
import threading
import time
from concurrent.futures import Future

import uvicorn

from serving.app import create_app
from serving.gateway import Gateway

log = logging.getLogger("serving.server")


def uvicorn_options() -> dict:
    """httptools and uvloop when installed (they are dependencies): the C HTTP parser and event loop cut
    per-request server time; uvicorn's pure-Python h11 / asyncio remain the fallback."""

    opts = {}
    if importlib.util.find_spec("httptools") is not None:
        opts["http"] = "httptools"
    if importlib.util.find_spec("uvloop") is not None:
        opts["loop"] = "uvloop"
    return opts


def _free_port(host: str) -> int:
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
        self._done: Future | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 120.0) -> GatewayServer:
        if not self.gateway.started:
            self.gateway.start()
        app = create_app(self.settings, self.gateway)
        config = uvicorn.Config(app, host=self.host, port=self.port, log_level="warning", access_log=False,
                                lifespan="on", timeout_graceful_shutdown=10, **uvicorn_options())
        self._server = uvicorn.Server(config)
        self._done = start_server(self._server, getattr(self.gateway.engine, "loop", None))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._done.done():
                self.gateway.stop()
                raise RuntimeError(f"the gateway server did not start on {self.url}") from self._done.exception()
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the gateway server did not start on {self.url} within {timeout_s} s")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._done is not None:
            with contextlib.suppress(Exception):  # a server that failed has nothing left to stop
                self._done.result(timeout=30)
        self.gateway.stop()

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(server, loop: asyncio.AbstractEventLoop | None = None) -> Future:
    """Run ``server`` (a ``uvicorn.Server``) in the background; the future resolves when it has stopped.

    The gateway passes the engine's event loop when it has one
    (:class:`serving.engines.process.ProcessEngine`): the server then runs on that loop, so
    request handlers hand batches to the engine process and receive their results on one thread, with
    no hand-off between threads (the engine's docstring says why that matters). Without a loop (other
    engines run their own batcher thread) the server gets a thread and a loop of its own, as
    ``uvicorn.run`` would."""
    if loop is not None:
        async def serve() -> None:
            try:
                await server.serve()
            except SystemExit as err:  # uvicorn exits on a failed start-up; here that would stop the engine's loop
                raise RuntimeError(f"the HTTP server failed to start (exit status {err.code})") from None

        return asyncio.run_coroutine_threadsafe(serve(), loop)
    done: Future = Future()

    def run() -> None:
        try:
            server.run()
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits for the server
            done.set_exception(err)

    threading.Thread(target=run, name="gateway-uvicorn", daemon=True).start()
    return done


def serve_forever(settings) -> None:
    """Blocking server for `rtrl serve` (Ctrl-C / SIGTERM stops it, flushing events)."""

    s = settings.serving
    gateway = Gateway(settings)
    gateway.start()
    app = create_app(settings, gateway)
    port = s.port or _free_port(s.host)
    log.warning("rtrl gateway on http://%s:%d (engine %s, serving %s)", s.host, port, s.engine,
                gateway.engine.versions())
    print(f"rtrl gateway listening on http://{s.host}:{port}", flush=True)
    config = uvicorn.Config(app, host=s.host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=10, **uvicorn_options())
    server = uvicorn.Server(config)

    def shutdown(signum, frame) -> None:  # uvicorn listens for signals only in the main thread's loop
        server.should_exit = True

    previous = {sig: signal.signal(sig, shutdown) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        done = start_server(server, getattr(gateway.engine, "loop", None))
        while True:  # a timed wait, so that the main thread runs the signal handlers
            try:
                done.result(timeout=0.5)
                break
            except TimeoutError:
                continue
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.should_exit = True
        gateway.stop()
