"""The gateway's engine process killed (SIGKILL) with requests in flight: those requests get a clear 503,
the engine process is restarted with the versions it served, and new requests succeed."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from serving_fixtures import PROMPT, gateway_settings

from policy.sampling import SamplingParams


def test_killed_engine_process_fails_in_flight_requests_with_503_and_restarts(tmp_path, tiny_model_dir):
    from serving.auth import create_api_key
    from serving.engines.base import EngineClosed
    from serving.server import GatewayServer

    settings = gateway_settings(tmp_path, tiny_model_dir, batch_window_ms=0)
    key = create_api_key(settings, "restart-test")
    with GatewayServer(settings) as server:
        engine = server.gateway.engine
        client = openai.OpenAI(api_key=key, base_url=server.url + "/v1", max_retries=0, timeout=60)
        first = client.completions.create(model=settings.model.name, prompt=PROMPT, max_tokens=4)
        version = first.model.split("@", 1)[1]
        old_pid = engine._proc.pid
        # Requests in flight for sure: the child is stopped with a batch on its pipe, three more wait.
        os.kill(old_pid, signal.SIGSTOP)
        filler = engine.submit([[1, 2]], [SamplingParams(max_new_tokens=1)])
        with ThreadPoolExecutor(3) as pool:
            waiting = [pool.submit(client.completions.create, model=settings.model.name, prompt=PROMPT,
                                   max_tokens=4) for _ in range(3)]
            deadline = time.monotonic() + 30
            while engine.queue_depth < 3:
                assert time.monotonic() < deadline, "the requests did not reach the engine queue"
                time.sleep(0.005)
            t_kill = time.monotonic()
            os.kill(old_pid, signal.SIGKILL)
            errors = []
            for fut in waiting:
                with pytest.raises(openai.APIStatusError) as info:
                    fut.result(60)
                errors.append(info.value)
        with pytest.raises(EngineClosed, match="died"):
            filler.result(30)
        for err in errors:
            assert err.status_code == 503 and "engine process died" in str(err) and "restarting" in str(err)
            assert err.response.headers.get("retry-after")
        # Not ready until the new process serves; then ready again, on the same version.
        http = httpx.Client(base_url=server.url, timeout=10)
        saw_not_ready = http.get("/readyz").status_code == 503
        deadline = time.monotonic() + 120
        while http.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the engine process was not restarted"
            time.sleep(0.1)
        recovered_s = time.monotonic() - t_kill
        again = client.completions.create(model=settings.model.name, prompt=PROMPT, max_tokens=4)
        assert again.model.endswith("@" + version) and again.choices[0].model_extra["completion_id"]
        assert engine._proc.pid != old_pid and engine.restarts == 1
        metrics = http.get("/metrics").text
        http.close()
        assert "rtrl_engine_restarts_total 1.0" in metrics and "rtrl_engine_up 1.0" in metrics
        assert saw_not_ready or engine.last_restart_s < recovered_s
