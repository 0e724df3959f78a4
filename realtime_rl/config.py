"""Settings for the real-time stage: bus, feedback database, ingestion, updates, the release gate, the schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class BusSettings(_Section):
    """Event bus: Kafka in production, an embedded durable log by default."""

    backend: Literal["embedded", "kafka"] = Field("embedded", description="Which bus backend to use.")
    embedded_path: str = Field("var/bus/events.db", description="Embedded bus log file (SQLite, WAL).")
    embedded_synchronous: Literal["NORMAL", "FULL"] = Field(
        "FULL", description="Embedded bus fsync policy: FULL survives power loss, NORMAL only process crashes.")
    embedded_poll_interval_ms: int = Field(20, ge=1, description="How often an idle embedded consumer "
                                           "re-reads the log while waiting in poll().")
    linger_ms: int = Field(5, ge=0, description="How long a producer waits to batch messages before sending "
                           "(both backends).")
    send_timeout_s: float = Field(5.0, gt=0, description="Bound on how long send()/flush() may block before "
                                  "raising BusUnavailable (Kafka max_block_ms; embedded lock wait).")
    bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers, comma separated.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="Kafka security protocol.")
    sasl_mechanism: str | None = Field(None, description="Kafka SASL mechanism (PLAIN, SCRAM-SHA-256, ...).")
    sasl_username: str | None = Field(None, description="Kafka SASL user.")
    sasl_password: SecretStr | None = Field(None, description="Kafka SASL password. Never logged.")
    ssl_cafile: str | None = Field(None, description="Kafka TLS: CA bundle to verify the brokers.")
    ssl_certfile: str | None = Field(None, description="Kafka TLS: client certificate (mutual TLS).")
    ssl_keyfile: str | None = Field(None, description="Kafka TLS: client private key (mutual TLS).")
    client_id: str = Field("rtrl", description="Kafka client id (shows up in broker logs and quotas).")
    events_topic: str = Field("rtrl.events", description="Topic for completion and feedback events "
                              "(keyed by completion id, so both share a partition).")
    versions_topic: str = Field("rtrl.model_versions", description="Topic for model_version events.")
    partitions: int = Field(4, ge=1, description="Partitions when rtrl creates the topics.")
    replication_factor: int = Field(1, ge=1, description="Replication factor when rtrl creates Kafka topics "
                                    "(3 on a production cluster).")
    create_topics: bool = Field(True, description="Create missing topics through the Kafka admin client.")
    request_timeout_ms: int = Field(5000, ge=100, description="Kafka request timeout.")
    delivery_timeout_ms: int = Field(15000, ge=100, description="Kafka: give up on an unacknowledged message "
                                     "after this long (flush then raises BusUnavailable).")
    reconnect_backoff_max_ms: int = Field(1000, ge=10, description="Kafka: cap on reconnect back-off, so "
                                          "clients notice a restored network path quickly.")
    session_timeout_ms: int = Field(6000, ge=1000, description="Kafka consumer-group session timeout "
                                    "(short, so a dead member is noticed quickly).")
    heartbeat_interval_ms: int = Field(1000, ge=100, description="Kafka consumer-group heartbeat interval.")
    max_poll_interval_ms: int = Field(10000, ge=1000, description="Kafka consumer-group max poll interval.")
    fetch_max_bytes: int = Field(52_428_800, ge=1024, description="Kafka consumer: max bytes per fetch.")
    max_partition_fetch_bytes: int = Field(4_194_304, ge=1024,
                                           description="Kafka consumer: max bytes per partition per fetch.")


class DatabaseSettings(_Section):
    """The feedback tables."""

    url: SecretStr = Field(SecretStr("sqlite:///var/feedback.db"),
                           description="SQLAlchemy URL (postgresql+psycopg://... in production). Never logged.")
    auto_migrate: bool = Field(True, description="Upgrade the schema to the newest revision when the ingester "
                               "opens the database (off: `rtrl db upgrade` must be run first).")
    connect_timeout_s: int = Field(5, ge=1, description="PostgreSQL connect timeout.")
    sqlite_busy_timeout_s: float = Field(30.0, gt=0, description="SQLite: wait this long for a write lock.")


class IngestSettings(_Section):
    """`rtrl ingest`: bus -> feedback tables with exactly-once effect."""

    group: str = Field("rtrl-ingest", description="Consumer group; its offsets live in `consumer_offsets`.")
    start_from: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group with no stored offset starts on a partition.")
    batch_max_records: int = Field(5000, ge=1, description="Most records written in one database transaction.")
    batch_max_wait_ms: int = Field(100, ge=0, description="Longest wait to fill a batch before committing.")
    poll_timeout_s: float = Field(0.5, gt=0, description="One bus poll's timeout.")
    max_event_bytes: int = Field(1_000_000, ge=1024, description="Larger events are dead-lettered as oversized.")
    dead_letter_max_raw_bytes: int = Field(4_194_304, ge=0, description="Raw bytes kept per dead letter "
                                           "(longer payloads are truncated; the full size is recorded).")
    retry_backoff_s: float = Field(1.0, gt=0, description="Wait after a failed transaction (database down).")
    pg_copy: bool = Field(True, description="PostgreSQL: stage rows with COPY, then INSERT ... ON CONFLICT.")
    log_every_s: float = Field(10.0, gt=0, description="Progress line interval in follow mode.")
