"""Load any local Hugging Face causal-LM directory: config, safetensors weights, tokenizer.

Never touches the network: ``HF_HUB_OFFLINE`` is forced on and ``local_files_only`` is passed, so
a directory that is incomplete fails here with the list of what is missing instead of a download.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "float64": "float64", "fp64": "float64"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


# transformers builds a model under context managers that patch process-wide state (torch.nn.init
# functions, PreTrainedModel.init_weights / tie_weights, the default dtype) and restore it on exit.
# Two threads doing that at once restore each other's patches: tie_weights stays disabled for the
# rest of the process and every later load fails ("Cannot copy out of meta tensor"). A gateway
# swapping in a version while the updater loads its policy in the same process (the demo) hit this,
# so every model construction in this package holds this lock.
MODEL_BUILD_LOCK = threading.Lock()


class ModelLoadError(RuntimeError):
    """The directory is not a loadable causal LM; the message names what is missing or wrong."""


@dataclass
class Policy:
    model: Any
    tokenizer: Any
    model_dir: Path
    device: str
    dtype: str


def check_model_dir(model_dir: str | Path) -> Path:
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory not found: {path} (run `rtrl init-model` to build the tiny default)")
    problems = []
    if not (path / "config.json").is_file():
        problems.append("config.json")
    if not any(path.glob("*.safetensors")):
        problems.append("*.safetensors weights")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        problems.append("a tokenizer (tokenizer.json)")
    if problems:
        raise ModelLoadError(f"{path} is not a complete Hugging Face model directory: missing {', '.join(problems)}")
    return path


def torch_dtype(name: str):
    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}") from None


def quiet_transformers() -> None:
    """Per-load progress bars are noise in service logs and CI output."""

    logging.disable_progress_bar()


def load_tokenizer(model_dir: str | Path):
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = check_model_dir(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(model_dir: str | Path, dtype: str = "float32", device: str = "cpu"):
    os.environ["HF_HUB_OFFLINE"] = "1"
    quiet_transformers()
    path = check_model_dir(model_dir)
    try:
        with MODEL_BUILD_LOCK:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), local_files_only=True,
                                                         **_experts_kernel(dtype))
    except (OSError, ValueError) as err:
        raise ModelLoadError(f"could not load {path}: {err}") from err
    return model.to(device).eval()


def _experts_kernel(dtype: str) -> dict[str, str]:
    """float64 runs a mixture-of-experts model's experts one by one: torch's grouped matmul, the default
    experts kernel, has no float64 kernel (a dense model ignores the setting)."""
    return {"experts_implementation": "eager"} if DTYPES.get(dtype) == "float64" else {}


def save_policy(model, tokenizer, out_dir: str | Path, state_dict: dict | None = None) -> Path:
    """Write an HF directory (safetensors weights, config, tokenizer) that transformers and vLLM load
    unchanged; ``state_dict`` replaces the model's own tensors (a sharded model's gathered weights)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def load_policy(model_dir: str | Path, dtype: str = "float32", device: str = "cpu") -> Policy:
    """Model (eval mode) and tokenizer from one local directory."""
    return Policy(model=load_model(model_dir, dtype, device), tokenizer=load_tokenizer(model_dir),
                  model_dir=Path(model_dir), device=device, dtype=DTYPES.get(dtype, dtype))
