"""`rtrl keys add|list|revoke` and `rtrl serve` argument handling."""

from __future__ import annotations

from typer.testing import CliRunner

from rtrl.cli import app


def test_keys_add_list_revoke(tmp_path, monkeypatch):
    monkeypatch.setenv("RTRL_SERVING__API_KEYS_FILE", str(tmp_path / "keys.json"))
    runner = CliRunner()
    added = runner.invoke(app, ["keys", "add", "alice"])
    assert added.exit_code == 0, added.output
    key = added.output.strip().splitlines()[-1]
    assert key.startswith("rtrl-")
    key_id = key.split("-")[1]
    listed = runner.invoke(app, ["keys", "list"])
    assert key_id in listed.output and "alice" in listed.output and "active" in listed.output
    assert key.split("-")[2] not in listed.output and key.split("-")[2] not in (tmp_path / "keys.json").read_text()
    revoked = runner.invoke(app, ["keys", "revoke", "alice"])
    assert revoked.exit_code == 0 and key_id in revoked.output
    assert "revoked" in runner.invoke(app, ["keys", "list"]).output
    missing = runner.invoke(app, ["keys", "revoke", "alice"])
    assert missing.exit_code == 1


def test_serve_refuses_cleanly(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert "OpenAI-compatible" in runner.invoke(app, ["serve", "--help"]).output
    bad = runner.invoke(app, ["serve", "--engine", "tensorrt"])
    assert bad.exit_code == 2 and "engine" in bad.output
    monkeypatch.setenv("RTRL_MODEL__DIR", str(tmp_path / "nothing-here"))
    monkeypatch.setenv("RTRL_SERVING__SOURCE", "dir")
    empty = runner.invoke(app, ["serve", "--port", "0"])
    assert empty.exit_code == 1 and "no production version" in empty.output
    exposed = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--port", "0"])
    assert exposed.exit_code == 1 and "feedback_secret" in exposed.output
