"""Which weights to serve: version sources and the watcher that hot-swaps when they change.

Sources answer "which version is on channel X now, and where is its HF directory":

* :class:`RegistrySource` reads the registry's ``production`` / ``candidate`` channels
  (``policy.registry.Registry``) and materialises the version to a local directory;
* :class:`DirSource` serves a plain HF directory (``model.dir``). Its version id is the manifest's
  ``version`` when the directory has an ``rtrl_version.json`` / ``manifest.json`` naming one, else
  ``sha-`` + the first 16 hex digits of the SHA-256 over the weight files. The path is re-resolved
  on each poll, so repointing a symlink (a common deploy step) is a new version.

The watcher polls every ``serving.poll_interval_s`` and hands a changed version to the engine, which
swaps between batches (see :mod:`serving.engines.base`).
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path

from policy.registry import Registry
from realtime_rl.bus import BusUnavailable, open_consumer
from realtime_rl.events import ModelVersionEvent, decode_event

log = logging.getLogger("serving.versions")

MANIFEST_NAMES = ("rtrl_version.json", "manifest.json")


class VersionRef:
    """A version on a channel; its HF directory is located (e.g. materialised) only when first asked for,
    so that polling an unchanged channel costs a channel read, not a checksum pass over the weights."""

    def __init__(self, version: str, model_dir: str | Path | Callable[[], str | Path],
                 channel: str = "production") -> None:
        self.version, self.channel = version, channel
        lazy = callable(model_dir)
        self._dir = None if lazy else Path(model_dir)
        self._locate = model_dir if lazy else None
        self._lock = threading.Lock()

    @property
    def model_dir(self) -> Path:
        with self._lock:
            if self._dir is None:
                self._dir = Path(self._locate())
            return self._dir

    def __repr__(self) -> str:
        return f"VersionRef({self.version!r}, channel={self.channel!r})"


def dir_version(model_dir: str | Path) -> str:
    path = Path(model_dir).resolve()
    for name in MANIFEST_NAMES:
        f = path / name
        if f.is_file():
            try:
                data = json.loads(f.read_text())
            except ValueError:
                continue
            if isinstance(data, dict) and isinstance(data.get("version"), str) and data["version"]:
                return data["version"]
    h = hashlib.sha256()
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no *.safetensors weights")
    for f in files:
        h.update(f.name.encode())
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return "sha-" + h.hexdigest()[:16]


class DirSource:
    """A plain HF directory (production) and optionally a candidate directory."""

    def __init__(self, production_dir: str | Path, candidate_dir: str | Path | None = None) -> None:
        self._dirs = {"production": Path(production_dir)}
        if candidate_dir:
            self._dirs["candidate"] = Path(candidate_dir)
        self._cache: dict[str, tuple[tuple, str]] = {}

    def current(self, channel: str) -> VersionRef | None:
        path = self._dirs.get(channel)
        if path is None or not path.exists():
            return None
        resolved = path.resolve()
        stamp = (str(resolved), tuple((f.name, f.stat().st_mtime_ns, f.stat().st_size)
                                      for f in sorted(resolved.iterdir()) if f.is_file()))
        cached = self._cache.get(channel)
        if cached is None or cached[0] != stamp:  # one entry per channel: polls never re-hash unchanged weights
            cached = self._cache[channel] = (stamp, dir_version(resolved))
        return VersionRef(cached[1], resolved, channel)


class RegistrySource:
    """The registry's channels (``policy.registry``); versions are materialised to local directories."""

    def __init__(self, settings) -> None:
        self._registry = Registry.from_settings(settings.registry)

    def current(self, channel: str) -> VersionRef | None:
        if channel not in self._registry.channel_names:
            return None
        version = self._registry.channel(channel)
        if version is None:
            return None
        # materialize() verifies every file and tensor checksum: a corrupt version is refused there
        # and the watcher keeps serving the current one.
        return VersionRef(version, lambda: self._registry.materialize(version), channel)


def open_source(settings):
    s = settings.serving
    if s.source in ("registry", "auto"):
        try:
            source = RegistrySource(settings)
            if s.source == "registry" or source.current("production") is not None:
                return source
        except Exception as err:  # noqa: BLE001 - `auto` falls back to the plain directory
            if s.source == "registry":
                raise
            log.info("registry unavailable (%s); serving the plain directory %s", err, settings.model.dir)
    return DirSource(settings.model.dir, s.candidate_dir)


class VersionWatcher:
    """Polls a source and swaps the engine to new versions; runs in a daemon thread."""

    def __init__(self, source, engine, interval_s: float, metrics=None, on_swap=None) -> None:
        self.source, self.engine, self.interval_s = source, engine, interval_s
        self.metrics, self.on_swap = metrics, on_swap
        self.last_error: str | None = None
        # (channel, version, pause_s) of every hot swap after start-up, for reports; bounded.
        self.history: collections.deque[tuple[str, str, float]] = collections.deque(maxlen=1000)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="version-watcher", daemon=True)

    def sync(self) -> list[tuple[str, str, float]]:
        """Check every channel once; install what changed. Returns (channel, version, pause_s) swaps."""
        swaps = []
        with self._lock:
            channels = ["production"] + (["candidate"] if self.engine.supports_candidate else [])
            for channel in channels:
                ref = self.source.current(channel)
                live = self.engine.versions().get(channel)
                if ref is None:
                    if live is not None and channel != "production":
                        self.engine.drop(channel)
                    continue
                if ref.version == live:
                    continue
                pause = self.engine.load(ref, channel)
                log.info("serving %s on %s (was %s); pause %.1f ms", ref.version, channel, live, pause * 1000)
                if self.metrics is not None and live is not None:  # the first load is start-up, not a pause
                    self.metrics.swap_pause.observe(pause)
                    self.metrics.swaps.labels(channel).inc()
                if live is not None:
                    self.history.append((channel, ref.version, pause))
                swaps.append((channel, ref.version, pause))
                if self.on_swap is not None:
                    self.on_swap(channel, ref.version)
        return swaps

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def poke(self) -> None:
        """Poll now instead of at the next interval (a `model_version` event arrived)."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.sync()
                self.last_error = None
            except Exception as err:  # noqa: BLE001 - keep serving the current version, retry next poll
                self.last_error = str(err)
                log.warning("version poll failed (still serving %s): %s", self.engine.versions(), err)


class VersionEventFollower:
    """Pokes the watcher when a `model_version` event for this model appears on the bus.

    Reads ``bus.versions_topic`` from its end at start-up (older events are history; the first poll
    already saw their effect). Bus outages only delay swaps to the next regular poll.
    """

    def __init__(self, bus_settings, model_name: str, watcher: VersionWatcher) -> None:
        self.bus_settings, self.model_name, self.watcher = bus_settings, model_name, watcher
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="version-events", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=15)

    def _loop(self) -> None:
        topic = self.bus_settings.versions_topic
        consumer = None
        while not self._stop.is_set():
            try:
                if consumer is None:
                    consumer = open_consumer(self.bus_settings, f"gateway-versions-{id(self)}")
                    consumer.assign(dict(((topic, p), off) for p, off in consumer.end_offsets(topic).items()))
                for rec in consumer.poll(0.5):
                    try:
                        event = decode_event(rec.value)
                    except ValueError:
                        continue
                    if isinstance(event, ModelVersionEvent) and event.model == self.model_name:
                        self.seen += 1
                        self.watcher.poke()
            except BusUnavailable as err:
                log.info("version events unavailable (%s); relying on polling", err)
                if consumer is not None:
                    consumer.close()
                consumer = None
                self._stop.wait(2.0)
        if consumer is not None:
            consumer.close()
