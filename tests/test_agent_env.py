"""The agent environment over repository tasks: the tools, bad commands, the sandboxed `test` tool, the
hidden-test reward, the demonstrator's transcripts and the task loaders."""

from __future__ import annotations

import json

import pytest

from offline_rl.agent_env import PROMPT, RepoEnv, SandboxTests, TrustedTests, behaviour, header, parse_command
from offline_rl.config import RewardSettings, SandboxSettings
from offline_rl.demos import DemoHabits, Demonstrator, transcript_text
from offline_rl.repo_tasks import (
    FAMILIES,
    RepoTask,
    RepoTest,
    TaskFormatError,
    generate_repo_tasks,
    load_repo_tasks,
    make_repo_task,
    trace_rule,
    write_repo_tasks,
)
from offline_rl.rewards import RewardFunction
from offline_rl.sandbox import SandboxPool
from offline_rl.tasks import split_specs

TASK = RepoTask(
    task_id="t1", family="fix", issue="area returns wrong values",
    files={"geom.py": "def side(x): return x+1\ndef area(x): return x*2+1\n",
           "test_geom.py": "import geom\nassert geom.area(0) == 5\n"},
    tests=[RepoTest("geom", "area", [0], 5), RepoTest("geom", "area", [1], 8)],
    hidden_tests=[RepoTest("geom", "area", [-3], -4), RepoTest("geom", "area", [10], 35)])


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(SandboxSettings(), size=2) as p:
        yield p


def test_tools_fix_a_bug_and_the_hidden_tests_decide(pool):
    env = RepoEnv(SandboxTests(pool), max_turns=8)
    st = env.reset(TASK)
    assert st.context == header(TASK) and st.context.endswith(PROMPT)
    assert env.step(st, "ls") == "geom.py test_geom.py\n" + PROMPT
    assert env.step(st, "grep def area") == "geom.py:2:def area(x): return x*2+1\n" + PROMPT
    assert env.step(st, "cat geom.py 2-2").startswith("2 def area(x): return x*2+1\n")
    obs = env.step(st, "test")
    assert obs.startswith("FAIL area: got 1 3 want area(0)=5 area(1)=8")
    assert "-3" not in obs and "35" not in obs  # hidden inputs and outputs never reach the policy
    assert env.step(st, "edit geom.py 2 def area(x): return x*3+5") == "ok\n" + PROMPT
    assert env.step(st, "test") == "PASS 2/2\n" + PROMPT
    assert env.step(st, "submit") == "" and st.done and st.submitted
    fn = RewardFunction(pool, RewardSettings())
    reward = fn.score_submission(env.submission(st), well_formed=True)
    assert reward.passed and reward.total == pytest.approx(1.05)
    b = behaviour(st)
    assert b["test_before_edit"] == 1 and b["test_before_submit"] == 1 and b["turns"] == 7


def test_unchanged_or_wrong_code_earns_nothing(pool):
    """Partial credit would pay for submitting untouched code that passes some hidden tests by chance."""
    env = RepoEnv(SandboxTests(pool))
    fn = RewardFunction(pool, RewardSettings())
    st = env.reset(TASK)
    env.step(st, "edit geom.py 2 def area(x): return x*3+4")  # wrong on every hidden input
    env.step(st, "submit")
    assert fn.score_submission(env.submission(st), True).total == 0.0
    unsubmitted = env.reset(TASK)
    assert env.submission(unsubmitted) is None and fn.score_submission(None, True).total == 0.0


def test_bad_commands_are_observations_not_crashes(pool):
    env = RepoEnv(SandboxTests(pool), max_turns=20)
    st = env.reset(TASK)
    cases = {
        "rm -rf /": "error: unknown command 'rm'",
        "": "error: empty command",
        "cat ../../etc/passwd": "error: ../../etc/passwd is outside the repository",
        "cat /etc/passwd": "error: /etc/passwd is outside the repository",
        "edit test_geom.py 2 assert True": "error: test files are read-only",
        "edit geom.py 9 x = 1": "error: geom.py has 2 lines",
        "edit geom.py two x": "error: usage: edit FILE LINE TEXT",
        "cat nope.py": "error: no file nope.py",
        "ls -la": "error: ls takes no arguments",
        "grep": "error: usage: grep TEXT",
    }
    for command, expected in cases.items():
        assert env.step(st, command).startswith(expected), command
    assert not st.done and behaviour(st)["malformed"] == len(cases)
    assert st.files == TASK.files  # nothing changed


