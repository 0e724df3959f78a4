"""API key storage, feedback tokens, replay guard and rate limits (pure units, no server)."""

from __future__ import annotations

import json

import pytest

from serving.auth import KeyStore, KeyStoreError
from serving.feedback_tokens import FeedbackTokens, ReplayGuard, sign
from serving.ratelimit import RateLimiter


def test_keys_are_stored_hashed_and_revocable(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    key = store.create("alice")
    _, key_id, secret = key.split("-", 2)  # the secret is urlsafe base64: it may contain "-" itself
    raw = (tmp_path / "keys.json").read_text()
    assert secret not in raw and key not in raw
    entry = json.loads(raw)["keys"][0]
    assert entry["key_id"] == key_id and len(entry["salt"]) == 32 and len(entry["sha256"]) == 64
    assert store.authenticate(key) == key_id
    assert store.authenticate(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert store.authenticate("Bearer nonsense") is None and store.authenticate("") is None
    second = store.create("alice")  # names may repeat; ids do not
    assert second.split("-")[1] != key_id and store.authenticate(second) == second.split("-")[1]
    # Another process (the CLI) revokes: this store sees the file change.
    KeyStore(tmp_path / "keys.json").revoke("alice")
    assert store.authenticate(key) is None and store.authenticate(second) is None
    assert store.create("alice") != key
    assert [k.revoked for k in store.list()] == [True, True, False]
    with pytest.raises(KeyStoreError):
        store.revoke("nobody")


def test_two_keys_with_the_same_secret_do_not_share_a_hash(tmp_path):
    store = KeyStore(tmp_path / "keys.json")
    store.create("a")
    store.create("b")
    hashes = [k.sha256 for k in store.list()]
    salts = [k.salt for k in store.list()]
    assert len(set(hashes)) == 2 and len(set(salts)) == 2


def test_feedback_token_verdicts():
    tokens = FeedbackTokens("s3cret", ttl_s=60, replay_capacity=100)
    t = tokens.issue("cmpl-1", "alice", "v1", now=1000)
    assert tokens.check(t, "cmpl-1", "bob", now=1001)[0] == "foreign"
    assert tokens.check(t, "cmpl-2", "alice", now=1001)[0] == "forged"
    assert tokens.check(t, "cmpl-1", "alice", now=1061)[0] == "expired"
    verdict, claims = tokens.check(t, "cmpl-1", "alice", now=1001)
    assert verdict == "ok" and claims.version == "v1" and claims.key_id == "alice"
    assert tokens.check(t, "cmpl-1", "alice", now=1002)[0] == "replayed"
    # Payload edits (another version, a later expiry, another key) break the MAC.
    other = FeedbackTokens("other-secret", 60, 100).issue("cmpl-3", "alice", "v1", now=1000)
    assert tokens.check(other, "cmpl-3", "alice", now=1001)[0] == "forged"
    mac = t.rsplit(".", 1)[1]
    for key_id, version, expiry in [("alice", "v2", 1060), ("alice", "v1", 99999), ("bob", "v1", 1060)]:
        body = sign(b"x", "cmpl-4", key_id, version, expiry).split(".")[0]
        assert tokens.check(f"{body}.{mac}", "cmpl-4", key_id, now=1001)[0] == "forged"
    for junk in ["", ".", "abc.def", "e30.00", "!!!.zz"]:
        assert tokens.check(junk, "cmpl-1", "alice", now=1001)[0] == "forged"


def test_replay_guard_is_bounded_and_forgets_expired():
    guard = ReplayGuard(capacity=3)
    assert guard.claim("a", expiry=10, now=0) and not guard.claim("a", 10, 1)
    guard.claim("b", 100, 1)
    guard.claim("c", 100, 1)
    assert len(guard) == 3
    guard.claim("d", 100, 20)  # "a" expired at 10: cleaned, nothing unexpired evicted
    assert guard.evictions == 0 and len(guard) == 3
    guard.claim("e", 100, 21)  # full of unexpired ids: the oldest is forgotten (and counted)
    assert guard.evictions == 1 and len(guard) == 3


def test_rate_limiter_token_bucket():
    rl = RateLimiter(rate=2.0, burst=3)
    assert [rl.acquire("k", now=0.0) for _ in range(3)] == [0, 0, 0]
    wait = rl.acquire("k", now=0.0)
    assert wait == pytest.approx(0.5)
    assert rl.acquire("other", now=0.0) == 0  # per key
    assert rl.acquire("k", now=0.6) == 0
    assert rl.acquire("k", now=0.6) > 0
