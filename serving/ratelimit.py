"""Per-key token buckets: ``rate`` requests per second sustained, ``burst`` at once."""

from __future__ import annotations

import threading
import time


class RateLimiter:
    def __init__(self, rate: float, burst: int, max_keys: int = 100_000) -> None:
        self.rate, self.burst, self.max_keys = rate, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str, now: float | None = None) -> float:
        """Take one token; return 0 when allowed, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            if tokens >= 1:
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            if len(self._buckets) > self.max_keys:  # bounded memory: forget idle buckets (they refill anyway)
                self._buckets = {k: v for k, v in self._buckets.items() if now - v[1] < self.burst / self.rate}
            return (1 - tokens) / self.rate
