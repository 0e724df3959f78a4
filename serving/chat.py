"""Chat messages -> prompt text.

When the model directory's tokenizer has a chat template, it is used
(``apply_chat_template(..., add_generation_prompt=True)``). Otherwise (the tiny model has none) the
*plain template* applies: the messages' texts joined by newlines, in order, roles not rendered. A
completion model then sees the conversation as one document, so a single user message is exactly
the completion prompt, e.g. ``# f(0)=7 f(1)=15\\ndef f(x): return ``.
"""

from __future__ import annotations

from serving.schemas import ChatMessage


def render_chat(tokenizer, messages: list[ChatMessage]) -> str:
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": m.role, "content": m.text} for m in messages],
                                             tokenize=False, add_generation_prompt=True)
    return "\n".join(m.text for m in messages)
