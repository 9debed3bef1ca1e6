"""A target step's input and output in columns (numpy arrays, one row per sequence).

The engine's hot path works on these rather than on one object per sequence: a
step of 64 requests is a handful of array operations on the host, and the wire
format (target_service.wire) carries the same columns as packed bytes.
SequenceStep / SequenceResult stay as the per-sequence view for callers that
want it (tests, tools).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
import torch

from target_service.controls import ControlColumns
from target_service.types import SamplingParams, SequenceResult, SequenceStep


@dataclass(frozen=True, kw_only=True, eq=False)
class StepBatch:
    """Every sequence's tree for one step. Item b's nodes are tokens[starts[b]:starts[b+1]]."""

    request_ids: tuple[str, ...]
    create: np.ndarray  # bool [B]
    num_nodes: np.ndarray  # int32 [B]
    num_fixed: np.ndarray  # int32 [B]
    tokens: np.ndarray  # int32 [R]
    parents: np.ndarray  # int32 [R]: parent within the item, -1 for its node 0
    temperature: np.ndarray  # float32 [B]; 0 = greedy
    top_k: np.ndarray  # int32 [B]; 0 = off
    top_p: np.ndarray  # float32 [B]; outside (0, 1) = off
    seed: np.ndarray  # uint64 [B]
    has_seed: np.ndarray  # bool [B]
    top_logprobs: np.ndarray  # int32 [B]
    return_features: np.ndarray  # bool [B]
    controls: ControlColumns | None = None  # None: every sequence's logits controls are neutral
    # bool [B] (SequenceStep.sample_is_output); not given: all False, filled in at construction
    sample_is_output: np.ndarray | None = None

    def __post_init__(self) -> None:
        B = len(self.request_ids)
        for name in ("create", "num_nodes", "num_fixed", "temperature", "top_k", "top_p", "seed", "has_seed",
                     "top_logprobs", "return_features"):
            if len(getattr(self, name)) != B:
                raise ValueError(f"StepBatch.{name} has {len(getattr(self, name))} entries for {B} sequences")
        if self.sample_is_output is None:
            object.__setattr__(self, "sample_is_output", np.zeros(B, dtype=bool))
        elif len(self.sample_is_output) != B:
            raise ValueError(f"StepBatch.sample_is_output has {len(self.sample_is_output)} entries for {B} sequences")
        if self.controls is not None and self.controls.size != B:
            raise ValueError(f"StepBatch.controls has {self.controls.size} entries for {B} sequences")
        if len(self.tokens) != len(self.parents) or len(self.tokens) != int(self.num_nodes.sum()):
            raise ValueError(f"{len(self.tokens)} tokens and {len(self.parents)} parents for "
                             f"{int(self.num_nodes.sum())} nodes")

    @property
    def size(self) -> int:
        return len(self.request_ids)

    # Computed once per batch (read-only): validation, packing and results each ask.
    @cached_property
    def starts(self) -> np.ndarray:
        """int64 [B + 1]: where each item's nodes begin, then the total."""
        out = np.zeros(self.size + 1, dtype=np.int64)
        # The ufunc itself: np.cumsum's wrapper and its cast cost a plain step about a microsecond more.
        np.add.accumulate(self.num_nodes, dtype=np.int64, out=out[1:])
        return out

    @cached_property
    def drafted_trees(self) -> dict[int, tuple[int, ...]]:
        """Per item with drafted nodes (few: plain decode has none), the parents of its tree part:
        the root (its last fixed node) is 0, its parent 0. Validation and packing both walk them."""
        if len(self.tokens) == self.size:
            return {}
        starts, nf = self.starts, self.num_fixed
        trees = {}
        for b in np.flatnonzero(self.num_nodes > nf).tolist():
            root = int(nf[b]) - 1
            drafted = self.parents[starts[b] + root + 1: starts[b + 1]] - root
            trees[b] = (0, *drafted.tolist())
        return trees

    @cached_property
    def greedy(self) -> np.ndarray:
        return ~(self.temperature > 0)

    @classmethod
    def from_items(cls, items: list[SequenceStep]) -> StepBatch:
        tokens: list[int] = []
        parents: list[int] = []
        for it in items:
            tokens.extend(it.tokens)
            parents.extend(it.parents)
        sampling = [it.sampling for it in items]
        seeds = [s.seed for s in sampling]
        # One array per dtype, a row per column: an array costs about a microsecond to make
        # whatever its length, and a one-item step made thirteen.
        ints = np.array([[len(it.tokens) for it in items], [it.num_fixed for it in items],
                         [s.top_k for s in sampling], [it.top_logprobs for it in items]], dtype=np.int32)
        floats = np.array([[s.temperature for s in sampling], [s.top_p for s in sampling]], dtype=np.float32)
        flags = np.array([[it.create for it in items], [s is not None for s in seeds],
                          [it.return_features for it in items], [it.sample_is_output for it in items]], dtype=bool)
        return cls(
            request_ids=tuple(it.request_id for it in items),
            create=flags[0], num_nodes=ints[0], num_fixed=ints[1],
            tokens=np.array(tokens, dtype=np.int64).astype(np.int32) if tokens else np.zeros(0, np.int32),
            parents=np.array(parents, dtype=np.int32),
            temperature=floats[0], top_k=ints[2], top_p=floats[1],
            seed=np.array([s or 0 for s in seeds], dtype=np.uint64), has_seed=flags[1],
            top_logprobs=ints[3], return_features=flags[2], sample_is_output=flags[3],
            controls=ControlColumns.from_items([it.controls for it in items]))

    def items(self) -> list[SequenceStep]:
        starts = self.starts
        out = []
        for b, rid in enumerate(self.request_ids):
            nodes = slice(starts[b], starts[b + 1])
            out.append(SequenceStep(
                request_id=rid, tokens=tuple(int(t) for t in self.tokens[nodes]),
                parents=tuple(int(p) for p in self.parents[nodes]), num_fixed=int(self.num_fixed[b]),
                create=bool(self.create[b]),
                sampling=SamplingParams(temperature=float(self.temperature[b]), top_k=int(self.top_k[b]),
                                        top_p=float(self.top_p[b]),
                                        seed=int(self.seed[b]) if self.has_seed[b] else None),
                top_logprobs=int(self.top_logprobs[b]), return_features=bool(self.return_features[b]),
                sample_is_output=bool(self.sample_is_output[b]),
                **({} if self.controls is None else {"controls": self.controls.item(b)})))
        return out

    def with_seeds(self, draw: callable) -> StepBatch:
        """Give every sampled sequence without a seed one (draw() -> int < 2**63)."""
        missing = ~self.has_seed & (self.temperature > 0)
        if not missing.any():
            return self
        seed = self.seed.copy()
        seed[missing] = [draw() for _ in range(int(missing.sum()))]
        return replace(self, seed=seed, has_seed=self.has_seed | missing)


    def take(self, rows: np.ndarray, tokens: np.ndarray) -> StepBatch:
        """Items `rows` of a batch of one-node items, each now with the given token and no
        create flag: the next step of a plain-decode grant (whose every sample is output: it feeds them
        forward)."""
        pick = {name: getattr(self, name)[rows] for name in ("num_nodes", "num_fixed", "temperature", "top_k",
                                                             "top_p", "seed", "has_seed", "top_logprobs",
                                                             "return_features")}
        return StepBatch(request_ids=tuple(self.request_ids[r] for r in rows.tolist()),
                         create=np.zeros(len(rows), dtype=bool), tokens=tokens.astype(np.int32),
                         parents=np.full(len(rows), -1, dtype=np.int32),
                         sample_is_output=np.ones(len(rows), dtype=bool),
                         controls=None if self.controls is None else self.controls.take(rows), **pick)


