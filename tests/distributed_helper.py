"""Run under ``torchrun`` by tests/test_scale_distributed.py (and in one process for the reference):
mid-training and the online update's training step on the tiny model, each five optimizer steps on
the same global batches, through the functions ``rtrl midtrain`` and ``rtrl update`` call.

``python tests/distributed_helper.py MODEL_DIR OUT_DIR [--then-grpo]`` writes ``OUT_DIR/result.json``
(rank 0): the two loss curves and the share of the parameters each rank held. ``--then-grpo`` then
runs GRPO as ``rtrl grpo --init MODEL_DIR`` would, with the settings of the environment, in the same
process group (the test kills it mid-run and resumes it with ``torchrun -m rtrl grpo``: one launch
of the job fewer)."""

from __future__ import annotations

import json
import random
import sys
from datetime import UTC, datetime
from pathlib import Path

MIDTRAIN = {"steps": 5, "batch_tokens": 768, "warmup_steps": 2, "eval_at_end": False, "threads": 1}
UPDATE = {"lr": 1e-3, "epochs": 1, "minibatch_size": 8, "target_kl": None}
EXAMPLES = 40  # five minibatches of eight


def make_examples(model_dir: Path):
    """Logged completions of the tiny model for the update: real prompts, seeded random completions,
    behaviour log-probs a little off the model's own (so ratios move and some are clipped)."""
    from offline_rl.tasks import generate_tasks
    from policy.loading import load_policy
    from policy.logprobs import sequence_logprobs
    from realtime_rl.dataset import LoggedExample, TrainingExample

    policy = load_policy(model_dir)
    rng = random.Random(7)
    tasks = generate_tasks(0).train[:EXAMPLES]
    prompts = [policy.tokenizer(t.prompt, add_special_tokens=False)["input_ids"] for t in tasks]
    comps = [[rng.randrange(3, 250) for _ in range(rng.randint(1, 6))] for _ in tasks]
    lp = sequence_logprobs(policy.model, prompts, comps, pad_token_id=policy.tokenizer.pad_token_id)
    out, advantages = [], []
    for i, (p, c) in enumerate(zip(prompts, comps, strict=True)):
        logged = [float(lp.logprobs[i, j]) + rng.uniform(-0.3, 0.3) for j in range(len(c))]
        accepted = rng.random() < 0.5
        ex = LoggedExample(completion_id=f"c{i}", version="v0", caller=f"k{i % 4}", task_bucket="affine",
                           prompt_token_ids=p, completion_token_ids=c, logprobs=logged, sampling_logprobs=logged,
                           signal="accept" if accepted else "reject", feedback_at=datetime.now(UTC))
        # Some kept texts of edits, balance weights and an edit's unchanged beginning: both parts of the
        # update's loss (realtime_rl/update.py) are exercised.
        out.append(TrainingExample(example=ex, reward=0.75 if accepted else -0.25, accepted=accepted,
                                   weight=rng.uniform(0.5, 1.5), source="kept" if i % 5 == 4 else "served",
                                   kept_prefix=1 if not accepted and len(c) > 1 else 0))
        advantages.append((0.75 if accepted else -0.25) - 0.25)
    return out, advantages


def run(model_dir: Path, out_dir: Path) -> dict:
    from offline_rl.midtrain import run_midtrain
    from policy.distributed import setup
    from policy.loading import load_policy
    from realtime_rl.config import UpdateSettings
    from realtime_rl.update import train_policy
    from rtrl.config import load_settings

    settings = load_settings(model={"dir": str(model_dir)}, midtrain={**MIDTRAIN, "out_dir": str(out_dir / "mid")})
    dp = setup(settings.distributed)
    run_midtrain(settings, progress=False)
    examples, advantages = make_examples(model_dir)
    model = dp.shard(load_policy(model_dir).model)
    fractions = dp.sum_dict({str(dp.rank): dp.param_fraction(model)})
    metrics = train_policy(model, examples, advantages, UpdateSettings(**UPDATE), dp=dp)
    midtrain = json.loads((out_dir / "mid" / "midtrain.json").read_text()) if dp.is_main else {}
    return {"ranks": dp.world, "midtrain_losses": midtrain.get("losses"), "update_losses": metrics["loss_curve"],
            "param_fraction_per_rank": [fractions[str(r)] for r in range(dp.world)]}


if __name__ == "__main__":
    from policy.distributed import is_main_process, shutdown

    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    result = run(model, out)
    if is_main_process():
        (out / "result.json").write_text(json.dumps(result))
    if "--then-grpo" in sys.argv:
        from offline_rl.grpo import run_grpo
        from rtrl.config import load_settings

        run_grpo(load_settings(), model, progress=False)
    shutdown()
