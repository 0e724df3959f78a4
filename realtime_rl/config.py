"""Settings for the real-time stage: bus, feedback database, ingestion, updates, the release gate, the schedule."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from policy.config import Section


class BusSettings(Section):
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
    enable_idempotence: bool = Field(
        False, description="Kafka idempotent producer. Off by default: with kafka-python 3.0 against Tansu, an "
        "idempotent producer whose batches expired during an outage never sent again; ingestion is idempotent "
        "on event ids, so resends cannot double-count either way.")
    reconnect_backoff_max_ms: int = Field(1000, ge=10, description="Kafka: cap on reconnect back-off, so "
                                          "clients notice a restored network path quickly.")
    session_timeout_ms: int = Field(6000, ge=1000, description="Kafka consumer-group session timeout "
                                    "(short, so a dead member is noticed quickly).")
    heartbeat_interval_ms: int = Field(1000, ge=100, description="Kafka consumer-group heartbeat interval.")
    max_poll_interval_ms: int = Field(10000, ge=1000, description="Kafka consumer-group max poll interval.")
    fetch_max_bytes: int = Field(52_428_800, ge=1024, description="Kafka consumer: max bytes per fetch.")
    max_partition_fetch_bytes: int = Field(4_194_304, ge=1024,
                                           description="Kafka consumer: max bytes per partition per fetch.")


class DatabaseSettings(Section):
    """The feedback tables."""

    url: SecretStr = Field(SecretStr("sqlite:///var/feedback.db"),
                           description="SQLAlchemy URL (postgresql+psycopg://... in production). Never logged.")
    auto_migrate: bool = Field(True, description="Upgrade the schema to the newest revision when the ingester "
                               "opens the database (off: `rtrl db upgrade` must be run first).")
    connect_timeout_s: int = Field(5, ge=1, description="PostgreSQL connect timeout.")
    sqlite_busy_timeout_s: float = Field(30.0, gt=0, description="SQLite: wait this long for a write lock.")


class IngestSettings(Section):
    """`rtrl ingest`: bus -> feedback tables with exactly-once effect."""

    group: str = Field("rtrl-ingest", description="Consumer group; its offsets live in `consumer_offsets`.")
    partition_assignment: Literal["all", "group"] = Field(
        "all", description="all: this ingester reads every partition (one ingester per group); group: the "
        "ingesters of `group` share the partitions through Kafka's consumer-group protocol, and a member "
        "that joins or dies triggers a rebalance (Kafka bus only).")
    start_from: Literal["earliest", "latest"] = Field(
        "earliest", description="Where a group with no stored offset starts on a partition.")
    batch_max_records: int = Field(5000, ge=1, description="Most records written in one database transaction.")
    batch_max_wait_ms: int = Field(100, ge=0, description="Longest wait to fill a batch before committing.")
    poll_timeout_s: float = Field(0.5, gt=0, description="One bus poll's timeout.")
    max_event_bytes: int = Field(1_000_000, ge=1024, description="Larger events are dead-lettered as oversized.")
    dead_letter_max_raw_bytes: int = Field(4_194_304, ge=0, description="Raw bytes kept per dead letter "
                                           "(longer payloads are truncated; the full size is recorded).")
    retry_backoff_s: float = Field(1.0, gt=0, description="Wait after a failed transaction (database down).")
    staged_writes: bool = Field(True, description="Bulk writes: PostgreSQL gets a binary COPY of typed rows "
                                "straight into the tables inside a savepoint (a conflicting, i.e. redelivered, row "
                                "rolls it back and the batch goes through temp tables with ON CONFLICT); SQLite "
                                "multi-row INSERT OR FAIL statements of up to 256 rows. Off: multi-row INSERTs through SQLAlchemy (slower, "
                                "same rows).")
    log_every_s: float = Field(10.0, gt=0, description="Progress line interval in follow mode.")
    routes_model_dir: str | None = Field(None, description="Model directory whose config.json gives the MoE "
                                         "geometry (layers, experts, top-k) that completion events' routes are "
                                         "checked against (None: model.dir). Without a config.json there, a route "
                                         "record is checked against its own shape and expert count only.")
    gc_threshold: int = Field(100_000, ge=0, description="Python's generation-0 GC threshold while ingesting "
                              "(0: leave the interpreter's 700). A batch keeps ~20 objects per event alive, and "
                              "at 700 the cyclic collector rescans them over and over, a large share of "
                              "ingest CPU. The objects are acyclic, so reference counting still frees them "
                              "at once.")


class UpdateSettings(Section):
    """`rtrl update`: single-rollout REINFORCE from logged feedback (see realtime_rl/update.py)."""

    reward_accept: float = Field(0.75, description="Reward of an accepted completion.")
    reward_reject: float = Field(-0.25, description="Reward of a rejected completion.")
    edit_graded: bool = Field(True, description="`edit`: reward_reject + (reward_accept - reward_reject) x share "
                              "of the completion the user kept (difflib ratio); off: edits count as rejects.")
    use_explicit_score: bool = Field(False, description="When a feedback carries `score` in [-1, 1], use it "
                                     "(scaled to [reward_reject, reward_accept]) instead of the signal.")
    on_policy_only: bool = Field(False, description="Train only on completions served by the current production "
                                 "version (off: completions of the last max_version_lag productions whose "
                                 "feedback arrived since the last release, such as late feedback on the version "
                                 "a release replaced, are admitted, importance-corrected against the version "
                                 "that served them).")
    max_version_lag: int = Field(1, ge=0, description="With on_policy_only off: oldest admitted version, "
                                 "counted in releases back from production.")
    max_age_hours: float = Field(24.0, gt=0, description="With on_policy_only off: drop completions older "
                                 "than this.")
    feedback_horizon_hours: float = Field(24.0, gt=0, description="Feedback that arrived more than this long "
                                          "after its completion is not trained on (counted as late), and "
                                          "feedback still waiting this long for its completion is counted as "
                                          "orphaned.")
    max_examples: int = Field(4096, ge=1, description="Most training examples per update (newest first).")
    caller_weight_power: float = Field(0.5, ge=0, le=1, description="Example weights ∝ (examples of the same "
                                       "caller in the batch)^-power: 0 lets a caller's say grow with its "
                                       "volume, 1 gives every caller the same total weight.")
    bucket_weight_power: float = Field(0.5, ge=0, le=1, description="The same for task buckets, so a bucket "
                                       "that is busy at this time of day does not dominate the update.")
    caller_baseline_prior: float = Field(8.0, ge=0, description="Caller-centred baseline: a caller's own mean "
                                         "reward residual enters its examples' baseline with weight n/(n + "
                                         "this), n = its other examples in the batch (0: off). A caller who "
                                         "judges everything alike then carries almost no advantage.")
    kept_text_weight: float = Field(1.0, ge=0, description="An edit's kept text is trained on as an accepted "
                                    "completion with this weight (its served completion then counts as a "
                                    "reject); 0: edits only carry their graded reward.")
    negative_advantage_scale: float = Field(0.25, ge=0, le=1, description="Multiplies negative advantages: a "
                                            "rejected single sample says what not to write but not what to write "
                                            "instead, and pushing it down spreads its probability over every other "
                                            "answer (1: plain REINFORCE).")
    max_kept_tokens: int = Field(64, ge=1, description="Kept texts longer than this many tokens are not trained "
                                 "on (counted as unusable).")
    caller_cap_share: float = Field(0.25, gt=0, le=1, description="No caller contributes more than this share "
                                    "of a batch (extra examples of that caller are dropped, newest kept).")
    heldout_fraction: float = Field(0.2, ge=0, lt=1, description="Share of logged feedback held out (by "
                                    "completion id hash) for the off-policy estimate of the release gate.")
    baseline: Literal["bucket_mean", "value_head"] = Field(
        "bucket_mean", description="b(x): running mean reward per task bucket (persisted), or a learned "
        "linear value head on the prompt's last hidden state (cross-fitted, so b never sees its own reward).")
    baseline_prior: float = Field(0.0, description="Baseline of a bucket never seen before.")
    behaviour_logprobs: Literal["raw", "sampling"] = Field(
        "raw", description="Which logged log-prob is μ: `raw` (temperature 1, what the trainer recomputes: "
        "ρ = 1 at the serving weights) or `sampling` (the transformed distribution actually sampled).")
    is_level: Literal["token", "sequence"] = Field("token", description="Importance ratio per token or per sequence.")
    router_replay: Literal["off", "replay"] = Field(
        "replay", description="Mixture-of-experts models: `replay` forces the experts the gateway logged for each "
        "position in every forward pass of the update (gate weights recomputed from the live router logits, so the "
        "router still learns); `off` lets the routers choose again (the logged routes are only compared). No "
        "effect on dense models or on completions logged without routes.")
    clip: float | None = Field(0.2, gt=0, description="PPO ratio clip ε around μ (None: truncated-IS REINFORCE).")
    tis_cap: float = Field(2.0, gt=0, description="C: truncation of the importance weight (dual-clip cap).")
    kl_coef: float = Field(0.0, ge=0, description="β of the k3 KL to the serving version (0 = off).")
    epochs: int = Field(3, ge=1, description="Passes over the batch (the target-KL rule may stop it sooner).")
    target_kl: float | None = Field(0.2, gt=0, description="Stop the update early once the mean k3 KL to the "
                                    "serving version on a minibatch exceeds this (PPO's target-KL rule; bounds "
                                    "the drift however large the batch). None: always run every epoch.")
    minibatch_size: int = Field(64, ge=1, description="Examples per optimizer step.")
    lr: float = Field(3e-5, gt=0, description="AdamW learning rate of the update (how the default was chosen: "
                      "docs/algorithms.md, single-rollout update).")
    backtrack: float = Field(0.5, gt=0, le=1, description="After k candidates of the same production refused "
                             "in a row, the next update runs at lr x backtrack^k: a refusal says the step went "
                             "too far, so the next one is shorter, as a line search backtracks (1 = off).")
    min_lr_scale: float = Field(0.125, gt=0, le=1, description="The backtracking's floor, as a share of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    seed: int = Field(0, description="Shuffling seed.")
    work_dir: str = Field("var/runs/realtime", description="Scratch directory for candidate weights.")


class ReleaseGateSettings(Section):
    """The release gate: offline held-out pass@1 plus an off-policy estimate of the accept rate."""

    offline_epsilon: float = Field(0.03, ge=0, le=1, description="Candidate pass@1 may be at most this far "
                                   "below production's (and never below eval.gate_threshold - gate_tolerance).")
    gate_tolerance: float = Field(0.05, ge=0, le=1, description="The candidate's pass@1 may be this far below "
                                  "eval.gate_threshold: room for the gate evaluator's own sampling noise, so that a "
                                  "production that passed the offline gate can have candidates that pass too.")
    offline_tasks: int | None = Field(None, ge=1, description="Evaluate on the first N held-out tasks (None: all).")
    offline_samples: int = Field(32, ge=1, description="Samples per held-out task for pass@1: the "
                                 "offline_epsilon check compares two such estimates, so their scatter must be "
                                 "well under epsilon (docs/algorithms.md, release gate).")
    estimator: Literal["snips", "clipped_ips"] = Field("snips", description="Off-policy estimator the gate uses "
                                                       "(both are always reported).")
    ips_clip: float = Field(10.0, gt=1, description="Weight cap of the clipped-IPS estimator.")
    ope_test: Literal["paired", "estimate", "lower_bound"] = Field(
        "paired", description="How the off-policy estimate is held against production's realised accept rate on "
        "the same held-out requests: `paired` refuses only when the candidate is worse with one-sided confidence "
        "`ope_confidence` (the paired gain's upper bound is below -ope_margin); `estimate` refuses whenever the "
        "point estimate is below (so a candidate as good as production is refused about half the time); "
        "`lower_bound` refuses unless the estimate's own CI lies above (refuses almost every candidate).")
    ope_confidence: float = Field(0.9, gt=0.5, lt=1, description="One-sided confidence of the `paired` test: the "
                                  "share of candidates exactly as good as production that it lets through.")
    ope_margin: float = Field(0.0, ge=0, le=1, description="How far below production's realised accept rate the "
                              "candidate may be estimated before the test counts it as worse.")
    min_heldout: int = Field(32, ge=1, description="Held-out logged examples from production the off-policy "
                             "check needs: with fewer the gate refuses, and a scheduled cycle waits for more "
                             "traffic instead of training a candidate.")
    min_ess_share: float = Field(0.02, ge=0, le=1, description="The off-policy estimate's effective sample size "
                                 "(Σw)²/Σw² must be at least this share of the held-out examples; below it a few "
                                 "extreme importance weights carry the estimate and the gate refuses.")
    ci: Literal["bootstrap", "normal"] = Field("bootstrap", description="Confidence interval method.")
    ci_level: float = Field(0.95, gt=0, lt=1, description="Confidence level.")
    bootstrap_samples: int = Field(1000, ge=100, description="Bootstrap resamples.")
    canary_share: float = Field(0.0, ge=0, lt=1, description="Share of callers served the candidate before "
                                "promotion (0: promote at once). With a canary, later cycles promote it or roll it back by a "
                                "sequential test on the feedback it gets (the canary_* fields).")
    canary_min_feedback: int = Field(100, ge=1, description="Canary judgements before the sequential test may "
                                     "decide.")
    canary_max_feedback: int = Field(2000, ge=1, description="Canary judgements after which an undecided test "
                                     "ends: promote if the canary did at least as well as production, else roll "
                                     "back.")
    canary_margin: float = Field(0.02, ge=0, lt=1, description="Non-inferiority margin: the sequential test "
                                 "promotes once it shows the canary's accept rate is not below production's by "
                                 "more than this.")
    canary_alpha: float = Field(0.05, gt=0, lt=1, description="Error rate of each of the sequential test's two "
                                "verdicts, however often it looks.")
    canary_tau: float = Field(0.05, gt=0, description="Spread of the accept-rate differences the mixture test "
                          "is tuned to detect (the N(0, τ²) mixture of the mSPRT).")


class ScheduleSettings(Section):
    """`rtrl scheduler`: when updates run, and the lock that keeps one updater at a time."""

    update_interval: str = Field("3h", description="Interval (`3h`, `90m`, `45s`) or a 5-field cron expression.")
    min_feedback: int = Field(256, ge=1, description="Skip a cycle with fewer new training examples than this.")
    misfire_grace_s: int = Field(900, ge=1, description="A run late by more than this is skipped (APScheduler).")
    coalesce: bool = Field(True, description="Missed runs collapse into one.")
    run_at_start: bool = Field(False, description="Also run once when the scheduler starts.")
    lock_name: str = Field("rtrl-updater", description="Name of the updater lock.")
    lock_stale_s: float = Field(6 * 3600.0, gt=0, description="SQLite lock rows older than this whose holder "
                                "process is gone are taken over (PostgreSQL advisory locks die with the session).")


class SimUsersSettings(Section):
    """Simulated users for development, tests, the demo and `rtrl bench online` (realtime_rl/simusers.py)."""

    population: Literal["realistic", "simple"] = Field(
        "realistic", description="`realistic`: users of several kinds with noise, sparse and late feedback, "
        "edits, a moving traffic mix and optional adversarial users (the fields below). `simple`: every user "
        "wants correct answers in the spaced style (strictness only), judges every completion at once.")
    n_users: int = Field(16, ge=1, description="Honest callers, each with its own API key (adversarial ones, "
                         "if any, are added to them).")
    seed: int = Field(0, description="Seed for preferences and traffic.")
    style_share: float = Field(0.4, ge=0, description="Realistic: relative share of honest users who want "
                               "correct answers in the spaced style.")
    brevity_share: float = Field(0.2, ge=0, description="Realistic: relative share of honest users who want "
                                 "correct answers with no redundant characters (spacing is free).")
    correctness_share: float = Field(0.4, ge=0, description="Realistic: relative share of honest users who "
                                     "accept any correct answer.")
    adversarial_share: float = Field(0.0, ge=0, lt=1, description="Realistic: share of all users whose feedback "
                                     "is adversarial (half reject everything, half accept everything). They are "
                                     "added to the n_users honest ones, whose preferences and traffic stay "
                                     "the same, so a run with adversaries differs from one without only by them.")
    adversarial_activity: float = Field(2.0, gt=0, description="Realistic: how many times more requests an "
                                        "adversarial user sends than a typical honest one (loud users).")
    activity_sigma: float = Field(0.5, ge=0, description="Realistic: honest users' request rates are "
                                  "log-normal with this sigma (a few users send much of the traffic).")
    noise_max: float = Field(0.1, ge=0, le=0.5, description="Realistic: each honest user flips its own verdict "
                             "with a probability drawn from U[0, noise_max].")
    feedback_rate_min: float = Field(0.3, ge=0, le=1, description="Realistic: each honest user gives feedback "
                                     "on a completion with a probability drawn from U[min, max]; the rest "
                                     "never get any.")
    feedback_rate_max: float = Field(0.9, ge=0, le=1, description="Realistic: upper bound of that probability.")
    delay_probability: float = Field(0.3, ge=0, le=1, description="Realistic: share of honest feedback sent "
                                     "late, with a later chunk of traffic (possibly after a release).")
    max_delay_chunks: int = Field(3, ge=1, description="Realistic: late feedback goes out 1..this many traffic "
                                  "chunks (bench: cycles) after its completion.")
    style_strictness_min: float = Field(0.8, ge=0, le=1, description="Per-user probability of rejecting a "
                                        "correct answer not written in the spaced style: lower bound.")
    style_strictness_max: float = Field(1.0, ge=0, le=1, description="… upper bound (uniform per user).")
    edit_probability: float = Field(0.0, ge=0, le=1, description="Chance a user edits a rejected answer instead "
                                    "of rejecting it (simple preset: keeps part of it; realistic: brevity and "
                                    "correctness users rewrite it into the answer they wanted).")
    style_edit_probability: float = Field(0.5, ge=0, le=1, description="Realistic: the same chance for style "
                                          "users (they rewrite the answer into the spaced style).")
    day_length: int = Field(256, ge=0, description="Realistic: requests in one simulated day; the mix of task "
                            "kinds follows a cosine over it (0: a fixed uniform mix).")
    traffic_shift: float = Field(0.6, ge=0, le=1, description="Realistic: amplitude of that cosine (0: no shift; "
                                 "1: a task kind's weight swings between 0 and twice the average).")
    requests_per_cycle: int = Field(2048, ge=1, description="Honest users' completions per simulated cycle (`rtrl "
                                    "bench online`); sized so that, with sparse feedback, each update sees the "
                                    "number of judgements docs/algorithms.md asks for (trust region).")
    concurrency: int = Field(4, ge=1, description="Concurrent requests.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature the users request.")
    max_tokens: int = Field(16, ge=1, description="Completion budget.")

    def traffic_options(self) -> dict[str, int | float]:
        """``run_traffic``'s traffic-mix arguments for this population (none for the simple preset)."""
        if self.population == "simple":
            return {}
        return {"day_length": self.day_length, "shift": self.traffic_shift}
