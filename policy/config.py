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
    """Shape of the tiny default model built by `rtrl init-model` (Llama architecture; with `--moe`, a
    Qwen3-MoE of the same width, depth and attention whose MLPs are mixtures of experts)."""

    hidden_size: int = Field(192, ge=16, description="Model width.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(6, ge=1, description="Attention heads (also KV heads).")
    intermediate_size: int = Field(384, ge=16, description="MLP width.")
    vocab_size: int = Field(512, ge=260, description="Byte-level BPE vocabulary size (256 bytes + merges + specials).")
    max_position_embeddings: int = Field(1024, ge=64, description="Context length in tokens (agent episodes "
                                         "are many turns long).")
    corpus_examples: int = Field(12000, ge=100, description="Documents of the code corpus (function documents "
                                 "and agent transcripts) the tokenizer is trained on.")
    seed: int = Field(0, description="Seed for weights and corpus: same seed, same model.")
    moe_experts: int = Field(4, ge=2, le=256, description="`--moe`: experts per MoE layer.")
    moe_top_k: int = Field(2, ge=1, description="`--moe`: experts each token is routed to in every layer.")
    moe_intermediate_size: int = Field(192, ge=16, description="`--moe`: width of each expert's MLP (top-k x this "
                                       "is the width a token's MLP computation sees).")
    moe_aux_loss_coef: float = Field(0.001, ge=0, description="`--moe`: weight of the load-balancing loss "
                                     "(Switch Transformer's) that mid-training adds to the language-model loss.")


class RegistrySettings(Section):
    """The version registry: the only way weights move between stages."""

    url: str = Field("var/registry", description="Local directory or fsspec URL (e.g. s3://bucket/registry).")
    snapshot_every: int = Field(10, ge=1, description="Write a full snapshot every K versions (else a delta).")
    cache_dir: str = Field("var/cache/materialized", description="Where materialised HF directories are cached.")
    workers: int = Field(0, ge=0, description="Threads for shard-parallel encode/decode (0 = all cores).")
    shard_mb: float = Field(256, gt=0, description="Target size of snapshot shards and delta files (MiB): many "
                            "files of similar size transfer in parallel.")
    zstd_level: int = Field(1, ge=-7, le=22, description="zstd level for delta byte planes (1 is fast and, on "
                            "noise-like planes, as small as 9; 16+ is slightly smaller and much slower).")
    channels: list[str] = Field(["candidate", "production"], description="Channel names promote/rollback accept.")
    rollback_depth: int = Field(10, ge=2, description="Versions each channel can roll back through (gc keeps them).")
    keep_last: int = Field(5, ge=0, description="gc keeps this many newest versions (plus channels' and their chains).")


class DistributedSettings(Section):
    """Data-parallel training of mid-training, GRPO and the online update under ``torchrun``
    (torch.distributed with FSDP2; see policy/distributed.py)."""

    mode: Literal["auto", "off", "on"] = Field(
        "auto", description="auto: data-parallel when the process was started by torchrun with more than one "
        "rank (WORLD_SIZE > 1 in the environment), else one process; on: require torchrun (an error "
        "otherwise); off: one process only (an error under torchrun with several ranks, which would "
        "otherwise each train alone into the same run directory).")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Collective backend: auto picks nccl when model.device is a CUDA device, else gloo.")
    rendezvous_timeout_s: float = Field(
        120.0, gt=0, description="How long a rank waits to reach the other ranks at start-up before it "
        "gives up with an error naming the address it tried.")
    collective_timeout_s: float = Field(
        3600.0, gt=0, description="How long a rank waits in a collective, e.g. while rank 0 alone evaluates, "
        "samples or publishes; past it the run fails instead of hanging.")
