"""The torch engine and the shared micro-batcher, without HTTP."""

from __future__ import annotations

import pytest
from serving_fixtures import PROMPT, gateway_settings

from policy.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    from serving.engines.torch_engine import TorchEngine
    from serving.versions import DirSource

    settings = gateway_settings(tmp_path_factory.mktemp("eng"), tiny_model_dir, batch_window_ms=100, max_batch=8,
                                max_queue=12)
    eng = TorchEngine(settings)
    eng.load(DirSource(tiny_model_dir).current("production"))
    yield eng
    eng.close()


def test_rows_with_different_parameters_share_one_generate_call(engine):
    tok = engine.tokenizer
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in (PROMPT, "def g(x): return ", "x = ")]
    params = [SamplingParams(max_new_tokens=6, temperature=0, seed=None),
              SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, seed=1),
              SamplingParams(max_new_tokens=5, temperature=1.3, top_k=20, seed=2)]
    alone = [engine.generate_now([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    before = engine.batches_run
    futures = [engine.submit([p], [q]) for p, q in zip(prompts, params, strict=True)]
    together = [f.result(60)[0] for f in futures]
    assert engine.batches_run - before == 1  # merged within the 100 ms window
    for a, b, q in zip(alone, together, params, strict=True):
        assert a.sample.token_ids == b.sample.token_ids
        assert len(b.sample.token_ids) <= q.max_new_tokens
        assert b.sample.logprobs == pytest.approx(a.sample.logprobs, abs=1e-4)
        assert b.version == a.version and b.engine_ms > 0


def test_max_batch_splits_and_queue_bound_refuses(engine):
    from serving.engines.base import Overloaded

    tok = engine.tokenizer
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    before = engine.batches_run
    futs = [engine.submit([ids] * 4, [SamplingParams(max_new_tokens=2, seed=i * 10 + k) for k in range(4)])
            for i in range(3)]
    with pytest.raises(Overloaded):
        engine.submit([ids], [SamplingParams(max_new_tokens=2)])  # 12 rows waiting: the queue is full
    assert all(len(f.result(60)) == 4 for f in futs)
    assert engine.batches_run - before == 2  # 12 rows with max_batch 8: 8 + 4


def test_close_fails_waiting_requests_cleanly(tmp_path, tiny_model_dir):
    from serving.engines.base import EngineClosed
    from serving.engines.torch_engine import TorchEngine
    from serving.versions import DirSource

    eng = TorchEngine(gateway_settings(tmp_path, tiny_model_dir, batch_window_ms=0))
    with pytest.raises(EngineClosed):
        eng.submit([[1, 2]], [SamplingParams()]).result(10)  # nothing loaded yet
    eng.load(DirSource(tiny_model_dir).current("production"))
    assert eng.ready
    eng.close()
    with pytest.raises(EngineClosed):
        eng.submit([[1, 2]], [SamplingParams()])
