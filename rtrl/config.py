"""The one typed settings object.

Sources, highest priority first: keyword overrides, ``RTRL_*`` environment variables (nested with
``__``, e.g. ``RTRL_DB__URL``), the TOML file (``rtrl.toml`` in the working directory, or the path in
``RTRL_CONFIG``), then the embedded defaults under ``./var/``. An unknown key or a bad value is an
error that names the key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from offline_rl.config import (
    EnvSettings,
    EvalSettings,
    GRPOSettings,
    JudgeSettings,
    MidtrainSettings,
    RewardSettings,
    RolloutSettings,
    SandboxSettings,
    TaskSettings,
)
from policy.config import DistributedSettings, ModelSettings, RegistrySettings, TinyModelSettings
from realtime_rl.config import (
    BusSettings,
    DatabaseSettings,
    IngestSettings,
    ReleaseGateSettings,
    ScheduleSettings,
    SimUsersSettings,
    UpdateSettings,
)
from serving.config import ServingSettings

ENV_PREFIX = "RTRL_"
DEFAULT_CONFIG_FILE = "rtrl.toml"


class ConfigError(ValueError):
    """Raised for an unknown key or a bad value; the message names the key."""


class Settings(BaseSettings):
    """Everything rtrl reads, one section per stage."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    var_dir: str = Field("var", description="Root of the embedded defaults (databases, registry, logs, runs).")
    model: ModelSettings = Field(default_factory=ModelSettings)
    tiny: TinyModelSettings = Field(default_factory=TinyModelSettings)
    registry: RegistrySettings = Field(default_factory=RegistrySettings)
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    distributed: DistributedSettings = Field(default_factory=DistributedSettings)
    midtrain: MidtrainSettings = Field(default_factory=MidtrainSettings)
    grpo: GRPOSettings = Field(default_factory=GRPOSettings)
    rollout: RolloutSettings = Field(default_factory=RolloutSettings)
    eval: EvalSettings = Field(default_factory=EvalSettings)
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)
    rewards: RewardSettings = Field(default_factory=RewardSettings)
    judge: JudgeSettings = Field(default_factory=JudgeSettings)
    env: EnvSettings = Field(default_factory=EnvSettings)
    serving: ServingSettings = Field(default_factory=ServingSettings)
    bus: BusSettings = Field(default_factory=BusSettings)
    db: DatabaseSettings = Field(default_factory=DatabaseSettings)
    ingest: IngestSettings = Field(default_factory=IngestSettings)
    update: UpdateSettings = Field(default_factory=UpdateSettings)
    release: ReleaseGateSettings = Field(default_factory=ReleaseGateSettings)
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    simusers: SimUsersSettings = Field(default_factory=SimUsersSettings)

    @model_validator(mode="after")
    def _relocate_defaults(self) -> Settings:
        """Default paths live under ``var/``; a different ``var_dir`` moves every path not set explicitly."""
        root = self.var_dir.rstrip("/")
        if root == "var":
            return self
        for name in type(self).model_fields:
            section = getattr(self, name)
            if not isinstance(section, BaseModel):
                continue
            for field, value in list(section):
                if field in section.model_fields_set:
                    continue
                if isinstance(value, str) and value.startswith("var/"):
                    object.__setattr__(section, field, root + value[3:])
                elif isinstance(value, SecretStr) and value.get_secret_value().startswith("sqlite:///var/"):
                    object.__setattr__(section, field,
                                       SecretStr("sqlite:///" + root + value.get_secret_value()[len("sqlite:///var"):]))
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml_path = os.environ.get("RTRL_CONFIG", DEFAULT_CONFIG_FILE)
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=toml_path))


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"invalid settings ({source}):"]
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "\n".join(lines)


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Build the settings; raise :class:`ConfigError` naming any unknown key or bad value."""
    previous = os.environ.get("RTRL_CONFIG")
    if config_file is not None:
        if not Path(config_file).is_file():
            raise ConfigError(f"config file not found: {config_file}")
        os.environ["RTRL_CONFIG"] = str(config_file)
    source = os.environ.get("RTRL_CONFIG", DEFAULT_CONFIG_FILE)
    if "RTRL_CONFIG" in os.environ and not Path(source).is_file():
        raise ConfigError(f"config file not found: {source} (from RTRL_CONFIG)")
    known = {f"{ENV_PREFIX}{name}".upper() for name in Settings.model_fields} | {"RTRL_CONFIG"}
    for var in os.environ:
        head = var.upper().split("__", 1)[0]
        if var.upper().startswith(ENV_PREFIX) and head not in known:
            raise ConfigError(f"invalid settings (environment):\n  {var}: unknown key")
    try:
        return Settings(**overrides)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, f"{source} and RTRL_* environment")) from None
    finally:
        if config_file is not None:
            if previous is None:
                os.environ.pop("RTRL_CONFIG", None)
            else:
                os.environ["RTRL_CONFIG"] = previous


def redacted(settings: Settings) -> dict[str, Any]:
    """The effective settings as plain data, secrets masked (for `rtrl config show` and logs)."""

    def walk(value: Any) -> Any:
        if isinstance(value, SecretStr):
            return "**********"
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value

    return walk(settings.model_dump(mode="python"))
