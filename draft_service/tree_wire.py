"""Draft trees as packed columns (DraftResponse.packed): one Tensor per field for the
whole call, instead of a DraftTree message per tree with repeated fields. Packed and
parsed as plain lists (tandem.tensors.list_to_proto, list_from_proto): a call's trees
are few and small, and each side runs this on the round's path."""

from __future__ import annotations

import itertools

from draft_service.types import DraftTree
from tandem.tensors import list_from_proto, list_to_proto
from tandem.v1 import draft_pb2

NODE_COLUMNS = (("tokens", "int32"), ("parents", "int32"), ("depths", "int32"), ("logprobs", "float32"),
                ("scores", "float32"))


def trees_to_proto(trees: list[DraftTree]) -> draft_pb2.PackedTrees:
    def nodes(field: str, dtype: str):
        return list_to_proto(itertools.chain.from_iterable(getattr(t, field) for t in trees), dtype)

    return draft_pb2.PackedTrees(
        request_ids=[t.request_id for t in trees],
        num_nodes=list_to_proto([len(t.tokens) for t in trees], "int32"),
        root_tokens=list_to_proto([t.root_token for t in trees], "int32"),
        root_positions=list_to_proto([t.root_position for t in trees], "int64"),
        **{name: nodes(name, dtype) for name, dtype in NODE_COLUMNS})


def trees_from_proto(m: draft_pb2.PackedTrees) -> list[DraftTree]:
    counts = list_from_proto(m.num_nodes, "int32", "packed trees: num_nodes")
    roots = list_from_proto(m.root_tokens, "int32", "packed trees: root_tokens")
    positions = list_from_proto(m.root_positions, "int64", "packed trees: root_positions")
    columns = [list_from_proto(getattr(m, name), dtype, f"packed trees: {name}") for name, dtype in NODE_COLUMNS]
    request_ids = m.request_ids
    if not len(request_ids) == len(counts) == len(roots) == len(positions):
        raise ValueError("packed trees: the per-tree columns differ in length")
    nodes = sum(counts)
    if min(counts, default=0) < 0 or any(len(values) != nodes for values in columns):
        raise ValueError("packed trees: the node columns do not hold num_nodes entries")
    if len(request_ids) == 1:  # one request's call: its columns are its tree's
        return [DraftTree(request_ids[0], roots[0], positions[0], *columns)]
    trees, lo = [], 0
    for rid, count, root, position in zip(request_ids, counts, roots, positions):
        trees.append(DraftTree(rid, root, position, *(values[lo: lo + count] for values in columns)))
        lo += count
    return trees