def test_a_test_run_that_hangs_ends_that_call_only(pool):
    env = RepoEnv(SandboxTests(pool))
    st = env.reset(TASK)
    env.step(st, "edit geom.py 2 def area(x): return [i for i in iter(int, 1)]")
    obs = env.step(st, "test")
    assert obs.startswith("FAIL area: got ") and "timeout" in obs
    assert not st.done
    env.step(st, "edit geom.py 2 def area(x): return x*3+5")
    assert env.step(st, "test").startswith("PASS")


def test_a_broken_module_is_reported_per_call(pool):
    env = RepoEnv(SandboxTests(pool))
    st = env.reset(TASK)
    env.step(st, "edit geom.py 1 def side(x) return")
    assert "SyntaxError in geom.py line 1" in env.step(st, "test")


def test_parse_command():
    assert parse_command("edit a.py 3 def f(x): return x").args == ["a.py", "3"]
    assert parse_command("edit a.py 3 def f(x): return x").text == "def f(x): return x"
    assert parse_command("grep def area").text == "def area"
    assert parse_command("submit").tool == "submit"


def test_generated_tasks_are_split_by_function_and_valid():
    split = generate_repo_tasks(seed=0, heldout_per_family=3)
    assert {t.family for t in split.heldout} == set(FAMILIES)
    train_specs, held_specs = split_specs(0, 0.2)
    held = {s.expr for s in held_specs}
    assert all(t.metadata["reference"] in held for t in split.heldout)
    assert not any(t.metadata["reference"] in held for t in split.train)
    assert generate_repo_tasks(seed=0, heldout_per_family=3) == split  # deterministic


def test_demonstrations_replay_identically_in_the_sandbox(pool):
    """The corpus uses the in-process runner for its own generated code; the sandboxed environment
    must show the policy exactly what the transcripts show."""
    train_specs, _ = split_specs(0, 0.2)
    import random

    tasks = generate_repo_tasks(seed=0, heldout_per_family=1).train[:12]
    demo = Demonstrator(DemoHabits(verify=0.9, retry=0.9), train_specs, random.Random(3))
    sandboxed = RepoEnv(SandboxTests(pool), max_turns=16)
    for task in tasks:
        (segs,) = demo.episode(task)  # one context: no summary turn outside trace tasks
        st = sandboxed.reset(task)
        for text, is_action in segs[1:]:
            if is_action:
                sandboxed.step(st, text.rstrip("\n"))
        assert st.context == transcript_text(segs), task.task_id


def test_trace_demonstrations_read_the_rule_and_fix_with_it():
    """The demonstrator's trace episodes open the notes module the issue names, and only then write the
    rule's body; without the notes (read_notes 0) the single visible test does not inform the fix."""
    import random

    train_specs, _ = split_specs(0, 0.2)
    tasks = [make_repo_task("trace", spec, train_specs, random.Random(i), f"t{i}", "train")
             for i, spec in enumerate(train_specs[:8])]
    informed = Demonstrator(DemoHabits(read_notes=1.0, correct=1.0, summarise=0.0), train_specs, random.Random(1))
    blind = Demonstrator(DemoHabits(read_notes=0.0, correct=1.0, test_first=1.0, summarise=0.0), train_specs,
                         random.Random(1))
    for task in tasks:
        notes = task.issue.rsplit(" ", 1)[-1]
        rule = task.metadata["reference"]
        (segs,) = informed.episode(task)
        text = transcript_text(segs)
        assert text.splitlines()[2] == f"$ cat {notes}", text
        assert f"return {rule}" in text.split("$ edit", 1)[1].splitlines()[0], text
        st = RepoEnv(TrustedTests()).reset(task)  # finding the function does not show the rule
        assert rule not in RepoEnv(TrustedTests()).step(st, f"grep def {task.tests[0].function}")
        (segs,) = blind.episode(task)
        unread = transcript_text(segs)
        assert f"return {rule}" not in unread.split("$ edit", 1)[1].splitlines()[0], unread


