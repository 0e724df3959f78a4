"""Ingestion semantics on SQLite and PostgreSQL: joins, out-of-order and repeated feedback, idempotence,
dead letters, atomic batches, fencing of a second ingester, model-version history."""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from realtime_rl.events import ModelVersionEvent
from realtime_rl.ingest import Ingester
from tests.ingest_fixtures import T0, completion, counts, feedback, make_settings, rows, send


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres),
                        pytest.param("postgresql-staged", marks=pytest.mark.postgres)])
def db_url(request, tmp_path: Path, monkeypatch) -> str:
    """Every test on SQLite, on PostgreSQL, and on PostgreSQL with the staged (COPY) path taken for
    any batch size (normally only batches of ``COPY_MIN_ROWS`` events or more take it)."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'feedback.db'}"
    if request.param == "postgresql-staged":
        from realtime_rl import ingest_plan

        monkeypatch.setattr(ingest_plan, "COPY_MIN_ROWS", 1)
    return request.getfixturevalue("postgres_url")


ALL = ("completions", "feedback", "training_examples", "pending_feedback", "dead_letters")


def _ingest(settings) -> Ingester:
    ing = Ingester(settings)
    try:
        ing.drain(timeout_s=60)
    finally:
        ing.close()
    return ing


def test_completion_and_feedback_become_one_training_example(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    c = completion("c1")
    send(s, [c, feedback("c1", "edit", kept_text="x*2 + 1\n")])
    ing = _ingest(s)
    assert ing.stats.records == 2 and ing.stats.written.joined == 1
    assert counts(db_url, *ALL) == {"completions": 1, "feedback": 1, "training_examples": 1,
                                    "pending_feedback": 0, "dead_letters": 0}
    (ex,) = rows(db_url, "SELECT * FROM training_examples")
    ex = ex._mapping

    def decode(v):
        return json.loads(v) if isinstance(v, str) else v

    assert decode(ex["prompt_token_ids"]) == c.prompt_token_ids
    assert decode(ex["completion_token_ids"]) == c.completion_token_ids
    assert decode(ex["logprobs"]) == c.logprobs and decode(ex["sampling_logprobs"]) == c.sampling_logprobs
    assert decode(ex["sampling"])["temperature"] == 0.7
    assert (ex["signal"], ex["kept_text"], ex["version"], ex["task_bucket"], ex["feedback_count"]) == \
        ("edit", "x*2 + 1\n", "v1", "affine", 1)
    # Offsets were stored with the rows: a restarted ingester finds nothing new.
    again = _ingest(s)
    assert again.stats.records == 0


def test_feedback_before_its_completion_is_held_then_joined(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    send(s, [feedback("early", "reject")])
    _ingest(s)
    assert counts(db_url, "feedback", "pending_feedback", "training_examples") == \
        {"feedback": 1, "pending_feedback": 1, "training_examples": 0}
    send(s, [completion("early")])
    _ingest(s)  # a later transaction, a restarted process
    assert counts(db_url, "feedback", "pending_feedback", "training_examples") == \
        {"feedback": 1, "pending_feedback": 0, "training_examples": 1}
    assert rows(db_url, "SELECT signal FROM training_examples")[0][0] == "reject"


def test_repeated_feedback_latest_wins_and_history_is_kept(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    first = feedback("c1", "reject", ts=T0 + timedelta(seconds=1))
    newest = feedback("c1", "accept", ts=T0 + timedelta(seconds=30))
    middle = feedback("c1", "edit", ts=T0 + timedelta(seconds=10))
    send(s, [completion("c1"), first])
    _ingest(s)
    send(s, [newest])
    _ingest(s)
    send(s, [middle])  # arrives last, but is not the newest judgement
    _ingest(s)
    history = rows(db_url, "SELECT event_id, is_latest FROM feedback ORDER BY created_at")
    assert [r[0] for r in history] == [first.event_id, middle.event_id, newest.event_id]
    assert [bool(r[1]) for r in history] == [False, False, True]
    (ex,) = rows(db_url, "SELECT signal, feedback_event_id, feedback_count FROM training_examples")
    assert tuple(ex) == ("accept", newest.event_id, 3)


def test_redelivered_events_count_once_and_conflicting_ids_are_dead_lettered(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    c, f = completion("c1"), feedback("c1")
    send(s, [c, f, c, f])  # a producer that resent after a failed flush
    _ingest(s)
    send(s, [c, f])  # and again, in a later batch
    ing = _ingest(s)
    assert ing.stats.written.duplicates == 2
    impostor = completion("c1", text="other\n")  # same completion id, different event
    send(s, [impostor])
    _ingest(s)
    assert counts(db_url, "completions", "feedback", "training_examples", "dead_letters") == \
        {"completions": 1, "feedback": 1, "training_examples": 1, "dead_letters": 1}
    (reason, detail, raw), = rows(db_url, "SELECT reason, detail, raw FROM dead_letters")
    assert reason == "conflict" and c.event_id in detail and bytes(raw) == impostor.to_bytes()


def test_poison_events_are_dead_lettered_and_ingestion_continues(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url, ingest={"max_event_bytes": 4096})
    huge = completion("big", prompt="p" * 5000)
    nul = completion("nul", caller="key\x00a")  # a NUL in an id (text gets U+FFFD: test_ingest_decode.py)
    poison = [
        (b"k1", b"\xff\xfe not json"),
        (b"k2", b'{"type": "feedback", "completion_id": "c9"}'),
        (b"k3", b'{"type": "launch_missiles"}'),
        (b"big", huge.to_bytes()),
        (b"nul", nul.to_bytes()),
        (b"c8", completion("c8", logprobs=[-0.1]).to_bytes()),
        (b"c7", feedback("c7", "edit", kept_text=None).model_copy(update={"kept_text": None}).to_bytes()),
        (b"c6", completion("c6", version="v" * 200).to_bytes()),
    ]
    good = [completion(f"g{i}") for i in range(5)] + [feedback(f"g{i}") for i in range(5)]
    send(s, [*poison[:4], *good[:5], *poison[4:], *good[5:]])
    ing = _ingest(s)
    assert ing.stats.records == len(poison) + len(good)
    assert counts(db_url, "completions", "feedback", "training_examples", "dead_letters") == \
        {"completions": 5, "feedback": 5, "training_examples": 5, "dead_letters": len(poison)}
    letters = {bytes(r[0]): (r[1], bytes(r[2]), r[3]) for r in
               rows(db_url, "SELECT key, reason, raw, raw_size FROM dead_letters")}
    assert {k: v[0] for k, v in letters.items()} == {
        b"k1": "undecodable", b"k2": "schema_invalid", b"k3": "schema_invalid", b"big": "oversized",
        b"nul": "schema_invalid", b"c8": "schema_invalid", b"c7": "schema_invalid", b"c6": "schema_invalid"}
    for key, value in poison:
        assert letters[key][1] == value and letters[key][2] == len(value)  # raw bytes kept as received


def test_a_record_the_database_refuses_is_isolated(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    Ingester(s).close()  # creates the schema
    engine = sa.create_engine(db_url)
    # A real database-side refusal (a trigger), standing in for any constraint the schema cannot foresee.
    with engine.begin() as conn:
        if conn.dialect.name == "sqlite":
            conn.exec_driver_sql("CREATE TRIGGER refuse BEFORE INSERT ON completions WHEN NEW.prompt = 'refuse me' "
                                 "BEGIN SELECT RAISE(ABORT, 'refused by test trigger'); END")
        else:
            conn.exec_driver_sql("CREATE FUNCTION refuse() RETURNS trigger AS $$ BEGIN IF NEW.prompt = 'refuse me' "
                                 "THEN RAISE EXCEPTION 'refused by test trigger' USING ERRCODE = '22023'; END IF; "
                                 "RETURN NEW; END $$ LANGUAGE plpgsql")
            conn.exec_driver_sql("CREATE TRIGGER refuse BEFORE INSERT ON completions FOR EACH ROW EXECUTE FUNCTION refuse()")
    engine.dispose()
    events = [completion(f"c{i}") for i in range(300)] + [completion("bad", prompt="refuse me")]
    events += [feedback(f"c{i}") for i in range(300)]
    send(s, events)
    ing = _ingest(s)
    assert ing.stats.written.by_reason == {"db_rejected": 1}
    assert counts(db_url, "completions", "training_examples", "dead_letters") == \
        {"completions": 300, "training_examples": 300, "dead_letters": 1}
    (key, detail), = rows(db_url, "SELECT key, detail FROM dead_letters")
    assert bytes(key) == b"bad" and "refused by test trigger" in detail


def test_a_failure_mid_transaction_commits_nothing(tmp_path: Path, db_url: str, monkeypatch) -> None:
    """In the ingester's own process (``writer_process=False``, where a failure can be injected; the
    writer process runs the same transaction: tests/test_ingest_proc.py kills it mid-way)."""
    import realtime_rl.ingest as ingest_mod

    s = make_settings(tmp_path, db_url)
    # Enough events for PostgreSQL's staged (COPY) path: its temp tables die with the rolled-back transaction.
    send(s, [completion(f"c{i}") for i in range(150)] + [feedback(f"c{i}") for i in range(149)])
    real = ingest_mod.write_plan

    def write_then_fail(conn, *args, **kwargs):
        real(conn, *args, **kwargs)  # rows are written inside the transaction ...
        raise sa_exc.OperationalError("INSERT", {}, Exception("connection lost"))  # ... then it dies

    monkeypatch.setattr(ingest_mod, "write_plan", write_then_fail)
    ing = Ingester(s, writer_process=False)
    with pytest.raises(sa_exc.OperationalError):
        ing.run_once()
    assert counts(db_url, "completions", "feedback", "training_examples") == \
        {"completions": 0, "feedback": 0, "training_examples": 0}
    assert [r[0] for r in rows(db_url, "SELECT next_offset FROM consumer_offsets")] == [0] * 6
    monkeypatch.setattr(ingest_mod, "write_plan", real)
    ing.drain(timeout_s=30)  # the same process resumes from the committed positions
    ing.close()
    assert counts(db_url, "completions", "feedback", "training_examples") == \
        {"completions": 150, "feedback": 149, "training_examples": 149}


def test_a_second_ingester_of_the_group_is_fenced(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    send(s, [completion(f"c{i}") for i in range(20)] + [feedback(f"c{i}") for i in range(20)])
    a, b = Ingester(s), Ingester(s)
    a._attach()
    b._attach()  # both read the same stored positions
    assert a.run_once() == 40
    b.run_once()  # stale positions: its transaction must change nothing
    assert b.stats.fenced == 1 and b.stats.records == 0
    send(s, [completion("late"), feedback("late")])
    b.drain(timeout_s=30)  # re-read the positions, then continued after a's rows
    a.close()
    b.close()
    assert b.stats.records == 2
    assert counts(db_url, "completions", "feedback", "training_examples") == \
        {"completions": 21, "feedback": 21, "training_examples": 21}


def test_model_version_history_and_summary(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    published = ModelVersionEvent(model="tiny-coder", version="v2", parent="v1", action="published",
                                  sha256="ab" * 32, metrics={"pass_at_1": 0.5}, ts=T0)
    promoted = ModelVersionEvent(model="tiny-coder", version="v2", action="promoted", channel="production",
                                 metrics={"accept_rate": 0.6}, ts=T0 + timedelta(minutes=5))
    rolled = ModelVersionEvent(model="tiny-coder", version="v2", action="rollback", channel="production",
                               ts=T0 + timedelta(minutes=9))
    send(s, [promoted, rolled], topic=s.bus.versions_topic)
    _ingest(s)
    send(s, [published, promoted], topic=s.bus.versions_topic)  # late publish + a redelivery
    _ingest(s)
    assert counts(db_url, "model_version_actions", "model_versions") == {"model_version_actions": 3,
                                                                         "model_versions": 1}
    (v,) = rows(db_url, "SELECT parent, sha256, metrics, last_action, last_channel FROM model_versions")
    metrics = json.loads(v[2]) if isinstance(v[2], str) else v[2]
    assert (v[0], v[1], v[3], v[4]) == ("v1", "ab" * 32, "rollback", "production")
    assert metrics == {"pass_at_1": 0.5, "accept_rate": 0.6}


def test_run_follows_until_stopped_or_idle(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url, ingest={"batch_max_records": 50})
    ing = Ingester(s)
    stop = threading.Event()
    worker = threading.Thread(target=ing.run, kwargs={"stop_event": stop})
    worker.start()
    try:
        send(s, [completion(f"c{i}") for i in range(200)] + [feedback(f"c{i}") for i in range(200)])
        deadline = threading.Event()
        for _ in range(300):
            if ing.stats.records >= 400:
                break
            deadline.wait(0.05)
    finally:
        stop.set()
        worker.join(20)
    assert not worker.is_alive()
    assert ing.stats.records == 400 and ing.stats.transactions >= 8  # pipelined batches of <= 50
    assert counts(db_url, "training_examples") == {"training_examples": 200}
    assert ing.run(max_idle_s=0.3).records == 400  # nothing new: returns after the idle time
    ing.close()
