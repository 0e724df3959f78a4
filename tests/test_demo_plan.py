"""The demo's plan and resumable state: which offline environment, which sizes, what a switch redoes."""

from __future__ import annotations

import pytest

from rtrl.demo import STAGES, DemoError, DemoPlan, DemoState


def test_plan_trains_offline_on_what_the_users_ask_by_default():
    full, fast, agent = DemoPlan.for_mode(False), DemoPlan.for_mode(True), DemoPlan.for_mode(False, "agent")
    assert full.offline_preset == fast.offline_preset == "functions" and agent.offline_preset is None
    assert full.releases >= 3 and full.min_feedback > fast.min_feedback
    assert (agent.releases, agent.min_feedback) == (full.releases, full.min_feedback)
    with pytest.raises(DemoError, match="unknown demo environment 'repo'"):
        DemoPlan.for_mode(False, "repo")


def _finished(tmp_path, **data) -> DemoState:
    state = DemoState(tmp_path / "state.json")
    state.data.update(data)
    for stage in STAGES:
        state.data["stages"][stage] = {"seconds": 1.0}
    state.data["online_started_at"] = "2026-01-01T00:00:00+00:00"
    return state


def test_switching_environment_trains_again_from_midtraining(tmp_path):
    state = _finished(tmp_path, env="functions", fast=False)
    lines: list[str] = []
    state.select("agent", False, lines.append)
    assert list(state.data["stages"]) == ["model"] and "online_started_at" not in state.data
    assert "from functions to agent" in lines[0]
    # Recorded on disk: a resumed run sees the agent environment's state.
    assert DemoState(tmp_path / "state.json").data["env"] == "agent"


def test_a_state_without_environment_is_the_agent_path(tmp_path):
    state = _finished(tmp_path, fast=False)
    state.select("functions", False, lambda _: None)
    assert list(state.data["stages"]) == ["model"]


def test_switching_fast_redoes_the_online_stage(tmp_path):
    state = _finished(tmp_path, env="functions", fast=True)
    state.select("functions", False, lambda _: None)
    assert list(state.data["stages"]) == list(STAGES[:STAGES.index("online")])
    assert "online_started_at" not in state.data


def test_the_same_mode_keeps_every_finished_stage(tmp_path):
    state = _finished(tmp_path, env="agent", fast=False)
    state.select("agent", False, lambda _: None)
    assert list(state.data["stages"]) == list(STAGES) and state.data["online_started_at"]
