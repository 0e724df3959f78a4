"""Decoding one record: what is refused before it reaches a database, and what only looks suspicious."""

from __future__ import annotations

import json

from realtime_rl.bus.base import Record
from realtime_rl.ingest_decode import SCHEMA_INVALID, UNDECODABLE, _has_unicode_escape, decode_record
from tests.ingest_fixtures import completion


def _decode(raw: bytes):
    return decode_record(Record("t", 0, 0, None, raw, 0), 1_000_000)


def _with_text(text_json: str) -> bytes:
    """A valid completion whose ``completion`` field is the given JSON string literal, as written."""
    data = json.loads(completion("c1").to_bytes())
    data["completion"] = "@@"
    return json.dumps(data).replace('"@@"', text_json).encode()


def test_nul_in_text_is_stored_as_a_replacement_character_and_refused_in_ids() -> None:
    """A model can write a NUL; PostgreSQL text cannot hold one. The completion (its token ids are the
    training data) is kept with U+FFFD in its text; an id with a NUL is refused."""
    ok = _decode(_with_text(r'"a\u0000b"'))
    assert ok.reason is None and ok.event.completion == "a\ufffdb"
    data = json.loads(completion("c1").to_bytes())
    data["caller"] = "k\x00"
    assert _decode(json.dumps(data).encode()).reason == SCHEMA_INVALID


def test_lone_surrogates_are_refused() -> None:
    for literal in (r'"\ud800"', r'"x\uDC00"'):  # the JSON parser itself refuses these
        assert _decode(_with_text(literal)).reason in (UNDECODABLE, SCHEMA_INVALID), literal


def test_ordinary_escapes_and_lookalikes_pass() -> None:
    # An escaped backslash followed by "u0000" is the text \u0000, not a NUL; \u00e9 is é; a
    # surrogate pair is one valid character.
    for literal, text in ((r'"a\\u0000b"', "a\\u0000b"), (r'"caf\u00e9\n"', "café\n"),
                          (r'"\ud83d\ude42"', "🙂"), (r'"tab\there \\ done"', "tab\there \\ done")):
        d = _decode(_with_text(literal))
        assert d.event is not None, (literal, d.detail)
        assert d.event.completion == text


def test_unicode_escape_scan_is_exact() -> None:
    cases = {rb'"plain"': False, rb'"a\nb"': False, rb'"a\\u0000"': False, rb'"\\\u0041"': True,
             rb'"x\u0041"': True, rb'"\\\\u"': False, rb'"\"u"': False}
    assert {raw: _has_unicode_escape(raw) for raw in cases} == cases


def test_invalid_json_and_schema_violations_keep_their_reasons() -> None:
    assert _decode(b"\xff not json").reason == UNDECODABLE
    assert _decode(b'{"type": "feedback", "completion_id": "c9"}').reason == SCHEMA_INVALID
    lax = json.loads(completion("c2").to_bytes())
    lax["latency_ms"] = "12.5"  # coerced by the schema's lax rules, as before
    d = _decode(json.dumps(lax).encode())
    assert d.event is not None and d.event.latency_ms == 12.5
