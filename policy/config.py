"""Settings for the model artifact: where the weights live, how they are loaded, the tiny default model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Section(BaseModel):
    """Base of every settings section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(Section):
    """Which Hugging Face causal-LM directory to use and how to load it."""

    dir: str = Field("var/models/tiny", description="Local HF directory (config, safetensors, tokenizer). "
                     "`rtrl init-model` builds the tiny default here; any local HF causal LM works the same.")
    name: str = Field("tiny-coder", description="Model name shown to API callers (`model` = name@version).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights dtype when loaded.")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    threads: int = Field(1, ge=1, description="torch intra-op threads per process (1 is fastest for tiny "
                         "models on shared cores; benchmarks record it).")


class TinyModelSettings(Section):
    """Shape of the tiny default model built by `rtrl init-model` (Llama architecture)."""

    hidden_size: int = Field(192, ge=16, description="Model width.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(6, ge=1, description="Attention heads (also KV heads).")
    intermediate_size: int = Field(384, ge=16, description="MLP width.")
    vocab_size: int = Field(320, ge=260, description="Byte-level BPE vocabulary size (256 bytes + merges + specials).")
    max_position_embeddings: int = Field(512, ge=64, description="Context length.")
    corpus_examples: int = Field(20000, ge=100, description="Synthetic code examples the tokenizer is trained on.")
    seed: int = Field(0, description="Seed for weights and corpus: same seed, same model.")


class RegistrySettings(Section):
    """The version registry: the only way weights move between stages."""

    url: str = Field("var/registry", description="Local directory or fsspec URL (e.g. s3://bucket/registry).")
    snapshot_every: int = Field(10, ge=1, description="Write a full snapshot every K versions (else a delta).")
    cache_dir: str = Field("var/cache/materialized", description="Where materialised HF directories are cached.")
    workers: int = Field(0, ge=0, description="Threads for shard-parallel encode/decode (0 = all cores).")
    shard_mb: float = Field(256, gt=0, description="Target size of snapshot shards and delta files (MiB): many "
                            "files of similar size transfer in parallel.")
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level for delta byte planes (1 is fast and, on "
                            "noise-like planes, as small as 9; 16+ is ~5% smaller and ~10x slower).")
    channels: list[str] = Field(["candidate", "production"], description="Channel names promote/rollback accept.")
    rollback_depth: int = Field(10, ge=2, description="Versions each channel can roll back through (gc keeps them).")
    keep_last: int = Field(5, ge=0, description="gc keeps this many newest versions (plus channels' and their chains).")
