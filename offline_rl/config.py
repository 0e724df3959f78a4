"""Settings for the offline stage: tasks, mid-training, GRPO, evaluation and the quality gate.

One section per stage; every field is documented because `rtrl config show` and the docs print them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TaskSettings(_Section):
    """The built-in function-synthesis task generator (or a JSONL file of tasks)."""

    jsonl: str | None = Field(None, description="Load tasks from this JSONL file instead of the generator.")
    seed: int = Field(0, description="Generator seed: the split and the visible examples depend on it.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of each family held out for evaluation.")


class MidtrainSettings(_Section):
    """Continued next-token training on the synthetic code corpus."""

    out_dir: str = Field("var/runs/midtrain", description="Checkpoint directory (an HF directory).")
    steps: int = Field(600, ge=1, description="Optimizer steps.")
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    lr: float = Field(2e-3, gt=0, description="Peak AdamW learning rate (cosine decay to 10%).")


class GRPOSettings(_Section):
    """Group Relative Policy Optimization on the sandboxed environment."""

    out_dir: str = Field("var/runs/grpo", description="Run directory: checkpoints, metrics.jsonl.")
    steps: int = Field(200, ge=1, description="Trainer steps.")
    prompts_per_step: int = Field(16, ge=1, description="Distinct tasks per step.")
    group_size: int = Field(8, ge=2, le=128, description="G: rollouts per prompt.")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate.")
    max_new_tokens: int = Field(32, ge=1, description="Completion budget per turn.")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    max_staleness: int = Field(1, ge=0, description="Drop rollouts produced by weights more than this many "
                               "versions older than the trainer's (0 = synchronous).")


class EvalSettings(_Section):
    """Held-out evaluation and the quality gate."""

    gate_threshold: float = Field(0.55, ge=0, le=1, description="Held-out pass@1 a checkpoint must reach "
                                  "before it may serve users.")
    k: list[int] = Field(default_factory=lambda: [1, 4], description="k values for pass@k.")
    samples: int = Field(4, ge=1, description="Samples per task for pass@k estimation.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for evaluation.")
