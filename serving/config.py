"""Settings for the serving gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from policy.config import Section


class ServingSettings(Section):
    """The OpenAI-compatible gateway: engine, versions and hot swap, access control, limits, events."""

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8000, ge=0, le=65535, description="Bind port (0 = pick a free one).")
    engine: Literal["torch", "vllm"] = Field("torch", description="Inference engine.")
    feedback_secret: SecretStr = Field(SecretStr("change-me-in-production"),
                                       description="HMAC key for feedback tokens. Never logged.")
    api_keys_file: str = Field("var/api_keys.json", description="Hashed API keys (see `rtrl keys add`).")

    # Versions and hot swap.
    source: Literal["auto", "registry", "dir"] = Field(
        "auto", description="Where served weights come from: `registry` (the `production` channel of "
        "registry.url), `dir` (the plain HF directory model.dir, version id from its manifest or content "
        "hash), `auto` (registry when it has a production version, else dir).")
    poll_interval_s: float = Field(2.0, gt=0, description="How often the version watcher polls for a new "
                                   "production (and candidate) version.")
    follow_version_events: bool = Field(False, description="Also watch `model_version` events on the bus "
                                        "(bus.versions_topic) and poll at once when one arrives.")
    canary_share: float = Field(0.0, ge=0, le=1, description="Share of callers (stable hash of the key id) "
                                "routed to the `candidate` channel when one is set. The vLLM engine runs a second "
                                "vllm.LLM for it (its own KV cache of vllm_kv_cache_bytes; on GPU each "
                                "instance gets half of vllm_gpu_memory_utilization) and loads no "
                                "candidate while this is 0.")
    candidate_dir: str | None = Field(None, description="With source=dir: an HF directory served as the "
                                      "candidate version to the canary share of callers.")

    engine_process: bool = Field(True, description="Run the engine (torch models and sampler loop, or vLLM's "
                                 "engines) in a child process; the micro-batcher and the HTTP server share one event "
                                 "loop in the gateway process, so generation does not compete with request handling "
                                 "for the GIL. false = generate in a batcher thread of the gateway's process (one "
                                 "process: for tests and debugging).")

    # Engine batching.
    batch_window_ms: float = Field(2.0, ge=0, description="Micro-batching: after the first waiting request, "
                                   "wait this long for more before generating.")
    max_batch: int = Field(32, ge=1, description="Most sequences (rows: prompts x n) in one generate call.")
    max_queue: int = Field(256, ge=1, description="Most sequences waiting for the engine; beyond it "
                           "requests get 503 with Retry-After.")
    request_timeout_s: float = Field(120.0, gt=0, description="A request waiting longer than this for the "
                                     "engine gets 503.")

    gil_switch_interval_ms: float = Field(0.0, ge=0, description="If > 0, sys.setswitchinterval for the "
                                          "gateway process: a shorter interval hands the GIL from the engine "
                                          "thread to the HTTP loop sooner (lower tail latency, a little more "
                                          "switching). 0 keeps Python's default (5 ms).")

    # vLLM engine.
    vllm_kv_cache_bytes: int = Field(256 * 1024 * 1024, ge=1024 * 1024,
                                     description="vLLM KV cache size in bytes (kv_cache_memory_bytes).")
    vllm_max_num_seqs: int = Field(64, ge=1, description="vLLM: most sequences scheduled at once.")
    vllm_logprobs_mode: Literal["both", "raw_logprobs"] = Field(
        "both", description="vLLM per-token log-probs. both = the sampled-from distribution's log-prob "
        "(sampling_logprobs) from vLLM's processed mode plus the raw temperature-1 log-prob (logprobs, what "
        "the trainer recomputes), from a scoring pass of prompt + completion for rows whose sampling "
        "distribution is not the raw one (temperature != 1 or top-k/top-p); raw_logprobs = raw only, no "
        "extra pass, no sampling_logprobs.")
    vllm_gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="vLLM on GPU: share of memory "
                                               "for weights + KV cache (ignored on CPU).")

    # Access control and limits.
    rate_limit_rps: float = Field(50.0, gt=0, description="Per API key: sustained requests per second.")
    rate_limit_burst: int = Field(100, ge=1, description="Per API key: requests allowed in a burst.")
    max_request_bytes: int = Field(1_000_000, ge=1024, description="Larger request bodies get 413.")
    max_prompt_tokens: int = Field(2048, ge=1, description="Longer prompts get 413 (also bounded by the "
                                   "model context minus max_tokens).")
    max_tokens_limit: int = Field(512, ge=1, description="Largest max_tokens a request may ask for.")
    max_n: int = Field(16, ge=1, description="Largest n (choices per prompt) a request may ask for.")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request gives none (OpenAI: 16).")

    # Feedback tokens.
    feedback_token_ttl_s: int = Field(7 * 24 * 3600, ge=1, description="How long a feedback token is valid.")
    replay_cache_size: int = Field(1_000_000, ge=1, description="Completion ids remembered (until their token "
                                   "expires) to refuse replayed feedback; one gateway process only.")

    # Completion / feedback events.
    event_queue_size: int = Field(10_000, ge=1, description="In-memory event buffer; when full, events go "
                                  "straight to the spill file (a response is never blocked).")
    spill_dir: str = Field("var/spill", description="Durable local spill of events the bus could not take; "
                           "replayed when the bus returns (also at start-up).")
    spill_fsync: bool = Field(True, description="fsync the spill file after each write (survives power loss).")
    bus_retry_s: float = Field(1.0, gt=0, description="Wait between attempts to reach a bus that is down.")
    emit_batch: int = Field(500, ge=1, description="Most events sent to the bus per flush.")
    emit_linger_ms: float = Field(5.0, ge=0, description="After the first waiting event, wait this long for "
                                  "more before sending (fewer bus flushes under load).")
