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
