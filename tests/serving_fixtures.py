"""Helpers for the serving tests: settings on temporary paths, distinguishable model versions, events."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

PROMPT = "# f(0)=7 f(1)=15 f(2)=23 f(8)=71\ndef f(x): return "


def gateway_settings(tmp: Path, model_dir: Path | str, *, bus: dict | None = None, **serving):
    from rtrl.config import load_settings

    serving = {"api_keys_file": str(tmp / "keys.json"), "spill_dir": str(tmp / "spill"), "source": "dir",
               "poll_interval_s": 0.2, **serving}
    return load_settings(model={"dir": str(model_dir), "threads": 1}, serving=serving,
                         bus={"embedded_path": str(tmp / "bus" / "events.db"), **(bus or {})})


def make_versions(base_dir: Path, out_root: Path, count: int, scale: float = 0.05) -> list[Path]:
    """``count`` HF directories with the base's tokenizer and differently perturbed weights.

    Each carries ``rtrl_version.json`` naming it ``v0``, ``v1``, ...; ``v0`` is the base unchanged.
    """
    import json

    import torch

    from policy.loading import load_model

    dirs = []
    for i in range(count):
        out = out_root / f"v{i}"
        out.mkdir(parents=True, exist_ok=True)
        for f in base_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors"):
                shutil.copy(f, out / f.name)
        model = load_model(base_dir)
        if i:
            gen = torch.Generator().manual_seed(1000 + i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * scale * (p.std() if p.numel() > 1 else 1.0))
        model.save_pretrained(out, safe_serialization=True)
        (out / "rtrl_version.json").write_text(json.dumps({"version": f"v{i}"}))
        dirs.append(out)
    return dirs


def point(link: Path, target: Path) -> None:
    """Atomically repoint a symlink (how a deploy switches the served directory)."""
    tmp = link.with_name(link.name + ".new")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def read_events(bus_settings, timeout_s: float = 2.0):
    """Every event on the events topic (from offset 0), decoded."""
    from realtime_rl.bus import open_consumer
    from realtime_rl.events import decode_event

    topic = bus_settings.events_topic
    out = []
    with open_consumer(bus_settings, "serving-tests") as con:
        ends = con.end_offsets(topic)
        con.assign({(topic, p): 0 for p in con.partitions(topic)})
        got = dict.fromkeys(ends, 0)
        import time

        deadline = time.monotonic() + timeout_s
        while any(got[p] < ends[p] for p in ends) and time.monotonic() < deadline:
            for rec in con.poll(0.2):
                got[rec.partition] = rec.offset + 1
                out.append(decode_event(rec.value))
    return out


@contextmanager
def engine_held(engine):
    """Inside, submitted requests queue up and none starts; on leaving, they are free to form one batch.

    The in-thread engine: its batcher's lock is held (``submit`` takes it re-entrantly on this thread).
    The process engine: its child is stopped (SIGSTOP) with a one-token filler batch in flight, so the
    engine's event loop keeps running (HTTP requests are read and queued) but no batch can start; the
    filler's batch ends right after the child continues, before the held requests' batch."""
    import signal
    import time

    from policy.sampling import SamplingParams

    if not hasattr(engine, "loop"):
        with engine._cond:
            yield
        return
    # The last batch's answer may still be on its way (its rows' futures settle before its "end" is read):
    # stopping the child then would hold that batch, not the filler. Wait until the engine is idle.
    deadline = time.monotonic() + 30
    while engine._inflight is not None or engine.queue_depth:
        assert time.monotonic() < deadline, "the engine did not become idle"
        time.sleep(0.001)
    pid = engine._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        filler = engine.submit([[1, 2]], [SamplingParams(max_new_tokens=1)])
        deadline = time.monotonic() + 30
        while engine._inflight is None or engine.queue_depth:
            assert time.monotonic() < deadline, "the filler batch did not start"
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
    filler.result(60)
