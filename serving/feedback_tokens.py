"""Feedback tokens: HMAC-SHA256 over (completion id, caller key id, version, expiry).

Token layout: ``<base64url(json {"k": key_id, "v": version, "e": expiry})>.<hex hmac>``. The payload is
readable but not forgeable; carrying the key id lets the gateway tell a *foreign* token (valid, but
issued to another key) from a *forged* one (bad MAC). The MAC input joins the fields with NUL bytes,
which none of them may contain, so field boundaries cannot be shifted.

Replay detection keeps the completion ids already used in a bounded in-memory set until their tokens
expire. Limits: the set lives in one gateway process, so with several gateways (or after a restart)
the same token can be accepted once per process; and when more than ``replay_cache_size`` unexpired
ids are held, the oldest are forgotten (counted in ``rtrl_feedback_replay_evictions_total``). The
ingester's idempotence on ``completion_id`` is the durable second line: it keeps one feedback per
completion whatever the gateways accepted.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["ok", "forged", "foreign", "expired", "replayed"]


@dataclass(frozen=True)
class TokenClaims:
    key_id: str
    version: str
    expiry: int


def _mac(secret: bytes, completion_id: str, key_id: str, version: str, expiry: int) -> str:
    for field in (completion_id, key_id, version):
        if "\0" in field:
            raise ValueError("token fields may not contain NUL")
    msg = "\0".join((completion_id, key_id, version, str(expiry))).encode()
    return hmac.new(secret, msg, hashlib.sha256).hexdigest()


def sign(secret: bytes, completion_id: str, key_id: str, version: str, expiry: int) -> str:
    payload = json.dumps({"k": key_id, "v": version, "e": expiry}, separators=(",", ":")).encode()
    body = base64.urlsafe_b64encode(payload).rstrip(b"=").decode()
    return f"{body}.{_mac(secret, completion_id, key_id, version, expiry)}"


def parse(token: str) -> tuple[TokenClaims, str] | None:
    try:
        body, mac = token.rsplit(".", 1)
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        data = json.loads(raw)
        claims = TokenClaims(key_id=str(data["k"]), version=str(data["v"]), expiry=int(data["e"]))
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None
    return claims, mac


class ReplayGuard:
    """Completion ids whose feedback was accepted, kept until their token expires (bounded)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.evictions = 0
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._lock = threading.Lock()

    def claim(self, completion_id: str, expiry: int, now: float) -> bool:
        """Record the id; False if it was already used."""
        with self._lock:
            if completion_id in self._seen:
                return False
            # Entries are in insertion order, not expiry order; dropping expired ones from the front is
            # a cheap partial clean, the capacity bound does the rest.
            while self._seen:
                first, exp = next(iter(self._seen.items()))
                if exp >= now:
                    break
                del self._seen[first]
            while len(self._seen) >= self.capacity:
                self._seen.popitem(last=False)
                self.evictions += 1
            self._seen[completion_id] = expiry
            return True

    def __len__(self) -> int:
        return len(self._seen)


class FeedbackTokens:
    def __init__(self, secret: str, ttl_s: int, replay_capacity: int) -> None:
        self._secret = secret.encode()
        self.ttl_s = ttl_s
        self.replay = ReplayGuard(replay_capacity)

    def issue(self, completion_id: str, key_id: str, version: str, now: float | None = None) -> str:
        expiry = int((now or time.time()) + self.ttl_s)
        return sign(self._secret, completion_id, key_id, version, expiry)

    def check(self, token: str, completion_id: str, caller: str, now: float | None = None,
              consume: bool = True) -> tuple[Verdict, TokenClaims | None]:
        now = time.time() if now is None else now
        parsed = parse(token)
        if parsed is None:
            return "forged", None
        claims, mac = parsed
        try:
            expected = _mac(self._secret, completion_id, claims.key_id, claims.version, claims.expiry)
        except ValueError:
            return "forged", None
        if not hmac.compare_digest(expected, mac):
            return "forged", None
        if not hmac.compare_digest(claims.key_id, caller):
            return "foreign", claims
        if claims.expiry < now:
            return "expired", claims
        if consume and not self.replay.claim(completion_id, claims.expiry, now):
            return "replayed", claims
        return "ok", claims
