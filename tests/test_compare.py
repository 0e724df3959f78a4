"""The learning comparison (offline_rl/compare.py) on hand-made results: each model is judged at its own
best temperature, and gains are paired per task, so a gain that a lower temperature gives is zero."""

from __future__ import annotations

import pytest

from offline_rl.compare import Comparison, compare_models, grid_temperatures
from offline_rl.evaluate import EvalResult, GridResult
from rtrl.config import load_settings


def _result(t: float, per_task: dict[str, float]) -> EvalResult:
    p = sum(per_task.values()) / len(per_task)
    return EvalResult(pass_at_1=p, pass_at_k={1: p}, n_tasks=len(per_task), samples=4, mean_reward=p,
                      mean_test_fraction=p, temperature=t, ci95=(p - 0.1, p + 0.1), per_task=per_task)


def test_each_model_is_judged_at_its_best_temperature():
    # The start is best cold (T=0.2); the "trained" model equals the start's cold results at T=1.0
    # and is no better at T=0.2: sharpening, so no gain over the start at the best temperature.
    start = GridResult({1.0: _result(1.0, {"a": 0.25, "b": 0.25}), 0.2: _result(0.2, {"a": 0.75, "b": 0.5})})
    sharp = GridResult({1.0: _result(1.0, {"a": 0.75, "b": 0.5}), 0.2: _result(0.2, {"a": 0.75, "b": 0.5})})
    better = GridResult({1.0: _result(1.0, {"a": 1.0, "b": 1.0}), 0.2: _result(0.2, {"a": 1.0, "b": 0.75})})
    cmp = Comparison(grids={"midtrain": start, "sharp": sharp, "grpo": better}, temperatures=[1.0, 0.2],
                     serving_t=1.0, subject="grpo", n_tasks=2, samples=4)
    out = cmp.to_dict()
    assert out["best_t"]["midtrain"]["t"] == 0.2 and out["best_t"]["grpo"]["t"] == 1.0
    assert out["gains"]["midtrain"]["gain"] == pytest.approx(1.0 - 0.625)
    assert out["gains"]["sharp"]["tasks"] == 2 and set(out["gains"]) == {"midtrain", "sharp"}
    assert out["subject_at_serving_t"] == 1.0
    sharp_vs_start = Comparison(grids={"midtrain": start, "sharp": sharp}, temperatures=[1.0, 0.2],
                                serving_t=1.0, subject="sharp", n_tasks=2, samples=4).to_dict()
    assert sharp_vs_start["gains"]["midtrain"]["gain"] == 0.0


def test_grid_and_subject_are_checked():
    s = load_settings()
    s.eval.temperatures, s.eval.temperature = [0.2, 0.7], 1.0
    assert grid_temperatures(s) == [1.0, 0.7, 0.2]
    assert grid_temperatures(s, [0.5]) == [1.0, 0.5]
    with pytest.raises(ValueError, match="subject"):
        compare_models(s, {"midtrain": "nowhere"}, "grpo")
