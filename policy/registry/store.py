"""Where versions live: a local directory (default) or any fsspec URL.

Layout under the root::

    versions/<id>/manifest.json      the version is visible iff its manifest is
    versions/<id>/<shard files>      safetensors snapshot shards or delta files, aux/<config etc.>
    channels/<name>.json             channel pointer, rollback stack and full history
    staging/<id>.<pid>.<token>/      a publish in progress (local store only)
    locks/                           flock files (local store only)

Commit protocols:

- :class:`LocalStore` writes a version into ``staging/``, fsyncs every file and the directory, then
  renames the directory into ``versions/`` in one ``rename(2)``: a crash at any moment leaves
  either nothing visible or the whole version. Two publishers of the same content race on the
  rename; the loser sees the target exists and drops its copy (ids are content addresses, so the
  winner's version is the same weights). A live publisher holds an flock on its staging directory,
  so ``gc`` can tell abandoned staging (lock free: the process died) from work in progress.
- :class:`FsspecStore` (object stores have no directory rename) writes the shard files first,
  under names carrying a per-publish token so that concurrent publishers never overwrite each
  other's files, and the manifest last: a single-object PUT is atomic on S3-compatible stores, so
  the manifest is the commit point. It has no locks: run ``gc`` when no publisher is running.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import fsspec

from policy.registry.shards import read_file_writable

MANIFEST = "manifest.json"


class Staging(Protocol):
    """A version being written. ``prefix`` goes in front of every file name the publisher picks."""

    prefix: str

    def write(self, name: str, data: bytes | memoryview) -> None: ...

    def commit(self, manifest: bytes) -> bool:
        """Make the version visible; False if a version with this id already exists (ours is dropped)."""
        ...

    def abort(self) -> None: ...


class Store(Protocol):
    url: str

    def read(self, path: str, *, writable: bool = False) -> bytes | bytearray: ...

    def exists(self, path: str) -> bool: ...

    def list_versions(self) -> list[str]: ...

    def stage(self, version_id: str) -> Staging: ...

    def delete_version(self, version_id: str) -> None: ...

    def write_atomic(self, path: str, data: bytes) -> None: ...

    def lock(self, name: str, *, shared: bool = False) -> contextlib.AbstractContextManager[None]: ...

    def clean_staging(self, min_age_s: float = 60.0) -> list[str]: ...

    def size(self, path: str) -> int: ...


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (temp file, fsync, rename, fsync directory)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        _write_file(tmp, data)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    _fsync_dir(path.parent)


@contextlib.contextmanager
def flocked(path: Path, *, shared: bool = False, blocking: bool = True) -> Iterator[bool]:
    """Hold an flock on ``path`` (created if needed); yields False if non-blocking and busy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(fd, flags)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def remove_abandoned(staging_root: Path, min_age_s: float = 60.0) -> list[str]:
    """Delete staging directories whose writer died (its flock is free). Returns their names.

    ``min_age_s`` covers the instant between a publisher creating its directory and locking it.
    """
    removed: list[str] = []
    if not staging_root.is_dir():
        return removed
    now = time.time()
    for entry in sorted(staging_root.iterdir()):
        if not entry.is_dir() or now - entry.stat().st_mtime < min_age_s:
            continue
        with flocked(entry / ".lock", blocking=False) as free:
            if not free:
                continue  # a live publisher holds it
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


class _LocalStaging:
    def __init__(self, store: LocalStore, version_id: str) -> None:
        self.store = store
        self.version_id = version_id
        self.prefix = ""
        self.dir = store.root / "staging" / f"{version_id}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)
        # Held until commit or abort; the kernel drops it if this process dies, which is how gc
        # recognises abandoned staging.
        self._lock_fd = os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._dirs: set[Path] = {self.dir}

    def write(self, name: str, data: bytes | memoryview) -> None:
        path = self.dir / name
        if path.parent != self.dir:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._dirs.add(path.parent)
        _write_file(path, data)

    def commit(self, manifest: bytes) -> bool:
        self.write(MANIFEST, manifest)
        (self.dir / ".lock").unlink()
        for d in self._dirs:
            _fsync_dir(d)
        target = self.store.root / "versions" / self.version_id
        try:
            if target.exists():
                return False
            try:
                os.rename(self.dir, target)
            except OSError as err:
                if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    return False  # a concurrent publisher of the same content won the race
                raise
            _fsync_dir(target.parent)
            return True
        finally:
            self._release()
            if self.dir.exists():
                shutil.rmtree(self.dir, ignore_errors=True)

    def abort(self) -> None:
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


