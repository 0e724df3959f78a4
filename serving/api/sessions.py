"""Long agent sessions through the chat API: the summary turn the model was trained with, applied by the
gateway (the ``session`` extension of ``POST /v1/chat/completions``; docs/agent.md, "Self-summarisation").

A context of the session holds the conversation, the answer (``max_tokens``) and room for a summary
turn (:data:`policy.summary.SUMMARY_REQUEST` and ``summary_max_tokens``). While it does, the request
is answered as any chat request. When it would not, the gateway asks the model for its summary (the
conversation followed by the summary request, one line of at most ``summary_max_tokens``), then
answers from a fresh context: the first message (the task), the summary, and with ``carry`` =
``last_observation`` the last assistant message and what followed it (dropped when it would leave no
room). The summary is a completion of its own with its own feedback token; every completion's event
records its ``segment`` and the summary its context started from.
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.summary import SUMMARY_PREFIX, SUMMARY_REQUEST
from serving.api.errors import APIError
from serving.schemas import ChatMessage, SessionOptions


@dataclass(frozen=True)
class Budget:
    """A session context's token arithmetic (all in tokens)."""

    context_budget: int
    max_new: int  # the answer
    summary_turn: int  # the summary request and the longest summary

    def fits(self, prompt_tokens: int) -> bool:
        """Whether a context of ``prompt_tokens`` still has room for the answer and a later summary turn."""
        return prompt_tokens + self.max_new + self.summary_turn <= self.context_budget


def summary_request(messages: list[ChatMessage]) -> list[ChatMessage]:
    """The conversation followed by the summary request (the model's next line is its summary)."""
    return [*messages, ChatMessage(role="user", content=SUMMARY_REQUEST)]


def fresh_context(messages: list[ChatMessage], summary: str, carry: bool) -> list[ChatMessage]:
    """The context after the summary turn: the first message, the summary (nothing for an empty one),
    and with ``carry`` the last assistant message and every message after it (the last message alone
    when no assistant message follows the first)."""
    fresh = [messages[0]]
    if not summary:
        return fresh
    fresh.append(ChatMessage(role="user", content=SUMMARY_PREFIX + summary))
    if carry and len(messages) > 1:
        last = max((i for i, m in enumerate(messages) if m.role == "assistant" and i > 0), default=len(messages) - 1)
        fresh += messages[last:]
    return fresh


def too_small(opts: SessionOptions, least_context: int, budget: Budget) -> APIError:
    """A budget that cannot hold even the smallest context after a summary (``least_context``: the first
    message and a summary of ``summary_max_tokens``), the answer and the next summary turn."""
    need = least_context + budget.max_new + budget.summary_turn
    return APIError(413, f"session.context_budget {opts.context_budget} cannot hold a context after a summary: "
                    f"the first message with a summary of up to {opts.summary_max_tokens} tokens ({least_context}), "
                    f"max_tokens {budget.max_new} and the next summary turn ({budget.summary_turn}) need {need}",
                    "invalid_request_error", "context_budget_too_small", param="session.context_budget")
