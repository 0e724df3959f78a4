"""`rtrl ingest`, `rtrl dlq list|replay`: an oversized event is dead-lettered, the limit is raised, the
letter is replayed and then ingested; the pipeline never stops."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from rtrl.cli import app
from tests.ingest_fixtures import completion, counts, feedback, make_settings, send


def test_ingest_dead_letter_list_and_replay(tmp_path: Path, monkeypatch) -> None:
    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    s = make_settings(tmp_path, url)
    for key, value in {"RTRL_DB__URL": url, "RTRL_BUS__EMBEDDED_PATH": s.bus.embedded_path,
                       "RTRL_BUS__EVENTS_TOPIC": s.bus.events_topic, "RTRL_BUS__VERSIONS_TOPIC": s.bus.versions_topic,
                       "RTRL_INGEST__POLL_TIMEOUT_S": "0.2", "RTRL_INGEST__MAX_EVENT_BYTES": "2048"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RTRL_CONFIG", raising=False)
    runner = CliRunner()
    big = completion("big", prompt="# " + "long context " * 200)
    send(s, [completion("c1"), big, feedback("c1"), feedback("big"), (b"junk", b"{oops")])

    result = runner.invoke(app, ["ingest", "--once"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout.strip().splitlines()[-1])
    assert stats["records"] == 5 and stats["dead_letters"] == 2 and stats["joined"] == 1

    listed = runner.invoke(app, ["dlq", "list", "--json"])
    assert listed.exit_code == 0, listed.output
    letters = {json.loads(line)["reason"]: json.loads(line) for line in listed.stdout.splitlines()}
    assert set(letters) == {"oversized", "undecodable"}
    assert letters["oversized"]["raw_size"] == len(big.to_bytes())
    assert "oversized" in runner.invoke(app, ["dlq", "list"]).stdout

    refused = runner.invoke(app, ["dlq", "replay"])
    assert refused.exit_code == 2  # neither ids nor --all: nothing replayed by accident

    monkeypatch.setenv("RTRL_INGEST__MAX_EVENT_BYTES", "1000000")  # the operator raises the limit
    replayed = runner.invoke(app, ["dlq", "replay", str(letters["oversized"]["id"])])
    assert replayed.exit_code == 0, replayed.output
    assert json.loads(replayed.stdout.strip().splitlines()[-1])["replayed"] == [letters["oversized"]["id"]]

    result = runner.invoke(app, ["ingest", "--follow", "--max-idle-s", "0.5"])
    assert result.exit_code == 0, result.output
    assert counts(url, "completions", "training_examples", "pending_feedback", "dead_letters") == {
        "completions": 2, "training_examples": 2, "pending_feedback": 0, "dead_letters": 2}
    pending = runner.invoke(app, ["dlq", "list", "--json"]).stdout.splitlines()
    assert [json.loads(line)["reason"] for line in pending] == ["undecodable"]  # the replayed one is marked
    everything = runner.invoke(app, ["dlq", "list", "--all", "--json"]).stdout.splitlines()
    assert sum(json.loads(line)["replayed_at"] is not None for line in everything) == 1
