"""Synthetic event streams shaped like the gateway's traffic, for the ingest benchmark and tests.

A stream interleaves completions with their feedback the way a product sees it: most completions
get one judgement, some get a revised one later, a few have feedback that reaches the bus before
the completion (the gateway's spill-and-retry can reorder them), and versions change over time.
Everything is derived from a seed; the expected table contents are computed from the messages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from realtime_rl.events import CompletionEvent, FeedbackEvent, SamplingRecord, decode_event

_BUCKETS = ("affine", "square", "abs", "max", "min", "mod")


@dataclass
class SampleStream:
    messages: list[tuple[bytes, bytes]] = field(default_factory=list)
    """(key, value) in send order; the key is the completion id."""
    completions: dict[str, CompletionEvent] = field(default_factory=dict)
    feedback: dict[str, FeedbackEvent] = field(default_factory=dict)
    """Every feedback event, by event id."""

    def latest_feedback(self) -> dict[str, FeedbackEvent]:
        """Per completion id: the judgement that must win (newest timestamp, then event id)."""
        best: dict[str, FeedbackEvent] = {}
        for fb in self.feedback.values():
            cur = best.get(fb.completion_id)
            if cur is None or (fb.ts, fb.event_id) > (cur.ts, cur.event_id):
                best[fb.completion_id] = fb
        return best

    def expected_examples(self) -> dict[str, FeedbackEvent]:
        """Completion id -> winning feedback, for completions whose both halves are in the stream."""
        return {cid: fb for cid, fb in self.latest_feedback().items() if cid in self.completions}


def completion_event(rng: random.Random, cid: str, version: str, ts: datetime) -> CompletionEvent:
    a, b = rng.randint(1, 9), rng.randint(0, 20)
    prompt = f"# f(0)={b} f(1)={a + b} f(2)={2 * a + b} f(8)={8 * a + b}\ndef f(x): return "
    completion = f"x*{a}+{b}\n"
    n = len(completion)
    return CompletionEvent(
        completion_id=cid, caller=f"key-{rng.randint(1, 5)}", model="tiny-coder", version=version,
        prompt=prompt, completion=completion,
        prompt_token_ids=[ord(ch) % 256 for ch in prompt], completion_token_ids=[ord(ch) % 256 for ch in completion],
        logprobs=[-rng.random() for _ in range(n)], sampling_logprobs=[-rng.random() for _ in range(n)],
        sampling=SamplingRecord(temperature=1.0, max_tokens=16), finish_reason="stop",
        latency_ms=round(rng.uniform(5, 80), 2), task_bucket=rng.choice(_BUCKETS), ts=ts,
    )


def feedback_event(rng: random.Random, c: CompletionEvent, ts: datetime,
                   accept_rate: float = 0.5) -> FeedbackEvent:
    u = rng.random()
    signal = "accept" if u < accept_rate else ("edit" if u < accept_rate + 0.15 else "reject")
    kept = c.completion.replace("+", " + ") if signal == "edit" else None
    return FeedbackEvent(completion_id=c.completion_id, caller=c.caller, version=c.version, signal=signal,
                         kept_text=kept, ts=ts)


def sample_stream(n_events: int, seed: int = 0, *, versions: tuple[str, ...] = ("v1", "v2", "v3", "v4"),
                  feedback_rate: float = 0.8, revise_rate: float = 0.1, early_rate: float = 0.05,
                  start: datetime | None = None, prefix: str = "c") -> SampleStream:
    """About ``n_events`` messages (exactly that many: the tail is cut) from ``seed``."""
    rng = random.Random(seed)
    stream = SampleStream()
    clock = start or datetime(2026, 11, 20, tzinfo=UTC)
    delayed: list[tuple[int, tuple[bytes, bytes]]] = []
    i = 0
    while len(stream.messages) < n_events:
        # Versions advance through the stream; accept rate improves a little with each one.
        v_index = min(len(versions) - 1, i * len(versions) * 18 // (10 * n_events))
        version = versions[v_index]
        clock += timedelta(seconds=rng.uniform(1, 60))
        cid = f"{prefix}{seed}-{i:07d}"
        c = completion_event(rng, cid, version, clock)
        completion_msg = (cid.encode(), c.to_bytes())
        feedback_msgs = []
        if rng.random() < feedback_rate:
            fb = feedback_event(rng, c, clock + timedelta(seconds=rng.uniform(1, 30)), 0.35 + 0.1 * v_index)
            feedback_msgs.append((fb, (cid.encode(), fb.to_bytes())))
            if rng.random() < revise_rate:
                fb2 = feedback_event(rng, c, fb.ts + timedelta(seconds=rng.uniform(1, 300)))
                feedback_msgs.append((fb2, (cid.encode(), fb2.to_bytes())))
        if feedback_msgs and rng.random() < early_rate:
            # Feedback first, the completion a few messages later.
            for _, msg in feedback_msgs:
                stream.messages.append(msg)
            delayed.append((len(stream.messages) + rng.randint(1, 20), completion_msg))
        else:
            stream.messages.append(completion_msg)
            stream.messages.extend(msg for _, msg in feedback_msgs)
        stream.completions[cid] = c
        for fb, _ in feedback_msgs:
            stream.feedback[fb.event_id] = fb
        while delayed and delayed[0][0] <= len(stream.messages):
            stream.messages.append(delayed.pop(0)[1])
        i += 1
    stream.messages.extend(msg for _, msg in delayed)
    _truncate(stream, n_events)
    return stream


def _truncate(stream: SampleStream, n: int) -> None:
    for _, value in stream.messages[n:]:
        event = decode_event(value)
        if isinstance(event, CompletionEvent):
            stream.completions.pop(event.completion_id, None)
        else:
            stream.feedback.pop(event.event_id, None)
    del stream.messages[n:]
