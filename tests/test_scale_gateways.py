"""Gateway replicas: two gateways (own ports, own engines) serving the registry's production version,
one key file, one feedback secret, one bus. A feedback token signed by one is accepted by the other;
under traffic spread over both, a newly promoted version reaches both with no failed request.

Each gateway generates in its own thread here (``serving.engine_process = false``): the replicas'
behaviour under test (registry polling, swaps, tokens, events) is the same with the child-process
engine, which would add two model-loading processes to the test."""

from __future__ import annotations

import itertools
import threading
import time

import httpx
from serving_fixtures import PROMPT, make_versions, read_events


def _wait_for(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_replicas_accept_each_others_tokens_and_swap_together_without_failures(tmp_path, tiny_model_dir):
    from policy.registry import Registry
    from rtrl.config import load_settings
    from serving.auth import create_api_key
    from serving.server import GatewayServer

    v0, v1 = make_versions(tiny_model_dir, tmp_path / "versions", 2)
    settings = load_settings(
        model={"dir": str(tiny_model_dir), "threads": 1},
        registry={"url": str(tmp_path / "registry"), "cache_dir": str(tmp_path / "cache")},
        serving={"source": "registry", "poll_interval_s": 0.1, "engine_process": False, "port": 0,
                 "api_keys_file": str(tmp_path / "keys.json"), "spill_dir": str(tmp_path / "spill"),
                 "feedback_secret": "shared-by-every-replica"},
        bus={"embedded_path": str(tmp_path / "bus" / "events.db")})
    registry = Registry.from_settings(settings.registry)
    first = registry.publish(v0).id
    registry.promote(first, "production")
    key = create_api_key(settings, "alice")
    headers = {"Authorization": f"Bearer {key}"}
    replicas = []
    for name in ("a", "b"):  # everything shared but the local spill directory
        replica = settings.model_copy(deep=True)
        replica.serving.spill_dir = str(tmp_path / f"spill-{name}")
        replicas.append(replica)
    servers = [GatewayServer(replicas[0]).start(), GatewayServer(replicas[1]).start()]
    a, b = servers
    try:
        assert a.url != b.url
        for s in servers:
            assert s.gateway.engine.versions()["production"] == first

        # A token signed by replica A is accepted by replica B (and refused there once spent).
        done = httpx.post(a.url + "/v1/completions", headers=headers, timeout=30,
                          json={"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 3}).json()
        choice = done["choices"][0]
        body = {"completion_id": choice["completion_id"], "feedback_token": choice["feedback_token"],
                "signal": "accept"}
        ok = httpx.post(b.url + "/v1/feedback", headers=headers, json=body, timeout=30)
        assert ok.status_code == 200, ok.text
        assert ok.json()["version"] == first
        again = httpx.post(b.url + "/v1/feedback", headers=headers, json=body, timeout=30)
        assert again.status_code == 403 and again.json()["error"]["code"] == "feedback_replayed"
        forged = httpx.post(b.url + "/v1/feedback", headers=headers, timeout=30,
                            json={**body, "feedback_token": choice["feedback_token"][:-2] + "00"})
        assert forged.status_code == 403

        # Traffic over both replicas (one client list, round robin) while production moves.
        urls = itertools.cycle([a.url, b.url])
        lock = threading.Lock()
        results: list[tuple[int, str, str]] = []
        stop = threading.Event()

        def load(worker: int) -> None:
            with httpx.Client(headers=headers, timeout=60) as http:
                for i in itertools.count():
                    if stop.is_set():
                        return
                    with lock:
                        url = next(urls)
                    try:
                        r = http.post(url + "/v1/completions", json={"model": "tiny-coder", "prompt": PROMPT,
                                                                     "max_tokens": 2, "seed": worker * 1000 + i})
                        item = (r.status_code, url, r.json().get("model", "") if r.status_code == 200 else r.text)
                    except httpx.HTTPError as err:
                        item = (-1, url, str(err))
                    with lock:
                        results.append(item)

        threads = [threading.Thread(target=load, args=(w,)) for w in range(3)]
        for t in threads:
            t.start()
        try:
            _wait_for(lambda: len(results) >= 6)
            second = registry.publish(v1, parent=first).id
            registry.promote(second, "production")
            for s in servers:
                _wait_for(lambda s=s: s.gateway.engine.versions()["production"] == second)
            n = len(results)
            _wait_for(lambda: len(results) >= n + 6)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        failed = [r for r in results if r[0] != 200]
        assert not failed, failed[:3]
        for s in servers:
            served = {model for status, url, model in results if url == s.url}
            assert served == {f"tiny-coder@{first}", f"tiny-coder@{second}"}, served
            assert len(s.gateway.engine.swap_pauses_s) == 1
        for s in servers:
            assert s.gateway.emitter.wait_idle(20)
    finally:
        for s in servers:
            s.stop()
    events = read_events(settings.bus)
    feedback = [e for e in events if e.type == "feedback"]
    assert [(e.completion_id, e.version) for e in feedback] == [(choice["completion_id"], first)]
    assert sum(e.type == "completion" for e in events) == 1 + len(results)
