"""Dataset builder: reward mapping, on-policy filter, de-duplication, per-caller caps, held-out split."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from realtime_rl.config import UpdateSettings
from realtime_rl.dataset import (
    LoggedExample,
    apply_caller_cap,
    build_dataset,
    caller_cap,
    edit_kept_share,
    is_heldout,
    reward_for,
)

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)


def ex(i: int, caller="a", version="v1", signal="accept", prompt=(1, 2), comp=None, minutes=0, **kw):
    comp = list(comp) if comp is not None else [10 + i, 3]
    return LoggedExample(completion_id=f"c{i}", version=version, caller=caller, task_bucket="affine",
                         prompt_token_ids=list(prompt), completion_token_ids=comp, logprobs=[-0.5] * len(comp),
                         sampling_logprobs=[-0.5] * len(comp), signal=signal,
                         feedback_at=T0 + timedelta(minutes=minutes + i / 100),
                         completion_at=T0 + timedelta(minutes=minutes), **kw)


def test_reward_mapping_accept_reject_and_graded_edit():
    cfg = UpdateSettings()
    assert reward_for(ex(0, signal="accept"), cfg) == 0.75
    assert reward_for(ex(0, signal="reject"), cfg) == -0.25
    full = ex(0, signal="edit", kept_text="x * 8 + 7", completion_text="x * 8 + 7")
    assert reward_for(full, cfg) == pytest.approx(0.75)
    none = ex(0, signal="edit", kept_text="", completion_text="x * 8 + 7")
    assert reward_for(none, cfg) == pytest.approx(-0.25)
    half = ex(0, signal="edit", kept_text="x * 8", completion_text="x * 8 + 7")
    share = edit_kept_share("x * 8 + 7", "x * 8")  # difflib: 2*5/(9+5)
    assert share == pytest.approx(10 / 14)
    assert reward_for(half, cfg) == pytest.approx(-0.25 + 1.0 * share)
    # Edits graded off: an edit is a reject; custom rewards are honoured.
    assert reward_for(half, UpdateSettings(edit_graded=False)) == -0.25
    assert reward_for(ex(0), UpdateSettings(reward_accept=1.0)) == 1.0
    # Edit text decoded from token ids when the table has no text column.
    assert reward_for(ex(0, signal="edit", kept_text="ab", comp=[1, 2]), cfg, decode=lambda ids: "ab") == 0.75
    with pytest.raises(ValueError, match="unknown feedback signal"):
        reward_for(ex(0, signal="maybe"), cfg)


def test_on_policy_filter_keeps_only_production_when_asked():
    rows = [ex(i, version="v2" if i % 2 else "v1", caller=f"u{i}") for i in range(20)]
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0, on_policy_only=True)
    ds = build_dataset(rows, cfg, production="v2", admitted_versions=["v1"], now=T0)
    assert {e.example.version for e in ds.train} == {"v2"}
    assert ds.stats.wrong_version == 10 and ds.stats.train == 10
    # Off-policy admitted within lag and age; too old ones dropped.
    off = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0, on_policy_only=False, max_age_hours=1)
    ds2 = build_dataset(rows, off, production="v2", admitted_versions=["v1"], now=T0 + timedelta(minutes=30))
    assert ds2.stats.train == 20
    ds3 = build_dataset(rows, off, production="v2", admitted_versions=["v1"], now=T0 + timedelta(hours=2))
    assert ds3.stats.train == 10 and ds3.stats.too_old == 10
    lag0 = off.model_copy(update={"max_version_lag": 0})
    assert build_dataset(rows, lag0, production="v2", admitted_versions=["v1"], now=T0).stats.train == 10


def test_dedup_same_caller_prompt_completion_counted_once():
    rows = [ex(i, caller="a", comp=[5, 6], signal="accept" if i < 4 else "reject") for i in range(5)]
    rows.append(ex(9, caller="b", comp=[5, 6]))  # another caller: not a duplicate
    rows.append(ex(10, caller="a", comp=[5, 7]))  # another completion: not a duplicate
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0)
    ds = build_dataset(rows, cfg, production="v1", now=T0)
    assert ds.stats.duplicates == 4 and ds.stats.train == 3
    kept_a = [e for e in ds.train if e.example.caller == "a" and e.example.completion_token_ids == [5, 6]]
    assert [e.example.signal for e in kept_a] == ["reject"]  # the newest judgement wins


def test_caller_cap_math_and_application():
    assert caller_cap([100, 10, 10, 10], 0.25) == 10  # 10 <= .25 * 40
    assert caller_cap([100, 30, 30, 30], 0.25) == 30
    assert caller_cap([100, 50, 20, 20], 0.5) == 90  # m=90: 90 <= .5*(90+50+20+20); m=91: 91 > 90.5
    assert caller_cap([5], 0.25) == 0  # a lone caller cannot steer the update at all
    assert caller_cap([5], 1.0) == 5
    rows = [ex(i, caller="spam", comp=[i, 1]) for i in range(60)]
    rows += [ex(100 + i, caller=f"u{i % 3}", comp=[i, 2]) for i in range(30)]
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=0.25)
    ds = build_dataset(rows, cfg, production="v1", now=T0)
    top = max(ds.stats.per_caller.values())
    assert top <= 0.25 * ds.stats.train + 1e-9
    assert ds.stats.per_caller["spam"] == 10 and ds.stats.capped == 50
    # The newest examples of a capped caller are the ones kept.
    spam = sorted(e.example.completion_id for e in ds.train if e.example.caller == "spam")
    assert spam == sorted(f"c{i}" for i in range(50, 60))
    kept, dropped = apply_caller_cap(ds.train, 1.0)
    assert dropped == 0 and len(kept) == len(ds.train)


def test_heldout_split_is_stable_and_disjoint():
    rows = [ex(i, caller=f"u{i % 50}", comp=[i, 9]) for i in range(400)]
    cfg = UpdateSettings(heldout_fraction=0.25, caller_cap_share=1.0)
    a = build_dataset(rows, cfg, production="v1", now=T0)
    b = build_dataset(list(reversed(rows)), cfg, production="v1", now=T0)
    assert {e.example.completion_id for e in a.heldout} == {e.example.completion_id for e in b.heldout}
    assert not {e.example.completion_id for e in a.heldout} & {e.example.completion_id for e in a.train}
    assert 60 < len(a.heldout) < 140
    assert a.fingerprint == b.fingerprint
    assert all(is_heldout(e.example.completion_id, 0.25) for e in a.heldout)


def test_malformed_rows_are_dropped():
    bad = LoggedExample("bad", "v1", "a", None, [1], [2, 3], [-0.1], None, "accept", feedback_at=T0)
    ds = build_dataset([bad, ex(1)], UpdateSettings(heldout_fraction=0, caller_cap_share=1), production="v1",
                       now=T0)
    assert ds.stats.malformed == 1 and ds.stats.train == 1
