"""Analyst loaders: pandas DataFrames over the read-only view layer of the feedback database.

The views (created by migration ``0002_analyst_views``, documented there) are the contract:

=========================== ==================================================================
``v_feedback_latest``       one row per completion with feedback, its newest judgement
``v_accept_rate_by_version`` accept/edit/reject counts and rates per version
``v_accept_rate_by_day``    the same per (UTC day, version)
``v_accept_rate_by_bucket`` the same per (task bucket, version)
``v_latency_by_version``    served completions per version: count, mean and max latency
``v_completions``           every served completion (no token arrays), with ``has_feedback``
``v_kept_edits``            edit judgements: served completion and the text the user kept
``v_model_versions``        registry versions as ingested (publish/promote/rollback)
``v_dead_letter_summary``   dead letters per reason
=========================== ==================================================================

Rates count each completion once, by its newest judgement. Loaders only read views; the engine
from :func:`connect_readonly` refuses writes (SQLite ``query_only``; PostgreSQL
``default_transaction_read_only``), and on PostgreSQL the ``rtrl_analyst`` role can see the views
and nothing else. Timestamps come back as UTC-aware pandas timestamps on both databases.
"""

from __future__ import annotations

import math

import pandas as pd
import sqlalchemy as sa

from realtime_rl.database import make_engine

VIEWS = ("v_feedback_latest", "v_accept_rate_by_version", "v_accept_rate_by_day", "v_accept_rate_by_bucket",
         "v_latency_by_version", "v_completions", "v_kept_edits", "v_model_versions", "v_dead_letter_summary")
_TIME_COLUMNS = ("completion_at", "feedback_at", "first_completion_at", "last_completion_at", "created_at",
                 "updated_at", "first_at", "last_at")
_COUNT_COLUMNS = ("n_feedback", "n_accept", "n_edit", "n_reject", "n_completions", "n", "n_replayed")
_RATE_COLUMNS = ("accept_rate", "edit_rate", "reject_rate")


def connect_readonly(url: str) -> sa.Engine:
    """A read-only engine for ``url`` (the configured one: ``load_settings().db.url.get_secret_value()``)."""
    return make_engine(url, readonly=True)


def read_view(engine: sa.Engine, view: str, where: str = "", params: dict | None = None) -> pd.DataFrame:
    """All rows of one documented view, with types normalised across SQLite and PostgreSQL."""
    if view not in VIEWS:
        raise ValueError(f"unknown view {view!r}; the view layer is: {', '.join(VIEWS)}")
    with engine.connect() as conn:
        df = pd.read_sql_query(sa.text(f"SELECT * FROM {view} {where}"), conn, params=params or {})
    for col in df.columns:
        if col in _TIME_COLUMNS:
            df[col] = pd.to_datetime(df[col], utc=True, format="mixed")
        elif col == "day":
            df[col] = pd.to_datetime(df[col])
        elif col in _COUNT_COLUMNS:
            df[col] = df[col].astype("int64")
        elif col in _RATE_COLUMNS:
            df[col] = df[col].astype("float64")
    return df


def _with_ci(df: pd.DataFrame) -> pd.DataFrame:
    """Add a 95% Wilson interval for the accept rate (small versions get honest, wide bars)."""
    z = 1.959963984540054
    lows, highs = [], []
    for n, k in zip(df["n_feedback"], df["n_accept"], strict=True):
        if n == 0:
            lows.append(math.nan)
            highs.append(math.nan)
            continue
        p = k / n
        denom = 1 + z * z / n
        centre = (p + z * z / (2 * n)) / denom
        half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
        lows.append(max(0.0, centre - half))
        highs.append(min(1.0, centre + half))
    return df.assign(accept_ci_low=lows, accept_ci_high=highs)


