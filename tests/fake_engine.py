"""A deterministic GenerationEngine for testing the API layers without models.

Every request "generates" a fixed script of characters (rotated by its seed),
one token per step with speculation "never" and two per step otherwise, from
a background thread, like the real core: deltas arrive on the engine's thread,
stop strings and stop token ids end a request, max_tokens ends it with
"length", abort() silences it (no final delta: callers must not rely on one).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from gateway.metrics import GatewayMetrics
from gateway.types import Delta, DeltaSink, GenerationParams, SpecStats, TokenLogprob
from tandem.errors import InvalidArgument, ResourceExhausted, Unavailable
from tests.tiny_models import save_char_tokenizer

SCRIPT = "The quick brown fox jumps over the lazy dog. "
TOKEN_LOGPROB = -0.25
OTHER_LOGPROB = -2.0


def expected_text(max_tokens: int, seed: int | None = None, stop: tuple[str, ...] = ()) -> str:
    """What the fake produces for a request (before any stop string)."""
    start = (seed or 0) % len(SCRIPT)
    text = "".join(SCRIPT[(start + i) % len(SCRIPT)] for i in range(max_tokens))
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text if cut < 0 else text[:cut]


def make_char_tokenizer(path: Path):
    save_char_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


@dataclass
class _Run:
    request_id: str
    prompt: list[int]
    params: GenerationParams
    sink: DeltaSink
    tokens: list[int]  # everything it will emit
    visible_chars: int  # text shown (stop strings cut it short)
    finish: str
    sent: int = 0
    spec: SpecStats = field(default_factory=SpecStats)


class FakeEngine:
    model_name = "tiny-fake"

    def __init__(self, tokenizer, max_model_len: int = 128, max_queue: int = 64):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_queue = max_queue
        self.metrics = GatewayMetrics()
        self.is_ready = True
        self.token_delay = 0.0  # seconds per step; tests slow it down to disconnect mid-stream
        self.submitted: dict[str, tuple[list[int], GenerationParams]] = {}
        self.aborted: list[str] = []
        self._runs: dict[str, _Run] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # -- GenerationEngine
    def ready(self) -> bool:
        return self.is_ready

    def submit(self, request_id: str, prompt_token_ids: list[int], params: GenerationParams,
               sink: DeltaSink) -> None:
        if not self.is_ready:
            raise Unavailable("fake engine not ready")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidArgument("prompt too long")
        with self._cond:
            if request_id in self._runs:
                raise InvalidArgument(f"duplicate request id {request_id}")
            if len(self._runs) >= self.max_queue:
                raise ResourceExhausted("fake queue full")
            self.submitted[request_id] = (list(prompt_token_ids), params)
            self._runs[request_id] = self._plan(request_id, prompt_token_ids, params, sink)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        with self._cond:
            if self._runs.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    # -- test helpers
    @property
    def running(self) -> int:
        with self._cond:
            return len(self._runs)

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(5)

    # -- internals
    def _plan(self, request_id: str, prompt: list[int], params: GenerationParams, sink: DeltaSink) -> _Run:
        text = expected_text(params.max_tokens, params.seed)
        tokens = [self.tokenizer.convert_tokens_to_ids(c) for c in text]
        visible, finish = len(tokens), "length"
        cut = expected_text(params.max_tokens, params.seed, params.stop)
        if len(cut) < len(text):  # a stop string: its tokens are generated, its text is not shown
            stop = min((s for s in params.stop if text.find(s) == len(cut)), key=len)
            visible, finish = len(cut), "stop"
            tokens = tokens[:len(cut) + len(stop)]
        for i, t in enumerate(tokens):
            if t in params.stop_token_ids:
                tokens, visible, finish = tokens[:i + 1], min(visible, i), "stop"
                break
        return _Run(request_id, list(prompt), params, sink, tokens, visible, finish)

    def _logprob(self, token_id: int, k: int) -> TokenLogprob:
        other = 3 if token_id != 3 else 4
        top = [(token_id, self.tokenizer.decode([token_id]), TOKEN_LOGPROB),
               (other, self.tokenizer.decode([other]), OTHER_LOGPROB)]
        return TokenLogprob(token_id, self.tokenizer.decode([token_id]), TOKEN_LOGPROB, tuple(top[:k]))

    def _step(self, run: _Run) -> Delta:
        spec = run.params.speculation != "never"
        n = 2 if spec else 1
        new = run.tokens[run.sent:run.sent + n]
        start, run.sent = run.sent, run.sent + len(new)
        text = self.tokenizer.decode(run.tokens[start:min(run.sent, run.visible_chars)]) \
            if start < run.visible_chars else ""
        s = run.spec
        run.spec = s.after_verify(3, len(new) - 1) if spec else s.after_plain()
        logprobs = None
        if run.params.logprobs is not None:
            logprobs = tuple(self._logprob(t, run.params.logprobs) for t in new)
        done = run.sent >= len(run.tokens)
        return Delta(tuple(new), text, logprobs, run.finish if done else None, len(run.prompt), run.sent,
                     run.spec)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._runs and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                runs = list(self._runs.values())
            for run in runs:
                with self._cond:
                    if run.request_id not in self._runs:
                        continue  # aborted meanwhile
                    delta = self._step(run)
                    if delta.finish_reason is not None:
                        del self._runs[run.request_id]
                run.sink(delta)  # outside the lock, as a real engine would
            if self.token_delay:
                time.sleep(self.token_delay)
