"""The chat `session` extension on a live gateway (torch engine, tiny model, official `openai` client):
a long agent session is summarised when it outgrows its context budget, answered from the fresh
context, and every completion's event says which context and which summary it followed."""

from __future__ import annotations

import httpx
import openai
import pytest
from serving_fixtures import gateway_settings, read_events

from policy.summary import SUMMARY_PREFIX, SUMMARY_REQUEST
from realtime_rl.database import make_engine
from realtime_rl.ingest import Ingester
from realtime_rl.tables import completions
from serving.auth import create_api_key
from serving.server import GatewayServer

TASK = "# issue: depth returns wrong values; its rule is in mathx.py\n# tools: ls | cat FILE | test | submit\n$ "
TURNS = [("assistant", "cat mathx.py"), ("user", "1 def rule(x): return max(x, 9)\n$ "),
         ("assistant", "grep def depth"), ("user", "core.py:1:def depth(x): return max(x,19)\n$ ")]


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("session")
    settings = gateway_settings(tmp, tiny_model_dir, batch_window_ms=0)
    settings.db = settings.db.model_copy(update={"url": type(settings.db.url)(f"sqlite:///{tmp / 'feedback.db'}")})
    key = create_api_key(settings, "agent")
    server = GatewayServer(settings).start()
    yield server, settings, key
    server.stop()


def _chat(server, key, messages, **session):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    return c.chat.completions.create(model="tiny-coder", messages=messages, max_tokens=8, seed=3, temperature=0.7,
                                     extra_body={"session": session})


def _tokens(server, text: str) -> int:
    return len(server.gateway.engine.tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_session_is_summarised_when_it_outgrows_its_budget(live):
    server, settings, key = live
    messages = [{"role": "user", "content": TASK}] + [{"role": r, "content": t} for r, t in TURNS]
    whole = _tokens(server, "\n".join(m["content"] for m in messages))
    short = _chat(server, key, messages[:1], context_budget=whole + 200)
    assert short.model_extra["session"] == {"segment": 0, "summary_id": None, "summarised": False, "summary": None,
                                            "summary_feedback_token": None, "messages": None,
                                            "prompt_tokens": _tokens(server, TASK)}

    # A budget the first message and a summary fit in, the whole conversation does not.
    r = _chat(server, key, messages, context_budget=whole - 10 + 8 + _tokens(server, SUMMARY_REQUEST) + 16,
              summary_max_tokens=16)
    s = r.model_extra["session"]
    assert s["summarised"] is True and s["segment"] == 1 and s["summary_id"].startswith("cmpl-")
    assert "\n" not in s["summary"]
    fresh = s["messages"]
    assert fresh[0]["content"] == TASK
    if s["summary"]:
        assert fresh[1]["content"] == SUMMARY_PREFIX + s["summary"]
        assert [m["content"] for m in fresh[2:]] in ([], [t for _, t in TURNS[2:]])  # the last exchange, or not
    assert s["prompt_tokens"] == _tokens(server, "\n".join(m["content"] for m in fresh))

    # The summary is a completion of the caller's own: feedback on it is accepted.
    fb = httpx.post(server.url + "/v1/feedback", headers={"Authorization": f"Bearer {key}"},
                    json={"completion_id": s["summary_id"], "feedback_token": s["summary_feedback_token"],
                          "signal": "accept"})
    assert fb.status_code == 200, fb.text

    # Continuing from the fresh context: the next request names its context and summary.
    follow = _chat(server, key, fresh + [{"role": "assistant", "content": r.choices[0].message.content}],
                   context_budget=10_000, segment=s["segment"], summary_id=s["summary_id"])
    assert follow.model_extra["session"]["segment"] == 1 and not follow.model_extra["session"]["summarised"]

    server.gateway.emitter.wait_idle(10)
    events = {e.completion_id: e for e in read_events(settings.bus) if e.type == "completion"}
    summary = events[s["summary_id"]]
    assert summary.session == {"segment": 0, "summary_id": None, "summary": True}
    assert summary.prompt.endswith(SUMMARY_REQUEST) and 1 <= len(summary.completion_token_ids) <= 16
    answer = events[r.choices[0].model_extra["completion_id"]]
    assert answer.session == {"segment": 1, "summary_id": s["summary_id"], "summary": False}
    assert answer.prompt == "\n".join(m["content"] for m in fresh)
    assert events[follow.choices[0].model_extra["completion_id"]].session == answer.session
    assert events[short.choices[0].model_extra["completion_id"]].session["segment"] == 0

    # The ingester stores each completion's session record.
    ingester = Ingester(settings)
    try:
        ingester.drain(timeout_s=30)
    finally:
        ingester.close()
    with make_engine(settings.db).connect() as conn:
        stored = dict(conn.execute(completions.select().with_only_columns(completions.c.completion_id,
                                                                          completions.c.session)).all())
    assert stored[s["summary_id"]] == summary.session and stored[answer.completion_id] == answer.session


def test_bad_sessions_are_refused_with_the_reason(live):
    server, _, key = live
    messages = [{"role": "user", "content": TASK}] + [{"role": r, "content": t} for r, t in TURNS]
    with pytest.raises(openai.APIStatusError) as err:
        _chat(server, key, messages, context_budget=20)
    assert err.value.status_code == 413 and "cannot hold a context after a summary" in err.value.message
    for extra in ({"n": 2}, {"stream": True}):
        body = {"model": "tiny-coder", "messages": messages, "session": {"context_budget": 500}, **extra}
        resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert resp.status_code == 422 and "session works with n=1 and without stream" in resp.text
    resp = httpx.post(server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny-coder", "messages": messages, "session": {"context_budget": 0}})
    assert resp.status_code == 422 and "context_budget" in resp.text
