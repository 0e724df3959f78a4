"""The update cycle on real tables, the real registry and the embedded bus, with the tiny model:
gate pass and refusal, idempotent reruns, skip rules, the record shown by `rtrl releases`."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from typer.testing import CliRunner

from realtime_rl.cycle import run_update_cycle
from realtime_rl.database import make_engine
from realtime_rl.release import RegistryStore, list_releases, list_runs
from realtime_rl.release_tables import baselines
from tests.rtrl_update_fixtures import insert_logged, make_world, spy_on_update_passes, sqlite_url  # noqa: F401


def _quiet(_msg: str) -> None:
    pass


def _version_events(settings) -> list[dict]:
    from realtime_rl.bus import open_consumer

    with open_consumer(settings.bus, "test-reader") as c:
        topic = settings.bus.versions_topic
        c.assign({(topic, p): 0 for p in c.partitions(topic)})
        out = []
        for _ in range(5):
            out += [json.loads(r.value) for r in c.poll(0.2)]
        return out


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_good_update_is_released_then_reruns_are_idempotent(model, request, tmp_path, sqlite_url,  # noqa: F811
                                                            monkeypatch):
    # The MoE world's logged examples carry the sampler's routes, as the gateway's events do.
    w = make_world(tmp_path, sqlite_url, request.getfixturevalue("tiny_model_dir" if model == "dense"
                                                                 else "tiny_moe_dir"))
    passes = spy_on_update_passes(monkeypatch) if model == "moe" else []
    store = RegistryStore(w.settings)
    r = run_update_cycle(w.settings, log=_quiet)
    assert r.status == "released", r.reason
    assert r.production_version == w.production and r.candidate_version != w.production
    assert store.production() == r.candidate_version
    gate = r.gate
    assert gate["checks"] == {"offline_gate": True, "offline_regression": True, "ope": True, "ope_support": True}
    assert gate["ope"]["estimate"] >= gate["production_accept_rate"]
    assert gate["ope"]["ci"][0] <= gate["ope"]["estimate"] <= gate["ope"]["ci"][1]
    assert r.metrics["train"]["steps"] > 0 and abs(r.metrics["train"]["mismatch_abs_logp"]) < 1e-3
    if model == "moe":
        # Every gradient pass forced the logged routes of every example; the serving weights' own routers
        # choose them again (but for near-ties), so the replayed recompute above is the sampler's.
        grads = [(routes, replay) for routes, replay, grad in passes if grad]
        assert grads and all(routes is not None and all(x is not None for x in routes) and replay
                             for routes, replay in grads)
        assert r.metrics["train"]["router_replay"] == 1.0 and r.metrics["train"]["route_disagreement"] < 0.01

    events = _version_events(w.settings)
    assert [(e["action"], e["version"]) for e in events] == [("published", r.candidate_version),
                                                             ("promoted", r.candidate_version)]
    assert events[0]["parent"] == w.production and events[1]["channel"] == "production"

    engine = make_engine(w.settings.db)
    try:
        rel = list_releases(engine)
        assert len(rel) == 1 and rel[0]["decision"] == "released" and rel[0]["parent_version"] == w.production
        with engine.connect() as conn:
            counts = dict(conn.execute(sa.select(baselines.c.bucket, baselines.c.count)).all())
        assert sum(counts.values()) == r.n_train
        # Rerun: the logged data was served by the old version, so the on-policy filter leaves nothing.
        again = run_update_cycle(w.settings, log=_quiet)
        assert again.status == "skipped" and store.production() == r.candidate_version
        assert len(list_releases(engine)) == 1
        with engine.connect() as conn:
            assert dict(conn.execute(sa.select(baselines.c.bucket, baselines.c.count)).all()) == counts
        assert [x["status"] for x in list_runs(engine)] == ["skipped", "released"]
    finally:
        engine.dispose()


def test_harmful_update_is_refused_and_visible(tmp_path, sqlite_url, tiny_model_dir, monkeypatch):  # noqa: F811
    # Inverted rewards push probability away from accepted answers: the off-policy check must catch it.
    w = make_world(tmp_path, sqlite_url, tiny_model_dir, UPDATE__REWARD_ACCEPT=-1.0, UPDATE__REWARD_REJECT=1.0)
    store = RegistryStore(w.settings)
    r = run_update_cycle(w.settings, log=_quiet)
    assert r.status == "refused"
    assert r.gate["checks"]["ope"] is False and "snips" in r.reason
    assert r.gate["ope"]["estimate"] < r.gate["production_accept_rate"]
    assert store.production() == w.production  # production stays

    # Same data again: recorded as skipped, nothing new published or refused twice.
    again = run_update_cycle(w.settings, log=_quiet)
    assert again.status == "skipped" and "same data" in again.reason

    from rtrl.cli import app

    for k, v in w.env.items():
        monkeypatch.setenv(k, v)
    out = CliRunner().invoke(app, ["releases"])
    assert out.exit_code == 0, out.output
    assert "refused" in out.output and r.candidate_version in out.output and "snips" in out.output
    rows = [json.loads(line) for line in CliRunner().invoke(app, ["releases", "--json"]).output.splitlines()]
    assert rows[0]["decision"] == "refused" and rows[0]["ope_estimate"] < rows[0]["production_accept_rate"]


def test_refused_candidates_make_the_next_step_shorter(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    # Inverted rewards: every candidate is refused, so each new cycle backtracks further, to the floor.
    w = make_world(tmp_path, sqlite_url, tiny_model_dir, UPDATE__REWARD_ACCEPT=-1.0, UPDATE__REWARD_REJECT=1.0,
                   UPDATE__MIN_LR_SCALE=0.25, SCHEDULE__MIN_FEEDBACK=1)
    scales = []
    for k in range(3):
        if k:
            insert_logged(w.settings, w.production, tiny_model_dir, seed=k, start=datetime.now(UTC))
        r = run_update_cycle(w.settings, log=_quiet)
        assert r.status == "refused", r.reason
        scales.append(r.metrics["train"]["lr_scale"])
    assert scales == [1.0, 0.5, 0.25]


def test_skip_rules_min_feedback_and_no_production(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir, SCHEDULE__MIN_FEEDBACK=100000)
    r = run_update_cycle(w.settings, log=_quiet)
    assert r.status == "skipped" and "min_feedback" in r.reason
    forced = run_update_cycle(w.settings, log=_quiet, force=True)
    assert forced.status in ("released", "refused")

    # Too little held-out traffic from production for the gate's off-policy check: no candidate is trained.
    (tmp_path / "heldout").mkdir()
    w2 = make_world(tmp_path / "heldout", f"sqlite:///{tmp_path / 'heldout.db'}", tiny_model_dir,
                    RELEASE__MIN_HELDOUT=100000)
    r3 = run_update_cycle(w2.settings, log=_quiet)
    assert r3.status == "skipped" and "release.min_heldout 100000" in r3.reason and r3.candidate_version is None

    from tests.rtrl_update_fixtures import make_settings

    empty, _ = make_settings(tmp_path / "empty", f"sqlite:///{tmp_path / 'empty.db'}")
    (tmp_path / "empty").mkdir()
    r2 = run_update_cycle(empty, log=_quiet)
    assert r2.status == "skipped" and "no production" in r2.reason


def test_new_feedback_after_release_trains_the_new_version(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir)
    store = RegistryStore(w.settings)
    first = run_update_cycle(w.settings, log=_quiet)
    assert first.status == "released"
    insert_logged(w.settings, first.candidate_version, store.materialize(first.candidate_version), seed=1,
                  start=datetime.now(UTC))
    second = run_update_cycle(w.settings, log=_quiet)
    assert second.production_version == first.candidate_version
    # The on-policy filter now follows the new production version: only its completions are used.
    assert second.n_train > 0
    assert second.metrics["dataset"]["per_version"] == {first.candidate_version: second.n_train}
    # The first update may already accept every answer (then there is no advantage left to learn from).
    assert second.status in ("released", "refused") or "no learning signal" in second.reason


@pytest.mark.postgres
def test_cycle_on_postgres(tmp_path, postgres_url, tiny_model_dir):
    w = make_world(tmp_path, postgres_url, tiny_model_dir)
    r = run_update_cycle(w.settings, log=_quiet)
    assert r.status == "released", r.reason
    assert RegistryStore(w.settings).production() == r.candidate_version
    engine = make_engine(w.settings.db)
    try:
        assert [x["decision"] for x in list_releases(engine)] == ["released"]
    finally:
        engine.dispose()
    assert run_update_cycle(w.settings, log=_quiet).status == "skipped"


@pytest.mark.parametrize(("cand", "prod", "gate_ok", "regression_ok"), [
    (0.47, 0.48, True, True),    # within the evaluator's noise below the 0.5 gate: admitted
    (0.44, 0.45, False, True),   # more than the tolerance below the gate: refused
    (0.47, 0.52, True, False),   # over the floor but a real regression from production: refused
])
def test_offline_gate_floor_allows_for_evaluator_noise_only(cand, prod, gate_ok, regression_ok):
    from realtime_rl.release import evaluate_gate
    from rtrl.config import load_settings

    s = load_settings()
    s.eval.gate_threshold, s.release.gate_tolerance, s.release.offline_epsilon = 0.5, 0.05, 0.03
    scores = {"candidate": cand, "production": prod}
    report = evaluate_gate(s, candidate_model="candidate", production_model="production", heldout=[],
                           production="p", evaluator=scores.__getitem__)
    assert report.checks["offline_gate"] is gate_ok
    assert report.checks["offline_regression"] is regression_ok
    assert not report.passed  # no held-out logged feedback: the off-policy check cannot pass
