"""The lifecycle report: ``var/report/index.html`` with PNG plots, and a terminal summary table.

Inputs are plain data gathered by the demo from the rooms (GRPO metrics log, feedback tables,
registry manifests, gateway swap timings), so the report can be rebuilt from a finished run.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


@dataclass
class VersionRow:
    version: str
    stage: str
    accept_rate: float | None = None
    ci: tuple[float, float] | None = None
    n_feedback: int = 0
    offline_pass_at_1: float | None = None
    ope_estimate: float | None = None
    delta_bytes: int | None = None
    raw_bytes: int | None = None
    kind: str = ""
    released: bool = True
    note: str = ""
    per_kind: dict[str, tuple[float, float, float, int]] = field(default_factory=dict)  # kind -> rate, lo, hi, n
    decision: str = "offline"


@dataclass
class ReportData:
    gate: float
    grpo_curve: list[tuple[int, float]] = field(default_factory=list)
    pass_before: float | None = None
    pass_after: float | None = None
    versions: list[VersionRow] = field(default_factory=list)
    swap_pauses_ms: list[float] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    gate_decisions: list[dict[str, str]] = field(default_factory=list)
    controls: dict[str, Any] | None = None
    """The ``controls`` stage (:meth:`offline_rl.compare.Comparison.to_dict` plus ``control_seconds``):
    GRPO against the mid-trained model and the matched-compute control, each at its best temperature."""
    mismatch: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per stage (offline GRPO, real-time updates): the train/inference gap metrics averaged over its
    steps or update runs (:func:`summarise_mismatch`)."""


MISMATCH_COLUMNS = {
    "mismatch_kl_k3": "k3 KL (as trained)",
    "mismatch_extreme_frac": "|Δlogp| > ln 2",
    "router_kl_k3_off": "k3 KL, routers free",
    "router_kl_k3_replay": "k3 KL, routes replayed",
    "router_extreme_frac_off": "|Δlogp| > ln 2, free",
    "router_extreme_frac_replay": "|Δlogp| > ln 2, replayed",
    "route_disagreement": "routes differ",
}
"""The gap metrics the report shows (the router ones only exist for mixture-of-experts models)."""


def summarise_mismatch(records: list[dict]) -> dict[str, float]:
    """Mean of each :data:`MISMATCH_COLUMNS` metric over the records that carry it."""
    out = {}
    for key in MISMATCH_COLUMNS:
        values = [float(r[key]) for r in records if isinstance(r.get(key), int | float)]
        if values:
            out[key] = sum(values) / len(values)
    return out


def online_summary(data: ReportData) -> dict:
    """The online stage in serving order: every version the run produced (refused candidates marked),
    its realised accept rate with 95% CI, per user kind, offline pass@1 and the gate's off-policy
    estimate; the gate's refusals with reasons; and how well the estimate predicted the realised rate
    (mean absolute error over released versions that have both)."""
    versions = [{"version": v.version, "released": v.released, "decision": v.decision,
                 "accept_rate": v.accept_rate, "ci": list(v.ci) if v.ci else None, "n_feedback": v.n_feedback,
                 "offline_pass_at_1": v.offline_pass_at_1, "ope_estimate": v.ope_estimate,
                 "per_kind": {k: {"accept_rate": r, "ci": [lo, hi], "n": n} for k, (r, lo, hi, n)
                              in sorted(v.per_kind.items())}} for v in data.versions]
    pairs = [(v.ope_estimate, v.accept_rate) for v in data.versions
             if v.released and v.ope_estimate is not None and v.accept_rate is not None]
    refused = [d for d in data.gate_decisions if d["decision"] == "refused"]
    served = [v for v in versions if v["released"] and v["accept_rate"] is not None]
    first, last = (served[0], served[-1]) if served else (None, None)
    gain = ((last["accept_rate"] - first["accept_rate"]) / first["accept_rate"]
            if first and last and first is not last and first["accept_rate"] else None)
    return {"versions": versions, "relative_gain": gain,
            "ci_separated": bool(first and last and first is not last and last["ci"][0] > first["ci"][1]),
            "gate": {"decisions": len(data.gate_decisions), "refused": len(refused),
                     "refusal_reasons": [d["reason"] for d in refused]},
            "ope_mae": sum(abs(e - r) for e, r in pairs) / len(pairs) if pairs else None, "ope_pairs": len(pairs)}


