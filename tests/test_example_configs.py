"""The example configurations: each loads, and `examples/postgres-kafka.toml` runs the lifecycle's
online stage against the machine's PostgreSQL and a real Kafka-protocol broker (Tansu).

The offline stages are not repeated here: the run starts (`--from-production`) from a copy of the
registry the embedded demo run produced, so this test adds only the online stage's time.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from rtrl.config import load_settings

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ["production.toml", "postgres-kafka.toml"])
def test_example_configs_load(name):
    s = load_settings(ROOT / "examples" / name)
    assert s.bus.backend == "kafka"
    assert s.db.url.get_secret_value().startswith("postgresql+psycopg://")


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.postgres
@pytest.mark.kafka
def test_postgres_kafka_config_runs_the_online_lifecycle(demo_run, postgres_url, kafka_bootstrap, tmp_path):
    demo_work, _, _ = demo_run
    work = tmp_path / "pgkafka"
    work.mkdir()
    shutil.copytree(demo_work / "var" / "registry", work / "registry")
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           # The example names fixed addresses; point them at this session's broker and database.
           "RTRL_BUS__BOOTSTRAP_SERVERS": kafka_bootstrap, "RTRL_DB__URL": postgres_url,
           "RTRL_REGISTRY__URL": str(work / "registry")}
    env.pop("RTRL_CONFIG", None)
    # One release proves the path through Kafka and PostgreSQL; the demo test covers two on the defaults.
    proc = subprocess.run([sys.executable, "-m", "rtrl", "demo", "--fast", "--from-production", "--releases", "1",
                           "--json", "-c", str(ROOT / "examples" / "postgres-kafka.toml")],
                          cwd=work, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["realtime_releases"] >= 1
    assert summary["failed_requests"] == 0
    assert (work / "var" / "pgkafka" / "report" / "index.html").is_file()
    engine = sa.create_engine(postgres_url)
    with engine.connect() as conn:
        n_completions = conn.execute(sa.text("select count(*) from completions")).scalar_one()
        n_feedback = conn.execute(sa.text("select count(*) from feedback")).scalar_one()
        n_released = conn.execute(sa.text("select count(*) from releases where decision = 'released'")).scalar_one()
    engine.dispose()
    assert n_completions >= 256 and n_feedback >= 256
    assert n_released == summary["realtime_releases"]
