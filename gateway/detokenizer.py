"""Incremental detokenization with stop-string hold-back."""

from __future__ import annotations


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces.

    Decoding token by token breaks multi-byte characters and merges that depend
    on context, so each piece is the difference between decoding a short window
    with and without the new tokens; a piece ending in U+FFFD (an incomplete
    character) waits for the next token. When the output ends, `flush()` gives
    what is still held back as the tokenizer decodes it (an incomplete
    character becomes U+FFFD), so that the pieces add up to the decoding of all
    the output tokens.
    """

    def __init__(self, tokenizer, prompt_tail: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A fast (Rust) tokenizer decodes directly: with clean_up_tokenization_spaces off,
        # transformers' decode() returns exactly the backend's text, after ~10 us of Python
        # around a ~1 us decode. Two decodes per token made detokenizing 37% of the gateway's
        # step at 64 requests (fake services, CPU); a slow tokenizer keeps the wrapper.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend_decode = backend.decode if backend is not None else None
        # A little prompt context for leading-space rules; none when the prompt ends inside a
        # character, or the output's first bytes would complete the prompt's character.
        context = list(prompt_tail)
        if context and self._decode(context).endswith("\ufffd"):
            context = []
        self.ids: list[int] = context
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return full[len(prefix):]
        return ""

    def push_many(self, token_ids: list[int]) -> str:
        """The text of push() of each token in turn, joined, from two decodes of the window instead of two
        per token (a verified tree commits several tokens a step). Where the window ends inside a character
        (or adds no text), each token is pushed alone. The same text as one by one on the byte-level test
        tokenizer (tests/test_detokenizer_utf8.py), the demo pair's and a SentencePiece-style one (BENCHMARKS.md,
        "A step's tokens detokenized in one decode")."""
        if len(token_ids) < 2:
            return "".join(self.push(token_id) for token_id in token_ids)
        start = len(self.ids)
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            # As one push would leave it: the emitted window (whole characters) is the next push's context.
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        del self.ids[start:]
        return "".join(self.push(token_id) for token_id in token_ids)

    def flush(self) -> str:
        """The text held back (an incomplete character at the end): the output has ended."""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopMatcher:
    """Finds stop strings in streamed text, holding back what could still become one."""

    def __init__(self, stops: tuple[str, ...], include_stop: bool = False):
        self.stops = stops
        self.include_stop = include_stop  # the text ends after the stop string, not before it
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""  # text not yet released to the client

    def feed(self, piece: str, match: bool = True) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was hit). match=False: the text
        may not end on a stop string yet (min_tokens), but is still held back as usual."""
        self.pending += piece
        if self.stops and match:
            hits = [(i, -len(s), s) for i, s in ((self.pending.find(s), s) for s in self.stops) if i >= 0]
            if hits:
                at, _, stop = min(hits)
                out, self.pending = self.pending[: at + len(stop) if self.include_stop else at], ""
                return out, True
        cut = len(self.pending) - self.hold if self.stops else len(self.pending)
        out, self.pending = self.pending[:max(cut, 0)], self.pending[max(cut, 0):]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out
