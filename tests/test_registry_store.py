"""Publishing and rebuilding versions: bit-exact chains, storage choices, corruption, broken chains."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch

from policy.registry import BrokenChain, CorruptVersion, PublishError, Registry, VersionNotFound
from tests.registry_fixtures import assert_bit_exact, fresh, make, rl_step, state_dict


def test_chain_of_twelve_versions_is_bit_exact_from_disk(tmp_path):
    reg = make(tmp_path)
    sd = state_dict()
    versions, states = [], []
    parent = None
    for i in range(12):
        info = reg.publish(sd, parent=parent, stage="test", metrics={"step": i})
        versions.append(info)
        states.append(sd)
        parent = info.id
        sd = rl_step(sd, i)
    kinds = [(v.kind, v.depth) for v in versions]
    assert kinds[0] == ("snapshot", 0) and kinds[5] == ("snapshot", 0) and kinds[10] == ("snapshot", 0)
    assert kinds[4] == ("delta", 4) and kinds[11] == ("delta", 1)
    assert all(v.stored_bytes < v.raw_bytes / 2 for v in versions if v.kind == "delta")
    cold = fresh(reg)
    for info, want in zip(versions, states, strict=True):
        assert_bit_exact(cold.load_state_dict(info.id), want)
    # the in-memory path gives the same bits as the cold path
    assert_bit_exact(reg.load_state_dict(versions[-1].id), states[-1])
    report = cold.verify()
    assert report.ok, report.errors
    assert len(report.checked) == 12


def test_returned_tensors_are_the_callers_to_modify(tmp_path):
    reg = make(tmp_path)
    sd = state_dict()
    v0 = reg.publish(sd)
    got = reg.load_state_dict(v0.id)
    got["head.weight"].add_(1.0)
    sd["head.weight"].add_(1.0)  # the caller keeps training its own tensors in place
    assert_bit_exact(reg.load_state_dict(v0.id), state_dict())
    v1 = reg.publish(rl_step(state_dict(), 0), parent=v0.id)
    assert_bit_exact(fresh(reg).load_state_dict(v1.id), rl_step(state_dict(), 0))


def test_identity_is_the_content(tmp_path):
    reg = make(tmp_path)
    a = reg.publish(state_dict(), stage="one")
    b = reg.publish(state_dict(), stage="two", metrics={"x": 1})
    assert a.id == b.id and b.stage == "one"
    assert len(reg.list()) == 1
    c = reg.publish(state_dict(seed=1), parent=a.id)
    assert c.id != a.id and c.sha256.startswith(c.id)
    assert reg.resolve(c.id[:6]) == c.id and reg.resolve("latest") == c.id
    with pytest.raises(VersionNotFound):
        reg.resolve("ffffffffffff")
    with pytest.raises(VersionNotFound):
        reg.resolve("production")  # a channel that points nowhere yet


def test_snapshot_when_delta_is_not_smaller_and_new_tensors(tmp_path):
    reg = make(tmp_path)

    def noise(seed):
        g = torch.Generator().manual_seed(seed)
        return {"w": torch.randint(-(2**31), 2**31 - 1, (64, 64), dtype=torch.int32, generator=g)}

    v0 = reg.publish(noise(0))
    unrelated = reg.publish(noise(1), parent=v0.id)  # incompressible change: the delta cannot be smaller
    assert unrelated.kind == "snapshot"
    assert reg.show(unrelated.id)["codec"]["snapshot_reason"] == "delta not smaller"
    base = reg.publish(state_dict(seed=5), parent=unrelated.id)
    assert base.kind == "delta"
    codings = {t["name"]: t["coding"] for t in reg.show(base.id)["tensors"]}
    assert set(codings.values()) == {"raw"}  # no tensor of the parent matches by name
    sd = rl_step(state_dict(seed=5), 1)
    sd["extra.weight"] = torch.randn(16, 16)  # no parent tensor: coded raw inside the delta
    del sd["mask"]
    grown = reg.publish(sd, parent=base.id)
    assert grown.kind == "delta"
    codings = {t["name"]: t["coding"] for t in reg.show(grown.id)["tensors"]}
    assert codings["extra.weight"] == "raw" and codings["head.weight"] == "delta" and "mask" not in codings
    assert_bit_exact(fresh(reg).load_state_dict(grown.id), sd)
    forced = reg.publish(rl_step(sd, 2), parent=grown.id, snapshot=True)
    assert forced.kind == "snapshot"


def test_publish_hf_directory_and_inherit_aux_files(tmp_path):
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    src.mkdir()
    sd = {k: v for k, v in state_dict().items() if k != "scalar"}
    save_file(sd, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "tokenizer.json").write_text("{}")
    reg = make(tmp_path)
    v0 = reg.publish(src, stage="init")
    aux = [f["name"] for f in reg.show(v0.id)["files"] if f["role"] == "aux"]
    assert sorted(aux) == ["aux/config.json", "aux/tokenizer.json"]
    v1 = reg.publish(rl_step(sd, 0), parent=v0.id)  # a state dict: config and tokenizer come from the parent
    out = reg.materialize(v1.id, tmp_path / "out")
    assert (out / "config.json").read_text() == (src / "config.json").read_text()
    assert (out / "tokenizer.json").is_file()
    from safetensors.torch import load_file

    files = sorted(out.glob("*.safetensors"))
    got = {}
    for f in files:
        got.update(load_file(f))
    if len(files) > 1:
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(sd)
    assert_bit_exact(got, rl_step(sd, 0))
    assert reg.materialize(v1.id, tmp_path / "out") == out  # intact: reused
    with pytest.raises(PublishError):
        reg.publish(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(PublishError, match="safe_serialization"):
        reg.publish(empty)


def test_materialized_cache_is_checked_before_reuse(tmp_path):
    reg = make(tmp_path)
    v0 = reg.publish(state_dict())
    v1 = reg.publish(rl_step(state_dict(), 0), parent=v0.id)
    path = reg.materialize(v1.id)
    assert path.parent == tmp_path / "cache"
    weights = sorted(path.glob("*.safetensors"))[0]
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    rebuilt = fresh(reg).materialize(v1.id)  # damaged cache entry: rebuilt, not returned
    from safetensors.torch import load_file

    got = {}
    for f in sorted(rebuilt.glob("*.safetensors")):
        got.update(load_file(f))
    assert_bit_exact(got, rl_step(state_dict(), 0))
    # a later version rebuilt by a cold registry starts from the intact cached directory
    v2 = reg.publish(rl_step(rl_step(state_dict(), 0), 1), parent=v1.id)
    shutil.rmtree(tmp_path / "registry" / "versions" / v0.id)  # the snapshot is no longer needed
    assert_bit_exact(fresh(reg).load_state_dict(v2.id), rl_step(rl_step(state_dict(), 0), 1))


def _small_chain(tmp_path):
    reg = make(tmp_path, chunk_elements=1 << 20, shard_mb=1)
    sd0 = {"w": (0.02 * torch.randn(24, 8, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16),
           "b": torch.zeros(8)}
    v0 = reg.publish(sd0)
    sd1 = rl_step(sd0, 0)
    v1 = reg.publish(sd1, parent=v0.id)
    return reg, v0, v1, sd1


def test_any_corrupted_byte_is_detected(tmp_path):
    reg, v0, v1, sd1 = _small_chain(tmp_path)
    root = tmp_path / "registry" / "versions"
    files = [p for v in (v0.id, v1.id) for p in sorted((root / v).rglob("*")) if p.is_file()]
    assert len(files) == 4  # two manifests, a snapshot shard, a delta file
    checked = 0
    for path in files:
        original = path.read_bytes()
        for pos in range(len(original)):
            bad = bytearray(original)
            bad[pos] ^= 0x20
            path.write_bytes(bytes(bad))
            cold = fresh(reg)
            with pytest.raises(CorruptVersion):
                cold.load_state_dict(v1.id)
            checked += 1
        path.write_bytes(original)
    assert checked > 500
    assert fresh(reg).verify().ok
    assert_bit_exact(fresh(reg).load_state_dict(v1.id), sd1)


def test_corruption_errors_name_version_file_and_tensor(tmp_path):
    reg, v0, v1, _ = _small_chain(tmp_path)
    delta = reg.show(v1.id)["tensors"][0]["file"]
    path = tmp_path / "registry" / "versions" / v1.id / delta
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01
    path.write_bytes(bytes(data))
    report = fresh(reg).verify()
    assert not report.ok and len(report.errors) == 1
    assert v1.id in report.errors[0] and delta in report.errors[0]
    # past the file checksum, the frame layer names the tensor itself
    from policy.registry.materialize import apply_delta, read_snapshot

    cold = fresh(reg)
    base = read_snapshot(cold, cold.manifest(v0.id))
    m = cold.manifest(v1.id)
    digest = hashlib.sha256(bytes(data)).hexdigest()
    files = [f.model_copy(update={"sha256": digest}) if f.name == delta else f for f in m.files]
    with pytest.raises(CorruptVersion) as err:
        apply_delta(cold, m.model_copy(update={"files": files}), base)
    assert v1.id in str(err.value) and err.value.tensor in ("w", "b")


def test_missing_shard_and_broken_chain(tmp_path):
    reg, v0, v1, _ = _small_chain(tmp_path)
    shard = reg.show(v0.id)["files"][0]["name"]
    moved = tmp_path / "moved"
    shutil.move(tmp_path / "registry" / "versions" / v0.id / shard, moved)
    with pytest.raises(CorruptVersion, match=f"version {v0.id}, file {shard}: file is missing"):
        fresh(reg).load_state_dict(v1.id)
    shutil.rmtree(tmp_path / "registry" / "versions" / v0.id)
    with pytest.raises(BrokenChain, match=f"version {v1.id}: parent {v0.id} is missing"):
        fresh(reg).load_state_dict(v1.id)
    report = fresh(reg).verify()
    assert not report.ok and any("is missing" in e for e in report.errors)


def test_fsspec_store_round_trip(tmp_path):
    import uuid

    url = f"memory://rtrl-test-{uuid.uuid4().hex[:8]}/registry"
    reg = Registry(url, cache_dir=tmp_path / "cache", snapshot_every=3, chunk_elements=500, shard_mb=0.004)
    sd = state_dict()
    parent, states = None, []
    for i in range(4):
        parent = reg.publish(sd, parent=parent).id
        states.append((parent, sd))
        sd = rl_step(sd, i)
    cold = Registry(url, memory_cache=0)
    for vid, want in states:
        assert_bit_exact(cold.load_state_dict(vid), want)
    assert [v.kind for v in cold.list()] == ["snapshot", "delta", "delta", "snapshot"]
    cold.promote(states[1][0], "production")
    cold.promote(states[2][0], "production")
    assert cold.rollback("production").id == states[1][0]
    assert cold.verify().ok
    # kept: the newest (a snapshot) and production's stack [v1], which needs v0; v2 is garbage
    assert cold.gc(keep_last=1)["deleted"] == [states[2][0]]
    assert cold.verify().ok
    assert (cold.materialize(states[3][0], tmp_path / "m") / "model.safetensors").is_file()
    assert reg.materialize(states[3][0]).parent == tmp_path / "cache"
