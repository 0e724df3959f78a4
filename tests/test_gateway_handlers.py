"""The gateway's handler on its own (no HTTP server, no FastAPI): it authenticates, plans, generates,
signs, builds the response models and records events; and the app's OpenAPI document describes every
route with its request and response schemas."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from serving_fixtures import PROMPT, gateway_settings, read_events

from serving.api.errors import APIError
from serving.api.handler import GatewayHandler
from serving.app import create_app
from serving.auth import create_api_key
from serving.gateway import Gateway
from serving.schemas import (
    ChatRequest,
    ChatResponse,
    CompletionRequest,
    CompletionResponse,
    FeedbackRequest,
    FeedbackResponse,
)


@pytest.fixture(scope="module")
def started(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("handler")
    settings = gateway_settings(tmp, tiny_model_dir, engine_process=False, max_prompt_tokens=200)
    alice, bob = create_api_key(settings, "alice"), create_api_key(settings, "bob")
    gw = Gateway(settings)
    gw.start()
    yield GatewayHandler(gw), settings, alice, bob
    gw.stop()


def completion(**kw) -> CompletionRequest:
    return CompletionRequest(**{"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 4, **kw})


def test_completion_is_signed_and_recorded_once_after_runs(started):
    h, settings, alice, bob = started
    key_id = h.admit(h.authenticate(alice))
    assert key_id == alice.split("-")[1]
    reply = asyncio.run(h.complete(key_id, completion(n=2, seed=5, logprobs=0,
                                                      metadata={"task_bucket": "affine"})))
    body = reply.body
    version = h.gw.engine.versions()["production"]
    assert isinstance(body, CompletionResponse) and body.model == f"tiny-coder@{version}"
    assert [c.index for c in body.choices] == [0, 1]
    assert all(c.completion_id.startswith("cmpl-") and c.feedback_token for c in body.choices)
    assert all(len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) >= 1 for c in body.choices)
    assert body.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in body.choices)
    assert float(reply.headers["x-rtrl-overhead-ms"]) >= 0 and float(reply.headers["x-rtrl-generate-ms"]) > 0
    # The events are announced before the response goes out and emitted by ``after``.
    assert h.gw.emitter.pending >= 2 and not h.gw.emitter.wait_idle(0.2)
    reply.after()
    assert h.gw.emitter.wait_idle(10)
    events = {e.completion_id: e for e in read_events(settings.bus) if e.type == "completion"}
    for c in body.choices:
        ev = events[c.completion_id]
        assert ev.caller == key_id and ev.completion == c.text and ev.task_bucket == "affine"
        assert ev.version == version and ev.logprobs == pytest.approx(c.logprobs.token_logprobs)

    first = body.choices[0]
    fb = FeedbackRequest(completion_id=first.completion_id, feedback_token=first.feedback_token, signal="accept")
    with pytest.raises(APIError) as foreign:
        h.feedback(h.authenticate(bob), fb)
    assert foreign.value.status == 403 and foreign.value.code == "feedback_foreign"
    ok = h.feedback(key_id, fb)
    assert isinstance(ok, FeedbackResponse) and ok.version == version and ok.completion_id == first.completion_id
    with pytest.raises(APIError) as replayed:
        h.feedback(key_id, fb)
    assert replayed.value.code == "feedback_replayed"


def test_chat_and_stream_agree_with_the_completion(started):
    h, _, alice, _ = started
    key_id = h.authenticate(alice)
    plain = asyncio.run(h.complete(key_id, completion(max_tokens=6, seed=3)))
    plain.after()
    chat = asyncio.run(h.chat(key_id, ChatRequest(model="tiny-coder", max_tokens=6, seed=3,
                                                  messages=[{"role": "user", "content": PROMPT}])))
    chat.after()
    assert isinstance(chat.body, ChatResponse)
    assert chat.body.choices[0].message.content == plain.body.choices[0].text

    async def collect() -> list[bytes]:
        return [chunk async for chunk in await h.stream(key_id, completion(max_tokens=6, seed=3, stream=True))]

    data = [line[len(b"data: "):] for chunk in asyncio.run(collect()) for line in chunk.split(b"\n\n") if line]
    assert data[-1] == b"[DONE]"
    text = "".join(c["text"] for d in data[:-1] for c in json.loads(d)["choices"])
    assert text == plain.body.choices[0].text
    assert h.gw.emitter.wait_idle(10)


def test_refusals_are_api_errors(started):
    h, settings, alice, _ = started
    for key in (None, "", "rtrl-000000000000-forged"):
        with pytest.raises(APIError) as err:
            h.authenticate(key)
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    key_id = h.authenticate(alice)
    cases = [(completion(model="gpt-4"), 404, "model_not_found"),
             (completion(n=settings.serving.max_n + 1), 422, "n_too_large"),
             (completion(max_tokens=settings.serving.max_tokens_limit + 1), 422, "max_tokens_too_large"),
             (completion(prompt=[5, 10**7]), 422, "invalid_token_id"),
             (completion(prompt=""), 422, "empty_prompt"),
             (completion(prompt="1 " * 300), 413, "context_length_exceeded")]
    for req, status, code in cases:
        with pytest.raises(APIError) as err:
            asyncio.run(h.complete(key_id, req))
        assert (err.value.status, err.value.code) == (status, code), req
    assert h.gw.emitter.pending == 0  # a refused request reserves no events


def test_openapi_documents_every_route_with_its_schemas(started):
    h, settings, _, _ = started
    app = create_app(settings, h.gw)
    client = TestClient(app)
    spec = client.get("/openapi.json").json()
    assert client.get("/docs").status_code == 200
    routes = [r for r in app.routes if isinstance(r, APIRoute)]
    assert {r.path for r in routes} == {"/v1/completions", "/v1/chat/completions", "/v1/feedback", "/v1/models",
                                        "/healthz", "/readyz", "/metrics"}
    for r in routes:
        for method in r.methods:
            assert method.lower() in spec["paths"][r.path], (method, r.path)
    bodies = {"/v1/completions": ("CompletionRequest", "CompletionResponse"),
              "/v1/chat/completions": ("ChatRequest", "ChatResponse"),
              "/v1/feedback": ("FeedbackRequest", "FeedbackResponse")}
    for path, (request, response) in bodies.items():
        op = spec["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + request)
        assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + response)
        assert op["responses"]["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
        assert op["security"] == [{"HTTPBearer": []}]
    schemas = spec["components"]["schemas"]
    assert "temperature" in schemas["CompletionRequest"]["properties"]
    assert {"completion_id", "feedback_token"} <= set(schemas["CompletionChoice"]["properties"])
    assert spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"].endswith("/ModelList")
    assert "requestBody" not in spec["paths"]["/healthz"]["get"]
