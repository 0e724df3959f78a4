"""Offline RL: a sandboxed coding environment, composite rewards, mid-training, GRPO (sync or async
with bounded staleness), held-out evaluation and the quality gate.

Python API (what ``rtrl`` commands and the demo call)::

    from offline_rl.midtrain import run_midtrain      # run_midtrain(settings, progress=True) -> Path (HF dir)
    from offline_rl.grpo import run_grpo               # run_grpo(settings, init_dir) -> GRPOResult
    from offline_rl.evaluate import evaluate           # evaluate(model, tokenizer, tasks, samples, k, temperature)
    from offline_rl.sandbox import Sandbox             # Sandbox(settings.sandbox).run(code, entry, tests)
    from offline_rl.env import CodingEnv               # single-turn / tool mode (run_examples, submit)
    from offline_rl.presets import apply_preset        # apply_preset(settings, "fast")
"""
