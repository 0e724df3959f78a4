"""Atomicity under SIGKILL and concurrent publishers (real subprocesses on one local store)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policy.registry import Registry
from tests.registry_fixtures import assert_bit_exact, fresh, make, rl_step, state_dict

ROOT = Path(__file__).resolve().parents[1]

# The child publishes the next version of the chain and, at the chosen point, announces itself and
# waits to be killed. The pause is injected by wrapping functions in the child only: the registry
# has no test hooks.
_CHILD = r"""
import os, sys, time
sys.path.insert(0, sys.argv[4])
from policy.registry import Registry, store
from tests.registry_fixtures import rl_step, state_dict
url, marker, point = sys.argv[1:4]

def stop_here():
    open(marker, "w").close()
    time.sleep(120)

if point == "files":
    original = store._LocalStaging.write
    count = [0]
    def write(self, name, data):
        original(self, name, data)
        count[0] += 1
        if count[0] == 2:
            stop_here()
    store._LocalStaging.write = write
elif point in ("rename", "channel"):
    real = os.rename if point == "rename" else os.replace
    def paused(src, dst, *a, **k):
        if "versions" in str(dst) or "channels" in str(dst):
            stop_here()
        return real(src, dst, *a, **k)
    if point == "rename":
        os.rename = paused
    else:
        os.replace = paused
reg = Registry(url, cache_dir=None, snapshot_every=5, chunk_elements=500, shard_mb=0.004, workers=1)
latest = reg.resolve("latest")
if point == "channel":
    reg.promote(latest, "production")
else:
    reg.publish(rl_step(state_dict(), 0), parent=latest)
print("finished without pausing", flush=True)
"""


@pytest.mark.parametrize("point", ["files", "rename", "channel"])
def test_sigkill_mid_publish_leaves_registry_consistent(tmp_path, point):
    reg = make(tmp_path)
    v0 = reg.publish(state_dict())
    marker = tmp_path / "paused"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, reg.url, str(marker), point, str(ROOT)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while not marker.exists():
            if child.poll() is not None:
                out, err = child.communicate()
                pytest.fail(f"child exited before the kill point: {out}\n{err}")
            if time.time() > deadline:
                pytest.fail("child never reached the kill point")
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    cold = fresh(reg)
    assert [v.id for v in cold.list()] == [v0.id]  # the half-published version is not visible
    assert cold.channel("production") is None  # nor the half-written promote
    report = cold.verify()
    assert report.ok, report.errors
    if point != "channel":
        assert report.warnings  # the abandoned staging directory is reported...
        assert cold.gc(staging_min_age_s=0)["staging_removed"]  # ...and gc removes it
        assert not cold.verify().warnings
    v1 = cold.publish(rl_step(state_dict(), 0), parent=v0.id)  # the same publish now succeeds
    assert_bit_exact(fresh(reg).load_state_dict(v1.id), rl_step(state_dict(), 0))


_PUBLISHER = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[4])
from policy.registry import Registry
from tests.registry_fixtures import rl_step, state_dict
url, go, seed, base = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[5]
reg = Registry(url, cache_dir=None, snapshot_every=5, chunk_elements=500, shard_mb=0.004, workers=1)
open(f"{go}.ready.{os.getpid()}", "w").close()
while not os.path.exists(go):
    time.sleep(0.01)
ids, sd, parent = [], state_dict(), base
for i in range(3):
    sd = rl_step(sd, 100 * seed + i)
    parent = reg.publish(sd, parent=parent, run=f"p{seed}").id
    ids.append(parent)
reg.promote(parent, "candidate")
print(json.dumps(ids))
"""


def test_concurrent_publishers_do_not_clobber(tmp_path):
    reg = make(tmp_path)
    v0 = reg.publish(state_dict())
    go = tmp_path / "go"
    seeds = [1, 2, 2]  # two publishers of identical content race on the same ids
    procs = [subprocess.Popen([sys.executable, "-c", _PUBLISHER, reg.url, str(go), str(s), str(ROOT), v0.id],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in seeds]
    deadline = time.time() + 90  # start them together, once all have imported
    while len(list(tmp_path.glob("go.ready.*"))) < len(procs) and time.time() < deadline:
        time.sleep(0.05)
    go.touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[1] == results[2]
    assert len({v for r in results for v in r}) == 6
    cold = fresh(reg)
    assert len(cold.list()) == 7
    report = cold.verify()
    assert report.ok, report.errors
    for seed, ids in zip(seeds, results, strict=True):
        sd = state_dict()
        for i, vid in enumerate(ids):
            sd = rl_step(sd, 100 * seed + i)
            assert_bit_exact(cold.load_state_dict(vid), sd)
            assert cold.info(vid).parent == (ids[i - 1] if i else v0.id)
    # every promote landed in the history: none was lost to a concurrent read-modify-write
    promoted = [h["version"] for h in cold.history("candidate")]
    assert {r[-1] for r in results} <= set(promoted)
    assert isinstance(Registry(reg.url).channel("candidate"), str)