def write_summary(data: ReportData, out_dir: str | Path) -> Path:
    """``summary.json``: ``{"online": online_summary(data)}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "summary.json"
    path.write_text(json.dumps({"online": online_summary(data)}, indent=2, default=str))
    return path


def _plots(data: ReportData, out: Path) -> list[tuple[str, str]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures: list[tuple[str, str]] = []

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    if data.grpo_curve:
        steps, rates = zip(*data.grpo_curve, strict=True)
        ax.plot(steps, rates, marker="o", label="held-out pass@1")
    ax.axhline(data.gate, color="tab:red", linestyle="--", label=f"gate {data.gate:.2f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("pass@1")
    ax.set_title("Offline GRPO: held-out pass rate")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "grpo_pass_rate.png")
    plt.close(fig)
    figures.append(("grpo_pass_rate.png", "Held-out pass@1 over GRPO steps, with the quality gate."))

    served = [v for v in data.versions if v.accept_rate is not None]
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    if served:
        xs = range(len(served))
        rates = [v.accept_rate for v in served]
        lo = [v.accept_rate - v.ci[0] if v.ci else 0 for v in served]
        hi = [v.ci[1] - v.accept_rate if v.ci else 0 for v in served]
        ax.errorbar(xs, rates, yerr=[lo, hi], fmt="o-", capsize=4, label="realised accept rate (95% CI)")
        ope = [(i, v.ope_estimate) for i, v in enumerate(served) if v.ope_estimate is not None]
        if ope:
            ax.scatter([i for i, _ in ope], [e for _, e in ope], marker="x", color="tab:green",
                       label="off-policy estimate before release", zorder=3)
        ax.set_xticks(list(xs), [v.version[:8] for v in served], rotation=20)
    ax.set_ylabel("accept rate")
    ax.set_title("Real-time RL: accept rate by version")
    ax.set_ylim(0, 1)
    if served:
        ax.legend(loc="upper left", fontsize=8)
    else:
        ax.text(0.5, 0.5, "no version has been judged by users yet", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "accept_rate.png")
    plt.close(fig)
    figures.append(("accept_rate.png", "Accept rate of each served version with 95% confidence intervals."))

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    kinds = sorted({k for v in served for k in v.per_kind})
    for kind in kinds:
        pts = [(i, v.per_kind[kind]) for i, v in enumerate(served) if kind in v.per_kind]
        ax.errorbar([i for i, _ in pts], [p[0] for _, p in pts], yerr=[[p[0] - p[1] for _, p in pts],
                    [p[2] - p[0] for _, p in pts]], fmt="o-", capsize=3, label=kind)
    if served:
        ax.set_xticks(range(len(served)), [v.version[:8] for v in served], rotation=20)
    ax.set_ylabel("accept rate")
    ax.set_title("Accept rate by kind of user")
    ax.set_ylim(0, 1)
    if kinds:
        ax.legend(loc="upper left", fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "accept_rate_by_kind.png")
    plt.close(fig)
    figures.append(("accept_rate_by_kind.png", "Accept rate of each served version per kind of simulated user "
                    "(95% CIs)."))

    sized = [v for v in data.versions if v.delta_bytes]
    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    if sized:
        colors = ["tab:gray" if v.kind == "snapshot" else "tab:blue" for v in sized]
        ax.bar(range(len(sized)), [v.delta_bytes / 1e6 for v in sized], color=colors)
        ax.set_xticks(range(len(sized)), [v.version[:8] for v in sized], rotation=20)
        for i, v in enumerate(sized):
            if v.raw_bytes:
                ax.annotate(f"{v.raw_bytes / v.delta_bytes:.0f}x", (i, v.delta_bytes / 1e6), ha="center",
                            va="bottom", fontsize=8)
    ax.set_ylabel("stored MB")
    ax.set_title("Registry: bytes stored per version (grey = full snapshot)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "delta_size.png")
    plt.close(fig)
    figures.append(("delta_size.png", "Bytes stored per version; labels give the ratio to the raw tensor bytes (the tiny model is fp32)."))

    fig, ax = plt.subplots(figsize=(6, 3.4), dpi=110)
    if data.swap_pauses_ms:
        ax.bar(range(1, len(data.swap_pauses_ms) + 1), data.swap_pauses_ms, color="tab:purple")
        ax.set_xticks(range(1, len(data.swap_pauses_ms) + 1))
    ax.set_xlabel("hot swap #")
    ax.set_ylabel("pause (ms)")
    ax.set_title("Gateway: inference pause per weight swap")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(out / "swap_pauses.png")
    plt.close(fig)
    figures.append(("swap_pauses.png", "How long each hot swap held new requests back."))
    return figures


def _fmt(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def write_report(data: ReportData, out_dir: str | Path) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    figures = _plots(data, out)
    rows = "\n".join(
        "<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in (
            v.version[:12], v.stage, "yes" if v.released else "refused", _fmt(v.offline_pass_at_1),
            _fmt(v.accept_rate), f"[{_fmt(v.ci[0])}, {_fmt(v.ci[1])}]" if v.ci else "–", v.n_feedback,
            _fmt(v.ope_estimate), v.note)) + "</tr>"
        for v in data.versions
    )
    imgs = "\n".join(f'<figure><img src="{name}" alt="{html.escape(cap)}"><figcaption>{html.escape(cap)}'
                     f"</figcaption></figure>" for name, cap in figures)
    stages = ", ".join(f"{k} {v:.0f} s" for k, v in data.stage_seconds.items())
    gap_rows = "\n".join(
        f"<tr><td>{html.escape(stage)}</td>" + "".join(f"<td>{_fmt(vals.get(k), 4)}</td>" for k in MISMATCH_COLUMNS)
        + "</tr>" for stage, vals in data.mismatch.items())
    gap_head = "".join(f"<th>{html.escape(name)}</th>" for name in MISMATCH_COLUMNS.values())
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>rtrl lifecycle report</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2rem auto; max-width: 1100px; color: #222; }}
.grid {{ display: grid; grid-template-columns: 1fr 1fr; gap: 1rem; }}
figure {{ margin: 0; }} img {{ width: 100%; border: 1px solid #ddd; }}
figcaption {{ font-size: .85rem; color: #555; }}
table {{ border-collapse: collapse; width: 100%; font-size: .9rem; }}
td, th {{ border-bottom: 1px solid #e5e5e5; padding: .3rem .5rem; text-align: left; }}
.kpi {{ display: flex; gap: 2rem; margin: 1rem 0; }} .kpi div {{ font-size: 1.4rem; }}
.kpi span {{ display: block; font-size: .8rem; color: #666; }}
</style></head><body>
<h1>rtrl lifecycle report</h1>
<p>Offline GRPO to the quality gate, then real-time releases from simulated users' feedback.</p>
<div class="kpi">
<div>{_fmt(data.pass_before)} → {_fmt(data.pass_after)}<span>held-out pass@1, before → after GRPO</span></div>
<div>{data.gate:.2f}<span>quality gate</span></div>
<div>{sum(1 for v in data.versions if v.stage == "realtime" and v.released)}<span>real-time releases</span></div>
<div>{_fmt(max(data.swap_pauses_ms) if data.swap_pauses_ms else None, 1)} ms<span>longest swap pause</span></div>
</div>
<div class="grid">{imgs}</div>
{_controls_table(data)}
<h2>Versions</h2>
<table><thead><tr><th>version</th><th>stage</th><th>released</th><th>offline pass@1</th><th>accept rate</th>
<th>95% CI</th><th>feedback</th><th>OPE estimate</th><th>note</th></tr></thead>
<tbody>{rows}</tbody></table>
{_online_tables(data)}
<h2>Train/inference gap</h2>
<p>Trainer's recompute against the inference engine's log-probs, averaged over GRPO steps and real-time
update runs; with a mixture-of-experts model also with the routers free and with the inference routes
replayed, and the share of (position, layer) routes the trainer would choose differently.</p>
<table><thead><tr><th>stage</th>{gap_head}</tr></thead><tbody>{gap_rows}</tbody></table>
<p style="color:#666;font-size:.85rem">Stage times: {html.escape(stages)}</p>
</body></html>
"""
    (out / "index.html").write_text(page, encoding="utf-8")
    (out / "report.json").write_text(json.dumps(asdict(data), indent=2, default=str))
    return out / "index.html"


