"""Composite rewards, the rule judge, and the LLM judge against a live local OpenAI-compatible server.

No LLM judge model exists on this machine, so the server is a small FastAPI app (run by uvicorn on a
free port) that returns canned JSON scores: the mock stands in for the model only; the client, the
HTTP round trip, the rubric prompt, the JSON-schema request and the reply validation are all real.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import SecretStr

from offline_rl.config import JudgeSettings, RewardSettings, SandboxSettings
from offline_rl.judge import RUBRIC, JudgeError, LLMJudge, RuleJudge, parse_scores
from offline_rl.rewards import RewardFunction
from offline_rl.sandbox import Sandbox
from offline_rl.tasks import Task
from offline_rl.tasks import TestCase as Case

TASK = Task(task_id="t1", prompt="# f(0)=1 f(1)=4 f(2)=7 f(3)=10\ndef f(x): return ",
            tests=[Case([x], 3 * x + 1) for x in (-7, -3, -1, 5, 11, 17)])


@pytest.fixture(scope="module")
def sandbox():
    sb = Sandbox(SandboxSettings())
    yield sb
    sb.close()


def test_parts_and_weights(sandbox):
    s = RewardSettings(tests=1.0, compiles=0.1, format=0.2, judge={"style": 0.3, "structure": 0.4})
    fn = RewardFunction(sandbox, s, RuleJudge())
    r = fn.score(TASK, "3*x+1")
    assert r.passed and r.parts["tests"] == 1.0 and r.parts["compiles"] == 1.0 and r.parts["format"] == 1.0
    assert r.parts["judge_style"] == 1.0 and r.parts["judge_structure"] == 1.0
    assert r.total == pytest.approx(1.0 + 0.1 + 0.2 + 0.3 + 0.4)
    # Partly right (x*3+1 only where x >= 0: tests at 5, 11, 17) and not well formed.
    r = fn.score(TASK, "max(x,0)*3+1", well_formed=False)
    assert r.parts["tests"] == pytest.approx(0.5) and r.parts["format"] == 0.0 and not r.passed
    assert r.total == pytest.approx(0.5 + 0.1 + 0.3 * r.parts["judge_style"] + 0.4 * r.parts["judge_structure"])


def test_shaping_needs_a_passing_test(sandbox):
    fn = RewardFunction(sandbox, RewardSettings(compiles=0.5, format=0.5), RuleJudge())
    wrong = fn.score(TASK, "x+100")
    assert wrong.parts["compiles"] == 1.0 and wrong.total == 0.0
    fn_open = RewardFunction(sandbox, RewardSettings(compiles=0.5, format=0.5, judge={}, require_pass=False))
    assert fn_open.score(TASK, "x+100").total == pytest.approx(1.0)
    broken = fn.score(TASK, "x+")
    assert broken.parts["compiles"] == 0.0 and broken.total == 0.0
    assert fn.score(TASK, None).total == 0.0


def test_score_many_runs_duplicates_once(sandbox):
    fn = RewardFunction(sandbox, RewardSettings())
    calls = []
    real = sandbox.run

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    sandbox.run = counting
    try:
        out = fn.score_many([(TASK, "3*x+1", True), (TASK, " 3*x+1 ", True), (TASK, "x", True), (TASK, "3*x+1", False)])
    finally:
        del sandbox.run
    assert len(calls) == 2
    assert [r.passed for r in out] == [True, True, False, True]
    assert out[3].parts["format"] == 0.0


def test_rule_judge_is_spacing_neutral_and_flags_structure():
    j = RuleJudge()
    assert j.score(TASK, "x*8+7") == j.score(TASK, "x * 8 + 7")
    assert j.score(TASK, "x*8+7+0")["style"] < 1.0
    assert j.score(TASK, "(x*8+7)")["style"] < 1.0
    assert j.score(TASK, "__import__('os').getpid()")["structure"] < 1.0
    assert j.score(TASK, "7")["structure"] < 1.0
    assert j.score(TASK, "x*")["style"] == 0.0


def test_parse_scores_validates():
    assert parse_scores('{"style": 10, "structure": 5}', ("style", "structure")) == {"style": 1.0, "structure": 0.5}
    for bad in ('{"style": 11, "structure": 5}', '{"style": 3}', "not json", '[1, 2]', '{"style": true, "structure": 1}'):
        with pytest.raises(JudgeError):
            parse_scores(bad, ("style", "structure"))


# --- the LLM judge against a live local server ------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def judge_server():
    """A local OpenAI-compatible chat endpoint returning canned rubric scores (see module docstring)."""
    app = FastAPI()
    seen: list[dict] = []
    replies = {"content": json.dumps({"style": 8, "structure": 6})}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append({"body": body, "auth": request.headers.get("authorization")})
        if request.headers.get("authorization") != "Bearer judge-secret":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return {"id": "c1", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": replies["content"]}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.02)
    yield {"url": f"http://127.0.0.1:{port}/v1", "seen": seen, "replies": replies}
    server.should_exit = True
    th.join(timeout=5)


def test_llm_judge_round_trip(judge_server, sandbox):
    settings = JudgeSettings(kind="llm", endpoint=judge_server["url"], model="rubric-judge",
                             api_key=SecretStr("judge-secret"), max_retries=0)
    judge = LLMJudge(settings)
    scores = judge.score(TASK, "3*x+1")
    assert scores == {"style": 0.8, "structure": 0.6}
    body = judge_server["seen"][-1]["body"]
    assert body["model"] == "rubric-judge"
    assert body["messages"][0]["content"] == RUBRIC
    assert "3*x+1" in body["messages"][1]["content"]
    schema = body["response_format"]["json_schema"]["schema"]
    assert body["response_format"]["type"] == "json_schema"
    assert set(schema["required"]) == {"style", "structure"}
    # Cached per (task, code): GRPO groups repeat answers.
    n = len(judge_server["seen"])
    judge.score(TASK, "3*x+1")
    assert len(judge_server["seen"]) == n
    # In the composite reward, with each judge part logged.
    fn = RewardFunction(sandbox, RewardSettings(judge={"style": 0.5, "structure": 0.5}), judge)
    r = fn.score(TASK, "3*x+1")
    assert r.parts["judge_style"] == 0.8 and r.total == pytest.approx(1.0 + 0.05 + 0.05 + 0.4 + 0.3)


def test_llm_judge_errors_are_counted_not_fatal(judge_server, sandbox):
    wrong_key = LLMJudge(JudgeSettings(kind="llm", endpoint=judge_server["url"], api_key=SecretStr("nope"),
                                       max_retries=0))
    with pytest.raises(JudgeError):
        wrong_key.score(TASK, "x")
    judge_server["replies"]["content"] = '{"style": 42, "structure": 1}'
    try:
        judge = LLMJudge(JudgeSettings(kind="llm", endpoint=judge_server["url"], api_key=SecretStr("judge-secret"),
                                       max_retries=0))
        fn = RewardFunction(sandbox, RewardSettings(), judge)
        r = fn.score(TASK, "3*x+1")
        assert fn.judge_errors == 1 and r.judge_error and r.parts["judge_style"] == 0.0
        assert r.parts["tests"] == 1.0
    finally:
        judge_server["replies"]["content"] = json.dumps({"style": 8, "structure": 6})
    down = LLMJudge(JudgeSettings(kind="llm", endpoint=f"http://127.0.0.1:{_free_port()}/v1", max_retries=0,
                                  timeout_s=2))
    with pytest.raises(JudgeError):
        down.score(TASK, "x")


def test_api_key_is_never_in_the_settings_dump():
    s = JudgeSettings(kind="llm", api_key=SecretStr("top-secret"))
    assert "top-secret" not in repr(s) and "top-secret" not in s.model_dump_json()


def test_scoring_while_decoding_equals_scoring_afterwards(tiny_model_dir):
    # run_episodes starts each finished row's sandbox run during decoding; the rewards must be exactly
    # those of scoring the finished batch in one call, with repeated submissions run once.
    from offline_rl.config import EnvSettings
    from offline_rl.env import CodingEnv
    from offline_rl.rollout import TorchBackend, run_episodes
    from offline_rl.sandbox import SandboxPool
    from offline_rl.tasks import generate_tasks
    from policy.loading import load_policy

    policy = load_policy(tiny_model_dir)
    tasks = generate_tasks(0).train[:3]
    with SandboxPool(SandboxSettings(), size=3) as pool:
        env = CodingEnv(pool, EnvSettings())
        fn = RewardFunction(pool, RewardSettings(require_pass=False))
        backend = TorchBackend(policy.model, policy.tokenizer)
        early = run_episodes(backend, policy.tokenizer, env, tasks, 4, 1.0, 12, seed=3, reward_fn=fn)
        late = run_episodes(backend, policy.tokenizer, env, tasks, 4, 1.0, 12, seed=3)
        batch = fn.score_many([(t.task, t.submission, t.well_formed) for t in late])
        pending = fn.pending()
        for t in late:
            pending.add(t.task, t.submission)
        assert len(pending.runs) == len({(t.task.task_id, t.submission and t.submission.strip()) for t in late})
    assert [t.submission for t in early] == [t.submission for t in late]
    assert [(t.reward, t.parts, t.passed) for t in early] == [(r.total, r.parts, r.passed) for r in batch]
