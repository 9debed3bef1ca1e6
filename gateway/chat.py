"""Chat messages -> prompt token ids.

A tokenizer that ships a chat template (tokenizer_config.json "chat_template")
renders the conversation with it, as Hugging Face and vLLM do, with the
generation prompt for the assistant's turn appended. A tokenizer without one
(e.g. a base model, or the tests' character tokenizer) gets tandem's plain
template, one line per message then the assistant's cue:

    system: You are terse.
    user: Hi!
    assistant:

The model continues after "assistant:". Base models follow this well enough
for demos; use a chat-tuned model with a template for real conversations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.errors import InvalidArgument

ROLES = ("system", "developer", "user", "assistant", "tool")
PLAIN_ASSISTANT_CUE = "assistant:"


def message_text(content: Any, index: int) -> str:
    """A message's content as text: a string, or a list of text parts (OpenAI's content parts)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(
                    part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidArgument(f"messages[{index}].content: only text parts are supported, "
                                      f"got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidArgument(f"messages[{index}].content must be a string or a list of text parts")


def normalize_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
    """Check roles and flatten content parts into plain {"role", "content"} dicts."""
    if not messages:
        raise InvalidArgument("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ROLES:
            raise InvalidArgument(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        out.append({"role": role, "content": message_text(m.get("content"), i)})
    return out


def render_plain(messages: Sequence[dict[str, str]]) -> str:
    lines = [f"{m['role']}: {m['content']}\n" for m in messages]
    return "".join(lines) + PLAIN_ASSISTANT_CUE


def chat_prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]],
                    add_special_tokens: bool | None = None) -> list[int]:
    """Token ids of the prompt for the assistant's next turn. add_special_tokens (vLLM's field):
    None leaves them to the template (none added), or to the tokenizer for the plain template."""
    msgs = normalize_messages(messages)
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            raise InvalidArgument(f"the model's chat template rejected the messages: {exc}") from exc
        # The template writes the special tokens (BOS and the like) itself.
        return list(tokenizer.encode(text, add_special_tokens=bool(add_special_tokens)))
    return list(tokenizer.encode(render_plain(msgs), add_special_tokens=add_special_tokens is not False))
