"""Robust single-rollout updates: balance weights, the caller-centred baseline, kept texts as targets,
and the bad-input outcomes of feedback (unknown completion, a second judgement, late feedback, an
unusable kept text), end to end through the real ingester into the dataset the updater builds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from realtime_rl.baseline import bucket_mean_advantages, caller_centred
from realtime_rl.config import UpdateSettings
from realtime_rl.dataset import (
    LoggedExample,
    TrainingExample,
    balance_weights,
    build_dataset,
    count_orphans,
    load_logged,
    tokenize_kept,
)
from tests.ingest_fixtures import T0, completion, feedback, send
from tests.ingest_fixtures import make_settings as ingest_settings


def _ex(i: int, caller: str, reward: float, bucket: str = "affine", source: str = "served") -> TrainingExample:
    row = LoggedExample(f"c{i}", "v1", caller, bucket, [1, 2], [3 + i], [-0.5], None, "accept")
    return TrainingExample(row, reward, reward > 0, source=source)


def test_balance_weights_equalise_loud_callers_and_busy_buckets():
    exs = [_ex(i, "loud", 1.0) for i in range(16)] + [_ex(100 + i, f"q{i}", 1.0, bucket="mod") for i in range(4)]
    flat = balance_weights(exs, 0.0, 0.0)
    assert all(e.weight == pytest.approx(1.0) for e in flat)
    equal = balance_weights(exs, 1.0, 0.0)
    loud = sum(e.weight for e in equal if e.example.caller == "loud")
    assert loud == pytest.approx(equal[-1].weight)  # the loud caller's total = one quiet caller's
    assert sum(e.weight for e in equal) == pytest.approx(len(exs))  # mean weight 1
    half = balance_weights(exs, 0.5, 0.5, kept_weight=2.0)
    assert half[0].weight < half[-1].weight
    kept = balance_weights([*exs, _ex(999, "loud", 1.0, source="kept")], 1.0, 0.0, kept_weight=2.0)
    assert kept[-1].weight == pytest.approx(2 * kept[0].weight)


def test_caller_centred_baseline_silences_users_who_judge_everything_alike():
    honest = [_ex(i, f"h{i % 8}", 0.75 if i % 3 else -0.25) for i in range(48)]
    hostile = [_ex(100 + i, "nay", -0.25) for i in range(40)]
    exs = honest + hostile
    adv, base = bucket_mean_advantages(exs, {}, 0.0)
    plain = [a for a, e in zip(adv, exs, strict=True) if e.example.caller == "nay"]
    adv2, base2 = caller_centred(exs, {}, 0.0, prior_count=4.0)
    centred = [a for a, e in zip(adv2, exs, strict=True) if e.example.caller == "nay"]
    assert max(abs(a) for a in centred) < 0.1 * max(abs(a) for a in plain)
    assert all(abs(a - (e.reward - b)) < 1e-9 for a, b, e in zip(adv2, base2, exs, strict=True))
    # Leave-one-out: an example's own reward never moves its own baseline.
    flipped = [_ex(0, "h0", 10.0)] + exs[1:]
    _, b3 = caller_centred(flipped, {}, 0.0, prior_count=4.0)
    assert b3[0] == pytest.approx(base2[0])
    assert caller_centred(exs, {}, 0.0, prior_count=1e12)[1] == pytest.approx(base)  # k → ∞: the bucket mean


class _Tok:
    """A character tokenizer that cannot write '¤' (its decode turns it into '?'), as a tokenizer with
    an unknown token would."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) if c != "¤" else ord("?") for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def test_kept_text_becomes_an_accepted_example_and_unusable_ones_are_counted():
    tok = _Tok()
    assert tokenize_kept("x * 8", tok.encode, tok.decode, 64) == [ord(c) for c in "x * 8"]
    assert tokenize_kept("", tok.encode, tok.decode, 64) is None
    assert tokenize_kept("x" * 100, tok.encode, tok.decode, 64) is None
    assert tokenize_kept("x¤1", tok.encode, tok.decode, 64) is None
    t = T0
    rows = [LoggedExample(f"e{i}", "v1", f"u{i}", "affine", [1, 2], [120, 42, 56], [-0.5] * 3, None, "edit",
                          kept_text=kept, completion_text="x*8", feedback_at=t, completion_at=t)
            for i, kept in enumerate(["x * 8", "x¤8", "x*8"])]
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0)
    ds = build_dataset(rows, cfg, production="v1", now=t, encode=tok.encode, decode=tok.decode)
    assert ds.stats.kept == 1 and ds.stats.kept_unusable == 1
    by_id = {e.example.completion_id: e for e in ds.train}
    assert by_id["e0#kept"].source == "kept" and by_id["e0#kept"].reward == cfg.reward_accept
    assert by_id["e0#kept"].example.completion_token_ids == [ord(c) for c in "x * 8"]
    assert by_id["e0"].reward == cfg.reward_reject  # replaced by what the user kept
    assert by_id["e1"].reward > cfg.reward_reject  # unusable kept text: the graded edit reward stays
    assert by_id["e2"].reward == pytest.approx(cfg.reward_accept)  # kept verbatim
    assert len(ds.train) == 4
    off = build_dataset(rows, cfg.model_copy(update={"kept_text_weight": 0.0}), production="v1", now=t,
                        encode=tok.encode, decode=tok.decode)
    assert off.stats.kept == 0 and len(off.train) == 3


