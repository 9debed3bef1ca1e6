"""Draft trees as packed columns (DraftResponse.packed): one Tensor per field for the
whole call, instead of a DraftTree message per tree with repeated fields."""

from __future__ import annotations

import numpy as np

from draft_service.types import DraftTree
from tandem.tensors import array_from_proto, array_to_proto
from tandem.v1 import draft_pb2


def trees_to_proto(trees: list[DraftTree]) -> draft_pb2.PackedTrees:
    def column(values, dtype) -> np.ndarray:
        return np.fromiter(values, dtype=dtype)

    def nodes(field: str, dtype) -> np.ndarray:
        return column((v for t in trees for v in getattr(t, field)), dtype)

    return draft_pb2.PackedTrees(
        request_ids=[t.request_id for t in trees],
        num_nodes=array_to_proto(column((len(t.tokens) for t in trees), np.int32)),
        root_tokens=array_to_proto(column((t.root_token for t in trees), np.int32)),
        root_positions=array_to_proto(column((t.root_position for t in trees), np.int64)),
        tokens=array_to_proto(nodes("tokens", np.int32)), parents=array_to_proto(nodes("parents", np.int32)),
        depths=array_to_proto(nodes("depths", np.int32)), logprobs=array_to_proto(nodes("logprobs", np.float32)),
        scores=array_to_proto(nodes("scores", np.float32)))


def trees_from_proto(m: draft_pb2.PackedTrees) -> list[DraftTree]:
    counts = array_from_proto(m.num_nodes, "int32", "packed trees: num_nodes")
    roots = array_from_proto(m.root_tokens, "int32", "packed trees: root_tokens").tolist()
    positions = array_from_proto(m.root_positions, "int64", "packed trees: root_positions").tolist()
    columns = {name: array_from_proto(getattr(m, name), dtype, f"packed trees: {name}").tolist()
               for name, dtype in (("tokens", "int32"), ("parents", "int32"), ("depths", "int32"),
                                   ("logprobs", "float32"), ("scores", "float32"))}
    if not len(m.request_ids) == len(counts) == len(roots) == len(positions):
        raise ValueError("packed trees: the per-tree columns differ in length")
    ends = np.cumsum(counts).tolist()
    if any(len(values) != (ends[-1] if ends else 0) for values in columns.values()):
        raise ValueError("packed trees: the node columns do not hold num_nodes entries")
    out = []
    for b, rid in enumerate(m.request_ids):
        lo, hi = (ends[b - 1] if b else 0), ends[b]
        out.append(DraftTree(rid, roots[b], positions[b], *(columns[name][lo:hi] for name in
                                                          ("tokens", "parents", "depths", "logprobs", "scores"))))
    return out
