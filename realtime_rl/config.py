"""Settings for the real-time stage: bus, feedback database, updates, the release gate, the schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BusSettings(_Section):
    """Event bus: Kafka in production, an embedded durable log by default."""

    backend: Literal["embedded", "kafka"] = Field("embedded", description="Which bus backend to use.")
    embedded_path: str = Field("var/bus/events.db", description="Embedded bus log file (SQLite, WAL).")
    bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma separated.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security protocol.")
    sasl_mechanism: str | None = Field(None, description="Kafka SASL mechanism (PLAIN, SCRAM-SHA-256, ...).")
    sasl_username: str | None = Field(None, description="Kafka SASL user.")
    sasl_password: SecretStr | None = Field(None, description="Kafka SASL password. Never logged.")
    events_topic: str = Field("rtrl.events", description="Topic for completion and feedback events "
                              "(keyed by completion id, so both share a partition).")
    versions_topic: str = Field("rtrl.model_versions", description="Topic for model_version events.")
    partitions: int = Field(4, ge=1, description="Partitions when rtrl creates the topics.")


class DatabaseSettings(_Section):
    """The feedback tables."""

    url: SecretStr = Field(SecretStr("sqlite:///var/feedback.db"),
                           description="SQLAlchemy URL (postgresql+psycopg://... in production). Never logged.")
