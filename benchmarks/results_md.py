"""Render ``docs/results.md`` from the measured runs in ``benchmarks/results/*.jsonl``.

Every full (not ``--quick``) ``rtrl bench NAME`` run appends its JSON line to
``benchmarks/results/NAME.jsonl``; this module turns those files into one page: per benchmark, its
headline figures for each recorded run (newest first) with the machine record that lets a reader
judge them (date, Python speed, load, threads). Nothing on the page is typed by hand.

    python -m benchmarks.results_md            # rewrite docs/results.md
    python -m benchmarks.results_md --check    # exit 1 if docs/results.md is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "results.md"
MACHINE_COLUMNS = [("date", "date"), ("python loop ms", "python_loop_ms"), ("load", "loadavg_1m_start"),
                   ("threads", "threads")]
HEADLINES: dict[str, list[tuple[str, str]]] = {
    "learning": [("env", "env"), ("mid-trained, best T", "midtrain_best_t"), ("control, best T", "control_best_t"),
                 ("GRPO, best T", "grpo_best_t"), ("GRPO at serving T", "grpo_at_serving_t"),
                 ("gain vs mid-trained", "gain_vs_midtrain_detail"), ("gain vs control", "gain_vs_control_detail"),
                 ("GRPO s", "grpo_s"), ("wall s", "wall_s")],
    "grpo": [("ours sync s/step", "ours_sync_sec_per_step"), ("ours async s/step", "ours_async_sec_per_step"),
             ("TRL s/step", "trl_sec_per_step"), ("x TRL", "ratio_vs_trl"), ("async / sync", "async_over_sync"),
             ("multi-turn sync s/step", "multi_turn.ours_sync_sec_per_step"),
             ("multi-turn async s/step", "multi_turn.ours_async_sec_per_step")],
    "gateway": [("engine", "engine"), ("engine process", "engine_process"), ("overhead p50 ms", "overhead_p50_ms"), ("overhead p99 ms", "overhead_p99_ms"),
                ("vs vllm serve", "overhead_ratio_vs_vllm_server"),
                ("latency vs vllm serve", "latency_ratio_vs_vllm_server"), ("swap pause max ms", "swap_pause_ms_max"),
                ("failed during swaps", "failed_requests_during_swaps"), ("rps", "rps")],
    "ingest": [("cells", "results")],
    "online": [("population", "population"), ("releases", "cells.realistic.releases"),
               ("first accept", "cells.realistic.first_accept"), ("first CI", "cells.realistic.first_ci"),
               ("last accept", "cells.realistic.last_accept"), ("last CI", "cells.realistic.last_ci"),
               ("relative gain", "relative_gain"), ("CIs apart", "ci_separated"),
               ("last release, best T", "controls.best.last"), ("base, best T", "controls.best.base"),
               ("matched-compute control, best T", "controls.best.control"),
               ("gain vs base", "controls.gain_vs_base_best"), ("gain vs control", "controls.gain_vs_control_best"),
               ("unseen tasks: gain vs base", "controls.unseen.gain_vs_base_best"),
               ("vs control", "controls.unseen.gain_vs_control_best"),
               ("gain, 10% adversarial", "relative_gain_adversarial"), ("over", "adversarial_gain_over"),
               ("same, all users", "relative_gain_adversarial_all_users"), ("ratio", "adversarial_gain_ratio"),
               ("gate refused: realistic", "refusals.realistic.refused"),
               ("adversarial", "refusals.adversarial.refused"), ("by check", "refusals.adversarial.by_check"),
               ("sabotage: broken", "sabotage.broken"), ("refused", "sabotage.refused_broken"),
               ("regressions shipped", "sabotage.regressions_shipped"), ("OPE MAE", "ope_mae"),
               ("cycles", "cycles"), ("requests per cycle", "requests_per_cycle"), ("wall s", "total_s")],
    "demo": [("env", "env"), ("releases", "releases"), ("first accept", "first_accept"), ("first CI", "first_ci"),
             ("last accept", "last_accept"), ("last CI", "last_ci"), ("relative gain", "relative_gain"),
             ("CIs apart", "ci_separated"), ("releases >= gate", "released_at_or_above_gate"),
             ("gate refused", "gate_refused"), ("of", "gate_decisions"), ("OPE MAE", "ope_mae"),
             ("failed requests", "requests_failed"), ("demo s", "demo_s")],
    "scale": [("trainer samples/s at 1, 2 ranks", "trainer.samples_per_s"), ("trainer x", "trainer.speedup"),
              ("CPU bound x", "cpu_floor.trainer_speedup_bound"),
              ("rollout tokens/s at 1, 2 workers", "rollout.tokens_per_s"), ("rollout x", "rollout.speedup"),
              ("CPU bound x ", "cpu_floor.rollout_speedup_bound"), ("loss rel diff, 5 steps", "fsdp_loss_max_rel_diff"),
              ("params per rank", "param_fraction_per_rank"), ("device", "device")],
    "router-replay": [("device", "device"), ("min KL reduction, flipped tokens", "goals.min_kl_reduction_flipped"),
                      ("its 95% CI", "goals.min_kl_reduction_flipped_ci95"),
                      ("min KL reduction, whole batch", "goals.min_kl_reduction_where_routes_disagree"),
                      ("its 95% CI", "goals.min_kl_reduction_ci95"),
                      ("max abs Δlogp replayed, staleness 0 fp32", "goals.max_abs_dlogp_replay_staleness0_fp32"),
                      ("same, fp64", "goals.max_abs_dlogp_replay_staleness0_fp64"),
                      ("max replay overhead", "goals.max_recompute_overhead"),
                      ("route bytes per token and layer", "goals.max_bytes_per_token_routes"), ("cells", "cells")],
    "summarise": [("budget tokens", "budget_tokens"), ("trained summaries", "best_t.trained|trained"),
                  ("untrained summaries", "best_t.untrained|untrained"), ("control", "best_t.control"),
                  ("truncation", "best_t.truncation|truncation"), ("no budget", "best_t.no_budget|no_budget"), ("x truncation", "trained_over_truncation"),
                  ("x untrained", "trained_over_untrained"), ("gain vs untrained", "gain_vs_untrained"),
                  ("gain vs control", "gain_vs_control"), ("summary tokens", "summary_tokens_mean"),
                  ("summary / context", "compression_ratio"), ("segments", "segments_mean"),
                  ("rule kept", "summaries.trained.fact_kept|trained_detail.fact_kept"),
                  ("rule kept untrained", "summaries.untrained.fact_kept|untrained_detail.fact_kept"),
                  ("start mid-train steps", "start_midtrain_steps"),
                  ("GRPO steps", "grpo_steps"), ("GRPO T", "grpo_temperature"),
                  ("summary token weight", "summary_token_weight"), ("wall s", "wall_s")],
    "chaos": [("requests", "requests"), ("failed", "failed_requests"),
              ("failed outside engine kills", "failed_outside_engine_kills"), ("lost", "lost"),
              ("duplicates", "duplicates"), ("half-published", "half_published_versions"),
              ("malformed sent", "malformed_sent"), ("dead-lettered", "malformed_dead_lettered"),
              ("forged accepted", "forged_accepted"), ("faults", "faults_injected"), ("recovery s max", "recovery_s_max")],
}
SKIP = {key for _, key in MACHINE_COLUMNS} | {"cpu_model", "bench", "cpu_count", "loadavg_5m_start", "loadavg_1m_end", "python", "machine", "quick"}


def _get(record: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path``; ``a|b``: the first of the two paths present (a key renamed)."""
    if "|" in path:
        return next((v for v in (_get(record, p) for p in path.split("|")) if v is not None), None)
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict) and "pass_at_1" in value:
        ci = value.get("ci95")
        return f"{value['pass_at_1']:.3f} (T={value.get('t')})" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
    if isinstance(value, dict) and "accept" in value:
        ci = value.get("ci95")
        return f"{value['accept']:.3f} (T={value.get('t')})" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")
    if isinstance(value, dict) and "gain" in value:
        ci = value.get("ci95")
        return f"{value['gain']:+.3f}" + (f" [{ci[0]:+.3f}, {ci[1]:+.3f}]" if ci else "")
    if isinstance(value, dict) and {"p50", "p99"} <= value.keys():
        return f"p50 {_fmt(value['p50'])}, p99 {_fmt(value['p99'])}"
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return "[" + ", ".join(f"{v:.3f}" for v in value) + "]"
    if isinstance(value, list) and value and isinstance(value[0], dict):
        return "<br>".join(", ".join(f"{k}={_fmt(v)}" for k, v in cell.items() if not isinstance(v, dict | list))
                           for cell in value)
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))[:200]
    return str(value)


