"""`rtrl sample`: sample from any model directory, with per-token log-probs."""

from __future__ import annotations

import json

import typer

from policy.cli_settings import settings_or_exit


def register(app: typer.Typer) -> None:
    @app.command("sample")
    def sample(
        ctx: typer.Context,
        prompt: list[str] = typer.Argument(..., help="Prompt text (repeat for a batch). Use $'..\\n..' for newlines."),
        model_dir: str | None = typer.Option(None, "--model", "-m", help="HF model directory (default: model.dir)."),
        n: int = typer.Option(1, "-n", help="Samples per prompt."),
        temperature: float = typer.Option(1.0, help="0 = greedy."),
        top_p: float = typer.Option(1.0),
        top_k: int = typer.Option(0),
        max_tokens: int = typer.Option(32),
        stop: list[str] = typer.Option(["\n"], help="Stop strings (repeatable)."),
        seed: int | None = typer.Option(None),
        as_json: bool = typer.Option(False, "--json", help="Print samples as JSON lines with log-probs."),
        config: str | None = typer.Option(None, "--config", "-c", help="TOML settings file."),
    ) -> None:
        """Sample completions with per-token log-probs."""
        import torch

        from policy.loading import ModelLoadError, load_policy
        from policy.sampling import SamplingParams, generate

        settings = settings_or_exit(ctx, config)
        torch.set_num_threads(settings.model.threads)
        try:
            policy = load_policy(model_dir or settings.model.dir, settings.model.dtype, settings.model.device)
            params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k,
                                    max_new_tokens=max_tokens, stop=stop, seed=seed)
        except (ModelLoadError, ValueError) as err:
            typer.echo(str(err), err=True)
            raise typer.Exit(2) from None
        prompts = [p.encode().decode("unicode_escape") for p in prompt]
        for p, group in zip(prompts, generate(policy.model, policy.tokenizer, prompts, params), strict=True):
            for s in group:
                if as_json:
                    typer.echo(json.dumps({"prompt": p, "text": s.text, "finish_reason": s.finish_reason,
                                           "token_ids": s.token_ids, "logprobs": s.logprobs,
                                           "sampling_logprobs": s.sampling_logprobs}))
                else:
                    typer.echo(f"{p}{s.text}    [{s.finish_reason}, logp={sum(s.logprobs):.2f}]")
