"""Token ids and log-probs are checked at the door, on every ingest path, and again against the
vocabulary of the model a dataset is built for: no malformed event becomes training data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sqlalchemy as sa

from realtime_rl.config import UpdateSettings
from realtime_rl.dataset import OUT_OF_VOCAB, build_dataset, load_logged
from realtime_rl.ingest import Ingester
from tests.ingest_fixtures import completion, feedback, make_settings, rows, send

GOOD = {"type": "completion", "caller": "k", "model": "m", "version": "v1", "prompt": "p",
        "completion": "abc", "prompt_token_ids": [1, 2], "completion_token_ids": [5, 6, 7],
        "logprobs": [-0.5, -0.25, -1.0], "sampling_logprobs": [-0.5, -0.25, -1.0]}

# (name, field overrides, the text the dead letter's detail must hold)
BAD = [
    ("issue-negative", {"completion_token_ids": [-5, 6, 7]}, "completion_token_ids"),
    ("issue-huge", {"completion_token_ids": [10**30, 1, 2]}, "completion_token_ids"),
    ("prompt-negative", {"prompt_token_ids": [1, -1]}, "prompt_token_ids"),
    ("at-limit", {"completion_token_ids": [2**31, 1, 2]}, "completion_token_ids"),
    ("string-id", {"completion_token_ids": ["5", 6, 7]}, "completion_token_ids"),
    ("bool-id", {"prompt_token_ids": [True, 2]}, "prompt_token_ids"),
    ("float-id", {"completion_token_ids": [5.0, 6, 7]}, "completion_token_ids"),
    ("positive-logprob", {"logprobs": [-0.5, 0.01, -1.0]}, "logprobs"),
    ("positive-sampling", {"sampling_logprobs": [-0.5, 0.5, -1.0]}, "sampling_logprobs"),
    ("short-logprobs", {"logprobs": [-0.5, -0.25]}, "logprobs"),
    ("short-sampling", {"sampling_logprobs": [-0.5]}, "sampling_logprobs"),
    ("negative-temperature", {"sampling": {"temperature": -1.0}}, "sampling.temperature"),
    ("top-p-above-1", {"sampling": {"top_p": 1.5}}, "sampling.top_p"),
]
# JSON has no infinities or NaN, but parsers accept them (1e999 overflows to inf): raw texts.
RAW_BAD = [
    ("nan-logprob", b'"logprobs": [NaN, -0.25, -1.0]', "logprobs"),
    ("inf-sampling", b'"sampling_logprobs": [-1e999, -0.25, -1.0]', "sampling_logprobs"),
]


def _raw(cid: str, **fields) -> bytes:
    return json.dumps({**GOOD, "event_id": f"e-{cid}", "completion_id": cid, **fields}).encode()


def _messages() -> list[tuple[bytes, bytes]]:
    out = [(name.encode(), _raw(name, **fields)) for name, fields, _ in BAD]
    for name, text, _ in RAW_BAD:
        body = _raw(name, logprobs=0).replace(b'"logprobs": 0', text) if b'"logprobs"' in text else \
            _raw(name, sampling_logprobs=0).replace(b'"sampling_logprobs": 0', text)
        out.append((name.encode(), body))
    # Valid: a log-prob within the documented tolerance above 0, and ids past a small vocabulary
    # (the database can hold them; the dataset builder excludes them for a model that cannot).
    out.append((b"ok-tolerance", _raw("ok-tolerance", logprobs=[-0.5, 5e-5, -1.0])))
    out.append((b"ok-big-vocab", _raw("ok-big-vocab", completion_token_ids=[5, 60000, 7])))
    out.append((b"ok-big-prompt", _raw("ok-big-prompt", prompt_token_ids=[2**31 - 1, 2])))
    return out


EXPECTED_DEAD = {name: where for name, _, where in BAD + RAW_BAD}


def _check(url: str) -> None:
    dead = rows(url, "SELECT key, reason, detail FROM dead_letters")
    got = {bytes(key).decode(): (reason, detail) for key, reason, detail in dead}
    assert set(got) == set(EXPECTED_DEAD), set(got) ^ set(EXPECTED_DEAD)
    for name, (reason, detail) in got.items():
        assert reason == "schema_invalid", (name, reason, detail)
        assert EXPECTED_DEAD[name] in detail, (name, detail)
    stored = {r[0] for r in rows(url, "SELECT completion_id FROM completions")}
    assert stored == {"ok-tolerance", "ok-big-vocab", "ok-big-prompt", "c-good", "c-good-2"}


def _ingest(tmp_path: Path, url: str, **ingest) -> None:
    s = make_settings(tmp_path, url, ingest={"batch_max_records": 5000, **ingest.pop("cfg", {})})
    send(s, [*_messages(), completion("c-good"), feedback("c-good"), completion("c-good-2", text="x+1\n"),
             feedback("c-good-2", "reject"), feedback("ok-big-vocab"), feedback("ok-big-prompt")])
    ing = Ingester(s, **ingest)
    try:
        ing.drain(timeout_s=60)
    finally:
        ing.close()
    assert ing.stats.written.dead_letters == len(EXPECTED_DEAD)


def test_sqlite_plain_and_writer_process_paths_dead_letter_bad_ids_and_logprobs(tmp_path: Path) -> None:
    plain = f"sqlite:///{tmp_path / 'plain.db'}"
    _ingest(tmp_path, plain, cfg={"staged_writes": False}, writer_process=False)
    _check(plain)
    staged = f"sqlite:///{tmp_path / 'staged.db'}"
    _ingest(tmp_path, staged, cfg={"staged_writes": True})
    _check(staged)

    # A dataset for a model with a 320-id vocabulary: the two valid rows whose ids are past it are
    # excluded and counted by reason; the others train.
    engine = sa.create_engine(staged)
    try:
        logged = load_logged(engine)
    finally:
        engine.dispose()
    cfg = UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0)
    ds = build_dataset(logged, cfg, production="v1", vocab_size=320)
    assert ds.stats.window == 4 and ds.stats.out_of_vocab == 2 and ds.stats.malformed == 0
    assert ds.stats.excluded == {OUT_OF_VOCAB[0]: 1, OUT_OF_VOCAB[1]: 1}
    assert sorted(e.example.completion_id for e in ds.train) == ["c-good", "c-good-2"]
    # Without a vocabulary bound (or a large enough one) they are kept.
    assert build_dataset(logged, cfg, production="v1", vocab_size=2**31).stats.train == 4


@pytest.mark.postgres
def test_postgres_copy_path_dead_letters_bad_ids_and_logprobs(tmp_path: Path, postgres_url: str,
                                                              monkeypatch) -> None:
    from realtime_rl import ingest_plan

    monkeypatch.setattr(ingest_plan, "COPY_MIN_ROWS", 1)  # the binary COPY path in the writer process
    _ingest(tmp_path, postgres_url)
    _check(postgres_url)


def test_dataset_excludes_rows_stored_before_the_checks() -> None:
    """Rows already in a table (ingested before the checks existed) get the same rules, with reasons."""
    from realtime_rl.dataset import LoggedExample

    def row(cid: str, prompt=(1, 2), comp=(5, 6), lp=(-0.1, -0.2)) -> LoggedExample:
        return LoggedExample(completion_id=cid, version="v1", caller=cid, task_bucket=None,
                             prompt_token_ids=list(prompt), completion_token_ids=list(comp), logprobs=list(lp),
                             sampling_logprobs=None, signal="accept")

    rows_ = [row("ok"), row("neg", comp=(-5, 6)), row("huge", comp=(10**30, 1)), row("prompt", prompt=(400, 1)),
             row("nan", lp=(float("nan"), -0.1)), row("pos", lp=(0.3, -0.1)), row("short", lp=(-0.1,))]
    ds = build_dataset(rows_, UpdateSettings(heldout_fraction=0.0, caller_cap_share=1.0), production="v1",
                       vocab_size=320)
    assert [e.example.completion_id for e in ds.train] == ["ok"]
    assert ds.stats.out_of_vocab == 3 and ds.stats.malformed == 3
    assert ds.stats.excluded == {OUT_OF_VOCAB[1]: 2, OUT_OF_VOCAB[0]: 1, "log-probs not finite or above 0": 2,
                                 "log-probs do not line up with the completion tokens": 1}
