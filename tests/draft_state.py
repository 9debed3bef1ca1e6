"""A draft engine's state for tests: a random request history, a request's KV, and a snapshot to compare."""

from __future__ import annotations

import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft


def history(model: Eagle3Draft, n: int, seed: int) -> tuple[list[int], torch.Tensor]:
    """n + 1 random tokens and n random feature rows (the last token is the pending one)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, model.cfg.target_vocab_size, (n + 1,), generator=gen).tolist(),
            torch.randn(n, model.cfg.feature_width, generator=gen))


def kv_of(engine: DraftEngine, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft KV of a request's computed positions."""
    return engine.kv.read(0, engine.kv.slots(rid, 0, engine.computed(rid)))


def snapshot(engine: DraftEngine):
    """Every request's tokens and featured positions, computed lengths, and the load: what a refused call
    must leave as it was."""
    return ({rid: (list(st.tokens), sorted(st.features)) for rid, st in engine.requests.items()},
            {rid: engine.computed(rid) for rid in engine.requests}, engine.load())
