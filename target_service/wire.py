"""The StepStream wire format: a step's columns as packed Tensors, both ways.

The gateway and the target exchange StepBatch / StepResults columns as they are
(one bytes copy per column), instead of one protobuf message per sequence and
one repeated field per token.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tandem.tensors import (
    array_from_proto,
    array_to_proto,
    list_from_proto,
    list_to_proto,
    tensor_from_proto,
    tensor_to_proto,
)
from tandem.v1 import common_pb2, target_pb2
from target_service.controls import ControlColumns
from target_service.step_batch import StepBatch, StepResults
from target_service.types import InvalidStep, SequenceResult, SequenceStep

CREATE, RETURN_FEATURES, HAS_SEED, SAMPLE_IS_OUTPUT = 1, 2, 4, 8


_CONTROL_COLUMNS = (("repetition_penalty", "float32"), ("frequency_penalty", "float32"),
                    ("presence_penalty", "float32"), ("min_p", "float32"), ("min_tokens", "int32"),
                    ("prompt_len", "int32"), ("stop_counts", "int32"), ("stop_ids", "int32"),
                    ("bias_counts", "int32"), ("bias_ids", "int32"), ("bias_values", "float32"))


def controls_to_proto(cols: ControlColumns, m: target_pb2.PackedItems) -> None:
    for name, dtype in _CONTROL_COLUMNS:
        getattr(m, name).CopyFrom(array_to_proto(getattr(cols, name).astype(dtype)))


def controls_from_proto(m: target_pb2.PackedItems, size: int) -> ControlColumns | None:
    """The controls columns (None when absent), checked for consistent lengths."""
    present = [m.HasField(name) for name, _ in _CONTROL_COLUMNS]
    if not any(present):
        return None
    if not all(present):
        missing = [name for (name, _), p in zip(_CONTROL_COLUMNS, present) if not p]
        raise InvalidStep(f"items: logits controls given without {', '.join(missing)}")
    cols = {name: array_from_proto(getattr(m, name), dtype, f"items.{name}") for name, dtype in _CONTROL_COLUMNS}
    try:
        out = ControlColumns(**cols)
    except ValueError as exc:
        raise InvalidStep(f"items: {exc}") from None
    if out.size != size:
        raise InvalidStep(f"items: logits controls for {out.size} items, expected {size}")
    return out


def batch_to_proto(batch: StepBatch) -> target_pb2.PackedItems:
    flags = (batch.create * CREATE | batch.return_features * RETURN_FEATURES | batch.has_seed * HAS_SEED
             | batch.sample_is_output * SAMPLE_IS_OUTPUT)
    m = _items_to_proto(batch, flags)
    if batch.controls is not None:
        controls_to_proto(batch.controls, m)
    return m


def items_to_proto(items: list[SequenceStep]) -> target_pb2.PackedItems:
    """batch_to_proto(StepBatch.from_items(items)), packed from the items as plain lists: the gateway packs every
    step on the round's path, cold, where each numpy op costs tens of microseconds (list_to_proto). Items with
    logits controls, or values out of their column's range, take the batch's path."""
    if not all(it.controls.neutral for it in items):
        return batch_to_proto(StepBatch.from_items(items))
    sampling = [it.sampling for it in items]
    flags = [CREATE * it.create | RETURN_FEATURES * it.return_features | HAS_SEED * (s.seed is not None)
             | SAMPLE_IS_OUTPUT * it.sample_is_output for it, s in zip(items, sampling)]
    try:
        return target_pb2.PackedItems(
            request_ids=[it.request_id for it in items],
            num_nodes=list_to_proto([len(it.tokens) for it in items], "int32"),
            num_fixed=list_to_proto([it.num_fixed for it in items], "int32"), flags=list_to_proto(flags, "uint8"),
            tokens=list_to_proto(itertools.chain.from_iterable(it.tokens for it in items), "int32"),
            parents=list_to_proto(itertools.chain.from_iterable(it.parents for it in items), "int32"),
            temperature=list_to_proto([s.temperature for s in sampling], "float32"),
            top_k=list_to_proto([s.top_k for s in sampling], "int32"),
            top_p=list_to_proto([s.top_p for s in sampling], "float32"),
            # uint64 seeds, sent as int64 of the same bytes (as batch_to_proto sends them)
            seed=common_pb2.Tensor(dtype="int64", shape=[len(items)],
                                   data=array.array("Q", [s.seed or 0 for s in sampling]).tobytes()),
            top_logprobs=list_to_proto([it.top_logprobs for it in items], "int32"))
    except OverflowError:  # a token, seed or count its column cannot hold: the batch's path wraps it as before
        return batch_to_proto(StepBatch.from_items(items))


def _items_to_proto(batch: StepBatch, flags: np.ndarray) -> target_pb2.PackedItems:
    return target_pb2.PackedItems(
        request_ids=batch.request_ids, num_nodes=array_to_proto(batch.num_nodes.astype(np.int32)),
        num_fixed=array_to_proto(batch.num_fixed.astype(np.int32)), flags=array_to_proto(flags.astype(np.uint8)),
        tokens=array_to_proto(batch.tokens.astype(np.int32)), parents=array_to_proto(batch.parents.astype(np.int32)),
        temperature=array_to_proto(batch.temperature.astype(np.float32)),
        top_k=array_to_proto(batch.top_k.astype(np.int32)), top_p=array_to_proto(batch.top_p.astype(np.float32)),
        seed=array_to_proto(batch.seed.astype(np.uint64).view(np.int64)),
        top_logprobs=array_to_proto(batch.top_logprobs.astype(np.int32)))


def batch_from_proto(m: target_pb2.PackedItems) -> StepBatch:
    """The columns, checked for consistent lengths (InvalidStep otherwise); the engine
    validates their values."""
    B = len(m.request_ids)

    def column(name: str, dtype: str, length: int) -> np.ndarray:
        values = array_from_proto(getattr(m, name), dtype, f"items.{name}")
        if values.ndim != 1 or len(values) != length:
            raise InvalidStep(f"items.{name} has {values.size} values, expected {length}")
        return values

    num_nodes = column("num_nodes", "int32", B)
    if (num_nodes < 1).any():
        b = int(np.flatnonzero(num_nodes < 1)[0])
        raise InvalidStep(f"request {m.request_ids[b]!r}: empty tree: a step item needs at least one token")
    total = int(num_nodes.sum())
    flags = column("flags", "uint8", B)
    return StepBatch(
        request_ids=tuple(m.request_ids), create=(flags & CREATE) > 0, num_nodes=num_nodes,
        num_fixed=column("num_fixed", "int32", B), tokens=column("tokens", "int32", total),
        parents=column("parents", "int32", total), temperature=column("temperature", "float32", B),
        top_k=column("top_k", "int32", B), top_p=column("top_p", "float32", B),
        seed=column("seed", "int64", B).view(np.uint64), has_seed=(flags & HAS_SEED) > 0,
        top_logprobs=column("top_logprobs", "int32", B), return_features=(flags & RETURN_FEATURES) > 0,
        sample_is_output=(flags & SAMPLE_IS_OUTPUT) > 0, controls=controls_from_proto(m, B))


@dataclass(frozen=True, kw_only=True, eq=False)
class GrantStops:
    """Per item of a grant: how many tokens it may emit, and the ids it stops after."""

    max_new_tokens: np.ndarray  # int32 [B]
    stop_token_ids: tuple[frozenset[int], ...]

    def to_proto(self) -> target_pb2.GrantStops:
        counts = np.array([len(s) for s in self.stop_token_ids], dtype=np.int32)
        ids = np.array([t for s in self.stop_token_ids for t in sorted(s)], dtype=np.int32)
        return target_pb2.GrantStops(max_new_tokens=array_to_proto(self.max_new_tokens.astype(np.int32)),
                                     stop_token_counts=array_to_proto(counts), stop_token_ids=array_to_proto(ids))

    @classmethod
    def from_proto(cls, m: target_pb2.GrantStops, size: int) -> GrantStops:
        limit = array_from_proto(m.max_new_tokens, "int32", "stops.max_new_tokens")
        counts = array_from_proto(m.stop_token_counts, "int32", "stops.stop_token_counts")
        ids = array_from_proto(m.stop_token_ids, "int32", "stops.stop_token_ids")
        if len(limit) != size or len(counts) != size or int(counts.sum()) != len(ids) or (counts < 0).any():
            raise InvalidStep(f"grant stops do not match the {size} items")
        ends = np.cumsum(counts)
        return cls(max_new_tokens=limit,
                   stop_token_ids=tuple(frozenset(ids[e - c: e].tolist()) for c, e in zip(counts, ends)))


def results_to_proto(results: StepResults, item_index: np.ndarray) -> target_pb2.PackedResults:
    count = results.num_accepted.astype(np.int64)
    width = results.new_tokens.shape[1] if results.new_tokens.ndim == 2 else 0
    new_mask = np.arange(width)[None, :] < (count + 1)[:, None]
    accepted_mask = np.arange(width)[None, :] < count[:, None]
    m = target_pb2.PackedResults(
        item_index=array_to_proto(item_index.astype(np.int32)),
        num_accepted=array_to_proto(results.num_accepted.astype(np.int32)),
        accepted_nodes=array_to_proto(results.accepted_nodes[accepted_mask].astype(np.int32)),
        tokens=array_to_proto(results.new_tokens[new_mask].astype(np.int32)),
        logprobs=array_to_proto(results.logprobs[new_mask].astype(np.float32)),
        num_committed=array_to_proto(results.num_committed.astype(np.int64)))
    if results.top_ids is not None:
        k = results.top_k.astype(np.int64)
        col = np.arange(results.top_ids.shape[2])
        keep = new_mask[:, :, None] & (col[None, None, :] < k[:, None, None])
        m.top_k.CopyFrom(array_to_proto(results.top_k.astype(np.int32)))
        m.top_ids.CopyFrom(array_to_proto(results.top_ids[keep].astype(np.int32)))
        m.top_logprobs.CopyFrom(array_to_proto(results.top_logprobs[keep].astype(np.float32)))
    if results.features is not None:
        m.features.CopyFrom(tensor_to_proto(results.features))
        m.feature_counts.CopyFrom(array_to_proto(results.feature_counts.astype(np.int64)))
    return m


def results_from_proto(m: target_pb2.PackedResults, request_ids: list[str] | tuple[str, ...]
                       ) -> list[SequenceResult]:
    """Per-sequence results; request_ids are the call's items (item_index picks among them)."""
    # Plain lists (list_from_proto): the gateway parses every step's reply on the round's path, cold.
    index = list_from_proto(m.item_index, "int32", "item_index")
    count = list_from_proto(m.num_accepted, "int32", "num_accepted")
    accepted = list_from_proto(m.accepted_nodes, "int32", "accepted_nodes")
    tokens = list_from_proto(m.tokens, "int32", "tokens")
    logprobs = list_from_proto(m.logprobs, "float32", "logprobs")
    committed = list_from_proto(m.num_committed, "int64", "num_committed")
    top_k = list_from_proto(m.top_k, "int32", "top_k") if m.HasField("top_k") else None
    top_ids = list_from_proto(m.top_ids, "int32", "top_ids") if top_k else None
    top_lps = list_from_proto(m.top_logprobs, "float32", "top_logprobs") if top_k else None
    features: torch.Tensor | None = tensor_from_proto(m.features) if m.HasField("features") else None
    feature_counts = list_from_proto(m.feature_counts, "int64", "feature_counts") \
        if m.HasField("feature_counts") else None
    out = []
    at_acc = at_tok = at_top = at_feat = 0
    for i, item in enumerate(index):
        n_acc = count[i]
        n_new = n_acc + 1
        tops: list[tuple[list[int], list[float]]] = []
        if top_k and top_k[i]:
            k = top_k[i]
            for _ in range(n_new):
                tops.append((top_ids[at_top: at_top + k], top_lps[at_top: at_top + k]))
                at_top += k
        feats = None
        if feature_counts is not None and feature_counts[i]:
            feats = features[at_feat: at_feat + feature_counts[i]]
            at_feat += feature_counts[i]
        out.append(SequenceResult(request_id=request_ids[item], accepted_nodes=accepted[at_acc: at_acc + n_acc],
                                  tokens=tokens[at_tok: at_tok + n_new], logprobs=logprobs[at_tok: at_tok + n_new],
                                  top_logprobs=tops, features=feats, num_committed=committed[i]))
        at_acc += n_acc
        at_tok += n_new
    return out
