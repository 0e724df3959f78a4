"""`rtrl bench demo`: what a new user sees from `make demo`, recorded like every other measurement.

Runs ``rtrl demo --json`` (``--fast`` with ``--quick``) in a fresh directory with the default
settings: the command runs as a child process with no ``RTRL_*`` variable and no ``--config`` passed
on, as on a fresh clone. The record is the online stage's curve: the first served version's and the
last release's accept rate with their 95% CIs, the relative gain and whether the intervals are apart,
every version's offline pass@1 against the gate, the gate's refusals and the off-policy estimate's
error, and the accept rate per kind of user; beside it the offline stage's controls and each stage's
seconds.

This is the job, not a controlled experiment: the learning claim for real-time releases (against the
starting model at its best temperature and a matched-compute control) is ``rtrl bench online``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _curve(online: dict[str, Any], gate: float) -> dict[str, Any]:
    """The online summary's served versions, first and last, in the bench record's terms."""
    served = [v for v in online["versions"] if v["released"] and v["accept_rate"] is not None]
    first, last = (served[0], served[-1]) if served else ({}, {})
    released = [v for v in online["versions"] if v["released"] and v["offline_pass_at_1"] is not None]
    return {
        "releases": sum(v["decision"] == "released" for v in online["versions"]),
        "first_accept": first.get("accept_rate"), "first_ci": first.get("ci"),
        "last_accept": last.get("accept_rate"), "last_ci": last.get("ci"),
        "relative_gain": online["relative_gain"], "ci_separated": online["ci_separated"],
        "released_at_or_above_gate": all(v["offline_pass_at_1"] >= gate for v in released),
        "offline_pass_at_1": [v["offline_pass_at_1"] for v in released],
        "per_kind_first": first.get("per_kind"), "per_kind_last": last.get("per_kind"),
        "gate_decisions": online["gate"]["decisions"], "gate_refused": online["gate"]["refused"],
        "refusal_reasons": online["gate"]["refusal_reasons"], "ope_mae": online["ope_mae"],
    }


def run(settings, quick: bool = False, log: Callable[[str], None] = print) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-m", "rtrl", "demo", "--json", *(["--fast"] if quick else [])]
    with tempfile.TemporaryDirectory(prefix="rtrl-bench-demo-") as work:
        log(f"demo: {' '.join(cmd[2:])} in {work} (default settings)")
        # The demo's progress goes to this command's stderr as it runs; its JSON line comes on stdout.
        proc = subprocess.run(cmd, cwd=work, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the demo failed (exit {proc.returncode}; its log is above)")
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
        summary_file = json.loads((Path(work) / "var" / "report" / "summary.json").read_text())
    if summary_file["online"] != json.loads(json.dumps(summary["online"])):
        raise RuntimeError("var/report/summary.json disagrees with the summary the demo printed")
    out = {"env": summary["env"], "fast": quick, **_curve(summary["online"], summary["gate"]),
           "gate": summary["gate"], "requests_failed": summary["failed_requests"],
           "offline_pass_at_1_before": summary["pass_at_1_before"],
           "offline_pass_at_1_after": summary["pass_at_1_after"],
           "offline_gains_at_best_t": (summary["controls"] or {}).get("gains"),
           "stage_seconds": summary["stage_seconds"], "demo_s": summary["this_run_s"]}
    if out["relative_gain"] is not None:
        log(f"demo: accept {out['first_accept']:.3f} -> {out['last_accept']:.3f} over {out['releases']} releases "
            f"({out['relative_gain']:+.1%}, intervals apart: {out['ci_separated']})")
    return out