def test_bad_feedback_outcomes_and_late_joins_through_the_ingester(tmp_path):
    from realtime_rl.ingest import Ingester

    settings = ingest_settings(tmp_path, f"sqlite:///{tmp_path / 'fb.db'}")
    hour = timedelta(hours=1)
    send(settings, [
        completion("late-ok", version="v1", ts=T0), feedback("late-ok", ts=T0 + 2 * hour),
        completion("too-late", version="v1", ts=T0, text="x*3\n"), feedback("too-late", ts=T0 + 30 * hour),
        completion("twice", version="v2", ts=T0 + hour, caller="key-b"),
        feedback("twice", "accept", ts=T0 + hour + timedelta(seconds=5), caller="key-b"),
        feedback("twice", "reject", ts=T0 + hour + timedelta(seconds=9), caller="key-b"),
        feedback("nobody-served-this", ts=T0 + hour),
        completion("v0-row", version="v0", ts=T0, text="x*4\n"), feedback("v0-row", ts=T0 + hour),
    ])
    ingester = Ingester(settings, log_fn=lambda _m: None)
    try:
        for _ in range(20):
            if ingester.run_once() == 0 and ingester.run_once() == 0:
                break
        rows = load_logged(ingester.engine)
        orphans = count_orphans(ingester.engine, datetime.now(UTC) + hour)
    finally:
        ingester.close()
    by_id = {r.completion_id: r for r in rows}
    assert set(by_id) == {"late-ok", "too-late", "twice", "v0-row"}
    assert orphans == 1  # held in pending_feedback, never trained on, counted by every cycle
    assert by_id["twice"].signal == "reject" and by_id["twice"].feedback_count == 2  # the newest judgement wins
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0, feedback_horizon_hours=24)
    ds = build_dataset(rows, cfg, production="v2", admitted_versions=["v1", "v0"], now=T0 + 3 * hour)
    assert ds.stats.late == 1 and ds.stats.refeedback == 1 and ds.stats.wrong_version == 1  # v0: beyond the lag
    train = {e.example.completion_id: e for e in ds.train}
    assert set(train) == {"late-ok", "twice"} and ds.stats.off_policy == 1
    # The late feedback joined the completion v1 served, with v1's own logged log-probs as μ.
    assert train["late-ok"].example.version == "v1" and train["late-ok"].example.logprobs[0] == -0.25
