"""Dataset builder for single-rollout updates: logged feedback -> training batch + held-out OPE set.

Source: the ``training_examples`` table written by the ingester (one row per completion that got
feedback: the version that served it, the caller, prompt / completion token ids, the serving
version's per-token log-probs, the signal). Steps, each counted in :class:`DatasetStats`:

1. **Window**: rows whose feedback arrived after the last release (``since``) and up to ``until``.
2. **Version filter**: by default only the current production version (on-policy). With
   ``on_policy_only`` off, the last ``max_version_lag`` released versions are admitted too, if
   younger than ``max_age_hours``; the update corrects them with the importance ratio π_θ/μ.
3. **De-duplication**: same caller + same prompt ids + same completion ids count once (newest kept),
   so repeating a request does not multiply its weight.
4. **Held-out split** by a hash of the completion id (stable across reruns): the release gate's
   off-policy estimate uses these; the update never sees them.
5. **Per-caller cap** on the training part: no caller contributes more than ``caller_cap_share`` of
   the batch (the largest cap m with m <= share x batch size, newest examples kept).

Reward mapping (configurable): accept -> reward_accept (+0.75), reject -> reward_reject (-0.25),
edit -> reward_reject + (reward_accept - reward_reject) x difflib ratio(completion, kept text).
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from realtime_rl.config import UpdateSettings

TABLE = "training_examples"


@dataclass(frozen=True)
class LoggedExample:
    """One row of ``training_examples`` (the columns the updater reads)."""

    completion_id: str
    version: str
    caller: str
    task_bucket: str | None
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    logprobs: list[float]
    sampling_logprobs: list[float] | None
    signal: str
    kept_text: str | None = None
    score: float | None = None
    feedback_at: datetime | None = None
    completion_at: datetime | None = None
    completion_text: str | None = None
    sampling: dict[str, Any] | None = None


@dataclass(frozen=True)
class TrainingExample:
    example: LoggedExample
    reward: float
    accepted: bool

    @property
    def bucket(self) -> str:
        return self.example.task_bucket or "default"


@dataclass
class DatasetStats:
    window: int = 0
    wrong_version: int = 0
    too_old: int = 0
    malformed: int = 0
    duplicates: int = 0
    heldout: int = 0
    capped: int = 0
    train: int = 0
    per_caller: dict[str, int] = field(default_factory=dict)
    per_version: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Dataset:
    train: list[TrainingExample]
    heldout: list[TrainingExample]
    stats: DatasetStats
    data_until: datetime | None
    fingerprint: str


def edit_kept_share(completion: str, kept: str | None) -> float:
    """difflib ratio between what was served and what the user kept (1 = kept verbatim)."""
    if not completion and not kept:
        return 1.0
    return difflib.SequenceMatcher(None, completion, kept or "", autojunk=False).ratio()


def reward_for(ex: LoggedExample, cfg: UpdateSettings, decode: Callable[[list[int]], str] | None = None) -> float:
    """The configured reward of one logged feedback."""
    lo, hi = cfg.reward_reject, cfg.reward_accept
    if cfg.use_explicit_score and ex.score is not None:
        s = min(1.0, max(-1.0, float(ex.score)))
        return lo + (hi - lo) * (s + 1.0) / 2.0
    if ex.signal == "accept":
        return hi
    if ex.signal == "reject":
        return lo
    if ex.signal == "edit":
        if not cfg.edit_graded:
            return lo
        text = ex.completion_text
        if text is None:
            if decode is None:
                raise ValueError(f"edit feedback on {ex.completion_id}: the completion text is needed to grade it")
            text = decode(ex.completion_token_ids)
        return lo + (hi - lo) * edit_kept_share(text, ex.kept_text)
    raise ValueError(f"unknown feedback signal {ex.signal!r} on {ex.completion_id}")


def is_heldout(completion_id: str, fraction: float) -> bool:
    """Stable split: the same completion is always on the same side, whichever run asks."""
    if fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(completion_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def dedup_key(ex: LoggedExample) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    return ex.caller, tuple(ex.prompt_token_ids), tuple(ex.completion_token_ids)


def caller_cap(counts: Iterable[int], share: float) -> int:
    """Largest per-caller count m such that every caller kept at min(c, m) holds <= share of the total."""
    counts = sorted(counts)
    if not counts:
        return 0
    if share >= 1:
        return counts[-1]
    best = 0
    for m in range(1, counts[-1] + 1):
        total = sum(min(c, m) for c in counts)
        if m <= share * total + 1e-9:
            best = m
    return best


def apply_caller_cap(examples: Sequence[TrainingExample], share: float) -> tuple[list[TrainingExample], int]:
    """Keep at most ``caller_cap`` examples per caller (newest first); returns (kept, dropped)."""
    by_caller: dict[str, list[TrainingExample]] = defaultdict(list)
    for e in examples:
        by_caller[e.example.caller].append(e)
    m = caller_cap((len(v) for v in by_caller.values()), share)
    kept_ids: set[str] = set()
    for rows in by_caller.values():
        newest = sorted(rows, key=lambda e: _ts(e.example.feedback_at), reverse=True)[:m]
        kept_ids.update(e.example.completion_id for e in newest)
    kept = [e for e in examples if e.example.completion_id in kept_ids]
    return kept, len(examples) - len(kept)


def _ts(t: datetime | None) -> float:
    if t is None:
        return 0.0
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


def _well_formed(ex: LoggedExample) -> bool:
    n = len(ex.completion_token_ids)
    return (n > 0 and bool(ex.prompt_token_ids) and len(ex.logprobs) == n
            and (ex.sampling_logprobs is None or len(ex.sampling_logprobs) == n))


def build_dataset(rows: Iterable[LoggedExample], cfg: UpdateSettings, *, production: str,
                  admitted_versions: Sequence[str] = (), now: datetime | None = None,
                  decode: Callable[[list[int]], str] | None = None) -> Dataset:
    """Filter, de-duplicate, split and cap logged rows (already windowed by time).

    ``admitted_versions``: older versions, newest first, that may be admitted when ``on_policy_only``
    is off (only the first ``max_version_lag`` are used)."""
    now = now or datetime.now(UTC)
    stats = DatasetStats()
    allowed = {production}
    if not cfg.on_policy_only:
        allowed.update(list(admitted_versions)[: cfg.max_version_lag])
    oldest = now - timedelta(hours=cfg.max_age_hours)
    newest_by_key: dict[tuple, LoggedExample] = {}
    for ex in rows:
        stats.window += 1
        if ex.version not in allowed:
            stats.wrong_version += 1
            continue
        if ex.version != production and _ts(ex.completion_at or ex.feedback_at) < oldest.timestamp():
            stats.too_old += 1
            continue
        if not _well_formed(ex):
            stats.malformed += 1
            continue
        key = dedup_key(ex)
        prev = newest_by_key.get(key)
        if prev is not None:
            stats.duplicates += 1
            if _ts(prev.feedback_at) >= _ts(ex.feedback_at):
                continue
        newest_by_key[key] = ex
    kept = sorted(newest_by_key.values(), key=lambda e: (_ts(e.feedback_at), e.completion_id))
    train, heldout = [], []
    for ex in kept:
        te = TrainingExample(ex, reward_for(ex, cfg, decode), ex.signal == "accept")
        (heldout if is_heldout(ex.completion_id, cfg.heldout_fraction) else train).append(te)
    stats.heldout = len(heldout)
    if len(train) > cfg.max_examples:
        train = train[-cfg.max_examples:]
    train, stats.capped = apply_caller_cap(train, cfg.caller_cap_share)
    stats.train = len(train)
    stats.per_caller = dict(Counter(e.example.caller for e in train))
    stats.per_version = dict(Counter(e.example.version for e in train))
    ids = sorted(e.example.completion_id for e in train + heldout)
    fingerprint = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    data_until = max((e.feedback_at for e in kept if e.feedback_at is not None), default=None, key=_ts)
    return Dataset(train=train, heldout=heldout, stats=stats, data_until=data_until, fingerprint=fingerprint)


def _as_list(v: Any) -> Any:
    if v is None:
        return None
    if isinstance(v, str | bytes):
        return json.loads(v)
    return list(v)


def _as_dict(v: Any) -> dict[str, Any] | None:
    if v is None:
        return None
    if isinstance(v, str | bytes):
        return json.loads(v)
    return dict(v)


def _as_dt(v: Any) -> datetime | None:
    if v is None or isinstance(v, datetime):
        return v
    return datetime.fromisoformat(str(v))


def load_logged(engine, *, since: datetime | None = None, until: datetime | None = None,
                versions: Sequence[str] | None = None) -> list[LoggedExample]:
    """Read ``training_examples`` rows with ``since < feedback_at <= until`` (reflected, so this reader
    follows the ingester's schema without importing its models)."""
    import sqlalchemy as sa

    table = sa.Table(TABLE, sa.MetaData(), autoload_with=engine)
    q = sa.select(table)
    if since is not None:
        q = q.where(table.c.feedback_at > since)
    if until is not None:
        q = q.where(table.c.feedback_at <= until)
    if versions is not None:
        q = q.where(table.c.version.in_(list(versions)))
    text_col = next((c for c in ("completion", "completion_text") if c in table.c), None)
    out = []
    with engine.connect() as conn:
        for r in conn.execute(q).mappings():
            out.append(LoggedExample(
                completion_id=str(r["completion_id"]), version=str(r["version"]), caller=str(r["caller"]),
                task_bucket=r.get("task_bucket"), prompt_token_ids=_as_list(r["prompt_token_ids"]),
                completion_token_ids=_as_list(r["completion_token_ids"]), logprobs=_as_list(r["logprobs"]),
                sampling_logprobs=_as_list(r.get("sampling_logprobs")), signal=str(r["signal"]),
                kept_text=r.get("kept_text"), score=r.get("score"), feedback_at=_as_dt(r.get("feedback_at")),
                completion_at=_as_dt(r.get("completion_at")),
                completion_text=r.get(text_col) if text_col else None,
                sampling=_as_dict(r.get("sampling"))))
    return out
