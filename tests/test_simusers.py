"""Simulated users: the safe answer checker, the style preference, judgements."""

from __future__ import annotations

import random

from offline_rl.tasks import generate_tasks
from realtime_rl.simusers import SimUser, is_correct, is_spaced, make_population, parse_answer


def _task(reference: str):
    return next(t for t in generate_tasks(0).train + generate_tasks(0).heldout if t.reference == reference)


def test_correctness_against_hidden_tests():
    t = _task("x*8+7")
    assert is_correct("x*8+7", t) and is_correct("x * 8 + 7\n# trailing", t) and is_correct("7+8*x", t)
    assert not is_correct("x*8+6", t) and not is_correct("", t) and not is_correct("x*", t)
    a = _task("abs(x-3)")
    assert is_correct("abs(x - 3)", a) and not is_correct("x-3", a)  # negatives in the hidden tests
    m = _task("x%5")
    assert is_correct("x % 5", m) and not is_correct("x % 0", m)


def test_nothing_outside_the_whitelist_is_evaluated():
    t = _task("x*8+7")
    for evil in ("__import__('os').system('true')", "(lambda: 1)()", "x.__class__", "open('f')", "9**9**9",
                 "[x for x in ()]", "x if x else 1", "max(x, key=abs)"):
        assert not is_correct(evil, t)
    assert parse_answer("(" * 500) is None


def test_spaced_style():
    assert is_spaced("x * 8 + 7") and is_spaced("abs(x - 3)") and is_spaced("max(x, 4)") and is_spaced("x % 5")
    assert not is_spaced("x*8+7") and not is_spaced("abs(x-3)") and not is_spaced("max(x,4)")
    assert not is_spaced(" x * 8 + 7") and not is_spaced("x  * 8 + 7")


def test_judgements_follow_hidden_preferences():
    t = _task("x*8+7")
    strict, lax = SimUser("s", 1.0), SimUser("l", 0.0)
    rng = random.Random(0)
    assert strict.judge(t, "x * 8 + 7", rng) == ("accept", None)
    assert strict.judge(t, "x*8+7", rng) == ("reject", None)
    assert lax.judge(t, "x*8+7", rng) == ("accept", None)
    assert lax.judge(t, "x*8+6", rng) == ("reject", None)
    assert strict.judge(t, "x*8+7", rng, edit_probability=1.0) == ("edit", "x * 8 + 7")
    half = SimUser("h", 0.5)
    accepts = sum(half.judge(t, "x*8+7", rng)[0] == "accept" for _ in range(2000))
    assert 900 < accepts < 1100
    pop = make_population(50, seed=3, lo=0.8, hi=1.0)
    assert len({u.name for u in pop}) == 50 and all(0.8 <= u.strictness <= 1.0 for u in pop)
    assert [u.strictness for u in pop] == [u.strictness for u in make_population(50, 3, 0.8, 1.0)]


def _realistic(**kw):
    from realtime_rl.config import SimUsersSettings

    return SimUsersSettings(**{"n_users": 40, "seed": 7, **kw})


def test_realistic_population_kinds_noise_and_adversaries():
    from realtime_rl.simusers import build_population, kind_counts

    assert kind_counts(10, {"a": 0.4, "b": 0.2, "c": 0.4}) == {"a": 4, "b": 2, "c": 4}
    assert sum(kind_counts(7, {"a": 1, "b": 1, "c": 1}).values()) == 7
    pop = build_population(_realistic(adversarial_share=0.1))
    kinds = [u.kind for u in pop]
    assert kinds.count("reject_all") == 2 and kinds.count("accept_all") == 2
    assert {"style", "brevity", "correctness"} <= set(kinds)
    honest = [u for u in pop if u.kind not in ("reject_all", "accept_all")]
    assert all(0 <= u.noise <= 0.1 and 0.3 <= u.feedback_rate <= 0.9 for u in honest)
    assert max(u.activity for u in honest) > 2 * min(u.activity for u in honest)  # some users are loud
    assert [(u.kind, u.noise) for u in pop] == [(u.kind, u.noise) for u in build_population(_realistic(
        adversarial_share=0.1))]  # deterministic by seed
    # The adversaries are added: the honest users are those of the population without them.
    clean = build_population(_realistic())
    assert [(u.name, u.kind, u.noise, u.activity) for u in honest] == \
        [(u.name, u.kind, u.noise, u.activity) for u in clean]
    simple = build_population(_realistic(population="simple"))
    assert {u.kind for u in simple} == {"style"} and all(u.feedback_rate == 1 and u.noise == 0 for u in simple)


