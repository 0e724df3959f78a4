"""`rtrl bench gateway --quick`: every phase runs against a live gateway on the process engine (paired
overhead, the HTTP floor, throughput, five hot swaps under load) and reports what the JSON line
promises. Speed itself is for the benchmark command, not for this test: only counts and the shape of
the result are checked."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks import gateway as bench_gateway


def test_quick_bench_runs_every_phase_without_a_failed_request(tmp_path: Path, tiny_model_dir: Path) -> None:
    from rtrl.config import load_settings

    settings = load_settings(var_dir=str(tmp_path / "var"), model={"dir": str(tiny_model_dir), "threads": 1})
    lines: list[str] = []
    out = bench_gateway.run(settings, quick=True, log=lines.append)
    assert out["engine"] == "torch" and out["engine_process"] is True
    assert out["paired_requests"] == 60
    for key in ("overhead_p50_ms", "overhead_p99_ms", "http_floor_p50_ms", "http_floor_p99_ms",
                "http_floor_bare_p50_ms", "http_floor_warm_p50_ms",
                "server_overhead_p50_ms", "direct_latency_p50_ms", "gateway_latency_p50_ms", "rps", "rps_direct"):
        assert math.isfinite(out[key]), key
    assert out["http_floor_p50_ms"] > 0 and out["rps"] > 0 and out["direct_latency_p50_ms"] > 0
    assert out["overhead_p50_ms"] <= out["overhead_p99_ms"]
    # Five swaps under load, each seen by the engine, none failing a request; nothing left unsent.
    assert out["swaps"] == 5 and len(out["swap_pause_ms"]) == 5 and out["requests_during_swaps"] > 0
    assert out["failed_requests_during_swaps"] == 0 and out["errors_during_throughput"] == 0
    assert out["events_pending_at_stop"] == 0
    assert any(line.startswith("HTTP floor") for line in lines)
