"""The shared model core: tiny model, loading, sampling, teacher-forced log-probs."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offline_rl.corpus import build_default_model
from policy.config import TinyModelSettings
from policy.loading import ModelLoadError, load_policy
from policy.logprobs import sequence_logprobs
from policy.sampling import ContextTooLong, SamplingParams, generate, generate_ids

PROMPTS = [
    "# f(0)=7 f(1)=15 f(2)=23 f(8)=71\ndef f(x): return ",
    "# f(3)=3\ndef f(x): return ",
    "def f(x): return x*",
]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    return load_policy(tiny_model_dir)


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.iterdir()):
        if f.suffix in {".safetensors", ".json"}:
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def test_tiny_model_is_deterministic_and_small(tmp_path):
    cfg = TinyModelSettings(corpus_examples=1000, seed=3)
    a, b = build_default_model(tmp_path / "a", cfg), build_default_model(tmp_path / "b", cfg)
    assert _digest(a) == _digest(b)
    c = build_default_model(tmp_path / "c", cfg.model_copy(update={"seed": 4}))
    assert _digest(a) != _digest(c)
    n = sum(p.numel() for p in load_policy(a).model.parameters())
    assert 1_000_000 <= n <= 10_000_000


def test_tokenizer_round_trips_code_and_splits_digits(policy):
    tok = policy.tokenizer
    text = PROMPTS[0] + "x * 8 + 7\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert [tok.decode([i]) for i in tok("1234", add_special_tokens=False)["input_ids"]] == ["1", "2", "3", "4"]


def test_transformers_loads_it_unchanged(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir, local_files_only=True)
    out = model.generate(**tok(["def f(x):"], return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert out.shape[1] > 3


def test_incomplete_directory_is_a_clear_error(tmp_path, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="not found"):
        load_policy(tmp_path / "nothing")
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"missing \*\.safetensors weights, a tokenizer"):
        load_policy(partial)


@pytest.mark.parametrize("params", [
    SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=0),
    SamplingParams(n=2, temperature=0.7, top_p=0.8, top_k=20, max_new_tokens=12, stop=["\n"], seed=1),
])
def test_recompute_matches_sampler_logprobs_fp32(policy, params):
    groups = generate(policy.model, policy.tokenizer, PROMPTS, params)
    flat = [s for g in groups for s in g]
    assert len({len(s.token_ids) for s in flat} | {len(s.prompt_token_ids) for s in flat}) > 1  # ragged batch
    rec = sequence_logprobs(policy.model, [s.prompt_token_ids for s in flat], [s.token_ids for s in flat],
                            with_entropy=True, pad_token_id=policy.tokenizer.pad_token_id)
    for i, s in enumerate(flat):
        n = len(s.token_ids)
        assert rec.mask[i].sum().item() == n
        diff = (rec.logprobs[i, :n] - torch.tensor(s.logprobs)).abs().max().item()
        assert diff <= 1e-4, diff
        assert (rec.entropy[i, :n] > 0).all()


def test_shared_prompt_recompute_equals_the_plain_layout_values_and_gradients(tiny_model_dir):
    # G completions per prompt (ragged prompts, ragged completions, one empty): running each distinct
    # prompt once and copying its KV cache must give the plain layout's log-probs, entropies and grads.
    model = load_policy(tiny_model_dir).model.train()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    rows_p, rows_c = [], []
    for i, pr in enumerate(prompts):
        for j in range(4):
            rows_p.append(pr)
            rows_c.append([20 + (i * 7 + j * 3 + t) % 200 for t in range(1 + (i + j) % 5)])
    rows_c[5] = []

    def run(share: bool):
        model.zero_grad()
        tl = sequence_logprobs(model, rows_p, rows_c, grad=True, with_entropy=True, share_prompts=share)
        (tl.logprobs.sum() + 0.1 * tl.entropy.sum()).backward()
        return tl, torch.cat([q.grad.flatten() for q in model.parameters()])

    plain, g_plain = run(False)
    shared, g_shared = run(True)
    assert torch.equal(plain.mask, shared.mask)
    assert (plain.logprobs - shared.logprobs).abs().max().item() < 1e-5
    assert (plain.entropy - shared.entropy).abs().max().item() < 1e-5
    assert (g_plain - g_shared).abs().max().item() < 1e-5 * max(1.0, g_plain.abs().max().item())
    assert g_plain.abs().max().item() > 0


def test_rows_sharing_a_prompt_share_its_prefill_and_sample_the_same(policy):
    # GRPO groups: 4 rows per prompt. One prefill per distinct prompt, KV copied, must sample exactly
    # what each row samples on its own with the same seed.
    tok = policy.tokenizer
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS for _ in range(4)]
    params = [SamplingParams(temperature=1.0, max_new_tokens=12, stop=["\n"], seed=i) for i in range(len(ids))]
    kw = {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "decode": tok.decode}
    together = generate_ids(policy.model, ids, params, **kw)
    alone = [generate_ids(policy.model, [x], [p], **kw)[0] for x, p in zip(ids, params, strict=True)]
    assert len({tuple(s.token_ids) for s in together}) > 1
    for a, b in zip(together, alone, strict=True):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0.0) < 1e-4


def test_sampling_logprobs_follow_the_distribution_used(policy):
    plain = generate(policy.model, policy.tokenizer, PROMPTS[:1], SamplingParams(n=2, max_new_tokens=6, seed=5))
    for s in plain[0]:
        assert s.sampling_logprobs == pytest.approx(s.logprobs, abs=1e-5)
    top1 = generate(policy.model, policy.tokenizer, PROMPTS[:1], SamplingParams(max_new_tokens=6, top_k=1, seed=5))
    assert all(abs(x) < 1e-6 for x in top1[0][0].sampling_logprobs)
    greedy = generate(policy.model, policy.tokenizer, PROMPTS[:1], SamplingParams(max_new_tokens=6, temperature=0))
    assert greedy[0][0].token_ids == top1[0][0].token_ids


def test_seed_reproducible_and_per_row_params(policy):
    p = SamplingParams(n=2, max_new_tokens=8, seed=11)
    a = generate(policy.model, policy.tokenizer, PROMPTS, p)
    b = generate(policy.model, policy.tokenizer, PROMPTS, p)
    assert [s.token_ids for g in a for s in g] == [s.token_ids for g in b for s in g]
    ids = [policy.tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]] * 2
    rows = generate_ids(policy.model, ids, [SamplingParams(temperature=0, max_new_tokens=5),
                                            SamplingParams(temperature=1.0, max_new_tokens=9, seed=2)],
                        eos_token_id=policy.tokenizer.eos_token_id, pad_token_id=policy.tokenizer.pad_token_id)
    alone = generate_ids(policy.model, ids[:1], [SamplingParams(temperature=0, max_new_tokens=5)],
                         eos_token_id=policy.tokenizer.eos_token_id, pad_token_id=policy.tokenizer.pad_token_id)
    assert rows[0].token_ids == alone[0].token_ids  # batching with other rows changes nothing
    assert len(rows[0].token_ids) <= 5 and len(rows[1].token_ids) <= 9


def test_stop_strings_and_finish_reasons(policy):
    samples = generate(policy.model, policy.tokenizer, PROMPTS[:2],
                       SamplingParams(n=8, max_new_tokens=24, stop=["x", "1"], seed=0))
    reasons = set()
    for s in (s for g in samples for s in g):
        reasons.add(s.finish_reason)
        assert "x" not in s.text and "1" not in s.text
        full = policy.tokenizer.decode(s.token_ids)
        if s.finish_reason == "stop":
            assert full.startswith(s.text) and len(full) > len(s.text)
        else:
            assert len(s.token_ids) == 24
    assert "stop" in reasons


def test_context_limit_is_a_clear_error(policy):
    long_prompt = [5] * (policy.model.config.max_position_embeddings - 2)
    with pytest.raises(ContextTooLong, match="exceeds the model context"):
        generate(policy.model, policy.tokenizer, [long_prompt], SamplingParams(max_new_tokens=8))


def test_cli_init_model_then_sample(tmp_path):
    env_cfg = tmp_path / "rtrl.toml"
    env_cfg.write_text(f'[model]\ndir = "{tmp_path / "m"}"\n[tiny]\ncorpus_examples = 500\n')
    run = [sys.executable, "-m", "rtrl"]
    subprocess.run(run + ["init-model", "-c", str(env_cfg)], check=True, capture_output=True)
    again = subprocess.run(run + ["init-model", "-c", str(env_cfg)], capture_output=True, text=True)
    assert again.returncode == 1 and "--force" in again.stderr
    out = subprocess.run(run + ["sample", "def f(x): return ", "-n", "2", "--seed", "1", "--json",
                                "--max-tokens", "5", "-c", str(env_cfg)],
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()
    rows = [json.loads(line) for line in out]
    assert len(rows) == 2 and all(len(r["logprobs"]) == len(r["token_ids"]) for r in rows)


def test_concurrent_loads_in_one_process_each_get_the_real_weights(tiny_model_dir):
    """A gateway swapping versions while the updater loads its policy: transformers patches process-wide
    state while it builds a model, so unserialised concurrent loads leave weight tying switched off and
    later loads fail. Every load must come back tied, with the saved weights, and leave nothing patched."""
    import threading

    from transformers.modeling_utils import PreTrainedModel

    from policy.loading import load_model

    originals = (PreTrainedModel.tie_weights, PreTrainedModel.init_weights, torch.nn.init.normal_)
    reference = load_model(tiny_model_dir).state_dict()
    errors: list[BaseException] = []
    mismatched: list[str] = []

    def loads() -> None:
        try:
            for _ in range(12):
                model = load_model(tiny_model_dir)
                if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
                    mismatched.append("lm_head not tied to the embeddings")
                for name, tensor in model.state_dict().items():
                    if not torch.equal(tensor, reference[name]):
                        mismatched.append(name)
        except BaseException as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=loads) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:2]
    assert not mismatched, mismatched[:5]
    assert (PreTrainedModel.tie_weights, PreTrainedModel.init_weights, torch.nn.init.normal_) == originals
