"""The online loop end to end on the real parts: simulated users -> uvicorn gateway (openai client)
-> embedded bus -> ingester -> training_examples -> update -> gate -> registry -> hot swap."""

from __future__ import annotations

import sqlalchemy as sa

from benchmarks.online import run
from realtime_rl.database import make_engine
from realtime_rl.tables import training_examples
from tests.rtrl_update_fixtures import make_settings


def test_bench_online_loop_end_to_end(tmp_path, tiny_model_dir):
    settings, _ = make_settings(
        tmp_path, "sqlite:///unused.db", MODEL__DIR=tiny_model_dir, GRPO__OUT_DIR=tmp_path / "no-grpo",
        MIDTRAIN__OUT_DIR=tmp_path / "no-midtrain", SIMUSERS__REQUESTS_PER_CYCLE=40, SIMUSERS__N_USERS=5,
        SIMUSERS__STYLE_STRICTNESS_MIN=0, SIMUSERS__STYLE_STRICTNESS_MAX=0, SIMUSERS__EDIT_PROBABILITY=0.5,
        RELEASE__MIN_HELDOUT=3, UPDATE__CALLER_CAP_SHARE=0.5)
    out = run(settings, quick=True, log=lambda _m: None, cycles=1, bench_dir=tmp_path / "bench", cells=("simple",))
    assert out["gate"] == 0 and out["cycles"] == 1 and set(out["cells"]) == {"simple"}
    cell = out["cells"]["simple"]
    base = cell["versions"][0]
    assert base["decision"] == "base" and base["judged"] == 40  # the simple users judge every completion
    assert base["ci"][0] <= base["accept_rate"] <= base["ci"][1]
    cycle = cell["per_cycle"][0]
    assert cycle["ingested"] == 80  # one completion and one feedback event per request
    # The random tiny model is never right, so every judgement is a reject or a (graded) edit; edits
    # give the rewards their spread. The update then either released (and the gateway switched to the
    # new version for the final round) or was refused; both are recorded.
    assert cycle["status"] in ("released", "refused")
    if cycle["status"] == "released":
        assert cell["per_cycle"][1]["served"] == cycle["candidate"] and cell["releases"] == 1
    refused = cycle["status"] == "refused"
    assert cell["refusals"]["candidates"] == 1 and cell["refusals"]["refused"] == int(refused)
    assert bool(cycle["failed_checks"]) == refused and sum(cell["refusals"]["by_check"].values()) == len(
        cycle["failed_checks"])
    assert abs(cycle["train"]["mismatch_abs_logp"]) < 1e-4  # gateway log-probs = trainer's recompute
    engine = make_engine(f"sqlite:///{tmp_path / 'bench' / 'simple' / 'feedback.db'}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(training_examples.c.signal, training_examples.c.caller)).all()
    finally:
        engine.dispose()
    assert 30 <= len(rows) <= 40 and {s for s, _ in rows} <= {"accept", "reject", "edit"}
    assert len({c for _, c in rows}) == 5
