"""Settings: sources, precedence, and errors that name the key."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rtrl.config import ConfigError, load_settings, redacted


def test_defaults_live_under_var(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    s = load_settings()
    assert s.registry.url == "var/registry"
    assert s.db.url.get_secret_value().startswith("sqlite:///var/")
    assert s.bus.backend == "embedded"


def test_toml_then_env_precedence(monkeypatch, tmp_path):
    cfg = tmp_path / "rtrl.toml"
    cfg.write_text("[grpo]\nlr = 0.25\ngroup_size = 4\n")
    monkeypatch.setenv("RTRL_GRPO__GROUP_SIZE", "16")
    s = load_settings(cfg)
    assert s.grpo.lr == 0.25
    assert s.grpo.group_size == 16  # env beats the file


@pytest.mark.parametrize(
    "toml, key",
    [("[grpo]\nbogus = 1\n", "grpo.bogus"), ("nonsense = 2\n", "nonsense"), ("[nosuch]\nx = 1\n", "nosuch")],
)
def test_unknown_key_in_file_is_named(tmp_path, toml, key):
    cfg = tmp_path / "rtrl.toml"
    cfg.write_text(toml)
    with pytest.raises(ConfigError, match=rf"{key}.*unknown key"):
        load_settings(cfg)


def test_bad_value_is_named(monkeypatch):
    monkeypatch.setenv("RTRL_GRPO__GROUP_SIZE", "1")  # must be >= 2
    with pytest.raises(ConfigError, match=r"grpo\.group_size"):
        load_settings()


def test_unknown_env_keys_are_named(monkeypatch):
    monkeypatch.setenv("RTRL_GRPO__NOPE", "1")
    with pytest.raises(ConfigError, match=r"grpo\.nope"):
        load_settings()
    monkeypatch.delenv("RTRL_GRPO__NOPE")
    monkeypatch.setenv("RTRL_TYPO", "1")
    with pytest.raises(ConfigError, match="RTRL_TYPO"):
        load_settings()


def test_missing_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_settings(tmp_path / "absent.toml")


def test_secrets_are_masked(monkeypatch):
    monkeypatch.setenv("RTRL_DB__URL", "postgresql+psycopg://u:hunter2@db/x")
    data = redacted(load_settings())
    assert "hunter2" not in json.dumps(data, default=str)


def test_config_show_cli(tmp_path):
    env_file = tmp_path / "rtrl.toml"
    env_file.write_text('[serving]\nfeedback_secret = "s3cret-value"\nport = 8123\n')
    out = subprocess.run([sys.executable, "-m", "rtrl", "config", "show", "--json", "-c", str(env_file)],
                         capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert data["serving"]["port"] == 8123
    assert "s3cret-value" not in out
    bad = tmp_path / "bad.toml"
    bad.write_text("[serving]\nportt = 1\n")
    proc = subprocess.run([sys.executable, "-m", "rtrl", "config", "show", "-c", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "serving.portt: unknown key" in proc.stderr


def test_var_dir_moves_every_default_path_but_not_explicit_ones(tmp_path):
    cfg = tmp_path / "rtrl.toml"
    cfg.write_text('var_dir = "/data/rtrl"\n[registry]\nurl = "s3://bucket/reg"\n')
    s = load_settings(cfg)
    assert s.registry.url == "s3://bucket/reg"
    assert s.registry.cache_dir.startswith("/data/rtrl/")
    assert s.model.dir == "/data/rtrl/models/tiny"
    assert s.grpo.out_dir == "/data/rtrl/runs/grpo"
    assert s.db.url.get_secret_value() == "sqlite:////data/rtrl/feedback.db"
    assert s.bus.embedded_path == "/data/rtrl/bus/events.db"
