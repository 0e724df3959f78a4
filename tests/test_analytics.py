"""Analyst loaders over the read-only views, and the notebook executed against a populated database."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from realtime_rl import analytics
from realtime_rl.events import ModelVersionEvent
from realtime_rl.ingest import Ingester
from tests import ingest_fixtures
from tests.ingest_fixtures import T0, completion, feedback, make_settings, send

db_url = ingest_fixtures.db_url  # the fixture: SQLite and PostgreSQL

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "feedback_analysis.ipynb"


def _populate(settings) -> None:
    day2 = T0 + timedelta(days=1)
    events = [
        # v2 is listed first on the bus but was published after v1: loaders order by release.
        completion("b1", version="v2", ts=day2, latency_ms=40.0),
        feedback("b1", "accept", version="v2", ts=day2 + timedelta(seconds=3)),
        completion("a1", latency_ms=10.0), feedback("a1", "accept"),
        completion("a2", latency_ms=20.0, bucket="abs"), feedback("a2", "reject"),
        completion("a3", latency_ms=30.0, text="x*2+1\n"), feedback("a3", "edit", kept_text="x*2 + 1\n"),
        completion("a4", latency_ms=40.0, ts=day2),
        feedback("a4", "reject", ts=day2 + timedelta(seconds=1)),
        feedback("a4", "accept", ts=day2 + timedelta(seconds=9)),  # revised: the accept counts
        completion("a5", latency_ms=50.0),  # served, never judged
    ]
    send(settings, events)
    send(settings, [ModelVersionEvent(model="tiny-coder", version="v1", action="published", ts=T0 - timedelta(days=2)),
                    ModelVersionEvent(model="tiny-coder", version="v2", action="published", ts=T0 - timedelta(days=1))],
         topic=settings.bus.versions_topic)
    ing = Ingester(settings)
    ing.drain(timeout_s=30)
    ing.close()


def test_loaders_compute_rates_latency_and_edit_distance(tmp_path: Path, db_url: str) -> None:
    s = make_settings(tmp_path, db_url)
    _populate(s)
    engine = analytics.connect_readonly(db_url)
    try:
        by_version = analytics.accept_rate_by_version(engine)
        assert list(by_version["version"]) == ["v1", "v2"]
        v1 = by_version.iloc[0]
        assert (v1.n_feedback, v1.n_accept, v1.n_edit, v1.n_reject) == (4, 2, 1, 1)
        assert v1.accept_rate == pytest.approx(0.5) and v1.edit_rate == pytest.approx(0.25)
        assert 0.0 < v1.accept_ci_low < 0.5 < v1.accept_ci_high < 1.0
        assert by_version.iloc[1].accept_rate == 1.0

        by_day = analytics.accept_rate_by_day(engine)
        day1 = by_day[(by_day["version"] == "v1")].set_index("day")["n_feedback"]
        assert list(day1) == [3, 1] and day1.index[1] - day1.index[0] == timedelta(days=1)

        by_bucket = analytics.accept_rate_by_bucket(engine).set_index(["task_bucket", "version"])
        assert by_bucket.loc[("abs", "v1"), "reject_rate"] == 1.0
        assert by_bucket.loc[("affine", "v1"), "n_feedback"] == 3

        latency = analytics.latency_by_version(engine).set_index("version")
        assert latency.loc["v1", "n_completions"] == 5  # the unjudged completion counts here
        assert latency.loc["v1", "p50_ms"] == 30.0 and latency.loc["v1", "max_ms"] == 50.0

        edits = analytics.edit_distances(engine)
        assert list(edits["distance"]) == [2] and edits["relative"].iloc[0] == pytest.approx(2 / 8)
        assert analytics.edit_distance_by_version(engine).iloc[0]["n_edits"] == 1
        assert str(analytics.read_view(engine, "v_feedback_latest")["completion_at"].dt.tz) == "UTC"

        with pytest.raises(ValueError, match="unknown view"):
            analytics.read_view(engine, "completions")
        with engine.connect() as conn, pytest.raises(sa.exc.DBAPIError):
            conn.execute(sa.text("DELETE FROM feedback"))
    finally:
        engine.dispose()


def test_levenshtein() -> None:
    assert analytics.levenshtein("", "abc") == 3
    assert analytics.levenshtein("kitten", "sitting") == 3
    assert analytics.levenshtein("same", "same") == 0


def test_notebook_executes_against_a_populated_database(tmp_path: Path, monkeypatch) -> None:
    import nbclient
    import nbformat

    url = f"sqlite:///{tmp_path / 'feedback.db'}"
    _populate(make_settings(tmp_path, url))
    figure = tmp_path / "accept_rate.png"
    monkeypatch.setenv("RTRL_DB__URL", url)
    monkeypatch.setenv("FEEDBACK_NOTEBOOK_FIGURE", str(figure))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2
    first_table = nb.cells[1].outputs[0]["data"]["text/plain"]
    assert "v1" in first_table and "v2" in first_table
    assert figure.stat().st_size > 1000
