"""Run the test suite with the services it needs, then stop what this run started.

PostgreSQL is started if it is down (and stopped again afterwards); the Tansu Kafka-protocol broker
is started by the pytest fixtures on a free loopback port and stopped at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rtrl import devservices  # noqa: E402


def ensure_chromium() -> None:
    """The report test renders the demo's page in a real headless browser (Debian's chromium)."""
    if shutil.which("chromium"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        print("chromium is missing and cannot be installed here (needs root + apt-get): "
              "the report-rendering test will fail with that reason", flush=True)
        return
    print("installing Debian's chromium for the report-rendering test", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=False, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=False, stdout=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Tests call the `rtrl` console script by name, as a user would: the venv's bin goes first on PATH.
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", "")
    started_pg = False
    if not devservices.postgres_reachable():
        print("PostgreSQL is down: starting it for the tests", flush=True)
        devservices.ensure_postgres()
        started_pg = True
    ensure_chromium()
    try:
        rc = subprocess.call([sys.executable, "-m", "pytest", *argv], cwd=ROOT)
    finally:
        if started_pg:
            subprocess.run("pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main stop",
                           shell=True, check=False)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
