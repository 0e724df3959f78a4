"""`rtrl registry ...` end to end through the real CLI (typer's runner, in-process)."""

from __future__ import annotations

import json

from safetensors.torch import save_file
from typer.testing import CliRunner

from rtrl.cli import app
from tests.registry_fixtures import rl_step, state_dict


def _hf_dir(path, sd):
    path.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in sd.items()}, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text('{"model_type": "llama"}')
    return path


def test_registry_cli_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRL_REGISTRY__CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    url = ["--url", str(tmp_path / "reg")]

    def run(*args, code=0):
        result = runner.invoke(app, ["registry", *args, *url])
        assert result.exit_code == code, (args, result.output, result.stderr if result.stderr_bytes else "")
        return result

    def js(*args):
        return json.loads(run(*args, "--json").stdout)

    sd0 = state_dict()
    sd1 = rl_step(sd0, 0)
    v0 = js("publish", str(_hf_dir(tmp_path / "m0", sd0)), "--stage", "init", "--metric", "pass=0.5")
    v1 = js("publish", str(_hf_dir(tmp_path / "m1", sd1)), "--parent", v0["id"][:6], "--run", "r1")
    assert v0["kind"] == "snapshot" and v1["kind"] == "delta" and v1["parent"] == v0["id"]
    assert v0["metrics"] == {"pass": 0.5}
    assert [v["id"] for v in js("list")] == [v0["id"], v1["id"]]
    show = js("show", "latest")
    assert show["id"] == v1["id"] and show["run"] == "r1" and len(show["tensors"]) == len(sd1)
    assert "delta" in run("show", v1["id"]).stdout
    assert js("verify")["ok"] is True
    diff = js("diff", v0["id"], v1["id"])
    assert diff["changed"] > 0 and diff["ratio"] > 1
    out = js("materialize", v1["id"], str(tmp_path / "out"))
    assert (tmp_path / "out" / "config.json").is_file() and out["path"] == str(tmp_path / "out")
    cached = js("materialize", "latest")
    assert cached["path"].startswith(str(tmp_path / "cache"))
    assert js("promote", v0["id"], "--channel", "production") == {"channel": "production", "version": v0["id"]}
    js("promote", v1["id"], "--channel", "production")
    assert js("rollback", "--channel", "production")["version"] == v0["id"]
    hist = js("history", "production")
    assert hist["current"] == v0["id"] and [h["action"] for h in hist["history"]] == ["promoted", "promoted",
                                                                                          "rollback"]
    gc = js("gc", "--keep-last", "0", "--dry-run")
    assert gc["deleted"] == [v1["id"]] and gc["dry_run"]
    # bad input: clear messages and non-zero exits
    assert "not found" in run("show", "ffffffff", code=1).stderr
    assert "nothing to roll back" in run("rollback", "--channel", "production", code=1).stderr
    assert "unknown channel" in run("promote", v0["id"], "--channel", "prod", code=1).stderr
    assert "NAME=NUMBER" in runner.invoke(app, ["registry", "publish", str(tmp_path / "m0"), "-m", "x", *url]).output
    # a corrupted delta makes verify fail with the version and file named
    delta = next(f["name"] for f in show["files"] if f["role"] == "delta")
    path = tmp_path / "reg" / "versions" / v1["id"] / delta
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    report = runner.invoke(app, ["registry", "verify", *url, "--json"])
    assert report.exit_code == 1
    errors = json.loads(report.stdout)["errors"]
    assert len(errors) == 1 and v1["id"] in errors[0] and delta in errors[0]
    assert "FAILED" in run("verify", code=1).stdout
