"""`rtrl bench ingest --quick`: every cell (Kafka and embedded bus, SQLite and PostgreSQL) runs the
real ingester against the real broker and database, and the tables match the stream."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import ingest as bench_ingest


@pytest.mark.postgres
@pytest.mark.kafka
def test_quick_bench_fills_every_cell_and_checks_the_rows(tmp_path: Path, postgres_admin_url: str,
                                                          kafka_bootstrap: str, monkeypatch) -> None:
    from rtrl.config import load_settings

    monkeypatch.setenv("BENCH_PG_ADMIN_URL", postgres_admin_url)
    settings = load_settings(var_dir=str(tmp_path / "var"),
                             bus={"backend": "kafka", "bootstrap_servers": kafka_bootstrap})
    out = bench_ingest.run(settings, quick=True, log=lambda _m: None)
    cells = {(r["bus"], r["db"]) for r in out["results"]}
    assert cells == {(b, d) for b in ("kafka", "embedded") for d in ("sqlite", "postgresql")}
    for r in out["results"]:
        assert r["rows_ok"], r
        assert r["events"] == out["events"] and r["events_per_s"] > 0 and r["ceiling_events_per_s"] > 0
        assert r["fraction_of_ceiling"] == round(r["events_per_s"] / r["ceiling_events_per_s"], 3)
        # Every batch here is staged, so the writer process wrote it; its CPU is part of the ingester's.
        assert 0 < r["ingest_writer_cpu_us_per_event"] < r["ingest_cpu_us_per_event"]
    assert set(out["goals_met"]) == {"postgresql_events_per_s", "fraction_of_ceiling"}
