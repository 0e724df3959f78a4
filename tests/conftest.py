"""Shared fixtures: real PostgreSQL, a real Kafka-protocol broker, the tiny model, temporary settings.

A fixture that cannot start its service fails the tests that need it with the reason; nothing is
skipped silently.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The release gate's held-out evaluation at the size the pipeline tests were written for: they check that
# gate decisions are made, recorded and acted on, not the evaluator's precision (`bench online` runs at
# the default). Subprocesses (the CLI and demo tests) inherit it.
os.environ.setdefault("RTRL_RELEASE__OFFLINE_SAMPLES", "8")

from rtrl import devservices  # noqa: E402

PG_ADMIN_URL = os.environ.get("RTRL_TEST_PG_ADMIN_URL", devservices.DEFAULT_PG_ADMIN_URL)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def postgres_admin_url() -> str:
    try:
        devservices.ensure_postgres(PG_ADMIN_URL)
    except devservices.ServiceError as err:
        pytest.fail(str(err), pytrace=False)
    return PG_ADMIN_URL


@pytest.fixture
def postgres_url(postgres_admin_url: str) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    with devservices.temporary_postgres_database(postgres_admin_url) as url:
        yield url


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[devservices.TansuProcess]:
    """A Tansu broker on a free loopback port for the whole session (memory storage)."""
    try:
        broker = devservices.start_tansu_broker()
    except devservices.ServiceError as err:
        pytest.fail(str(err), pytrace=False)
    yield broker
    broker.stop()


@pytest.fixture
def kafka_bootstrap(kafka_broker: devservices.TansuProcess) -> str:
    return kafka_broker.bootstrap


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny default model (random weights), built once per session."""
    from offline_rl.corpus import build_default_model
    from policy.config import TinyModelSettings

    out = tmp_path_factory.mktemp("tiny_model")
    build_default_model(out, TinyModelSettings(corpus_examples=2000))
    return out


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny mixture-of-experts model (`rtrl init-model --moe`, random weights), built once per session."""
    from offline_rl.corpus import build_default_model
    from policy.config import TinyModelSettings

    out = tmp_path_factory.mktemp("tiny_moe")
    build_default_model(out, TinyModelSettings(corpus_examples=2000), moe=True)
    return out


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """One `rtrl demo --fast --json` in a fresh directory: (workdir, summary, stderr). Used by the demo
    tests and by the example-config test, which starts its online stage from this run's registry."""
    import json
    import subprocess
    import sys

    work = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("RTRL_CONFIG", None)
    proc = subprocess.run([sys.executable, "-m", "rtrl", "demo", "--fast", "--json"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return work, json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr
