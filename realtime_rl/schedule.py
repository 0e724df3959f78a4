"""`rtrl scheduler`: run the update cycle on a schedule with APScheduler.

``schedule.update_interval`` is an interval (``3h``, ``90m``, ``45s``, ``1h30m``) or a 5-field cron
expression (``0 */3 * * *``). Missed runs coalesce into one (``coalesce``) and a run later than
``misfire_grace_s`` is dropped; one job instance at a time per process (``max_instances=1``) and one
updater across processes (the database lock in :mod:`realtime_rl.locks`, taken by each cycle).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.blocking import BlockingScheduler
from apscheduler.triggers.cron import CronTrigger
from apscheduler.triggers.interval import IntervalTrigger

from realtime_rl.cycle import run_update_cycle

INTERVAL = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def parse_trigger(spec: str):
    """An APScheduler trigger for an interval or a cron expression; ValueError names the problem."""

    s = spec.strip()
    m = INTERVAL.match(s.replace(" ", ""))
    if m and any(m.groups()):
        h, mi, se = (int(g or 0) for g in m.groups())
        seconds = h * 3600 + mi * 60 + se
        if seconds <= 0:
            raise ValueError(f"update_interval {spec!r} must be positive")
        return IntervalTrigger(seconds=seconds)
    if len(s.split()) == 5:
        try:
            return CronTrigger.from_crontab(s, timezone="UTC")
        except ValueError as err:
            raise ValueError(f"update_interval {spec!r}: bad cron expression: {err}") from None
    raise ValueError(f"update_interval {spec!r}: expected an interval like 3h / 90m / 45s or a 5-field cron "
                     "expression")


def build_scheduler(settings, job: Callable[[], object], *, blocking: bool = True):
    """A scheduler with the update job registered (not started)."""

    cls = BlockingScheduler if blocking else BackgroundScheduler
    sched = cls(timezone="UTC")
    s = settings.schedule
    extra = {"next_run_time": datetime.now(UTC)} if s.run_at_start else {}
    # One job, so a start-up run and the first tick can never overlap in this process.
    sched.add_job(job, parse_trigger(s.update_interval), id="rtrl-update", coalesce=s.coalesce,
                  misfire_grace_time=s.misfire_grace_s, max_instances=1, replace_existing=True, **extra)
    return sched


def scheduled_cycle(settings, log: Callable[[str], None] = print) -> Callable[[], object]:
    """The job: one update cycle; an exception is logged, never kills the scheduler."""

    def job():
        try:
            result = run_update_cycle(settings, log=log)
        except Exception as err:  # the next tick retries; the run left nothing half-published
            log(f"update cycle failed: {type(err).__name__}: {err}")
            return None
        log(f"update cycle {result.run_id}: {result.status}: {result.reason}")
        return result

    return job
