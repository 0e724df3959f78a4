"""Incremental streaming: the sampler's per-step hook, the engine's token listeners inside a
micro-batch, and SSE through the official `openai` client against a live uvicorn server.

"Incremental" is checked by ordering, not by wall-clock: the engine is held in the middle of a
generation until the client has received its first chunk. A gateway that only streamed after
generation finished would never release it (the test would fail on the gate's timeout). Engine-level
tests run on both torch engines: the process engine (models in a child, batcher on an event loop) and
the in-thread one.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import Future

import httpx
import openai
import pytest
import torch
from serving_fixtures import PROMPT, engine_held, gateway_settings, read_events

from policy.sampling import SamplingParams, generate_ids


# -- the sampler hook ----------------------------------------------------------------------------------
def test_generate_ids_hooks_see_every_step_and_each_row_as_it_finishes(tiny_model_dir):
    from policy.loading import load_policy

    pol = load_policy(tiny_model_dir)
    tok = pol.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in (PROMPT, "def g(x): return ", "x = ")]
    params = [SamplingParams(max_new_tokens=9, seed=1), SamplingParams(max_new_tokens=2, seed=2),
              SamplingParams(max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3)]
    kw = dict(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, decode=lambda t: tok.decode(t))
    plain = generate_ids(pol.model, ids, params, **kw)

    seen: dict[int, list[int]] = {0: [], 1: [], 2: []}
    log: list[tuple] = []

    def on_step(rows, tokens):
        assert len(rows) == len(tokens) and rows == sorted(rows)
        for r, t in zip(rows, tokens, strict=True):
            assert r not in {e[1] for e in log if e[0] == "finish"}  # a finished row samples no more
            seen[r].append(t)
        log.append(("step", tuple(rows)))

    def on_finish(row, sample):
        assert sample.token_ids == seen[row]  # everything it sampled was announced first
        log.append(("finish", row, sample))

    hooked = generate_ids(pol.model, ids, params, on_step=on_step, on_finish=on_finish, **kw)
    for a, b in zip(plain, hooked, strict=True):  # the hooks change nothing
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.logprobs == b.logprobs and a.sampling_logprobs == b.sampling_logprobs
    finishes = [e for e in log if e[0] == "finish"]
    assert sorted(e[1] for e in finishes) == [0, 1, 2]
    assert all(e[2] is hooked[e[1]] for e in finishes)
    # Row 1 (2 tokens) was reported finished while the others were still decoding.
    first_finish = log.index(finishes[0])
    assert finishes[0][1] == 1 and any(e[0] == "step" for e in log[first_finish + 1:])


# -- the engine: listeners and early answers inside one micro-batch ---------------------------------------
@pytest.fixture(scope="module", params=[True, False], ids=["engine_process", "in_thread"])
def engine(request, tmp_path_factory, tiny_model_dir):
    from serving.engines import create_engine
    from serving.versions import DirSource

    eng = create_engine(gateway_settings(tmp_path_factory.mktemp("eng"), tiny_model_dir, batch_window_ms=50,
                                         engine_process=request.param))
    eng.load(DirSource(tiny_model_dir).current("production"))
    yield eng
    eng.close()


def test_streaming_job_inside_a_micro_batch_gets_its_own_tokens_as_they_come(engine):
    ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    long_p = [SamplingParams(max_new_tokens=10, seed=s) for s in (5, 6)]
    short_p = [SamplingParams(max_new_tokens=2, seed=7)]
    alone = engine.generate_now([ids, ids], long_p)
    calls: list[tuple[str, list, bool]] = []
    short: Future | None = None

    def listener(version, step):
        calls.append((version, step, short.done()))

    with engine_held(engine):  # both jobs are queued before the batcher can take either: one batch
        before = engine.batches_run
        short = engine.submit([ids], short_p)
        streamed = engine.submit([ids, ids], long_p, listener=listener)
    gens = streamed.result(60)
    assert engine.batches_run - before == 1
    assert short.result(0)[0].sample.token_ids  # the short job was answered ...
    assert calls[-1][2]  # ... while the streamed job was still generating
    assert len(calls) > 1 and all(v == gens[0].version for v, _, _ in calls)
    for k in (0, 1):
        got = [t for _, step, _ in calls for kk, t in step if kk == k]
        assert got == gens[k].sample.token_ids == alone[k].sample.token_ids
    assert all(kk in (0, 1) for _, step, _ in calls for kk, _ in step)  # only its own rows


def test_a_failing_listener_does_not_fail_the_batch(engine):
    ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]

    def broken(version, step):
        raise RuntimeError("listener bug")

    gens = engine.submit([ids], [SamplingParams(max_new_tokens=4, seed=1)], listener=broken).result(60)
    assert len(gens[0].sample.token_ids) >= 1


# -- SSE over a live server ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_model_dir):
    from serving.auth import create_api_key
    from serving.server import GatewayServer

    tmp = tmp_path_factory.mktemp("gw_stream")
    settings = gateway_settings(tmp, tiny_model_dir, batch_window_ms=50)
    key = create_api_key(settings, "streamer")
    server = GatewayServer(settings).start()
    yield server, settings, key
    server.stop()


def _client(server, key):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)


class _Gate:
    """Stops the engine's child process (SIGSTOP) once a streaming request has been handed ``after``
    decoding steps, until released (or 30 s pass), so the rest of its generation waits.
    ``released_in_time`` says whether someone released it while the child was stopped."""

    def __init__(self, engine, after: int) -> None:
        self.engine, self.after = engine, after
        self.event = threading.Event()
        self.released_in_time: bool | None = None
        self._orig = engine.submit_async
        self._holder: threading.Thread | None = None

    def _hold(self) -> None:
        try:
            self.released_in_time = self.event.wait(30)
        finally:
            os.kill(self.engine._proc.pid, signal.SIGCONT)

    def __enter__(self):
        def gated(rows, params, channel="production", listener=None):
            if listener is None:  # not a streaming request
                return self._orig(rows, params, channel, listener)
            steps = [0]

            def hook(version, step):
                listener(version, step)  # the tokens are handed over first ...
                steps[0] += 1
                if steps[0] == self.after:  # ... then generation stops until the client has seen them
                    os.kill(self.engine._proc.pid, signal.SIGSTOP)
                    self._holder = threading.Thread(target=self._hold)
                    self._holder.start()

            return self._orig(rows, params, channel, hook)

        self.engine.submit_async = gated
        return self

    def __exit__(self, *exc):
        self.engine.submit_async = self._orig
        self.event.set()
        if self._holder is not None:
            self._holder.join(30)


def _long_seed(client, prompt=PROMPT, tokens=12):
    """A seed whose completion runs to max_tokens and whose first token is printable text."""
    for seed in range(100):
        r = client.completions.create(model="tiny-coder", prompt=prompt, max_tokens=tokens, seed=seed, logprobs=0)
        ch = r.choices[0]
        first = ch.logprobs.tokens[0] if ch.logprobs.tokens else ""
        if ch.finish_reason == "length" and first.strip() and "\ufffd" not in first:
            return seed, r
    pytest.fail("no seed gave a 12-token completion")


def test_openai_stream_arrives_before_generation_finishes_and_matches_the_plain_text(live):
    server, settings, key = live
    c = _client(server, key)
    seed, plain = _long_seed(c)
    with _Gate(server.gateway.engine, after=2) as gate:
        pieces, finished_at = [], None
        for chunk in c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=12, seed=seed, stream=True):
            ch = chunk.choices[0]
            if ch.text and not gate.event.is_set():
                gate.event.set()  # the first text is here while the engine waits: release it
            pieces.append(ch.text)
            if ch.finish_reason:
                finished_at = len(pieces)
    assert gate.released_in_time is True, "the first chunk did not arrive while generation was paused"
    assert "".join(pieces) == plain.choices[0].text
    assert len([p for p in pieces if p]) >= 3 and finished_at == len(pieces)
    assert chunk.model == plain.model and chunk.choices[0].model_extra["feedback_token"]


def test_streamed_completion_event_carries_all_tokens_and_logprobs(live, tiny_model_dir):
    from policy.loading import load_policy
    from policy.logprobs import sequence_logprobs

    server, settings, key = live
    c = _client(server, key)
    chunks = list(c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=10, seed=3, n=2,
                                       temperature=0.8, top_p=0.9, logprobs=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 2
    by_index: dict[int, list] = {}
    for ch in chunks:
        for choice in ch.choices:
            by_index.setdefault(choice.index, []).append(choice)
    assert sorted(by_index) == [0, 1]
    assert server.gateway.emitter.wait_idle(10)
    events = {e.completion_id: e for e in read_events(settings.bus) if e.type == "completion"}
    pol = load_policy(tiny_model_dir)
    for choices in by_index.values():
        cids = {ch.model_extra["completion_id"] for ch in choices}
        assert len(cids) == 1  # the same completion id in every chunk of a choice
        ev = events[cids.pop()]
        assert ev.completion == "".join(ch.text for ch in choices)
        last = choices[-1]
        assert last.finish_reason and last.logprobs.token_logprobs == pytest.approx(ev.logprobs)
        assert len(ev.completion_token_ids) == len(ev.logprobs) == len(ev.sampling_logprobs) >= 1
        assert ev.sampling.temperature == 0.8 and ev.sampling.top_p == 0.9
        ref = sequence_logprobs(pol.model, [ev.prompt_token_ids], [ev.completion_token_ids]).logprobs[0]
        assert torch.allclose(ref, torch.tensor(ev.logprobs), atol=1e-4)


def test_streamed_text_with_stop_strings_equals_the_plain_text(live):
    server, _, key = live
    c = _client(server, key)
    seed, plain = _long_seed(c, tokens=16)
    text = plain.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]  # occurs in the completion: cuts it mid-way
    cut = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=16, seed=seed, stop=[stop, "zz#"])
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].text) < len(text)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="tiny-coder", prompt=PROMPT, max_tokens=16, seed=seed, stop=[stop, "zz#"], stream=True))
    assert streamed == cut.choices[0].text


def test_chat_stream_with_n_and_logprobs(live):
    server, _, key = live
    c = _client(server, key)
    msgs = [{"role": "user", "content": PROMPT}]
    plain = c.chat.completions.create(model="tiny-coder", messages=msgs, max_tokens=8, n=2, seed=4, logprobs=True)
    texts: dict[int, str] = {0: "", 1: ""}
    lps: dict[int, list] = {0: [], 1: []}
    roles = set()
    for chunk in c.chat.completions.create(model="tiny-coder", messages=msgs, max_tokens=8, n=2, seed=4,
                                           logprobs=True, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.delta.role:
                roles.add(ch.index)
            if ch.logprobs and ch.logprobs.content:
                lps[ch.index] += [t.logprob for t in ch.logprobs.content]
    assert roles == {0, 1}
    for i in (0, 1):
        assert texts[i] == plain.choices[i].message.content
        assert lps[i] == pytest.approx([t.logprob for t in plain.choices[i].logprobs.content])


def test_stream_inside_a_micro_batch_over_http(live):
    """A streamed and a plain request queued together (behind a held engine) share one batch; the
    stream still carries its own text, equal to the same request unstreamed."""
    server, _, key = live
    engine = server.gateway.engine
    c = _client(server, key)
    body = dict(model="tiny-coder", prompt=PROMPT, max_tokens=10)
    ref_a = c.completions.create(**body, seed=21).choices[0].text
    ref_b = c.completions.create(**body, seed=22).choices[0].text
    out: dict[str, object] = {}

    def plain():
        out["plain"] = c.completions.create(**body, seed=21).choices[0].text

    def streamed():
        out["chunks"] = [ch.choices[0].text for ch in c.completions.create(**body, seed=22, stream=True)]

    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    with engine_held(engine):  # requests queue up behind a batch that cannot finish yet
        for t in threads:
            t.start()
        deadline = time.monotonic() + 20
        while engine.queue_depth < 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        before = engine.batches_run
    for t in threads:
        t.join(60)
    assert engine.batches_run - before == 1
    assert out["plain"] == ref_a and "".join(out["chunks"]) == ref_b
    assert len([p for p in out["chunks"] if p]) >= 2


def test_client_that_disconnects_mid_stream_is_still_recorded(live):
    server, settings, key = live
    url = server.url + "/v1/completions"
    body = {"model": "tiny-coder", "prompt": PROMPT, "max_tokens": 12, "seed": 8, "stream": True}
    cid = None
    with httpx.stream("POST", url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                cid = json.loads(line[6:])["choices"][0]["completion_id"]
                break
    assert cid
    deadline = time.monotonic() + 20
    while True:
        server.gateway.emitter.wait_idle(5)
        found = [e for e in read_events(settings.bus) if e.type == "completion" and e.completion_id == cid]
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert found and len(found[0].completion_token_ids) == len(found[0].logprobs) >= 1


def test_stream_errors_before_the_first_token_keep_their_status(live):
    server, _, key = live
    c = _client(server, key)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="nope", prompt=PROMPT, max_tokens=4, stream=True)
    with pytest.raises(openai.UnprocessableEntityError):
        c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=4, n=10_000, stream=True)
