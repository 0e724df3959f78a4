"""Channels (promote, rollback, history, hooks) and retention (gc keeps what kept versions need)."""

from __future__ import annotations

import pytest

from policy.registry import ChannelError, CorruptVersion, Registry
from tests.registry_fixtures import assert_bit_exact, fresh, make, rl_step, state_dict


def _chain(reg: Registry, n: int) -> tuple[list[str], list[dict]]:
    sd, parent, ids, states = state_dict(), None, [], []
    for i in range(n):
        parent = reg.publish(sd, parent=parent, metrics={"step": i}).id
        ids.append(parent)
        states.append(sd)
        sd = rl_step(sd, i)
    return ids, states


def test_promote_rollback_and_history(tmp_path):
    events = []
    reg = make(tmp_path, rollback_depth=3)
    reg.on_event = events.append
    ids, _ = _chain(reg, 5)
    assert [e.action for e in events] == ["published"] * 5
    assert events[1].parent == ids[0] and events[1].sha256.startswith(ids[1])
    assert reg.channel("production") is None
    with pytest.raises(ChannelError, match="nothing to roll back"):
        reg.rollback("production")
    for v in ids[:4]:
        reg.promote(v, "production")
    reg.promote(ids[3], "production")  # already current: no event, no history entry
    reg.promote(ids[4], "candidate", note="looks good")
    assert reg.channel("production") == ids[3] and reg.channel("candidate") == ids[4]
    assert reg.info("production").channels == ("production",)
    assert reg.resolve("candidate") == ids[4]
    assert reg.rollback("production").id == ids[2]
    assert reg.rollback("production").id == ids[1]
    with pytest.raises(ChannelError):  # rollback_depth 3: ids[0] fell off the stack
        reg.rollback("production")
    history = reg.history("production")
    assert [(h["action"], h["version"]) for h in history] == [
        ("promoted", ids[0]), ("promoted", ids[1]), ("promoted", ids[2]), ("promoted", ids[3]),
        ("rollback", ids[2]), ("rollback", ids[1])]
    assert reg.history("candidate")[0]["note"] == "looks good"
    assert [e.action for e in events[5:]] == ["promoted"] * 5 + ["rollback"] * 2
    assert events[-1].channel == "production" and events[-1].version == ids[1]
    with pytest.raises(ChannelError, match="unknown channel"):
        reg.promote(ids[0], "prodution")
    # a second handle sees the same state: channels live in the store, not in the object
    assert fresh(reg).channel("production") == ids[1]


def test_channel_file_corruption_is_detected(tmp_path):
    reg = make(tmp_path)
    ids, _ = _chain(reg, 1)
    reg.promote(ids[0], "production")
    path = tmp_path / "registry" / "channels" / "production.json"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptVersion, match="channel production"):
        reg.channel("production")
    assert not reg.verify().ok


def test_gc_keeps_what_kept_versions_need(tmp_path):
    reg = make(tmp_path, snapshot_every=4)
    ids, states = _chain(reg, 10)  # snapshots at 0, 4, 8
    reg.promote(ids[2], "production")  # needs 1 and 0
    reg.promote(ids[6], "candidate")  # needs 5 and 4
    plan = reg.gc(keep=[ids[9][:6]], keep_last=1, dry_run=True)
    assert plan["dry_run"] and len(reg.list()) == 10
    report = reg.gc(keep=[ids[9][:6]], keep_last=1)
    assert report["deleted"] == plan["deleted"]
    assert set(report["deleted"]) == {ids[3], ids[7]}
    assert set(report["kept"]) == {ids[0], ids[1], ids[2], ids[4], ids[5], ids[6], ids[8], ids[9]}
    assert report["freed_bytes"] > 0
    cold = fresh(reg)
    assert cold.verify().ok
    for i in (2, 6, 9):
        assert_bit_exact(cold.load_state_dict(ids[i]), states[i])
    # once the channels move on (rollback depth 2 keeps one step back), their old chains are garbage
    short = Registry(reg.url, rollback_depth=2)
    for ch in ("production", "candidate"):
        short.promote(ids[9], ch)
        short.promote(ids[8], ch)
    report = short.gc(keep_last=1)
    deleted = report["deleted"]
    assert set(deleted) == {ids[0], ids[1], ids[2], ids[4], ids[5], ids[6]}
    for child, parent in ((2, 1), (1, 0), (6, 5), (5, 4)):
        assert deleted.index(ids[child]) < deleted.index(ids[parent])  # children first
    cold = fresh(reg)
    assert cold.verify().ok
    assert_bit_exact(cold.load_state_dict(ids[9]), states[9])