@dataclass(kw_only=True, eq=False)
class StepResults:
    """What a step gives back, per sequence b: new_tokens[b, :num_accepted[b] + 1] are the
    accepted drafted tokens, then the bonus token; accepted_nodes[b, :num_accepted[b]] are
    their indices in the item's tree. Features (when asked) are the committed tokens'
    rows, sequence after sequence, feature_counts[b] each (0 for those that did not ask)."""

    request_ids: tuple[str, ...]
    num_accepted: np.ndarray  # int32 [B]
    accepted_nodes: np.ndarray  # int32 [B, M]
    new_tokens: np.ndarray  # int32 [B, M]
    logprobs: np.ndarray  # float32 [B, M]
    num_committed: np.ndarray  # int64 [B]: tokens whose KV the target now holds
    top_ids: np.ndarray | None = None  # int32 [B, M, K]
    top_logprobs: np.ndarray | None = None  # float32 [B, M, K]
    top_k: np.ndarray | None = None  # int32 [B]: how many of K each sequence asked for
    features: torch.Tensor | None = None  # [sum(feature_counts), F]
    feature_counts: np.ndarray | None = None  # int64 [B]

    def sequence_results(self) -> list[SequenceResult]:
        out = []
        feature_at = 0
        for b, rid in enumerate(self.request_ids):
            n = int(self.num_accepted[b]) + 1
            tops: list[tuple[list[int], list[float]]] = []
            if self.top_ids is not None and self.top_k[b]:
                k = int(self.top_k[b])
                tops = [(self.top_ids[b, j, :k].tolist(), self.top_logprobs[b, j, :k].tolist()) for j in range(n)]
            features = None
            if self.feature_counts is not None and self.feature_counts[b]:
                count = int(self.feature_counts[b])
                features = self.features[feature_at: feature_at + count]
                feature_at += count
            out.append(SequenceResult(request_id=rid, accepted_nodes=self.accepted_nodes[b, : n - 1].tolist(),
                                      tokens=self.new_tokens[b, :n].tolist(), logprobs=self.logprobs[b, :n].tolist(),
                                      top_logprobs=tops, features=features, num_committed=int(self.num_committed[b])))
        return out
