"""The release gate against a deliberately broken candidate (the bench's sabotage hook on the real
update cycle): a trained candidate replaced by a regressed checkpoint, one that learnt the opposite of
what users want, is refused and production stays; the same cycle without sabotage releases. (The
weight-perturbation sabotage needs a trained model for the offline check to see it: `rtrl bench
online`'s sabotage cell.)"""

from __future__ import annotations

from benchmarks.online import _sabotage
from realtime_rl.cycle import run_update_cycle
from realtime_rl.release import RegistryStore
from tests.rtrl_update_fixtures import make_world, sqlite_url  # noqa: F401


def test_regressed_candidate_is_refused_and_production_stays(tmp_path, sqlite_url, tiny_model_dir):  # noqa: F811
    w = make_world(tmp_path, sqlite_url, tiny_model_dir)
    store = RegistryStore(w.settings)
    inverted = w.settings.model_copy(deep=True)
    inverted.update = inverted.update.model_copy(update={"reward_accept": -1.0, "reward_reject": 1.0})
    wrong = run_update_cycle(inverted, log=lambda _m: None)
    assert wrong.status == "refused" and wrong.candidate_version
    tamper = _sabotage(store.materialize(wrong.candidate_version), seed=0)
    swapped = run_update_cycle(w.settings, log=lambda _m: None, force=True, tamper=lambda m: tamper(2, m))
    assert swapped.metrics["tampered"] == "regressed checkpoint"
    assert swapped.status == "refused", swapped.reason
    assert swapped.gate["checks"]["ope"] is False and store.production() == w.production
    honest = run_update_cycle(w.settings, log=lambda _m: None, force=True, tamper=lambda m: tamper(1, m))
    assert not honest.metrics.get("tampered")
    assert honest.status == "released", honest.reason
