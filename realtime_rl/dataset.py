"""Dataset builder for single-rollout updates: logged feedback -> training batch + held-out OPE set.

Source: the ``training_examples`` table written by the ingester (one row per completion that got
feedback: the version that served it, the caller, prompt / completion token ids, the serving
version's per-token log-probs, its route record on a mixture-of-experts model, the signal). Steps, each counted in :class:`DatasetStats`:

1. **Window**: rows whose feedback arrived after the last release (``since``) and up to ``until``.
2. **Version filter**: by default only the current production version (on-policy). With
   ``on_policy_only`` off, the last ``max_version_lag`` released versions are admitted too, if
   younger than ``max_age_hours``; the update corrects them with the importance ratio π_θ/μ.
3. **Validity for the model being trained**: an example whose arrays do not line up, whose log-probs
   are not finite and <= 0, or whose token ids fall outside the model's vocabulary (``vocab_size``:
   an embedding lookup would index out of range) is excluded, counted by reason in
   ``DatasetStats.excluded`` (``malformed`` and ``out_of_vocab`` are the totals). The ingester already
   refuses ids outside [0, 2**31); the vocabulary bound depends on the model, so it is applied here.
4. **De-duplication**: same caller + same prompt ids + same completion ids count once (newest kept),
   so repeating a request does not multiply its weight.
5. **Held-out split** by a hash of the completion id (stable across reruns): the release gate's
   off-policy estimate uses these; the update never sees them.
6. **Per-caller cap** on the training part: no caller contributes more than ``caller_cap_share`` of
   the batch (the largest cap m with m <= share x batch size, newest examples kept).
6. **Kept text** of edits (``kept_text_weight`` > 0): the text a user kept becomes a training example
   of its own (same prompt, the kept text tokenised, reward ``reward_accept``, source ``kept``), and the
   completion it replaced counts as a reject, except for the tokens before the first one the user
   changed (``kept_prefix``: the update does not penalise what the user kept). Its behaviour log-probs are the serving weights'
   (recomputed by the update, see :mod:`realtime_rl.update`).
7. **Balance weights** (:func:`balance_weights`): each example's weight shrinks with the number of
   examples its caller and its task bucket have in the batch, so loud callers and busy buckets do not
   dominate the gradient.

Late, changed and orphaned feedback (the bad-input outcomes, each counted in :class:`DatasetStats`):

* feedback that arrived more than ``feedback_horizon_hours`` after its completion: not trained on
  (``late``); it stays in the ``feedback`` table and the accept-rate views;
* feedback that replaced an earlier judgement of the same completion: the newest one is used
  (``refeedback`` counts them; the ``feedback`` table keeps the history);
* feedback whose completion never arrived: held in ``pending_feedback`` by the ingester and joined
  if the completion comes; the cycle counts the ones older than the horizon (``orphaned``);
* an edit whose kept text cannot be tokenised (empty, over ``max_kept_tokens`` tokens, or not
  reproduced by decoding its tokens): no kept-text example (``kept_unusable``); the edit still
  counts for the served completion with its graded reward.

Reward mapping (configurable): accept -> reward_accept (+0.75), reject -> reward_reject (-0.25),
edit -> reward_reject + (reward_accept - reward_reject) x difflib ratio(completion, kept text), or
reward_reject when its kept text is trained on as in step 6.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from realtime_rl.config import UpdateSettings
from realtime_rl.ingest_decode import LOGPROB_TOLERANCE

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
    feedback_count: int = 1
    routes: dict[str, Any] | None = None
    """Mixture-of-experts models: the gateway's route record (``policy.routes`` wire form)."""


@dataclass(frozen=True)
class TrainingExample:
    """One training row. ``source`` is ``served`` (a logged completion, behaviour log-probs logged) or
    ``kept`` (an edit's kept text: not sampled from any version; behaviour = the serving weights)."""

    example: LoggedExample
    reward: float
    accepted: bool
    weight: float = 1.0
    source: str = "served"
    kept_prefix: int = 0  # leading completion tokens an edit's user kept: no penalty for them

    @property
    def bucket(self) -> str:
        return self.example.task_bucket or "default"


