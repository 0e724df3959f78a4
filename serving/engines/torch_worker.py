"""The torch engine's generation process (``serving.engine_process = true``).

Why a process: the sampler loop is Python, and in the gateway's process it shares the GIL with the
HTTP event loop, so every request pays for generation it is not part of (and generation slows down
while requests are parsed). Here the models live in a child process; the gateway process keeps the
micro-batcher (queue, window, swap ordering: :mod:`serving.engines.base`), which hands each batch
over and relays the child's per-step tokens and per-row results to the batcher's hooks.

Two pipes, so that a slow load never delays a batch:

* *gen* (batcher thread <-> child main thread), one batch at a time:
  ``("gen", slot, rows, params, stream)`` -> ``("step", rows, tokens)`` per decoding step (only when
  ``stream``), ``("fin", row, sample)`` per finished row, then ``("end", error_or_None)``;
  ``("free", slot)`` (no reply) drops a model no channel serves any more; ``("exit",)``.
* *ctl* (callers of ``load``, one at a time <-> a child thread): ``("load", slot, model_dir)`` ->
  ``("ok", info)`` or ``("err", error)``. Weights are read while the main thread keeps generating on
  the current ones, as they are in-process; the new slot becomes live only when the batcher names
  it in a later ``gen``, so the swap stays a pointer switch between batches.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import traceback
from typing import Any

import torch

from policy.loading import load_model, load_tokenizer
from policy.sampling import generate_ids


def _portable(err: BaseException) -> BaseException:
    """The error itself when it survives pickling, else a RuntimeError that says what it was."""
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:  # noqa: BLE001 - any unpicklable error still reaches the caller as text
        return RuntimeError(f"{type(err).__name__}: {err}")


def generate_batch(model, tok, rows, params, *, on_step=None, on_finish=None):
    """One batched ``generate_ids`` call with the tokenizer's special ids and text decoding: the same
    call in the engine process and in the batcher thread (``engine_process = false``)."""

    return generate_ids(model, rows, params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                        on_step=on_step, on_finish=on_finish)


def main(gen_conn, ctl_conn, threads: int, dtype: str, device: str) -> None:
    # The parent owns shutdown (it flushes events first): a Ctrl-C to the process group must not
    # kill the generator under batches in flight.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    torch.set_num_threads(threads)
    models: dict[int, Any] = {}
    tok_box: list[Any] = []

    def control() -> None:
        while True:
            try:
                msg = ctl_conn.recv()
            except (EOFError, OSError):
                return
            kind, slot, model_dir = msg
            if kind == "free":  # a load the parent refused: it was never live
                models.pop(slot, None)
                continue
            try:
                model = load_model(model_dir, dtype, device)
                if not tok_box:
                    tok_box.append(load_tokenizer(model_dir))
                models[slot] = model
                reply: tuple = ("ok", {"vocab_size": model.config.vocab_size,
                                       "context_len": getattr(model.config, "max_position_embeddings", None)})
            except BaseException as err:  # noqa: BLE001 - reported to the caller of load()
                reply = ("err", _portable(err))
            try:
                ctl_conn.send(reply)
            except (EOFError, OSError):
                return

    threading.Thread(target=control, name="torch-worker-loader", daemon=True).start()
    status = 0
    try:
        _serve(gen_conn, models, tok_box)
    except BaseException:  # noqa: BLE001 - reported below; the parent sees the pipe close
        traceback.print_exc()
        status = 1
    # Leave without the interpreter's teardown: a native thread pool still holding a joinable
    # std::thread when static destructors run aborts the process ("terminate called without an
    # active exception", exit status -6). Nothing here needs flushing but the standard streams.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(gen_conn, models: dict[int, Any], tok_box: list[Any]) -> None:
    send = gen_conn.send
    while True:
        try:
            msg = gen_conn.recv()
        except (EOFError, OSError):
            return
        kind = msg[0]
        if kind == "exit":
            return
        if kind == "free":
            models.pop(msg[1], None)
            continue
        _, slot, rows, params, stream = msg
        try:
            generate_batch(models[slot], tok_box[0], rows, params,
                           on_step=(lambda r, t: send(("step", r, t))) if stream else None,
                           on_finish=lambda r, s: send(("fin", r, s)))
            error = None
        except BaseException as err:  # noqa: BLE001 - the batch's requests get it; the process lives on
            error = _portable(err)
        try:
            send(("end", error))
        except (EOFError, OSError):
            return
