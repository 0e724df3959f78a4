"""`rtrl bench demo`'s record, from the online summary the demo writes (the run itself is test_demo's)."""

from __future__ import annotations

from benchmarks.demo import _curve


def _version(v, released, rate, ci, offline, decision="released"):
    return {"version": v, "released": released, "decision": decision if released else "refused",
            "accept_rate": rate, "ci": ci, "offline_pass_at_1": offline, "per_kind": {"style": {"accept_rate": rate}}}


def test_curve_is_first_served_to_last_release():
    online = {"versions": [_version("a", True, None, None, 0.40, "offline"),  # passed the gate, superseded before serving
                           _version("b", True, 0.45, [0.43, 0.47], 0.52, "offline"),
                           _version("c", False, None, None, 0.44),
                           _version("d", True, 0.58, [0.55, 0.61], 0.50)],
              "relative_gain": 0.2889, "ci_separated": True, "ope_mae": 0.03,
              "gate": {"decisions": 2, "refused": 1, "refusal_reasons": ["offline"]}}
    c = _curve(online, gate=0.3)
    assert (c["releases"], c["first_accept"], c["last_accept"], c["last_ci"]) == (1, 0.45, 0.58, [0.55, 0.61])
    assert c["offline_pass_at_1"] == [0.40, 0.52, 0.50] and c["released_at_or_above_gate"] is True
    assert c["per_kind_first"] == {"style": {"accept_rate": 0.45}} and c["gate_refused"] == 1
    assert _curve(online, gate=0.51)["released_at_or_above_gate"] is False