def test_trace_demonstrations_summarise_and_go_on_from_the_context_the_environment_opens():
    """With ``summarise``, a trace episode is two transcripts: the first reads the notes and ends with the
    summary request and the demonstrator's summary (policy text), the second is the fresh context
    :meth:`RepoEnv.restart` builds from that summary without the notes' output. A summary that kept the
    rule carries the right fix; one that did not leaves the fix a guess, so the corpus shows both
    outcomes for the reward to tell apart."""
    import random

    from policy.summary import SUMMARY_PREFIX, SUMMARY_REQUEST

    train_specs, _ = split_specs(0, 0.2)
    tasks = [make_repo_task("trace", spec, train_specs, random.Random(i), f"t{i}", "train")
             for i, spec in enumerate(train_specs[:6])]
    for keep in (1.0, 0.0):
        demo = Demonstrator(DemoHabits(read_notes=1.0, correct=1.0, summarise=1.0, summary_keeps_rule=keep),
                            train_specs, random.Random(2))
        for task in tasks:
            rule = trace_rule(task.tests[0].function, task.metadata["reference"])
            first, second = demo.episode(task)
            assert first[-2] == (SUMMARY_REQUEST, False) and first[-1][1], first[-2:]
            summary = first[-1][0].rstrip("\n")
            assert (rule in summary) == bool(keep), summary
            env = RepoEnv(TrustedTests())
            st = env.reset(task)
            for text, is_action in first[1:-2]:
                if is_action:
                    env.step(st, text.rstrip("\n"))
            assert [a for a, is_action in first if is_action][0] == f"cat {task.issue.rsplit(' ', 1)[-1]}\n"
            assert second[0] == (env.restart(st, summary, carry=False), False)
            assert second[0][0].splitlines()[2] == SUMMARY_PREFIX + summary
            fix = transcript_text(second).split("$ edit", 1)[1].splitlines()[0]
            assert (f"return {task.metadata['reference']}" in fix) == bool(keep), fix


def test_trusted_runner_is_never_the_environment_default(pool):
    env = RepoEnv(SandboxTests(pool))
    assert not isinstance(env.tests, TrustedTests)


def test_loaders_jsonl_and_directories(tmp_path):
    split = generate_repo_tasks(seed=0, heldout_per_family=1)
    write_repo_tasks(split.train[:3], tmp_path / "t.jsonl")
    assert load_repo_tasks(tmp_path / "t.jsonl") == split.train[:3]
    d = tmp_path / "repos" / "one"
    d.mkdir(parents=True)
    for path, text in TASK.files.items():
        (d / path).write_text(text)
    meta = {"issue": TASK.issue, "tests": [vars(t) for t in TASK.tests],
            "hidden_tests": [vars(t) for t in TASK.hidden_tests], "split": "heldout"}
    (d / "task.json").write_text(json.dumps(meta))
    [loaded] = load_repo_tasks(tmp_path / "repos")
    assert loaded.files == TASK.files and loaded.split == "heldout" and loaded.task_id == "one"


def test_loaders_refuse_what_cannot_be_run_safely(tmp_path):
    d = tmp_path / "repos" / "bad"
    d.mkdir(parents=True)
    (d / "geom.py").write_text("def area(x): return x\n")
    (d / "task.json").write_text(json.dumps({"issue": "x", "tests": [], "hidden_tests": []}))
    with pytest.raises(TaskFormatError, match="has no tests"):
        load_repo_tasks(tmp_path / "repos")
    (d / "task.json").write_text(json.dumps({"issue": "x", "tests": [vars(t) for t in TASK.tests],
                                             "hidden_tests": [vars(t) for t in TASK.hidden_tests]}))
    (d / "evil.py").symlink_to("/etc/hostname")
    with pytest.raises(TaskFormatError, match="leaves the task directory"):
        load_repo_tasks(tmp_path / "repos")
    escaping = {**TASK.to_dict(), "files": {"../x.py": "x = 1\n", **TASK.files}}
    with pytest.raises(TaskFormatError, match="escapes the repository"):
        RepoTask.from_dict(escaping)
    (tmp_path / "bad.jsonl").write_text("not json\n")
    with pytest.raises(TaskFormatError, match="bad.jsonl:1"):
        load_repo_tasks(tmp_path / "bad.jsonl")
