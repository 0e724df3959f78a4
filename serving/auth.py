"""API keys: created once (plaintext shown once), stored only as salted SHA-256 hashes.

A key looks like ``rtrl-<key_id>-<secret>``. The key id is not secret: it names the caller in events,
feedback tokens, rate limits and logs; the secret part never leaves this module except once, at
creation. The store is one JSON file written atomically (temp file + rename) so that `rtrl keys add`
and `rtrl keys revoke` take effect in a running gateway, which re-reads the file when it changes.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KEY_PREFIX = "rtrl"


class KeyStoreError(RuntimeError):
    """The key file is unreadable, or a name/id is unknown or taken."""


@dataclass
class StoredKey:
    key_id: str
    name: str
    salt: str
    sha256: str
    created: float
    revoked: bool = False


def _digest(salt: str, secret: str) -> str:
    return hashlib.sha256(f"{salt}:{secret}".encode()).hexdigest()


def split_key(plaintext: str) -> tuple[str, str] | None:
    parts = plaintext.split("-", 2)
    if len(parts) != 3 or parts[0] != KEY_PREFIX or not parts[1] or not parts[2]:
        return None
    return parts[1], parts[2]


class KeyStore:
    """Hashed API keys in one JSON file; thread-safe; reloads when the file changes."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._keys: dict[str, StoredKey] = {}
        self._stamp: tuple[float, int] | None = None

    def _load(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._keys, self._stamp = {}, None
            return
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._stamp:
            return
        try:
            data = json.loads(self.path.read_text())
            keys = {k["key_id"]: StoredKey(**k) for k in data.get("keys", [])}
        except (OSError, ValueError, TypeError, KeyError) as err:
            raise KeyStoreError(f"API key file {self.path} is unreadable: {err}") from err
        self._keys, self._stamp = keys, stamp

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"keys": [asdict(k) for k in self._keys.values()]}, indent=2))
        os.chmod(tmp, 0o600)
        os.replace(tmp, self.path)
        self._stamp = None

    def create(self, name: str) -> str:
        """Add a key named ``name``; return the plaintext (the only time it exists)."""
        if not name or len(name) > 100:
            raise KeyStoreError("a key name must be 1-100 characters")
        with self._lock:
            self._load()
            # Names need not be unique (a re-run demo registers its simulated users again); the key id is.
            key_id = secrets.token_hex(6)
            secret, salt = secrets.token_urlsafe(32), secrets.token_hex(16)
            self._keys[key_id] = StoredKey(key_id=key_id, name=name, salt=salt, sha256=_digest(salt, secret),
                                           created=time.time())
            self._save()
        return f"{KEY_PREFIX}-{key_id}-{secret}"

    def revoke(self, name_or_id: str) -> StoredKey:
        """Revoke the key with this id, or every active key with this name."""
        with self._lock:
            self._load()
            matches = [k for k in self._keys.values()
                       if (k.key_id == name_or_id or k.name == name_or_id) and not k.revoked]
            if not matches:
                raise KeyStoreError(f"no active key with name or id {name_or_id!r}")
            for k in matches:
                k.revoked = True
            self._save()
        return matches[0]

    def list(self) -> list[StoredKey]:
        with self._lock:
            self._load()
            return sorted(self._keys.values(), key=lambda k: k.created)

    def authenticate(self, plaintext: str) -> str | None:
        """The key id for a valid, unrevoked key; None otherwise (constant-time hash comparison)."""
        parts = split_key(plaintext)
        if parts is None:
            return None
        key_id, secret = parts
        with self._lock:
            self._load()
            stored = self._keys.get(key_id)
        if stored is None or stored.revoked:
            return None
        return key_id if hmac.compare_digest(stored.sha256, _digest(stored.salt, secret)) else None


def create_api_key(settings, name: str) -> str:
    """Create a key in ``settings.serving.api_keys_file``; return the plaintext key."""
    return KeyStore(settings.serving.api_keys_file).create(name)


def issue_key(settings, name: str) -> tuple[str, str]:
    """A new key for ``name``: (the plaintext key, the caller id the gateway logs for its requests)."""
    key = create_api_key(settings, name)
    parts = split_key(key)
    return key, parts[0] if parts else name