CONTROL_LABELS = {"midtrain": "mid-trained (start)", "control": "matched-compute control", "grpo": "GRPO (final)"}


def gains_text(gains: dict[str, dict]) -> str:
    """GRPO's paired gains over each control, with their 95% intervals, as one line of text."""
    return "; ".join(f"{g['gain']:+.3f} [{g['ci95'][0]:+.3f}, {g['ci95'][1]:+.3f}] over the "
                     f"{CONTROL_LABELS.get(name, name)}" for name, g in gains.items())


def _controls_table(data: ReportData) -> str:
    """Each model's held-out pass@1 at every temperature (its best in bold), then GRPO's paired gains."""
    c = data.controls
    if not c:
        return ""
    temps = c["temperatures"]
    head = "".join(f"<th>T={t}</th>" for t in temps)
    rows = []
    for name, by_t in c["pass_at_1_by_t"].items():
        best = c["best_t"][name]
        cells = "".join((f"<td><b>{_fmt(by_t[str(t)])}</b> [{_fmt(best['ci95'][0])}, {_fmt(best['ci95'][1])}]</td>"
                         if t == best["t"] else f"<td>{_fmt(by_t[str(t)])}</td>") for t in temps)
        rows.append(f"<tr><td>{html.escape(CONTROL_LABELS.get(name, name))}</td>{cells}</tr>")
    gains = html.escape(gains_text(c["gains"]))
    return f"""<h2>Is it learning?</h2>
<p>Held-out pass@1 ({c["heldout_tasks"]} tasks x {c["samples_per_task"]} samples) at each sampling temperature;
bold: each model's best, with its 95% interval. The control mid-trained on from the same checkpoint for
GRPO's wall time ({c["control_seconds"]:.0f} s). GRPO at its best temperature, paired per task: {gains}.
A gain that a lower temperature or more mid-training gives as well is not a learning result.</p>
<table><thead><tr><th>model</th>{head}</tr></thead><tbody>{"".join(rows)}</tbody></table>"""


