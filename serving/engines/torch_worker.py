"""The torch engine's generation process (``serving.engine_process = true``; the parent's side and the
pipe protocol: :mod:`serving.engines.process`). Each slot is its own model instance, loaded on the
child's loader thread while the main thread keeps generating; a swap is the parent naming the new
slot in its next batch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from policy.loading import load_model, load_tokenizer
from policy.sampling import Sample, SamplingParams, generate_ids
from serving.engines import child


def generate_batch(model, tok, rows, params, *, on_step=None, on_finish=None):
    """One batched ``generate_ids`` call with the tokenizer's special ids and text decoding: the same
    call in the engine process and in the batcher thread (``engine_process = false``)."""

    return generate_ids(model, rows, params, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
                        on_step=on_step, on_finish=on_finish)


class TorchBackend:
    def __init__(self, dtype: str, device: str) -> None:
        self.dtype, self.device = dtype, device
        self.models: dict[int, Any] = {}
        self.tokenizer = None

    def load(self, slot: int, model_dir: str, channel: str) -> dict:
        model = load_model(model_dir, self.dtype, self.device)
        if self.tokenizer is None:
            self.tokenizer = load_tokenizer(model_dir)
        self.models[slot] = model
        return {"vocab_size": model.config.vocab_size,
                "context_len": getattr(model.config, "max_position_embeddings", None)}

    def free(self, slot: int) -> None:
        self.models.pop(slot, None)

    def generate(self, slot: int, rows: list[list[int]], params: list[SamplingParams], *,
                 on_step: Callable[[list[int], list[int]], None] | None,
                 on_finish: Callable[[int, Sample], None]) -> None:
        generate_batch(self.models[slot], self.tokenizer, rows, params, on_step=on_step, on_finish=on_finish)


def main(gen_conn, ctl_conn, threads: int, dtype: str, device: str) -> None:
    torch.set_num_threads(threads)
    child.run(child.ChildLoop(gen_conn, ctl_conn), TorchBackend(dtype, device))