@dataclass
class DatasetStats:
    window: int = 0
    wrong_version: int = 0
    too_old: int = 0
    malformed: int = 0
    out_of_vocab: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    """Examples excluded as malformed or out of the vocabulary, by reason (see ``example_problem``)."""
    duplicates: int = 0
    heldout: int = 0
    capped: int = 0
    late: int = 0
    refeedback: int = 0
    orphaned: int = 0
    kept: int = 0
    kept_unusable: int = 0
    off_policy: int = 0
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


def tokenize_kept(kept: str | None, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                  max_tokens: int) -> list[int] | None:
    """Token ids of an edit's kept text, or None when it cannot be used as a target: empty, longer
    than ``max_tokens``, or not reproduced exactly by decoding its own tokens."""
    if not kept or not kept.strip():
        return None
    ids = list(encode(kept))
    if not ids or len(ids) > max_tokens or decode(ids) != kept:
        return None
    return ids


def kept_example(ex: LoggedExample, ids: list[int], reward: float) -> TrainingExample:
    """The kept text of an edit as an accepted completion of the same prompt (``source`` = kept)."""
    row = LoggedExample(completion_id=ex.completion_id + "#kept", version=ex.version, caller=ex.caller,
                        task_bucket=ex.task_bucket, prompt_token_ids=ex.prompt_token_ids,
                        completion_token_ids=ids, logprobs=[], sampling_logprobs=None, signal="accept",
                        feedback_at=ex.feedback_at, completion_at=ex.completion_at, completion_text=ex.kept_text)
    return TrainingExample(row, reward, True, source="kept")


def balance_weights(examples: Sequence[TrainingExample], caller_power: float, bucket_power: float,
                    kept_weight: float = 1.0) -> list[TrainingExample]:
    """w_i ∝ n_caller(i)^-caller_power · n_bucket(i)^-bucket_power, normalised to mean 1.

    Power 0 leaves counts as they are (a caller with k examples has k times the say); 1 gives every
    caller (bucket) the same total weight; 0.5 is in between. Counts are of served examples, so a
    caller's kept-text examples share that caller's weight, times ``kept_weight``."""
    if not examples:
        return []
    callers = Counter(e.example.caller for e in examples if e.source == "served")
    buckets = Counter(e.bucket for e in examples if e.source == "served")
    raw = [max(callers[e.example.caller], 1) ** -caller_power * max(buckets[e.bucket], 1) ** -bucket_power
           for e in examples]
    mean = sum(raw) / len(raw)
    return [TrainingExample(e.example, e.reward, e.accepted, w / mean * (kept_weight if e.source == "kept" else 1.0),
                            e.source, e.kept_prefix) for e, w in zip(examples, raw, strict=True)]


def _ts(t: datetime | None) -> float:
    if t is None:
        return 0.0
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


OUT_OF_VOCAB = ("prompt token id outside the vocabulary", "completion token id outside the vocabulary")


def _ids_outside(ids: Sequence[int], vocab_size: int | None) -> bool:
    if not ids:
        return False
    if not all(type(i) is int for i in ids):
        return True
    return min(ids) < 0 or (vocab_size is not None and max(ids) >= vocab_size)


def example_problem(ex: LoggedExample, vocab_size: int | None = None) -> str | None:
    """Why ``ex`` cannot be trained on by a model with ``vocab_size`` token ids (None: any vocabulary),
    or None. The reasons in ``OUT_OF_VOCAB`` count as ``out_of_vocab``, the others as ``malformed``."""
    n = len(ex.completion_token_ids)
    if n == 0 or not ex.prompt_token_ids:
        return "empty prompt or completion"
    if len(ex.logprobs) != n or (ex.sampling_logprobs is not None and len(ex.sampling_logprobs) != n):
        return "log-probs do not line up with the completion tokens"
    for values in (ex.logprobs, ex.sampling_logprobs):
        if values and not all(isinstance(v, int | float) and math.isfinite(v) and v <= LOGPROB_TOLERANCE
                              for v in values):
            return "log-probs not finite or above 0"
    if _ids_outside(ex.prompt_token_ids, vocab_size):
        return OUT_OF_VOCAB[0]
    if _ids_outside(ex.completion_token_ids, vocab_size):
        return OUT_OF_VOCAB[1]
    return None