def test_adversaries_send_requests_on_top_of_the_same_honest_traffic():
    from realtime_rl.simusers import build_population, plan_traffic

    tasks = generate_tasks(0).train[:12]
    clean, hostile = build_population(_realistic()), build_population(_realistic(adversarial_share=0.1))
    base = plan_traffic(clean, tasks, 2000, 3, day_length=500, shift=0.5)
    mixed = plan_traffic(hostile, tasks, 2000, 3, day_length=500, shift=0.5)
    honest = [(u.name, t.prompt, s) for u, t, s in mixed if u.kind not in ("reject_all", "accept_all")]
    assert honest == [(u.name, t.prompt, s) for u, t, s in base]
    extra = len(mixed) - len(base)
    expected = 2000 * sum(u.activity for u in hostile if u.kind in ("reject_all", "accept_all")) \
        / sum(u.activity for u in clean)
    assert extra == round(expected) > 0
    first_half = sum(u.kind in ("reject_all", "accept_all") for u, _, _ in mixed[: len(mixed) // 2])
    assert 0.35 * extra < first_half < 0.65 * extra  # spread over the day, not appended at its end


def test_each_kind_judges_by_its_own_preference_and_edits_into_it():
    t = _task("x*8+7")
    rng = random.Random(0)
    style = SimUser("s", 1.0, kind="style", edit_probability=1.0, edits_fix=True)
    brief = SimUser("b", 0.0, kind="brevity", edit_probability=1.0, edits_fix=True)
    plain = SimUser("c", 0.0, kind="correctness", edit_probability=0.0)
    assert style.judge(t, "x*8+7", rng) == ("edit", "x * 8 + 7")
    assert style.judge(t, "x*8+6", rng) == ("edit", "x * 8 + 7")  # a wrong answer is fixed, in the user's style
    assert brief.judge(t, "x * 8 + 7", rng) == ("accept", None)  # spacing is free
    assert brief.judge(t, "x*8+7+0*x", rng) == ("edit", "x*8+7")  # redundant: rewritten short
    assert plain.judge(t, "7+x*8", rng) == ("accept", None) and plain.judge(t, "x", rng) == ("reject", None)
    for kind, verdict in (("reject_all", "reject"), ("accept_all", "accept")):
        hostile = SimUser("h", 0.0, kind=kind, edit_probability=1.0)
        assert {hostile.judge(t, text, rng)[0] for text in ("x*8+7", "x * 8 + 7", "x")} == {verdict}
    noisy = SimUser("n", 0.0, kind="correctness", noise=0.2)
    flips = sum(noisy.judge(t, "x*8+7", rng)[0] == "reject" for _ in range(2000))
    assert 300 < flips < 500


def test_traffic_mix_shifts_over_the_day_and_late_feedback_waits():
    from realtime_rl.simusers import FeedbackBacklog, plan_traffic, task_weights

    tasks = generate_tasks(0).train
    users = [SimUser(f"u{i}", 0.5, activity=1.0 + 9.0 * (i == 0)) for i in range(5)]
    morning = plan_traffic(users, tasks, 300, 1, start=0, day_length=4000, shift=1.0)
    evening = plan_traffic(users, tasks, 300, 1, start=2000, day_length=4000, shift=1.0)

    def share(plan, bucket):
        return sum(t.bucket == bucket for _, t, _ in plan) / len(plan)

    moved = [abs(share(morning, b) - share(evening, b)) for b in {t.bucket for t in tasks}]
    assert max(moved) > 0.15
    assert sum(u.name == "u0" for u, _, _ in morning) > 120  # activity 10 vs 1: most requests
    w = task_weights(tasks, 0, 100, 0.5)
    assert min(w) >= 0.5 and max(w) <= 1.5
    backlog = FeedbackBacklog(items=[(1, "k", {"id": 1}), (3, "k", {"id": 2})])
    assert backlog.due(0) == [] and backlog.due(2) == [("k", {"id": 1})] and len(backlog.items) == 1


def test_in_process_judging_is_paired_by_seed(tiny_model_dir):
    """The online benchmark's controls judge several models on the same planned requests: the same
    seed gives the same users, tasks and judging draws, and the same model the same outcomes."""
    from offline_rl.tasks import generate_tasks
    from policy.loading import load_policy
    from realtime_rl.simusers import build_population, judge_in_process

    policy = load_policy(tiny_model_dir)
    users = build_population(_realistic())
    tasks = generate_tasks(0, 0.2).train

    def judge(seed: int, t: float = 1.0):
        return judge_in_process(policy.model, policy.tokenizer, users, tasks, n_requests=24, temperature=t,
                                max_tokens=8, seed=seed, batch=10)

    first = judge(3)
    assert len(first) == 24 and {k for k, _ in first} <= {u.kind for u in users}
    assert judge(3) == first  # same seed, same model: the same verdicts
    assert [k for k, _ in judge(3, t=0.5)] == [k for k, _ in first]  # another temperature: the same users
    assert [k for k, _ in judge(4)] != [k for k, _ in first]
