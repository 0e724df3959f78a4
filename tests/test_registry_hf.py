"""A version rebuilt from a snapshot plus a delta chain loads in transformers and in vLLM and generates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from policy.registry import Registry

PROMPT = "# f(0)=7 f(1)=15 f(2)=23 f(8)=71\ndef f(x): return "


def _perturbed(model, seed: int, scale: float = 2e-2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.sign(torch.randn(p.shape, generator=g)))


@pytest.fixture(scope="module")
def chain(tmp_path_factory, tiny_model_dir):
    """v0 = the tiny model dir; v1..v3 = deltas from state dicts of successively updated weights."""
    from policy.loading import load_policy

    tmp = tmp_path_factory.mktemp("registry_hf")
    reg = Registry(tmp / "registry", cache_dir=tmp / "cache", snapshot_every=10)
    v0 = reg.publish(tiny_model_dir, stage="init")
    policy = load_policy(tiny_model_dir)
    model, tok = policy.model, policy.tokenizer
    # publish exactly the tensors save_pretrained writes (the tied lm_head is not a separate tensor)
    names = set(reg.load_state_dict(v0.id))
    ids = [v0.id]
    for step in range(3):
        _perturbed(model, step)
        sd = {k: v for k, v in model.state_dict().items() if k in names}
        ids.append(reg.publish(sd, parent=ids[-1], stage="test", metrics={"step": step}).id)
    enc = tok(PROMPT, return_tensors="pt")
    with torch.no_grad():
        ref_logits = model(**enc).logits
        ref_tokens = model.generate(**enc, do_sample=False, max_new_tokens=8, pad_token_id=tok.pad_token_id)
    return {"reg": reg, "tmp": tmp, "ids": ids, "ref_logits": ref_logits, "ref_tokens": ref_tokens,
            "enc": enc, "tokenizer": tok, "base": tiny_model_dir}


def test_delta_chain_materialises_and_loads_in_transformers(chain):
    from policy.loading import load_policy

    reg, ids = chain["reg"], chain["ids"]
    assert [reg.info(v).kind for v in ids] == ["snapshot", "delta", "delta", "delta"]
    cold = Registry(reg.url, cache_dir=chain["tmp"] / "cold_cache", memory_cache=0)
    path = cold.materialize(ids[-1])
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).read_bytes() == (Path(chain["base"]) / name).read_bytes()
    policy = load_policy(path)
    with torch.no_grad():
        logits = policy.model(**chain["enc"]).logits
        tokens = policy.model.generate(**chain["enc"], do_sample=False, max_new_tokens=8,
                                       pad_token_id=policy.tokenizer.pad_token_id)
    assert torch.equal(logits, chain["ref_logits"])  # bit-identical weights give bit-identical logits
    assert torch.equal(tokens, chain["ref_tokens"])
    assert tokens.shape[1] > chain["enc"]["input_ids"].shape[1]
    # hot-swap path: the in-memory state dict loads into the running model unchanged
    sd = cold.load_state_dict(ids[-1])
    missing, unexpected = policy.model.load_state_dict(sd, strict=False)
    assert not unexpected and all("lm_head" in k for k in missing)


_VLLM = r"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], enforce_eager=True, dtype="float32", max_model_len=256, seed=0)
out = llm.generate([sys.argv[2]], SamplingParams(temperature=0.0, max_tokens=8, logprobs=0))[0].outputs[0]
print(json.dumps({"token_ids": list(out.token_ids),
                  "logprobs": [next(iter(lp.values())).logprob for lp in out.logprobs]}))
"""


@pytest.mark.vllm
def test_delta_chain_materialises_and_generates_in_vllm(chain):
    from policy.loading import load_policy
    from policy.logprobs import sequence_logprobs

    reg, ids = chain["reg"], chain["ids"]
    path = Registry(reg.url, cache_dir=chain["tmp"] / "vllm_cache", memory_cache=0).materialize(ids[-1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("RTRL_")}
    env.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    # its own process: in-process vLLM replaces torch's thread settings and global seed
    proc = subprocess.run([sys.executable, "-c", _VLLM, str(path), PROMPT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["token_ids"], "vLLM generated nothing"
    prompt_ids = chain["enc"]["input_ids"][0].tolist()
    # vLLM's log-probs of its tokens match transformers on the rebuilt version, not on the base
    got = torch.tensor(out["logprobs"])
    for model_dir, should_match in ((path, True), (chain["base"], False)):
        model = load_policy(model_dir).model
        lp = sequence_logprobs(model, [prompt_ids], [out["token_ids"]]).logprobs[0, :len(out["token_ids"])]
        err = float((lp - got).abs().max())
        assert (err < 1e-3) == should_match, (model_dir, err)