def accept_rate_by_version(engine: sa.Engine) -> pd.DataFrame:
    """Per version: counts, rates, a 95% CI on the accept rate; ordered by when the version appeared."""
    df = _with_ci(read_view(engine, "v_accept_rate_by_version"))
    versions = read_view(engine, "v_model_versions")[["version", "created_at"]]
    df = df.merge(versions.rename(columns={"created_at": "version_created_at"}), on="version", how="left")
    order = df["version_created_at"].fillna(df["first_completion_at"])
    return df.assign(_order=order).sort_values(["_order", "version"]).drop(columns="_order").reset_index(drop=True)


def accept_rate_by_day(engine: sa.Engine) -> pd.DataFrame:
    """Per (UTC day, version): counts and rates, ordered by day."""
    return _with_ci(read_view(engine, "v_accept_rate_by_day")).sort_values(["day", "version"]).reset_index(drop=True)


def accept_rate_by_bucket(engine: sa.Engine) -> pd.DataFrame:
    """Per (task bucket, version): counts and rates."""
    df = _with_ci(read_view(engine, "v_accept_rate_by_bucket"))
    return df.sort_values(["task_bucket", "version"]).reset_index(drop=True)


def latency_by_version(engine: sa.Engine) -> pd.DataFrame:
    """Per version over every served completion: n, mean, p50, p90, p99 and max latency (ms)."""
    df = read_view(engine, "v_completions")
    cols = ["version", "n_completions", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "max_ms"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    g = df.groupby("version")["latency_ms"]
    out = pd.DataFrame({
        "n_completions": g.size(), "mean_ms": g.mean(), "p50_ms": g.quantile(0.5), "p90_ms": g.quantile(0.9),
        "p99_ms": g.quantile(0.99), "max_ms": g.max(),
    }).reset_index()
    return out[cols]


def levenshtein(a: str, b: str) -> int:
    """Edit distance in characters (insertions, deletions, substitutions each cost 1)."""
    if len(a) < len(b):
        a, b = b, a
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def edit_distances(engine: sa.Engine) -> pd.DataFrame:
    """Per kept edit: characters changed between the served completion and what the user kept.

    ``relative`` divides by the longer text's length (0: kept as served, 1: fully rewritten).
    """
    df = read_view(engine, "v_kept_edits")
    if df.empty:
        return df.assign(distance=pd.Series(dtype="int64"), relative=pd.Series(dtype="float64"))
    distance = [levenshtein(c or "", k or "") for c, k in zip(df["completion"], df["kept_text"], strict=True)]
    longest = [max(len(c or ""), len(k or ""), 1) for c, k in zip(df["completion"], df["kept_text"], strict=True)]
    return df.assign(distance=distance, relative=[d / n for d, n in zip(distance, longest, strict=True)])


def edit_distance_by_version(engine: sa.Engine) -> pd.DataFrame:
    """Per version: number of kept edits and their mean / median edit distance."""
    df = edit_distances(engine)
    cols = ["version", "n_edits", "mean_distance", "median_distance", "mean_relative"]
    if df.empty:
        return pd.DataFrame(columns=cols)
    g = df.groupby("version")
    return pd.DataFrame({"n_edits": g.size(), "mean_distance": g["distance"].mean(),
                         "median_distance": g["distance"].median(),
                         "mean_relative": g["relative"].mean()}).reset_index()[cols]


def accept_rate_by_group(engine: sa.Engine, groups: dict[str, str]) -> pd.DataFrame:
    """Per (version, group): counts, the accept rate and its 95% CI, where ``groups`` maps a caller
    (API key id) to a group name, e.g. a kind of user; callers not in the map form ``(other)``."""
    df = read_view(engine, "v_feedback_latest")
    cols = ["version", "group", "n_feedback", "n_accept", "accept_rate"]
    if df.empty:
        return _with_ci(pd.DataFrame(columns=cols).astype({"n_feedback": "int64", "n_accept": "int64"}))
    df = df.assign(group=df["caller"].map(groups).fillna("(other)"))
    g = df.groupby(["version", "group"])["accepted"]
    out = pd.DataFrame({"n_feedback": g.size(), "n_accept": g.sum()}).reset_index()
    out = out.assign(accept_rate=out["n_accept"] / out["n_feedback"])
    return _with_ci(out[cols])
