"""The gateway's state and lifecycle: engine, version watcher, keys, tokens, limits, event emitter.

:class:`Gateway` is what the HTTP layer (:mod:`serving.app`) talks to; it holds no web objects.
"""

from __future__ import annotations

import hashlib
import logging
import sys
from pathlib import Path

from serving.auth import KeyStore
from serving.emitter import EventEmitter, default_producer_factory
from serving.engines import create_engine
from serving.engines.base import CANDIDATE, PRODUCTION
from serving.feedback_tokens import FeedbackTokens
from serving.metrics import GatewayMetrics
from serving.ratelimit import RateLimiter
from serving.versions import VersionEventFollower, VersionWatcher, open_source

log = logging.getLogger("serving")
DEFAULT_SECRET = "change-me-in-production"
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class UnknownModel(LookupError):
    pass


class NothingToServe(RuntimeError):
    """No production version: the registry channel is empty and model.dir holds no model."""


def canary_bucket(key_id: str) -> float:
    """A caller's stable position in [0, 1): the same key always lands on the same side of the split."""
    return int.from_bytes(hashlib.sha256(f"canary:{key_id}".encode()).digest()[:8], "big") / 2**64


class Gateway:
    def __init__(self, settings, *, engine=None, source=None, producer_factory=None) -> None:
        s = settings.serving
        if s.feedback_secret.get_secret_value() == DEFAULT_SECRET:
            if s.host not in LOOPBACK:
                raise ValueError("serving.feedback_secret is the built-in default: set a real secret "
                                 "(RTRL_SERVING__FEEDBACK_SECRET) before binding to a non-loopback address")
            log.warning("serving.feedback_secret is the built-in default; fine on loopback, never in production")
        self.settings = settings
        self.model_name = settings.model.name
        self.metrics = GatewayMetrics()
        self.keys = KeyStore(s.api_keys_file)
        self.tokens = FeedbackTokens(s.feedback_secret.get_secret_value(), s.feedback_token_ttl_s,
                                     s.replay_cache_size)
        self.limiter = RateLimiter(s.rate_limit_rps, s.rate_limit_burst)
        self.engine = engine or create_engine(settings, self.metrics)
        self.source = source or open_source(settings)
        self.emitter = EventEmitter(settings.bus.events_topic, Path(s.spill_dir),
                                    producer_factory or default_producer_factory(settings.bus),
                                    queue_size=s.event_queue_size, batch=s.emit_batch, retry_s=s.bus_retry_s,
                                    fsync=s.spill_fsync, linger_s=s.emit_linger_ms / 1000, metrics=self.metrics)
        self.watcher = VersionWatcher(self.source, self.engine, s.poll_interval_s, self.metrics,
                                      on_swap=self._on_swap)
        if s.canary_share > 0 and not self.engine.supports_candidate:
            log.warning("serving.canary_share=%s ignored: the %s engine serves one version at a time",
                        s.canary_share, s.engine)
        self.follower = (VersionEventFollower(settings.bus, self.model_name, self.watcher)
                         if s.follow_version_events else None)
        self._live: dict[str, str] = {}
        self.started = False

    def _on_swap(self, channel: str, version: str) -> None:
        old = self._live.get(channel)
        if old is not None:
            self.metrics.version.labels(channel, old).set(0)
        self.metrics.version.labels(channel, version).set(1)
        self._live[channel] = version

    def start(self) -> None:
        """Load the production version (blocking), then start the watcher and the event sender."""
        if self.settings.serving.gil_switch_interval_ms > 0:
            sys.setswitchinterval(self.settings.serving.gil_switch_interval_ms / 1000)
        self.emitter.start()
        try:
            swaps = self.watcher.sync()
        except BaseException:
            self.stop()
            raise
        if PRODUCTION not in self.engine.versions():
            self.stop()
            raise NothingToServe(f"no production version to serve (source {type(self.source).__name__}: registry "
                                 f"channel empty or {self.settings.model.dir} missing; `rtrl init-model` builds one)")
        log.info("gateway serving %s", ", ".join(f"{c}={v}" for c, v, _ in swaps))
        self.watcher.start()
        if self.follower is not None:
            self.follower.start()
        self.started = True

    def stop(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.watcher.stop()
        self.engine.close()
        self.emitter.stop()
        self.started = False

    @property
    def ready(self) -> bool:
        return self.started and self.engine.ready

    def channel_for(self, key_id: str, requested: str) -> str:
        """``name`` routes by the canary split; ``name@version`` pins a version that is live."""
        name, _, version = requested.partition("@")
        if name != self.model_name:
            raise UnknownModel(f"model {requested!r} not found; this gateway serves {self.model_name!r}")
        live = self.engine.versions()
        if version:
            for channel, v in live.items():
                if v == version:
                    return channel
            raise UnknownModel(f"version {version!r} is not being served (live: {sorted(live.values())})")
        share = self.settings.serving.canary_share
        if CANDIDATE in live and share > 0 and canary_bucket(key_id) < share:
            return CANDIDATE
        return PRODUCTION