def _online_tables(data: ReportData) -> str:
    """Per-kind accept rates, the gate's estimate next to what each release realised, and every gate
    decision with its reason."""
    served = [v for v in data.versions if v.accept_rate is not None]
    kinds = sorted({k for v in served for k in v.per_kind})
    head = "".join(f"<th>{html.escape(k)}</th>" for k in kinds)
    rows = "\n".join("<tr><td>" + html.escape(v.version[:12]) + "</td>" + "".join(
        f"<td>{_fmt(v.per_kind[k][0])} [{_fmt(v.per_kind[k][1])}, {_fmt(v.per_kind[k][2])}] n={v.per_kind[k][3]}</td>"
        if k in v.per_kind else "<td>–</td>" for k in kinds) + "</tr>" for v in served)
    summary = online_summary(data)
    ope = "\n".join(f"<tr><td>{html.escape(v.version[:12])}</td><td>{_fmt(v.ope_estimate)}</td>"
                     f"<td>{_fmt(v.accept_rate)}</td></tr>" for v in data.versions
                     if v.released and v.ope_estimate is not None)
    decisions = "\n".join(f"<tr><td>{html.escape(d['version'][:12])}</td><td>{html.escape(d['decision'])}</td>"
                           f"<td>{html.escape(d['reason'])}</td></tr>" for d in data.gate_decisions)
    gain = summary["relative_gain"]
    return f"""<h2>Real-time releases</h2>
<p>First served → last release: accept rate {"–" if gain is None else f"{gain:+.1%}"} relative
(95% CIs {"separated" if summary["ci_separated"] else "overlapping"}); the gate refused
{summary["gate"]["refused"]} of {summary["gate"]["decisions"]} candidates.</p>
<h3>Accept rate by kind of user</h3>
<table><thead><tr><th>version</th>{head}</tr></thead><tbody>{rows}</tbody></table>
<h3>Gate estimate vs realised</h3>
<p>Mean absolute error of the off-policy estimate: {_fmt(summary["ope_mae"])} over {summary["ope_pairs"]} releases.</p>
<table><thead><tr><th>version</th><th>OPE estimate before release</th><th>realised accept rate</th></tr></thead>
<tbody>{ope}</tbody></table>
<h3>Gate decisions</h3>
<table><thead><tr><th>candidate</th><th>decision</th><th>reason</th></tr></thead><tbody>{decisions}</tbody></table>"""


