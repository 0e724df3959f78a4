"""Mixture-of-experts routes: the wire form, capture in the sampler, replay in the teacher-forced recompute."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from policy.loading import load_policy
from policy.logprobs import sequence_logprobs
from policy.routes import RouteFormatError, RouteGeometry, Routes, extend, geometry_from_config, route_problem
from policy.routing import RouteMismatch, geometry_of, route_session
from policy.sampling import SamplingParams, generate
from policy.vllm_moe import engine_kwargs, route_mode, routes_from_output
from rtrl.cli import app

PROMPTS = ["# f(0)=7 f(1)=15 f(2)=23 f(8)=71\ndef f(x): return ", "def f(x): return x*"]


@pytest.fixture(scope="module")
def moe(tiny_moe_dir):
    return load_policy(tiny_moe_dir)


@pytest.fixture(scope="module")
def sampled(moe):
    groups = generate(moe.model, moe.tokenizer, PROMPTS, SamplingParams(n=3, max_new_tokens=12, seed=3))
    return [s for g in groups for s in g]


def test_wire_form_round_trips_and_is_compact():
    rng = np.random.default_rng(0)
    for experts, top_k in ((2, 1), (4, 2), (5, 2), (64, 8), (300, 4)):
        ids = np.stack([rng.permutation(experts)[:top_k] for _ in range(37 * 3)]).reshape(37, 3, top_k)
        r = Routes(ids, experts)
        wire = json.loads(json.dumps(r.to_wire()))
        assert Routes.from_wire(wire).same_as(r)
    tiny = Routes(np.zeros((100, 4, 2), dtype=np.uint8), 4).to_wire()
    per_token_layer = len(json.dumps(tiny, separators=(",", ":"))) / (100 * 4)
    assert per_token_layer <= 0.8  # 4 bits an entry: 0.67 bytes after base64's 4/3, plus the object's keys
    for bad, why in (({"shape": [2, 1, 1], "experts": 4}, "not a route record"),
                     ({"shape": [2, 1], "experts": 4, "data": ""}, "shape must be"),
                     ({"shape": [5, 1, 1], "experts": 4, "data": "AA=="}, "1 bytes of data"),
                     ({"shape": [1, 1, 1], "experts": 4, "data": "not base64!"}, "not a route record")):
        with pytest.raises(RouteFormatError, match=why):
            Routes.from_wire(bad)


def test_route_problems_name_what_and_where():
    g = RouteGeometry(2, 4, 2, ("model.layers.0.mlp.gate", "model.layers.1.mlp.gate"))
    ok = np.array([[[0, 1], [2, 3]]] * 5)
    assert route_problem(Routes(ok, 4), g, 5) is None
    assert "cover 5 positions, the sequence has 6" in route_problem(Routes(ok, 4), g, 6)
    assert "carry 1 MoE layers, the model has 2" in route_problem(Routes(ok[:, :1], 4), g, 5)
    assert "routes give 1 experts per token, its router picks 2" in route_problem(Routes(ok[:, :, :1], 4), g, 5)
    bad = ok.copy()
    bad[3, 1, 0] = 7  # a record encoded for 8 experts carries an id the 4-expert model does not have
    assert route_problem(Routes(bad, 8), g, 5) == ("MoE layer 1 (model.layers.1.mlp.gate): expert id 7 at "
                                                   "position 3 is out of range (4 experts)")
    with pytest.raises(RouteFormatError, match="does not fit a record of 4 experts"):
        Routes(bad, 4).to_wire()
    dup = ok.copy()
    dup[2, 1] = [3, 3]
    assert route_problem(Routes(dup, 4), g, 5) == "MoE layer 1 (model.layers.1.mlp.gate): position 2 names an expert twice"
    assert route_problem(Routes(ok, 4), None, 5) == "routes given for a model without MoE layers"
    first, more = Routes(ok[:3], 4), Routes(np.concatenate([ok[:3] * 0, ok[3:]]), 4)
    assert extend(first, more).same_as(Routes(ok, 4))


def test_geometry_from_config_matches_the_model(moe, tiny_moe_dir, tiny_model_dir):
    g = geometry_of(moe.model)
    assert (g.layers, g.experts, g.top_k) == (4, 4, 2)
    assert g.names == tuple(f"model.layers.{i}.mlp.gate" for i in range(4))
    cfg = json.loads((tiny_moe_dir / "config.json").read_text())
    assert geometry_from_config(cfg) == RouteGeometry(4, 4, 2)
    assert geometry_from_config({**cfg, "mlp_only_layers": [1], "decoder_sparse_step": 1}).layers == 3
    assert geometry_from_config(json.loads((tiny_model_dir / "config.json").read_text())) is None


def test_sampler_records_every_consumed_position_and_replay_reproduces_its_logprobs(moe, sampled):
    for s in sampled:
        assert s.routes.shape == (len(s.prompt_token_ids) + len(s.token_ids) - 1, 4, 2)
        # The sampler's routes are the ones a single teacher-forced pass over the same tokens chooses.
        with route_session(moe.model, capture=True) as rs:
            moe.model(input_ids=torch.tensor([(s.prompt_token_ids + s.token_ids)[:-1]]))
            live = rs.live().numpy()
        assert (np.sort(live, 2) == np.sort(s.routes.ids, 2)).all()
    prompts, comps = [s.prompt_token_ids for s in sampled], [s.token_ids for s in sampled]
    for share in (False, True):
        tl = sequence_logprobs(moe.model, prompts, comps, routes=[s.routes for s in sampled], share_prompts=share)
        gap = max((tl.logprobs[i, :len(s.token_ids)] - torch.tensor(s.logprobs)).abs().max().item()
                  for i, s in enumerate(sampled))
        assert gap <= 1e-5, (share, gap)
        assert tl.route_stats.pairs > 0 and tl.route_stats.pairs_differ == 0


def test_replay_forces_the_recorded_experts_and_the_router_still_learns(moe, sampled):
    s = sampled[0]
    forced = (s.routes.ids.astype(np.int64) + 1) % 4  # every entry another expert, still two distinct ones
    tampered = Routes(forced, 4)
    seen: list[torch.Tensor] = []
    hook = moe.model.model.layers[2].mlp.experts.register_forward_pre_hook(lambda _m, a: seen.append(a[1].clone()))
    try:
        moe.model.train()
        tl = sequence_logprobs(moe.model, [s.prompt_token_ids], [s.token_ids], routes=[tampered], grad=True,
                               share_prompts=False)
        tl.logprobs.sum().backward()
    finally:
        hook.remove()
        moe.model.eval()
    # The experts of layer 2 computed exactly the recorded choice on every recorded position.
    n = tampered.positions
    assert torch.equal(seen[0][:n].cpu(), torch.from_numpy(forced[:, 2]))
    assert tl.route_stats.rate > 0.9
    gate = moe.model.model.layers[2].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    moe.model.zero_grad(set_to_none=True)
    # Compared but not forced: the log-probs are the live routing's, the sampler's own.
    free = sequence_logprobs(moe.model, [s.prompt_token_ids], [s.token_ids], routes=[tampered], replay=False)
    assert torch.allclose(free.logprobs[0], torch.tensor(s.logprobs), atol=1e-5)
    assert not torch.allclose(tl.logprobs[0].detach(), free.logprobs[0], atol=1e-3)


def test_routes_that_do_not_fit_are_refused_naming_the_layer(moe, sampled, tiny_model_dir):
    s = sampled[1]
    args = ([s.prompt_token_ids], [s.token_ids])
    with pytest.raises(RouteMismatch, match="row 0: routes carry 3 MoE layers, the model has 4"):
        sequence_logprobs(moe.model, *args, routes=[Routes(s.routes.ids[:, :3], 4)])
    bad = s.routes.ids.copy()
    bad[4, 1, 1] = 3 if bad[4, 1, 0] != 3 else 2
    bad[5, 1, 0] = 9
    with pytest.raises(RouteMismatch, match=r"row 0: MoE layer 1 \(model.layers.1.mlp.gate\): expert id 9 at "
                                            r"position 5 is out of range \(4 experts\)"):
        sequence_logprobs(moe.model, *args, routes=[Routes(bad, 16)])
    with pytest.raises(RouteMismatch, match="row 0: routes cover"):
        sequence_logprobs(moe.model, [s.prompt_token_ids], [s.token_ids[:-1]], routes=[s.routes])
    dense = load_policy(tiny_model_dir)
    assert generate(dense.model, dense.tokenizer, PROMPTS[:1], SamplingParams(max_new_tokens=3))[0][0].routes is None
    with pytest.raises(RouteMismatch, match="without MoE layers"):
        sequence_logprobs(dense.model, *args, routes=[s.routes])


def test_cli_init_model_moe(tmp_path):
    cfg = tmp_path / "rtrl.toml"
    cfg.write_text(f'[model]\ndir = "{tmp_path / "m"}"\n[tiny]\ncorpus_examples = 500\n')
    result = CliRunner().invoke(app, ["init-model", "--moe", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    assert "4 MoE layers of 4 experts (top-2)" in result.output
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["router_aux_loss_coef"] > 0


def test_vllm_routed_experts_output_becomes_the_moe_layers_record(tiny_moe_dir, tiny_model_dir, monkeypatch):
    """The CUDA path's pieces that run without a GPU: which path a model gets, the engine options, and the
    record made from vLLM's ``routed_experts`` ([positions, decoder layers, top_k], dense layers included)."""
    assert route_mode(tiny_moe_dir, "cuda") == "output" and route_mode(tiny_moe_dir, "cpu") == "tap"
    assert route_mode(tiny_model_dir, "cuda") is None
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # restored after the test: engine_kwargs sets it
    assert engine_kwargs("output") == {"enable_return_routed_experts": True, "enable_prefix_caching": True}
    assert engine_kwargs("tap") == {"enable_prefix_caching": False} and engine_kwargs(None) == {}
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"  # the output exists on vLLM's V2 runner only
    config = {"num_hidden_layers": 4, "mlp_only_layers": [1], "num_experts": 8, "num_experts_per_tok": 2}
    out = np.random.default_rng(0).integers(0, 8, size=(10, 4, 2)).astype(np.int32)
    r = routes_from_output(out, config, positions=9)
    assert r.shape == (9, 3, 2) and r.experts == 8 and r.ids.dtype == np.uint8
    assert (r.ids == out[:9][:, [0, 2, 3]]).all()  # layer 1 is dense: no router, no row
    assert routes_from_output(out, config, positions=11) is None  # fewer rows than consumed positions
    assert routes_from_output(None, config, positions=9) is None
