"""Router replay from production logs: the gateway records each completion's routes, the ingester
checks and stores them (bad ones dead-lettered with the reason), and the single-rollout update
forces them in every forward pass."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import torch
from ingest_fixtures import feedback, rows, send
from serving_fixtures import PROMPT, gateway_settings, read_events

from policy.loading import load_policy
from policy.logprobs import sequence_logprobs
from policy.routes import Routes
from realtime_rl import update as update_mod
from realtime_rl.config import UpdateSettings
from realtime_rl.database import make_engine
from realtime_rl.dataset import build_dataset, load_logged
from realtime_rl.ingest import Ingester
from tests.rtrl_update_fixtures import spy_on_update_passes


@pytest.fixture(scope="module")
def logged(tmp_path_factory, tiny_moe_dir):
    """Completions of the MoE model served by the gateway (in-thread torch engine), as events."""
    from serving.auth import create_api_key
    from serving.server import GatewayServer

    tmp = tmp_path_factory.mktemp("moe_gw")
    settings = gateway_settings(tmp, tiny_moe_dir, engine_process=False)
    key = create_api_key(settings, "alice")
    server = GatewayServer(settings).start()
    try:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
        c.completions.create(model="tiny-coder", prompt=[PROMPT, "def g(x): return x"], n=3, max_tokens=8,
                             seed=5, temperature=1.0)
        assert server.gateway.emitter.wait_idle(10)
    finally:
        server.stop()
    events = [e for e in read_events(settings.bus) if e.type == "completion"]
    settings.db.url = f"sqlite:///{tmp / 'feedback.db'}"
    settings.ingest.routes_model_dir = str(tiny_moe_dir)
    settings.ingest.poll_timeout_s, settings.ingest.batch_max_wait_ms = 0.2, 20
    return settings, events


def test_gateway_events_carry_routes_that_replay_to_the_logged_logprobs(logged, tiny_moe_dir):
    _, events = logged
    assert len(events) == 6
    policy = load_policy(tiny_moe_dir)
    routes = [Routes.from_wire(e.routes) for e in events]
    for e, r in zip(events, routes, strict=True):
        assert r.shape == (len(e.prompt_token_ids) + len(e.completion_token_ids) - 1, 4, 2)
        assert len(e.model_dump_json()) - len(e.model_copy(update={"routes": None}).model_dump_json()) \
            <= 2 * r.positions * 4  # <= 2 bytes per token per layer on the wire
    tl = sequence_logprobs(policy.model, [e.prompt_token_ids for e in events],
                           [e.completion_token_ids for e in events], routes=routes)
    for i, e in enumerate(events):
        assert torch.allclose(tl.logprobs[i, :len(e.logprobs)], torch.tensor(e.logprobs), atol=1e-5)
    assert tl.route_stats.pairs_differ == 0


def _bad_routes(e, how: str) -> dict:
    ids = Routes.from_wire(e.routes).ids.astype(np.int64)
    if how == "length":
        return Routes(ids[:-1], 4).to_wire()
    if how == "layers":
        return Routes(ids[:, :3], 4).to_wire()
    if how == "top_k":
        return Routes(ids[:, :, :1], 4).to_wire()
    ids[2, 1, 0] = 6  # encoded for 8 experts: an id the model's 4-expert layers do not have
    return Routes(ids, 8).to_wire()


def test_ingest_stores_routes_and_dead_letters_bad_ones_with_the_reason(logged, tiny_moe_dir):
    settings, events = logged
    bad = {how: events[0].model_copy(update={"completion_id": f"bad-{how}", "event_id": f"bad-{how}",
                                             "routes": _bad_routes(events[0], how)})
           for how in ("length", "layers", "top_k", "expert_id")}
    # Tampered but valid routes: every expert choice moved to another expert (replayed below); another
    # caller, or the dataset would count them as repeats of the served ones.
    moved = [e.model_copy(update={"completion_id": "moved-" + e.completion_id, "event_id": "moved-" + e.event_id,
                                  "caller": "moved-" + e.caller,                                  "routes": Routes((Routes.from_wire(e.routes).ids + 1) % 4, 4).to_wire()})
             for e in events]
    signals = ["accept", "reject"] * 6
    send(settings, [*bad.values(), *moved])
    send(settings, [feedback(e.completion_id, s, version=e.version, caller=e.caller)
                    for e, s in zip(events + moved, signals, strict=True)])
    ing = Ingester(settings)
    try:
        ing.drain(timeout_s=30)
    finally:
        ing.close()
    dead = {r[0]: r[1] for r in rows(settings.db.url.get_secret_value(),
                                     "SELECT key, detail FROM dead_letters WHERE reason = 'schema_invalid'")}
    assert "routes cover" in dead[b"bad-length"] and "the sequence has" in dead[b"bad-length"]
    assert "routes carry 3 MoE layers, the model has 4" in dead[b"bad-layers"]
    assert "routes give 1 experts per token, its router picks 2" in dead[b"bad-top_k"]
    assert dead[b"bad-expert_id"] == "routes: MoE layer 1: expert id 6 at position 2 is out of range (4 experts)"
    stored = rows(settings.db.url.get_secret_value(), "SELECT COUNT(*) FROM training_examples WHERE routes IS NOT NULL")
    assert stored[0][0] == 12


def test_online_update_replays_the_logged_routes(logged, tiny_moe_dir, monkeypatch):
    settings, events = logged
    engine = make_engine(settings.db)
    try:
        examples = load_logged(engine)
    finally:
        engine.dispose()
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0, epochs=1, minibatch_size=4, lr=1e-5,
                         target_kl=None)
    data = build_dataset(examples, cfg, production=events[0].version)
    assert len(data.train) == 12 and all(t.example.routes is not None for t in data.train)
    calls = spy_on_update_passes(monkeypatch)

    def run(which: str, subset):
        policy = load_policy(tiny_moe_dir)
        calls.clear()
        m = update_mod.train_policy(policy.model, subset, [0.5] * len(subset),
                                    cfg.model_copy(update={"router_replay": which}),
                                    pad_token_id=policy.tokenizer.pad_token_id)
        return m, list(calls)

    served = [t for t in data.train if not t.example.completion_id.startswith("moved-")]
    moved = [t for t in data.train if t.example.completion_id.startswith("moved-")]
    m, seen = run("replay", moved)
    training = [c for c in seen if c[2]]
    assert training and all(r is not None and all(x is not None for x in r) and rep for r, rep, _ in training)
    # The forced (moved) experts changed the trainer's log-probs; its routers would have chosen the logged ones.
    assert m["route_disagreement"] > 0.9 and m["router_replay"] == 1.0
    assert m["mismatch_kl_k3"] == m["router_kl_k3_replay"] > 100 * max(m["router_kl_k3_off"], 1e-9)
    m_served, _ = run("replay", served)
    assert m_served["mismatch_abs_logp"] < 1e-5 and m_served["route_disagreement"] == 0.0
    m_off, seen_off = run("off", moved)
    assert all(not rep for _, rep, grad in seen_off if grad)
    assert m_off["mismatch_kl_k3"] == m_off["router_kl_k3_off"] < 1e-6