class LocalStore:
    """A registry in a local (or NFS-mounted) directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).expanduser().resolve()
        self.url = str(self.root)
        for sub in ("versions", "channels", "staging", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    def path(self, rel: str) -> Path:
        return self.root / rel

    def read(self, path: str, *, writable: bool = False) -> bytes | bytearray:
        if writable:
            return read_file_writable(self.root / path)
        return (self.root / path).read_bytes()

    def exists(self, path: str) -> bool:
        return (self.root / path).exists()

    def size(self, path: str) -> int:
        return (self.root / path).stat().st_size

    def list_versions(self) -> list[str]:
        base = self.root / "versions"
        return sorted(p.name for p in base.iterdir() if (p / MANIFEST).is_file())

    def stage(self, version_id: str) -> _LocalStaging:
        return _LocalStaging(self, version_id)

    def delete_version(self, version_id: str) -> None:
        src = self.root / "versions" / version_id
        if not src.exists():
            return
        # Rename first so the version disappears in one step, then delete at leisure.
        trash = self.root / "staging" / f"deleted-{version_id}.{uuid.uuid4().hex[:8]}"
        os.rename(src, trash)
        _fsync_dir(src.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def write_atomic(self, path: str, data: bytes) -> None:
        target = self.root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(target, data)

    def lock(self, name: str, *, shared: bool = False) -> contextlib.AbstractContextManager[None]:
        @contextlib.contextmanager
        def held() -> Iterator[None]:
            with flocked(self.root / "locks" / f"{name}.lock", shared=shared):
                yield

        return held()

    def clean_staging(self, min_age_s: float = 60.0) -> list[str]:
        return remove_abandoned(self.root / "staging", min_age_s)


class _FsspecStaging:
    def __init__(self, store: FsspecStore, version_id: str) -> None:
        self.store = store
        self.version_id = version_id
        self.prefix = f"{uuid.uuid4().hex[:8]}-"
        self.written: list[str] = []

    def _full(self, name: str) -> str:
        return f"{self.store.root}/versions/{self.version_id}/{name}"

    def write(self, name: str, data: bytes | memoryview) -> None:
        path = self._full(name)
        self.store.fs.pipe_file(path, bytes(data))
        self.written.append(path)

    def commit(self, manifest: bytes) -> bool:
        if self.store.exists(f"versions/{self.version_id}/{MANIFEST}"):
            self.abort()
            return False
        self.store.fs.pipe_file(self._full(MANIFEST), manifest)
        return True

    def abort(self) -> None:
        for path in self.written:
            with contextlib.suppress(FileNotFoundError):
                self.store.fs.rm_file(path)


class FsspecStore:
    """A registry on any fsspec filesystem (``s3://bucket/prefix``, ``memory://x``, ``gs://``...)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url)
        self.root = root.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def read(self, path: str, *, writable: bool = False) -> bytes | bytearray:
        data = self.fs.cat_file(self._p(path))
        return bytearray(data) if writable else data

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._p(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(self._p(path)))

    def list_versions(self) -> list[str]:
        base = self._p("versions")
        if not self.fs.exists(base):
            return []
        out = []
        for entry in self.fs.ls(base, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.fs.exists(f"{base}/{name}/{MANIFEST}"):
                out.append(name)
        return sorted(out)

    def stage(self, version_id: str) -> _FsspecStaging:
        return _FsspecStaging(self, version_id)

    def delete_version(self, version_id: str) -> None:
        base = self._p(f"versions/{version_id}")
        if not self.fs.exists(base):
            return
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{base}/{MANIFEST}")  # invisible first, then the rest
        self.fs.rm(base, recursive=True)

    def write_atomic(self, path: str, data: bytes) -> None:
        self.fs.pipe_file(self._p(path), data)

    def lock(self, name: str, *, shared: bool = False) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def clean_staging(self, min_age_s: float = 3600.0) -> list[str]:
        """Delete files of versions that never got a manifest (a publisher died before committing).

        Only files older than ``min_age_s``, so a publish in progress elsewhere is left alone.
        """
        removed: list[str] = []
        base = self._p("versions")
        if not self.fs.exists(base):
            return removed
        now = time.time()
        for entry in self.fs.ls(base, detail=False):
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.fs.exists(f"{base}/{name}/{MANIFEST}"):
                continue
            stale = True
            for f in self.fs.find(f"{base}/{name}", detail=True).values():
                created = f.get("created") or f.get("LastModified") or f.get("mtime")
                ts = created.timestamp() if hasattr(created, "timestamp") else created
                if isinstance(ts, int | float) and now - ts < min_age_s:
                    stale = False
            if stale:
                self.fs.rm(f"{base}/{name}", recursive=True)
                removed.append(name)
        return removed


def open_store(url: str | Path) -> LocalStore | FsspecStore:
    """A :class:`LocalStore` for a path or ``file://`` URL, else an :class:`FsspecStore`."""
    text = str(url)
    if "://" not in text:
        return LocalStore(text)
    if text.startswith("file://"):
        return LocalStore(text[len("file://"):])
    return FsspecStore(text)
