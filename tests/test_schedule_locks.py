"""Scheduling and the one-updater rule: triggers, lock contention (SQLite row lock and PostgreSQL
advisory lock, across processes and between two running schedulers), and a run SIGKILLed mid-update
that leaves nothing half-published so the next run proceeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from realtime_rl.cycle import run_update_cycle
from realtime_rl.database import make_engine
from realtime_rl.locks import updater_lock
from realtime_rl.release import RegistryStore, list_runs
from realtime_rl.release_tables import updater_locks
from realtime_rl.schedule import build_scheduler, parse_trigger
from realtime_rl.schema import upgrade
from tests.rtrl_update_fixtures import make_settings, make_world, sqlite_url  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def test_triggers_interval_and_cron():
    from apscheduler.triggers.cron import CronTrigger
    from apscheduler.triggers.interval import IntervalTrigger

    t = parse_trigger("3h")
    assert isinstance(t, IntervalTrigger) and t.interval.total_seconds() == 3 * 3600
    assert parse_trigger("1h30m").interval.total_seconds() == 5400
    assert parse_trigger("45s").interval.total_seconds() == 45
    assert isinstance(parse_trigger("0 */3 * * *"), CronTrigger)
    for bad in ("", "3 hours", "0s", "61 * * * *"):
        with pytest.raises(ValueError, match="update_interval"):
            parse_trigger(bad)


def test_scheduler_job_has_misfire_and_coalesce(tmp_path):
    settings, _ = make_settings(tmp_path, f"sqlite:///{tmp_path / 'x.db'}", SCHEDULE__MISFIRE_GRACE_S=120,
                                SCHEDULE__UPDATE_INTERVAL="2h")
    sched = build_scheduler(settings, lambda: None, blocking=False)
    job = sched.get_job("rtrl-update")
    assert job.coalesce is True and job.misfire_grace_time == 120 and job.max_instances == 1
    assert job.trigger.interval.total_seconds() == 7200


HOLDER = textwrap.dedent("""
    import sys, time
    from realtime_rl.database import make_engine
    from realtime_rl.locks import updater_lock
    engine = make_engine(sys.argv[1])
    with updater_lock(engine, "rtrl-updater") as held:
        open(sys.argv[2], "w").write("held" if held else "not-held")
        time.sleep(600)
""")


def _spawn(script: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=full_env)


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if proc.poll() is not None:
            raise AssertionError(f"child exited early with {proc.returncode}")
        time.sleep(0.05)
    raise AssertionError(f"{path} never appeared")


def _contention(url: str, tmp_path: Path) -> None:
    upgrade(url)
    marker = tmp_path / "held"
    proc = _spawn(HOLDER, [url, str(marker)])
    engine = make_engine(url)
    try:
        assert _wait_file(marker, proc) == "held"
        with updater_lock(engine, "rtrl-updater") as held:
            assert held is False  # another process holds it
        with updater_lock(engine, "another-name") as held:
            assert held is True  # locks are per name
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 10
        got = False
        while not got and time.monotonic() < deadline:
            with updater_lock(engine, "rtrl-updater") as got:
                pass
            time.sleep(0.1)
        assert got, "the lock of a killed holder was never freed"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        engine.dispose()


def test_lock_contention_sqlite_across_processes(tmp_path):
    _contention(f"sqlite:///{tmp_path / 'lock.db'}", tmp_path)


@pytest.mark.postgres
def test_lock_contention_postgres_advisory(tmp_path, postgres_url):
    _contention(postgres_url, tmp_path)
    engine = make_engine(postgres_url)
    try:
        with updater_lock(engine, "rtrl-updater") as a, updater_lock(engine, "rtrl-updater") as b:
            assert (a, b) == (True, False)  # two sessions of one process contend too
        with engine.connect() as conn:  # the advisory path never writes the SQLite-style row
            assert conn.execute(sa.select(sa.func.count()).select_from(updater_locks)).scalar() == 0
    finally:
        engine.dispose()


def test_two_schedulers_one_update(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir, SCHEDULE__RUN_AT_START="true",
                   SCHEDULE__UPDATE_INTERVAL="1h")
    results: list[str] = []
    done = threading.Event()

    def job():
        r = run_update_cycle(w.settings, log=lambda _m: None)
        results.append(r.status)
        if len(results) == 2:
            done.set()

    scheds = [build_scheduler(w.settings, job, blocking=False) for _ in range(2)]
    for s in scheds:
        s.start()
    try:
        assert done.wait(180), results
    finally:
        for s in scheds:
            s.shutdown(wait=True)
    assert sorted(results) == ["locked", "released"]
    assert RegistryStore(w.settings).production() != w.production


KILLED_RUN = textwrap.dedent("""
    import sys, time
    from rtrl.config import load_settings
    from realtime_rl.cycle import run_update_cycle
    marker = sys.argv[1]
    def log(msg):
        if "epoch 1/" in msg:
            open(marker, "w").write("training")
            time.sleep(600)  # SIGKILLed here, mid-update
    run_update_cycle(load_settings(), log=log)
""")


def test_run_killed_mid_update_leaves_nothing_then_next_run_proceeds(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir)
    store = RegistryStore(w.settings)
    versions_before = {v.id for v in store.registry.list()}
    marker = tmp_path / "training"
    proc = _spawn(KILLED_RUN, [str(marker)], env=w.env)
    try:
        assert _wait_file(marker, proc, timeout=180) == "training"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    engine = make_engine(w.settings.db)
    try:
        assert list_runs(engine) == []  # no record of the killed run
        with engine.connect() as conn:  # its lock row is left behind, held by a dead pid
            assert conn.execute(sa.select(updater_locks.c.pid)).scalar() == proc.pid
    finally:
        engine.dispose()
    assert store.production() == w.production
    assert {v.id for v in store.registry.list()} == versions_before  # nothing published

    r = run_update_cycle(w.settings, log=lambda _m: None)
    assert r.status == "released", r.reason
    assert store.production() == r.candidate_version