def print_summary(data: ReportData, stderr: bool = False) -> None:
    table = Table(title="rtrl lifecycle summary")
    for col in ("version", "stage", "released", "offline pass@1", "accept rate", "95% CI", "feedback", "OPE"):
        table.add_column(col)
    for v in data.versions:
        table.add_row(v.version[:12], v.stage, "yes" if v.released else "refused", _fmt(v.offline_pass_at_1),
                      _fmt(v.accept_rate), f"[{_fmt(v.ci[0])}, {_fmt(v.ci[1])}]" if v.ci else "–",
                      str(v.n_feedback), _fmt(v.ope_estimate))
    console = Console(stderr=stderr)
    console.print(table)
    kinds = sorted({k for v in data.versions for k in v.per_kind})
    if kinds:
        by_kind = Table(title="accept rate by kind of user")
        for col in ("version", *kinds):
            by_kind.add_column(col)
        for v in data.versions:
            if v.per_kind:
                by_kind.add_row(v.version[:12], *(f"{_fmt(v.per_kind[k][0])} [{_fmt(v.per_kind[k][1])}, "
                                                  f"{_fmt(v.per_kind[k][2])}]" if k in v.per_kind else "–"
                                                  for k in kinds))
        console.print(by_kind)
    refused = [d for d in data.gate_decisions if d["decision"] == "refused"]
    if refused:
        console.print(f"gate refused {len(refused)} of {len(data.gate_decisions)}: "
                      + "; ".join(f"{d['version'][:8]}: {d['reason'][:90]}" for d in refused))
    if data.controls:
        best = data.controls["best_t"]
        console.print("best temperature: " + ", ".join(
            f"{CONTROL_LABELS.get(n, n)} {_fmt(b['pass_at_1'])} (T={b['t']})" for n, b in best.items())
            + "; GRPO's gains: " + gains_text(data.controls["gains"]))
    console.print(f"held-out pass@1 {_fmt(data.pass_before)} → {_fmt(data.pass_after)} (gate {data.gate:.2f}); "
                  f"stages: " + ", ".join(f"{k} {v:.0f}s" for k, v in data.stage_seconds.items()))
