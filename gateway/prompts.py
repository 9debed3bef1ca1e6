"""Client prompts -> token ids that fit the model, shared by the REST and gRPC edges.

Length rule (as OpenAI and vLLM apply it): prompt tokens + max_tokens must fit
in max_model_len. An explicit max_tokens that does not fit is a 400 /
INVALID_ARGUMENT, never silently shortened; a missing one defaults to what fits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.errors import InvalidArgument


def text_prompt_ids(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """Tokenize a raw prompt the way the model's tokenizer does by default (e.g. with BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def check_token_ids(ids: Sequence[Any], what: str = "prompt") -> list[int]:
    out = []
    for t in ids:
        # bool is an int in Python; a JSON true is not a token id.
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise InvalidArgument(f"{what} token ids must be non-negative integers, got {t!r}")
        out.append(t)
    return out


def fit_max_tokens(prompt_len: int, requested: int | None, max_model_len: int,
                   default: int | None) -> int:
    """max_tokens for a request: `requested` if it fits, else an error; when absent,
    `default` (None = all the room left) capped to what fits."""
    if prompt_len == 0:
        raise InvalidArgument("the prompt is empty")
    room = max_model_len - prompt_len
    if room < 1:
        raise InvalidArgument(f"This model's maximum context length is {max_model_len} tokens, and the "
                              f"prompt has {prompt_len} tokens: no room for any output.")
    if requested is None:
        return room if default is None else min(default, room)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise InvalidArgument(f"max_tokens must be a positive integer, got {requested!r}")
    if requested > room:
        raise InvalidArgument(f"This model's maximum context length is {max_model_len} tokens. However, "
                              f"you requested {prompt_len + requested} tokens ({prompt_len} in the "
                              f"prompt, {requested} for the completion). Please reduce the prompt or "
                              f"max_tokens.")
    return requested