def build_dataset(rows: Iterable[LoggedExample], cfg: UpdateSettings, *, production: str,
                  admitted_versions: Sequence[str] = (), now: datetime | None = None,
                  decode: Callable[[list[int]], str] | None = None,
                  encode: Callable[[str], list[int]] | None = None, vocab_size: int | None = None) -> Dataset:
    """Filter, de-duplicate, split, cap and weight logged rows (already windowed by time).

    ``admitted_versions``: older versions, newest first, that may be admitted when ``on_policy_only``
    is off (only the first ``max_version_lag`` are used). ``encode`` and ``decode`` (the tokenizer)
    are needed for kept-text examples; without ``encode`` edits only carry their graded reward.
    ``vocab_size``: the trained model's number of token ids (rows of its embedding table); examples
    with an id at or above it are excluded."""
    now = now or datetime.now(UTC)
    stats = DatasetStats()
    allowed = {production}
    if not cfg.on_policy_only:
        allowed.update(list(admitted_versions)[: cfg.max_version_lag])
    oldest = now - timedelta(hours=cfg.max_age_hours)
    horizon = cfg.feedback_horizon_hours * 3600.0
    newest_by_key: dict[tuple, LoggedExample] = {}
    for ex in rows:
        stats.window += 1
        if ex.version not in allowed:
            stats.wrong_version += 1
            continue
        if ex.version != production and _ts(ex.completion_at or ex.feedback_at) < oldest.timestamp():
            stats.too_old += 1
            continue
        if ex.completion_at is not None and ex.feedback_at is not None \
                and _ts(ex.feedback_at) - _ts(ex.completion_at) > horizon:
            stats.late += 1
            continue
        problem = example_problem(ex, vocab_size)
        if problem is not None:
            stats.excluded[problem] = stats.excluded.get(problem, 0) + 1
            if problem in OUT_OF_VOCAB:
                stats.out_of_vocab += 1
            else:
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
    train = _with_kept_text(train, cfg, stats, encode, decode)
    train = balance_weights(train, cfg.caller_weight_power, cfg.bucket_weight_power, cfg.kept_text_weight)
    stats.train = len(train)
    stats.refeedback = sum(e.feedback_count > 1 for e in kept)
    stats.off_policy = sum(e.example.version != production for e in train)
    stats.per_caller = dict(Counter(e.example.caller for e in train))
    stats.per_version = dict(Counter(e.example.version for e in train))
    ids = sorted(e.example.completion_id for e in train + heldout)
    fingerprint = hashlib.sha256("\n".join(ids).encode()).hexdigest()
    data_until = max((e.feedback_at for e in kept if e.feedback_at is not None), default=None, key=_ts)
    return Dataset(train=train, heldout=heldout, stats=stats, data_until=data_until, fingerprint=fingerprint)


def _with_kept_text(train: list[TrainingExample], cfg: UpdateSettings, stats: DatasetStats,
                    encode: Callable[[str], list[int]] | None,
                    decode: Callable[[list[int]], str] | None) -> list[TrainingExample]:
    """Step 6 of the module docstring: each usable kept text becomes an example; its edit a reject."""
    if cfg.kept_text_weight <= 0 or encode is None or decode is None:
        return train
    out: list[TrainingExample] = []
    for e in train:
        if e.example.signal != "edit":
            out.append(e)
            continue
        ids = tokenize_kept(e.example.kept_text, encode, decode, cfg.max_kept_tokens)
        if ids is None:
            stats.kept_unusable += 1
            out.append(e)
            continue
        if ids == e.example.completion_token_ids:  # kept verbatim: the graded reward is already the accept's
            out.append(e)
            continue
        served = e.example.completion_token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(served, ids, strict=False)) if a != b), min(len(served), len(ids)))
        out.append(TrainingExample(e.example, cfg.reward_reject, False, kept_prefix=prefix))
        out.append(kept_example(e.example, ids, cfg.reward_accept))
        stats.kept += 1
    return out


def count_orphans(engine, older_than: datetime) -> int:
    """Feedback still waiting in ``pending_feedback`` for a completion since before ``older_than``."""

    table = sa.Table("pending_feedback", sa.MetaData(), autoload_with=engine)
    q = sa.select(sa.func.count()).select_from(table).where(table.c.first_seen_at < older_than)
    with engine.connect() as conn:
        return int(conn.execute(q).scalar() or 0)


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
                sampling=_as_dict(r.get("sampling")), feedback_count=int(r.get("feedback_count") or 1),
                routes=_as_dict(r.get("routes"))))
    return out
