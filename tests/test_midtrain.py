"""Mid-training: the LR schedule, prompt/answer tokenization, and `rtrl midtrain` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offline_rl.corpus import LENGTH_BUCKET, documents, function_segments, segment_ids, token_batches
from offline_rl.demos import transcript_text, transcripts
from offline_rl.midtrain import lr_factor
from offline_rl.tasks import split_specs


def test_lr_schedule_warmup_then_cosine():
    assert lr_factor(0, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(9, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(10, 100, 10, 0.1) == pytest.approx(1.0)
    assert lr_factor(55, 100, 10, 0.1) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, 100, 10, 0.1) == pytest.approx(0.1)
    assert lr_factor(50, 100, 0, 0.2, "linear") == pytest.approx(0.6)
    assert lr_factor(50, 100, 0, 0.2, "constant") == 1.0
    vals = [lr_factor(s, 200, 0, 0.1) for s in range(200)]
    assert all(a >= b for a, b in zip(vals, vals[1:], strict=False))


def test_prompt_and_answer_are_tokenized_as_at_inference(tiny_model_dir):
    from policy.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    prompt = "# f(0)=7 f(1)=15\ndef f(x): return "
    ids = segment_ids(tok, function_segments(prompt + "x*8+7\n"))
    head = tok(prompt, add_special_tokens=False)["input_ids"]
    assert ids[:len(head)] == head  # the prompt ends in the same (bare space) token the sampler sees
    assert tok.decode(ids) == prompt + "x*8+7\n"


def test_the_corpus_leaves_out_the_evaluated_splits_held_out_functions():
    """Documents are drawn with midtrain.seed (1) but must leave out the functions held out by the task
    split (tasks.seed, 0): drawn with the split of seed 1, 77 of 400 function documents and 18 of 60
    transcripts answered a held-out function of split 0."""
    _, held = split_specs(0, 0.2)
    answers = {s.expr for s in held} | {s.spaced for s in held}
    docs = documents(400, seed=1, split_seed=0, heldout_fraction=0.2, agent_share=0.0)
    assert not [segs for segs in docs if segs[-1][0].strip() in answers]
    leaked = [f"return {a}\n" for a in answers]
    texts = [transcript_text(t) for t in transcripts(60, seed=1, split_seed=0)]
    assert not [t for t in texts if any(p in t for p in leaked)]
    assert [t for t in (transcript_text(t) for t in transcripts(60, seed=1)) if any(p in t for p in leaked)]


class _CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def test_token_batches_keep_the_budget_and_shuffled_order_within_a_length_bucket():
    """Every document once, no batch over budget, and short documents of different lengths keep the
    order they were drawn in (sorting them by exact length made batches of one answer shape each,
    which mid-training learned far less from)."""
    lengths = [5 + (i * 7) % 30 for i in range(300)] + [LENGTH_BUCKET + 40 + i for i in range(20)]
    docs = [[(chr(65 + i % 26) * n, False)] for i, n in enumerate(lengths)]
    batches = list(token_batches(_CharTokenizer(), docs, batch_tokens=400))
    rows = [r for b in batches for r in b]
    assert sorted(map(len, rows)) == sorted(lengths)
    assert all(len(b) * max(map(len, b)) <= 400 or len(b) == 1 for b in batches)
    short = [b for b in batches if max(map(len, b)) < LENGTH_BUCKET]
    assert any(list(map(len, b)) != sorted(map(len, b)) for b in short)


def test_midtrain_cli_saves_a_loadable_model(tiny_model_dir, tmp_path):
    out = tmp_path / "mid"
    env = {**os.environ, "RTRL_MIDTRAIN__EVAL_AT_END": "false", "RTRL_MIDTRAIN__BATCH_TOKENS": "720",
           "RTRL_MIDTRAIN__WARMUP_STEPS": "2"}
    proc = subprocess.run([sys.executable, "-m", "rtrl", "midtrain", "--init", str(tiny_model_dir), "--out", str(out),
                           "--steps", "15"], capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == str(out)
    summary = json.loads((out / "midtrain.json").read_text())
    assert summary["steps"] == 15 and summary["loss_last"] < summary["loss_first"] - 1.0
    from policy.loading import load_policy

    policy = load_policy(out)
    assert len(policy.tokenizer) == len(load_policy(tiny_model_dir).tokenizer)
    missing = subprocess.run([sys.executable, "-m", "rtrl", "midtrain", "--init", str(tmp_path / "none"),
                              "--steps", "1"], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert missing.returncode == 2 and "not found" in missing.stderr


def test_training_loop_uses_its_own_threads_and_gives_the_callers_back(tiny_model_dir, tmp_path):
    import torch

    from offline_rl.midtrain import run_midtrain
    from rtrl.config import load_settings

    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    for threads, expected in ((None, cores), (3, 3)):
        settings = load_settings(var_dir=str(tmp_path / "var"), model={"dir": str(tiny_model_dir), "threads": 1},
                                 midtrain={"steps": 2, "batch_tokens": 256, "warmup_steps": 0, "eval_at_end": False,
                                           "threads": threads})
        seen: list[int] = []
        out = run_midtrain(settings, out_dir=tmp_path / f"mid-{threads}", progress=False,
                           on_step=lambda step, model, seen=seen: seen.append(torch.get_num_threads()))
        assert seen == [expected, expected]
        assert json.loads((out / "midtrain.json").read_text())["threads"] == expected
        assert torch.get_num_threads() == 1  # the caller's setting, restored


def test_summary_request_gets_no_loss_and_the_summary_does():
    """Mid-training does not teach the model to write the environment's summary request (it would write
    it as a command whenever a context grew as long as the demonstrations' summarised ones), only to
    answer it."""
    from offline_rl.corpus import document_row
    from policy.summary import SUMMARY_REQUEST

    tok = _CharTokenizer()
    segs = [("# issue: x\n$ ", False), ("cat notes.py\n", True), ("1 RULE = 1\n$ ", False),
            (SUMMARY_REQUEST, False), ("rule 1\n", True)]
    row = document_row(tok, segs)
    start = len("# issue: x\n$ cat notes.py\n1 RULE = 1\n$ ")
    assert row.ids == [ord(c) for c in "".join(t for t, _ in segs)]
    assert not any(row.trained[start:start + len(SUMMARY_REQUEST)])
    assert all(row.trained[:start]) and all(row.trained[start + len(SUMMARY_REQUEST):])


def test_corpus_families_default_to_the_task_families_and_repeat_as_weights():
    """``midtrain.families`` draws transcripts of its families in turn (a family named twice, twice as
    often); left empty, the corpus follows ``tasks.repo_families``."""
    import itertools

    from offline_rl.config import MidtrainSettings, TaskSettings
    from offline_rl.corpus import midtrain_batches

    class Recorder(_CharTokenizer):
        issues: list[str] = []

        def __call__(self, text, add_special_tokens=False):
            if text.startswith("# issue: "):
                self.issues.append(text.splitlines()[0])
            return super().__call__(text)

    def issues(cfg, tasks):
        Recorder.issues = []
        list(itertools.islice(midtrain_batches(Recorder(), cfg, tasks), 2))
        return Recorder.issues

    tasks = TaskSettings(repo_families=["trace"])
    only = issues(MidtrainSettings(agent_share=1.0, batch_tokens=2000), tasks)
    assert only and all("its rule is in" in i for i in only)
    mixed = issues(MidtrainSettings(agent_share=1.0, batch_tokens=2000, families=["fix", "trace", "trace"]), tasks)
    trace = sum("its rule is in" in i for i in mixed)
    assert 0 < len(mixed) - trace < trace, mixed


def test_rule_drill_shows_rules_no_task_is_drawn_from():
    """``rule_drill`` rules are functions outside the task grammar: never a task's function (so never a
    held-out one), and a trace transcript with one copies it into the fix."""
    from offline_rl.tasks import function_specs, outside_specs

    outside = {s.expr for s in outside_specs()}
    assert outside and not outside & {s.expr for s in function_specs()}
    texts = [transcript_text(t) for t in transcripts(40, seed=1, families=("trace",), rule_drill=0.5)]
    fixes = [t.split("$ edit", 1)[1].split(" return ", 1)[1].splitlines()[0] for t in texts if "$ edit" in t]
    drilled = [f for f in fixes if f in outside]
    assert 0 < len(drilled) < len(fixes)
    assert [transcript_text(t) for t in transcripts(20, seed=1, families=("trace",))] == \
        [transcript_text(t) for t in transcripts(20, seed=1, families=("trace",), rule_drill=0.0)]
