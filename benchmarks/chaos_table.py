"""The "what survives what" table of docs/operations.md, rendered from a `rtrl bench chaos --json` line.

``python -m benchmarks.chaos_table [RESULTS.jsonl] [DOC.md]`` renders the last line of the results file
(default ``benchmarks/results/chaos.jsonl``) and replaces the block between the two markers in the
document (default ``docs/operations.md``), so the table is regenerated from a run, never typed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

START, END = "<!-- chaos-table:start -->", "<!-- chaos-table:end -->"
FAULTS = {
    "ingester_kill9": "ingester killed (-9), restarted",
    "bus_restart": "Kafka broker killed and restarted",
    "bus_outage": "embedded bus log locked (producers time out)",
    "postgres_restart": "PostgreSQL restarted (immediate stop)",
    "updater_kill9_mid_publish": "updater killed (-9) while writing a version",
    "engine_kill9": "gateway's engine process killed (-9) under load",
    "spill_disk_full": "gateway's spill disk full during the bus outage",
    "malformed_events": "bursts of malformed events on the bus",
}
STACK_NAMES = {"embedded": "embedded defaults", "kafka_postgres": "Kafka + PostgreSQL"}


def _fault_cell(stack: dict, name: str) -> str:
    n = stack["faults_injected"].get(name, 0)
    if not n:
        return "not injected"
    rec = stack.get("recovery_s", {}).get(name)
    return f"{n}x, back in {rec:g} s" if rec is not None else f"{n}x"


def _outcome_rows(stacks: list[dict]) -> list[tuple[str, list[str]]]:
    def ratio(s: dict, a: str, b: str) -> str:
        return f"{s[a]} of {s[b]}"

    return [
        ("completions served / in the tables", [ratio(s, "completions_in_db", "completions_served") for s in stacks]),
        ("served, refused by the ingester (dead letter)",
         [f"{s.get('served_dead_lettered', 0)} ({'; '.join(s.get('served_dead_lettered_reasons', [])) or '-'})"
          for s in stacks]),
        ("feedback accepted / in the tables", [ratio(s, "feedback_in_db", "feedback_accepted") for s in stacks]),
        ("lost / duplicated", [f"{s['lost']} / {s['duplicates']}" for s in stacks]),
        ("spill writes refused (disk full) / events dropped",
         [f"{int(s['gateway_metrics'].get('rtrl_events_spill_errors_total', 0))} / "
          f"{int(s['gateway_metrics'].get('rtrl_events_dropped_total', 0))}" for s in stacks]),
        ("half-published registry versions", [str(s["half_published_versions"]) for s in stacks]),
        ("malformed events dead-lettered", [ratio(s, "malformed_dead_lettered", "malformed_sent") for s in stacks]),
        ("forged or replayed feedback accepted", [ratio(s, "forged_accepted", "forged_sent") for s in stacks]),
        ("requests failed (outside an engine kill)",
         [f"{s['failed_requests']} of {s['requests']} ({s['failed_outside_engine_kills']})" for s in stacks]),
    ]


def render(result: dict) -> str:
    """Markdown: one column per stack, one row per fault (how often, how long until it worked again),
    then the reconciliation."""
    stacks = list(result["stacks"].values())
    head = "| | " + " | ".join(STACK_NAMES.get(s["stack"], s["stack"]) for s in stacks) + " |"
    lines = [head, "|---" * (len(stacks) + 1) + "|"]
    for name, label in FAULTS.items():
        lines.append(f"| {label} | " + " | ".join(_fault_cell(s, name) for s in stacks) + " |")
    for label, cells in _outcome_rows(stacks):
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    load = f"load {result.get('loadavg_1m_start')} at start, {result.get('cpu_count')} cores"
    lines.append("")
    lines.append(f"From `rtrl bench chaos --json` ({result.get('wall_s')} s, {load}); regenerate with "
                 "`python -m benchmarks.chaos_table`.")
    return "\n".join(lines)


def update_doc(doc: Path, table: str) -> None:
    text = doc.read_text()
    start, end = text.index(START) + len(START), text.index(END)
    doc.write_text(text[:start] + "\n" + table + "\n" + text[end:])


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    results = Path(args[0] if args else "benchmarks/results/chaos.jsonl")
    doc = Path(args[1] if len(args) > 1 else "docs/operations.md")
    last = [line for line in results.read_text().splitlines() if line.strip()][-1]
    update_doc(doc, render(json.loads(last)))
    print(f"{doc}: table rendered from the last line of {results}")


if __name__ == "__main__":
    main()
