"""What every `rtrl bench` result line carries about the machine it ran on."""

from __future__ import annotations

import json
import math

from typer.testing import CliRunner

from rtrl import bench


def test_machine_record_names_the_machine_and_its_python_speed() -> None:
    record = bench.machine_record(threads=3)
    assert record["threads"] == 3
    assert record["cpu_count"] >= 1
    assert isinstance(record["cpu_model"], str) and record["cpu_model"]
    assert math.isfinite(record["python_loop_ms"]) and record["python_loop_ms"] > 0
    assert {"loadavg_1m_start", "loadavg_5m_start", "python", "machine"} <= record.keys()


def test_python_speed_scales_with_the_work(monkeypatch) -> None:
    """The calibration times the loop it names: 20x the iterations take clearly longer (best-of
    timings, so load can only push the small one up, never the large one down below it)."""
    monkeypatch.setattr(bench, "CALIBRATION_LOOP", 20_000)
    small = bench.python_speed_ms(repeats=3)
    monkeypatch.setattr(bench, "CALIBRATION_LOOP", 400_000)
    large = bench.python_speed_ms(repeats=3)
    assert large > 3 * small


def test_bench_command_prints_the_machine_record_in_its_json_line(monkeypatch, tmp_path) -> None:
    import typer

    from policy.cli_settings import CommandContext
    from rtrl.cli import load_settings_or_exit

    app = typer.Typer(context_settings={"obj": CommandContext(load_settings_or_exit)})
    bench.register(app)

    @app.command("noop")
    def _noop() -> None:
        """A second command: with one, typer would collapse the app into `bench` itself."""

    monkeypatch.setitem(bench.BENCHMARKS, "probe", "tests.test_bench_record:_probe_run")
    monkeypatch.setattr(bench, "RESULTS_DIR", tmp_path)
    result = CliRunner().invoke(app, ["bench", "probe", "--json"])
    assert result.exit_code == 0, result.output
    line = json.loads(result.output.strip().splitlines()[-1])
    assert line["bench"] == "probe" and line["value"] == 42
    assert line["python_loop_ms"] > 0 and "cpu_model" in line and "wall_s" in line
    # A full run is kept in the results file; a --quick one (a smoke test) is not.
    assert [json.loads(x) for x in (tmp_path / "probe.jsonl").read_text().splitlines()] == [line]
    assert CliRunner().invoke(app, ["bench", "probe", "--json", "--quick"]).exit_code == 0
    assert len((tmp_path / "probe.jsonl").read_text().splitlines()) == 1


def _probe_run(settings, quick: bool, log) -> dict:
    log("probe running")
    return {"value": 42}


def test_results_page_is_generated_from_the_recorded_runs() -> None:
    """docs/results.md is what `python -m benchmarks.results_md` makes of benchmarks/results/*.jsonl."""
    from benchmarks import results_md

    assert results_md.main(["--check"]) == 0, "docs/results.md is stale: run python -m benchmarks.results_md"
