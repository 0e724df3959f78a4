"""Chat messages to prompt text: the model's own chat template when it has one, else the plain template."""

from __future__ import annotations

from serving.chat import render_chat
from serving.schemas import ChatMessage


def test_plain_template_and_model_template(tiny_model_dir):
    from policy.loading import load_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    msgs = [ChatMessage(role="system", content="# tests"), ChatMessage(role="user", content=[
        {"type": "text", "text": "def f(x): "}, {"type": "text", "text": "return "}])]
    assert not getattr(tok, "chat_template", None)
    assert render_chat(tok, msgs) == "# tests\ndef f(x): return "
    tok.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert render_chat(tok, msgs) == "<system># tests\n<user>def f(x): return \n<assistant>"
