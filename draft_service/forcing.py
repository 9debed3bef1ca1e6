"""Benchmarks only: proposals forced to a recorded greedy continuation at a set acceptance rate.

The scale track runs a target with random weights, whose continuations no draft
could predict. The draft still runs for real (its cost is real); afterwards, on
each tree's main path (the best-scored child at every level) the drafted token
is set to the target's recorded greedy token with probability `acceptance` per
level, stopping at the first miss; every other child of a main-path node is set
to a wrong token. Greedy verification then accepts a run of length k with
probability acceptance^k (1 - acceptance), as a draft with that per-token
acceptance would.

A run's draw depends on the record and the tree's root position only, not on the
request: two requests on one prompt, in two modes or two rounds of a benchmark,
meet the same run wherever they draft from the same position (common random
numbers). Why: seeded per request, the draws alone moved a level's committed
tokens per step by 3-7% between `always` and `auto` drafting the same 5/4/8 tree
(H200 scale track at 0.6, one request, 16 requests a level: 2.34-2.47 for `always`,
2.26-2.46 for `auto`, against 2.30 expected), as much as the gap issue 14 measures.

The record is a JSONL file, one {"tokens": [...]} per prompt: the prompt's ids
followed by the target's greedy continuation. A request is matched to the
record that starts with its known tokens; one that matches none, or that left
its record (a different token was committed), keeps the draft's own tokens.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from draft_service.types import DraftTree


@dataclass(frozen=True)
class ForcingConfig:
    record: str
    acceptance: float
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance <= 1.0:
            raise ValueError(f"--force-acceptance must be in [0, 1], got {self.acceptance}")


def load_records(path: str | Path) -> list[list[int]]:
    records = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            tokens = json.loads(line)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: expected a JSON object with a 'tokens' list ({exc})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{path}:{n}: 'tokens' must be a list of token ids")
        records.append(tokens)
    if not records:
        raise ValueError(f"{path}: no records")
    return records


class ForcedProposals:
    def __init__(self, cfg: ForcingConfig, records: list[list[int]], vocab_size: int):
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.records = records
        self._match: dict[str, int] = {}  # request -> index of its record
        self.forced = 0  # trees rewritten
        self.unmatched = 0  # trees left as drafted (no record, or off it)

    def _record_for(self, request_id: str, known: list[int]) -> int | None:
        """The index of the record the request follows (None: it follows none)."""
        i = self._match.get(request_id)
        if i is not None and self.records[i][: len(known)] == known:
            return i
        for i, rec in enumerate(self.records):
            if len(rec) > len(known) and rec[: len(known)] == known:
                self._match[request_id] = i
                return i
        self._match.pop(request_id, None)
        return None

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._match.pop(rid, None)

    def rewrite(self, tree: DraftTree, known: list[int]) -> DraftTree:
        """`known`: the request's tokens, committed then the pending root token."""
        index = self._record_for(tree.request_id, known)
        if index is None or not tree.tokens:
            self.unmatched += bool(tree.tokens)
            return tree
        truth = self.records[index][len(known):]  # truth[d - 1] is the right token at depth d
        rng = random.Random(f"{self.cfg.seed}:{index}:{tree.root_position}")
        run = 0
        while run < len(truth) and rng.random() < self.cfg.acceptance:
            run += 1
        kids: dict[int, list[int]] = {}
        for node, parent in enumerate(tree.parents):
            kids.setdefault(parent, []).append(node)
        tokens = list(tree.tokens)
        node, depth = -1, 0
        while kids.get(node) and depth < len(truth):
            depth += 1
            right = truth[depth - 1]
            level = kids[node]
            for c in level:  # every child wrong first, each with its own wrong token
                if tokens[c] == right:
                    tokens[c] = (right + 1 + c) % self.vocab_size
            main = max(level, key=lambda c: tree.scores[c])
            if depth <= run:
                tokens[main] = right
            node = main
        self.forced += 1
        return replace(tree, tokens=tokens)
