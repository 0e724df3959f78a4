"""The summary turn's wording: how a context that is full asks the policy to summarise its work, and how
the summary opens the next context. Part of the model's protocol, like a chat template: the environment
that trains summaries (``offline_rl.agent_env``) and the gateway that applies them to long sessions
(``serving``) must write the same text, or a served model meets a request it was never trained on."""

from __future__ import annotations

SUMMARY_REQUEST = "# context full\n# summary: "
"""What is written on the prompt line when the next turn would not fit the context budget; the
policy's next line is its summary. Short on purpose: every context keeps room for it (with the tiny
model's tokenizer it is 20 tokens; a longer wording cost 53 of a few hundred)."""
SUMMARY_PREFIX = "# summary: "
"""How the summary opens the fresh context."""


def clean_summary(text: str) -> str:
    """The summary as the fresh context shows it: its first line, stripped."""
    return text.split("\n", 1)[0].strip()
