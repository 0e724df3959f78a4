"""`rtrl bench chaos --quick`: the online loop on the embedded defaults under ingester kills, a bus
outage with a full spill disk, malformed events and forged feedback; nothing served is lost or
duplicated, every malformed event is a dead letter, no forged token is accepted. And the operations
doc's table renders from such a result."""

from __future__ import annotations

from pathlib import Path

from benchmarks import chaos, chaos_table


def test_quick_chaos_run_loses_nothing(tmp_path: Path, monkeypatch, tiny_model_dir: Path) -> None:
    from rtrl.config import load_settings

    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    result = chaos.run(load_settings(), quick=True, log=lines.append, model_dir=tiny_model_dir)
    s = result["stacks"]["embedded"]
    assert s["faults_injected"]["ingester_kill9"] == chaos.QUICK.ingester_kills
    assert s["faults_injected"]["bus_outage"] == 1 and s["faults_injected"]["spill_disk_full"] == 1
    assert s["gateway_metrics"]["rtrl_events_spill_errors_total"] >= 1  # the full disk was hit, and said so
    assert s["completions_served"] > 10 and s["feedback_accepted"] > 10
    assert s["lost"] == 0 and s["duplicates"] == 0, (s["lost_samples"], lines)
    assert s["malformed_sent"] == 8 and s["malformed_dead_lettered"] == 8 and s["malformed_in_tables"] == 0
    assert s["forged_sent"] > 0 and s["forged_accepted"] == 0
    assert s["half_published_versions"] == 0 and s["failed_outside_engine_kills"] == 0
    assert result["goal_met"] is s["goal_met"] is True

    doc = tmp_path / "ops.md"
    doc.write_text(f"# x\n{chaos_table.START}\nold\n{chaos_table.END}\ntail\n")
    chaos_table.update_doc(doc, chaos_table.render({**result, "wall_s": 1.0}))
    text = doc.read_text()
    assert "old" not in text and text.endswith(f"{chaos_table.END}\ntail\n")
    assert "| ingester killed (-9), restarted | 2x, back in" in text
    assert "| malformed events dead-lettered | 8 of 8 |" in text
