"""The gateway over the torch engine, through the official `openai` client and raw HTTP on a live server."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
import torch
from serving_fixtures import PROMPT, gateway_settings, read_events


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    from serving.auth import create_api_key
    from serving.server import GatewayServer

    tmp = tmp_path_factory.mktemp("gw")
    settings = gateway_settings(tmp, tiny_model_dir, batch_window_ms=20, max_request_bytes=4096,
                                max_prompt_tokens=200)
    alice, bob = create_api_key(settings, "alice"), create_api_key(settings, "bob")
    server = GatewayServer(settings).start()
    yield server, settings, alice, bob
    server.stop()


def client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def post(server, path, key, body, **kw):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, bytes | str):
        return httpx.post(server.url + path, content=body, headers={**headers, "content-type": "application/json"},
                          **kw)
    return httpx.post(server.url + path, json=body, headers=headers, **kw)


def test_openai_client_completes_chats_and_streams(live):
    server, settings, alice, _ = live
    c = client(server, alice)
    version = server.gateway.engine.versions()["production"]
    r = c.completions.create(model="tiny-coder", prompt=[PROMPT, "def g(x): return "], n=2, max_tokens=6,
                             seed=7, temperature=0.8, top_p=0.9, stop=["\n"], logprobs=0,
                             extra_body={"metadata": {"task_bucket": "affine"}})
    assert r.model == f"tiny-coder@{version}"
    assert [ch.index for ch in r.choices] == [0, 1, 2, 3]
    for ch in r.choices:
        assert ch.model_extra["completion_id"].startswith("cmpl-") and ch.model_extra["feedback_token"]
        assert len(ch.logprobs.token_logprobs) == len(ch.logprobs.tokens) >= 1
        assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)
        assert "\n" not in ch.text
    assert len({ch.model_extra["completion_id"] for ch in r.choices}) == 4
    # Same seed, same text: streamed and non-streamed paths agree.
    again = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=6, seed=11)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny-coder", prompt=PROMPT,
                                                                         max_tokens=6, seed=11, stream=True))
    assert streamed == again.choices[0].text

    chat = c.chat.completions.create(model="tiny-coder", messages=[{"role": "user", "content": PROMPT}],
                                     max_tokens=5, n=2, seed=3, logprobs=True)
    assert chat.model == f"tiny-coder@{version}" and len(chat.choices) == 2
    assert chat.choices[0].logprobs.content and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == sum(len(ch.logprobs.content) for ch in chat.choices)
    # The plain chat template: one user message is exactly the completion prompt.
    same = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=5, seed=3)
    single = c.chat.completions.create(model="tiny-coder", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=5, seed=3)
    assert single.choices[0].message.content == same.choices[0].text
    stream = c.chat.completions.create(model="tiny-coder", messages=[{"role": "user", "content": PROMPT}],
                                       max_tokens=5, seed=3, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == single.choices[0].message.content
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)

    models = c.models.list()
    assert {m.id for m in models.data} == {"tiny-coder", f"tiny-coder@{version}"}


def test_completion_events_carry_what_training_needs(live, tiny_model_dir):
    from policy.loading import load_policy
    from policy.logprobs import sequence_logprobs

    server, settings, alice, _ = live
    r = client(server, alice).completions.create(model="tiny-coder", prompt=PROMPT, n=3, max_tokens=8, seed=5,
                                                 temperature=0.7, logprobs=0,
                                                 extra_body={"metadata": {"task_bucket": "affine"}})
    assert server.gateway.emitter.wait_idle(10)
    ids = {ch.model_extra["completion_id"]: ch for ch in r.choices}
    events = {e.completion_id: e for e in read_events(settings.bus) if e.type == "completion"}
    alice_id = alice.split("-")[1]
    policy = load_policy(tiny_model_dir)
    for cid, ch in ids.items():
        ev = events[cid]
        assert ev.caller == alice_id and ev.version == server.gateway.engine.versions()["production"]
        assert ev.task_bucket == "affine" and ev.sampling.temperature == 0.7 and ev.sampling.seed == 5
        assert ev.prompt == PROMPT and ev.completion == ch.text and ev.latency_ms > 0
        assert ev.prompt_token_ids == policy.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        assert ev.logprobs == pytest.approx(ch.logprobs.token_logprobs)
        assert len(ev.sampling_logprobs) == len(ev.completion_token_ids) == len(ev.logprobs)
        # The recorded log-probs are the serving weights' own (temperature 1), per sampled token.
        ref = sequence_logprobs(policy.model, [ev.prompt_token_ids], [ev.completion_token_ids])
        assert torch.allclose(ref.logprobs[0], torch.tensor(ev.logprobs), atol=1e-4)


def test_concurrent_requests_are_batched(live):
    server, _, alice, _ = live
    engine = server.gateway.engine
    before = engine.batches_run
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futs = [pool.submit(post, server, "/v1/completions", alice,
                            {"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 4, "seed": i}, timeout=60)
                for i in range(8)]
        assert all(f.result().status_code == 200 for f in futs)
    # 8 requests in fewer generate calls than requests: they were merged (20 ms window).
    assert engine.batches_run - before < 8


def test_feedback_round_trip_and_refusals(live):
    server, settings, alice, bob = live
    r = client(server, alice).completions.create(model="tiny-coder", prompt=PROMPT, n=2, max_tokens=4)
    first, second = (ch.model_extra for ch in r.choices)
    body = {"completion_id": first["completion_id"], "feedback_token": first["feedback_token"], "signal": "edit",
            "kept_text": "x*8+7", "score": 0.5, "comment": "close"}
    rejected = server.gateway.metrics.feedback_rejected
    # Foreign: bob never received this completion (checked before alice uses it).
    foreign = post(server, "/v1/feedback", bob, body)
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "feedback_foreign"
    ok = post(server, "/v1/feedback", alice, body)
    assert ok.status_code == 200, ok.text
    assert ok.json()["version"] == server.gateway.engine.versions()["production"]
    replay = post(server, "/v1/feedback", alice, body)
    assert replay.status_code == 403 and replay.json()["error"]["code"] == "feedback_replayed"
    # Forged: a token for one completion used for another, a flipped MAC, garbage.
    for token, cid in [(first["feedback_token"], second["completion_id"]),
                       (second["feedback_token"][:-1] + ("0" if second["feedback_token"][-1] != "0" else "1"),
                        second["completion_id"]),
                       ("not-a-token", second["completion_id"])]:
        bad = post(server, "/v1/feedback", alice, {**body, "completion_id": cid, "feedback_token": token})
        assert bad.status_code == 403 and bad.json()["error"]["code"] == "feedback_forged"
    assert rejected.labels("forged")._value.get() >= 3
    assert rejected.labels("foreign")._value.get() >= 1 and rejected.labels("replayed")._value.get() >= 1
    metrics = httpx.get(server.url + "/metrics").text
    assert 'rtrl_feedback_rejected_total{reason="forged"}' in metrics
    assert post(server, "/v1/feedback", alice, {**body, "signal": "edit", "kept_text": None}).status_code == 422
    assert server.gateway.emitter.wait_idle(10)
    fb = [e for e in read_events(settings.bus) if e.type == "feedback" and e.completion_id == first["completion_id"]]
    assert len(fb) == 1 and fb[0].signal == "edit" and fb[0].kept_text == "x*8+7" and fb[0].caller == alice.split("-")[1]


def test_bad_input_gets_clear_4xx(live):
    server, settings, alice, _ = live
    good = {"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 2}
    cases = [
        (post(server, "/v1/completions", alice, b"{not json"), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "temperature": 9}), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "prompt": 5}), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "echo": True}), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "max_tokens": 100000}), 422, "max_tokens_too_large"),
        (post(server, "/v1/chat/completions", alice, {"model": "tiny-coder", "messages": []}), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "model": "gpt-4"}), 404, "model_not_found"),
        (post(server, "/v1/completions", alice, {**good, "model": "tiny-coder@nope"}), 404, "model_not_found"),
        (post(server, "/v1/completions", alice, {**good, "prompt": "x" * 5000}), 413, "request_too_large"),
        (post(server, "/v1/completions", alice, {**good, "prompt": "1 " * 300}), 413, "context_length_exceeded"),
        (post(server, "/v1/completions", alice, {**good, "prompt": [5, 99999]}), 422, "invalid_token_id"),
        (post(server, "/v1/completions", alice, {**good, "prompt": [[3, -1]]}), 422, "invalid_token_id"),
        (post(server, "/v1/completions", alice, {**good, "prompt": ""}), 422, "empty_prompt"),
        (post(server, "/v1/completions", alice, {**good, "stop": ["a", "b", "c", "d", "e"]}), 422, "invalid_body"),
        (post(server, "/v1/completions", alice, {**good, "n": 1000}), 422, "n_too_large"),
        (post(server, "/v1/chat/completions", alice, {"model": "tiny-coder", "messages": [{"role": "tool",
                                                                                           "content": "x"}]}),
         422, "invalid_body"),
        (post(server, "/v1/completions", alice, b"\xff\xfe"), 422, "invalid_body"),
        (post(server, "/v1/completions", None, good), 401, "invalid_api_key"),
        (post(server, "/v1/completions", "rtrl-000000000000-forged", good), 401, "invalid_api_key"),
    ]
    for resp, status, code in cases:
        assert resp.status_code == status, resp.text
        assert resp.json()["error"]["code"] == code
    detail = cases[1][0].json()["error"]
    assert detail["param"] == "temperature" and detail["details"]
    with pytest.raises(openai.NotFoundError):
        client(server, alice).completions.create(model="other", prompt="x", max_tokens=1)
    # A client that gives up mid-request leaves the server healthy.
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", alice, {**good, "max_tokens": 30}, timeout=0.001)
    assert post(server, "/v1/completions", alice, good).status_code == 200
    assert server.gateway.metrics.requests.labels("/v1/completions", "500")._value.get() == 0


def test_revoked_key_rate_limit_and_overload(live):
    from serving.auth import KeyStore, create_api_key
    from serving.ratelimit import RateLimiter

    server, settings, alice, _ = live
    gw = server.gateway
    good = {"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 2}
    carol = create_api_key(settings, "carol")
    assert post(server, "/v1/completions", carol, good).status_code == 200
    KeyStore(settings.serving.api_keys_file).revoke("carol")
    assert post(server, "/v1/completions", carol, good).status_code == 401

    limiter, gw.limiter = gw.limiter, RateLimiter(rate=0.2, burst=2)
    try:
        codes = [post(server, "/v1/completions", alice, good) for _ in range(3)]
        assert [c.status_code for c in codes] == [200, 200, 429]
        assert int(codes[-1].headers["Retry-After"]) >= 1
    finally:
        gw.limiter = limiter

    max_queue, gw.engine.max_queue = gw.engine.max_queue, 1
    try:
        busy = post(server, "/v1/completions", alice, {**good, "n": 2})
        assert busy.status_code == 503 and busy.headers["Retry-After"]
    finally:
        gw.engine.max_queue = max_queue
    timeout, settings.serving.request_timeout_s = settings.serving.request_timeout_s, 0.001
    try:
        slow = post(server, "/v1/completions", alice, {**good, "max_tokens": 40})
        assert slow.status_code == 503 and slow.json()["error"]["code"] == "timeout"
        assert slow.headers["Retry-After"]
    finally:
        settings.serving.request_timeout_s = timeout
    assert httpx.get(server.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(server.url + "/readyz").json()
    assert ready["status"] == "ready" and ready["versions"]["production"]
    assert json.loads(post(server, "/v1/completions", alice, good).text)["choices"]


def test_response_bodies_are_exactly_the_schemas_serialisation(live):
    """The completion routes build their JSON without pydantic: it must be what the schemas would send
    (same fields, order and values), with log-probs and several choices."""
    from serving.schemas import ChatResponse, CompletionResponse

    server, _, alice, _ = live
    r = post(server, "/v1/completions", alice, {"model": "tiny-coder", "prompt": [PROMPT, "x = "], "n": 2,
                                                "max_tokens": 4, "seed": 3, "logprobs": 1})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert CompletionResponse.model_validate_json(r.content).model_dump_json().encode() == r.content
    assert len(r.json()["choices"]) == 4 and r.json()["choices"][0]["logprobs"]["top_logprobs"]
    assert float(r.headers["x-rtrl-overhead-ms"]) >= 0 and float(r.headers["x-rtrl-generate-ms"]) > 0
    for logprobs in (True, False):
        r = post(server, "/v1/chat/completions", alice, {"model": "tiny-coder", "max_tokens": 4, "seed": 4,
                                                         "logprobs": logprobs,
                                                         "messages": [{"role": "user", "content": PROMPT}]})
        assert r.status_code == 200
        assert ChatResponse.model_validate_json(r.content).model_dump_json().encode() == r.content
        assert (r.json()["choices"][0]["logprobs"] is not None) == logprobs


def test_http_server_runs_on_the_engine_event_loop(live):
    """With the process engine, uvicorn serves on the engine's own loop: handlers submit batches and get
    their results on one thread (no thread hand-off per request, no second thread for the HTTP server)."""
    import asyncio
    import threading

    server = live[0]
    engine = server.gateway.engine
    assert not any(t.name == "gateway-uvicorn" for t in threading.enumerate())

    async def task_names() -> list[str]:
        return [t.get_coro().__qualname__ for t in asyncio.all_tasks()]

    names = asyncio.run_coroutine_threadsafe(task_names(), engine.loop).result(10)
    assert any(n.startswith("start_server.") for n in names), names
    assert post(server, "/v1/completions", live[2], {"model": "tiny-coder", "prompt": PROMPT,
                                                     "max_tokens": 2}).status_code == 200