def _columns(name: str, runs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    if name in HEADLINES:
        return HEADLINES[name]
    keys: list[str] = []
    for run in runs:
        keys += [k for k, v in run.items() if k not in SKIP and k not in keys and not isinstance(v, dict | list)]
    return [(k, k) for k in keys[:10]]


def section(name: str, runs: list[dict[str, Any]], limit: int = 8) -> str:
    cols = MACHINE_COLUMNS + _columns(name, runs)
    lines = [f"## {name}", "", f"`rtrl bench {name} --json`: {len(runs)} recorded run(s), newest first.", "",
             "| " + " | ".join(label for label, _ in cols) + " |", "|" + "---|" * len(cols)]
    for run in reversed(runs[-limit:]):
        lines.append("| " + " | ".join(_fmt(_get(run, key)) for _, key in cols) + " |")
    return "\n".join(lines) + "\n"



def read_runs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def render(files: Iterable[Path]) -> str:
    parts = ["# Measured results", "",
             "Generated by `python -m benchmarks.results_md` from `benchmarks/results/*.jsonl` (one JSON line per "
             "full `rtrl bench NAME` run). Absolute times depend on the host: compare runs through "
             "`python loop ms` (the best of five timings of a fixed pure-Python loop; higher is a slower "
             "host) and the load they ran under; ratios against a peer measured in the same run travel better.",
             ""]
    for path in sorted(files):
        runs = read_runs(path)
        if runs:
            parts.append(section(path.stem, runs))
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/results.md is out of date")
    args = ap.parse_args(argv)
    text = render(RESULTS.glob("*.jsonl"))
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run python -m benchmarks.results_md", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
