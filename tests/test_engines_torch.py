"""The torch engine and the shared micro-batcher, without HTTP."""

from __future__ import annotations

import pytest
from serving_fixtures import PROMPT, engine_held, gateway_settings, make_versions

from policy.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tmp_path_factory, tiny_model_dir):
    from serving.engines import create_engine
    from serving.versions import DirSource

    settings = gateway_settings(tmp_path_factory.mktemp("eng"), tiny_model_dir, batch_window_ms=100, max_batch=8,
                                max_queue=12)
    eng = create_engine(settings)
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
    from serving.engines import create_engine
    from serving.engines.base import EngineClosed
    from serving.versions import DirSource

    eng = create_engine(gateway_settings(tmp_path, tiny_model_dir, batch_window_ms=0))
    with pytest.raises(EngineClosed):
        eng.submit([[1, 2]], [SamplingParams()]).result(10)  # nothing loaded yet
    eng.load(DirSource(tiny_model_dir).current("production"))
    assert eng.ready
    eng.close()
    with pytest.raises(EngineClosed):
        eng.submit([[1, 2]], [SamplingParams()])
    assert eng._proc.exitcode == 0  # the child left cleanly (no abort in native teardown)


def test_engine_process_and_in_thread_modes_generate_the_same(engine, tmp_path, tiny_model_dir):
    """The default runs the models in a child process; the in-thread mode must give the same samples."""
    from serving.engines import create_engine
    from serving.engines.torch_engine import TorchEngine
    from serving.engines.torch_process import ProcessTorchEngine
    from serving.versions import DirSource

    assert engine.settings.serving.engine_process and engine._proc.is_alive()
    assert isinstance(engine, ProcessTorchEngine)
    local = create_engine(gateway_settings(tmp_path, tiny_model_dir, batch_window_ms=0, engine_process=False))
    try:
        assert type(local) is TorchEngine and not hasattr(local, "loop")
        local.load(DirSource(tiny_model_dir).current("production"))
        ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        params = [SamplingParams(max_new_tokens=6, seed=3), SamplingParams(max_new_tokens=4, temperature=0.7,
                                                                           top_k=10, stop=["\n"], seed=4)]
        a = engine.generate_now([ids, ids], params, timeout=60)
        b = local.generate_now([ids, ids], params, timeout=60)
        assert [g.sample.token_ids for g in a] == [g.sample.token_ids for g in b]
        assert [g.sample.text for g in a] == [g.sample.text for g in b]
        for x, y in zip(a, b, strict=True):
            assert x.sample.logprobs == pytest.approx(y.sample.logprobs, abs=1e-5)
            assert x.version == y.version
        assert engine.context_len == local.context_len and len(engine.tokenizer) == len(local.tokenizer)
    finally:
        local.close()


def test_engine_process_errors_and_swaps(tmp_path, tiny_model_dir):
    """A generate error in the child reaches the caller with its type; swaps free the replaced model in
    the child."""
    from concurrent.futures import Future

    from policy.sampling import ContextTooLong
    from serving.engines import create_engine
    from serving.engines.base import _Job
    from serving.engines.process import SlotHandle
    from serving.versions import VersionRef

    dirs = make_versions(tiny_model_dir, tmp_path / "versions", 2)
    eng = create_engine(gateway_settings(tmp_path, dirs[0], batch_window_ms=0))
    try:
        eng.load(VersionRef("v0", dirs[0]))
        ids = eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        with pytest.raises(ContextTooLong):  # raised in the child by the sampler's own check
            eng.generate_now([ids * 200], [SamplingParams(max_new_tokens=4)], timeout=60)
        before = eng.generate_now([ids], [SamplingParams(max_new_tokens=4, seed=1)], timeout=60)[0]
        pause = eng.load(VersionRef("v1", dirs[1]))
        assert 0 <= pause < 1 and eng.versions() == {"production": "v1"}
        after = eng.generate_now([ids], [SamplingParams(max_new_tokens=4, seed=1)], timeout=60)[0]
        assert before.version == "v0" and after.version == "v1"
        assert after.sample.logprobs != pytest.approx(before.sample.logprobs, abs=1e-6)  # other weights
        # Slot 1 held v0: it was freed in the child after the swap. Sent from a control action, which runs
        # on the engine's loop between batches, as every batch is sent.
        stale: Future = Future()
        eng._control(lambda: eng._send(SlotHandle("v0", 1), [_Job([ids], [SamplingParams(max_new_tokens=2)],
                                                                    "production", stale)]))
        with pytest.raises(KeyError):
            stale.result(30)
        # A dead child: tests/test_engine_restart.py.
    finally:
        eng.close()


def test_a_swap_that_fails_in_the_engine_process_replaces_the_process(tmp_path, tiny_model_dir):
    """A swap the child performs (vLLM reloads weights in place there) and that fails there: the caller of
    ``load`` gets the child's error, and a new engine process serves the version the channel was switched
    to (the old one may hold a mix of both versions' weights)."""
    import time

    from serving.engines.process import ChildStep
    from serving.engines.torch_process import ProcessTorchEngine
    from serving.versions import VersionRef

    class SwapInChild(ProcessTorchEngine):
        def _finish_swap(self, handle, pause):
            return ChildStep(("swap", handle.slot))  # the torch worker has no in-child swap: it fails there

    dirs = make_versions(tiny_model_dir, tmp_path / "versions", 2)
    eng = SwapInChild(gateway_settings(tmp_path, dirs[0], batch_window_ms=0))
    try:
        eng.load(VersionRef("v0", dirs[0]))
        old_pid = eng._proc.pid
        with pytest.raises(AttributeError, match="swap"):
            eng.load(VersionRef("v1", dirs[1]))
        deadline = time.monotonic() + 60
        while not (eng.ready and eng.restarts == 1):
            assert time.monotonic() < deadline, "the engine process was not replaced"
            time.sleep(0.05)
        ids = eng.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        gen = eng.generate_now([ids], [SamplingParams(max_new_tokens=2)], timeout=60)[0]
        assert gen.version == "v1" and eng._proc.pid != old_pid
    finally:
        eng.close()


def test_process_engine_sends_a_lone_request_before_submit_async_returns(engine):
    """On the engine's loop, a request that finds the child idle (after a lone batch) is pickled onto the
    pipe inside submit_async: the child starts generating while the caller goes on."""
    import asyncio
    import time

    ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    engine.generate_now([ids], [SamplingParams(max_new_tokens=2, seed=1)], timeout=60)  # a lone batch
    deadline = time.monotonic() + 10
    while engine._inflight is not None:  # its end message
        assert time.monotonic() < deadline
        time.sleep(0.001)

    async def go():
        fut = engine.submit_async([ids], [SamplingParams(max_new_tokens=2, seed=2)])
        sent = engine._inflight is not None and engine.queue_depth == 0
        return sent, await fut

    sent, gens = asyncio.run_coroutine_threadsafe(go(), engine.loop).result(60)
    assert sent and gens[0].sample.token_ids


def test_process_engine_skips_a_request_cancelled_before_its_batch(engine):
    import time

    ids = engine.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    with engine_held(engine):
        fut = engine.submit([ids], [SamplingParams(max_new_tokens=2)])
        assert fut.cancel()
        before = engine.batches_run
    deadline = time.monotonic() + 10
    while engine.queue_depth:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)
    assert engine.batches_run == before and engine._inflight is None
