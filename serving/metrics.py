"""Prometheus metrics of one gateway, on its own registry (several gateways may share a test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_MS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("rtrl_http_requests_total", "HTTP requests by route and status.",
                                ["route", "status"], registry=r)
        self.latency = Histogram("rtrl_request_seconds", "Request handling time.", ["route"],
                                 buckets=_MS_BUCKETS, registry=r)
        self.overhead = Histogram("rtrl_gateway_overhead_seconds", "Request time outside the engine "
                                  "(parsing, auth, tokenising, signing, events, serialising).",
                                  buckets=_MS_BUCKETS, registry=r)
        self.completions = Counter("rtrl_completions_total", "Choices served.", ["version"], registry=r)
        self.tokens = Counter("rtrl_completion_tokens_total", "Tokens generated.", registry=r)
        self.batch_rows = Histogram("rtrl_engine_batch_rows", "Sequences per engine generate call.",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.engine_queue = Gauge("rtrl_engine_queue_rows", "Sequences waiting for the engine.", registry=r)
        self.engine_up = Gauge("rtrl_engine_up", "1 while the engine (process) can generate; 0 while a dead "
                               "engine process is being restarted.", registry=r)
        self.engine_restarts = Counter("rtrl_engine_restarts_total", "Engine processes restarted after dying.",
                                       registry=r)
        self.swap_pause = Histogram("rtrl_swap_pause_seconds", "Serving pause of a version swap.",
                                    buckets=_MS_BUCKETS, registry=r)
        self.swaps = Counter("rtrl_swaps_total", "Version swaps by channel.", ["channel"], registry=r)
        self.version = Gauge("rtrl_serving_version_info", "1 for the version live on a channel.",
                             ["channel", "version"], registry=r)
        self.feedback = Counter("rtrl_feedback_total", "Feedback accepted, by signal.", ["signal"], registry=r)
        self.feedback_rejected = Counter("rtrl_feedback_rejected_total", "Feedback refused (403), by reason: "
                                         "forged, foreign, expired, replayed.", ["reason"], registry=r)
        self.replay_evictions = Gauge("rtrl_feedback_replay_evictions_total", "Unexpired completion ids "
                                      "forgotten by the bounded replay set.", registry=r)
        self.rate_limited = Counter("rtrl_rate_limited_total", "Requests refused with 429.", registry=r)
        self.auth_failures = Counter("rtrl_auth_failures_total", "Requests with a missing or bad key.",
                                     registry=r)
        self.events = Counter("rtrl_events_emitted_total", "Events handed to the emitter.", ["type"],
                              registry=r)
        self.events_spilled = Counter("rtrl_events_spilled_total", "Events written to the spill file.",
                                      registry=r)
        self.events_replayed = Counter("rtrl_events_replayed_total", "Spilled events delivered later.",
                                       registry=r)
        self.spill_depth = Gauge("rtrl_events_spill_depth", "Events waiting in the spill (and overflow) file.",
                                 registry=r)
        self.spill_errors = Counter("rtrl_events_spill_errors_total", "Spill or overflow writes that failed "
                                    "(disk full, quota, I/O error); the events wait in memory meanwhile.",
                                    registry=r)
        self.spill_failing = Gauge("rtrl_events_spill_failing", "1 while the last write to the spill "
                                   "directory failed.", registry=r)
        self.events_dropped = Counter("rtrl_events_dropped_total", "Events lost: the in-memory buffer was "
                                      "full and the spill directory refused them too.", registry=r)
        self.event_queue = Gauge("rtrl_events_queue_depth", "Events waiting in memory (buffered or held by the sender).", registry=r)
        self.bus_up = Gauge("rtrl_bus_up", "1 when the last bus send succeeded.", registry=r)
