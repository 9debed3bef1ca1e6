"""Draft trees on the wire (DraftResponse.packed): what the draft packs is what the gateway reads.

The columns travel as plain lists through the stdlib's array module (tandem.tensors.list_to_proto,
list_from_proto): the same bytes numpy's columns were, and the same refusals of a message that does not
hold what its columns say.
"""

from __future__ import annotations

import numpy as np
import pytest

from draft_service.tree_wire import trees_from_proto, trees_to_proto
from draft_service.types import DraftTree
from tandem.errors import InvalidArgument
from tandem.tensors import array_from_proto, array_to_proto, list_from_proto, list_to_proto


def tree(rid: str, nodes: int, root: int = 5, position: int = 40) -> DraftTree:
    return DraftTree(rid, root, position, [10 + i for i in range(nodes)], [i - 1 for i in range(nodes)],
                     [i + 1 for i in range(nodes)], [-0.25 * i for i in range(nodes)], [-0.5 * i for i in range(nodes)])


@pytest.mark.parametrize("trees", [[tree("a", 8)], [tree("a", 3), tree("b", 0), tree("c", 5, root=7, position=2**40)],
                                   [tree("a", 0)], []])
def test_packed_trees_read_back_as_the_trees_that_were_packed(trees):
    assert trees_from_proto(trees_to_proto(trees)) == trees


def test_plain_list_columns_are_the_bytes_of_numpy_columns():
    for values, dtype, np_dtype in (([1, -2, 3], "int32", np.int32), ([2**40, -1], "int64", np.int64),
                                    ([0.5, -1.25, 3.0], "float32", np.float32), ([], "int32", np.int32)):
        assert list_to_proto(values, dtype) == array_to_proto(np.array(values, dtype=np_dtype))
        assert list_from_proto(list_to_proto(values, dtype), dtype, "x") == values
        assert array_from_proto(list_to_proto(values, dtype), dtype, "x").tolist() == values


def test_a_column_of_another_dtype_or_the_wrong_size_is_refused():
    with pytest.raises(InvalidArgument, match="x: expected int64 values, got 'int32'"):
        list_from_proto(list_to_proto([1, 2], "int32"), "int64", "x")
    short = list_to_proto([1, 2], "int32")
    short.shape[:] = [3]
    with pytest.raises(InvalidArgument, match="x: shape \\[3\\] needs 12 bytes, got 8"):
        list_from_proto(short, "int32", "x")


def test_packed_trees_whose_columns_disagree_are_refused():
    packed = trees_to_proto([tree("a", 3), tree("b", 2)])
    packed.root_tokens.CopyFrom(list_to_proto([5], "int32"))
    with pytest.raises(ValueError, match="per-tree columns differ"):
        trees_from_proto(packed)
    packed = trees_to_proto([tree("a", 3), tree("b", 2)])
    packed.tokens.CopyFrom(list_to_proto([1, 2, 3, 4], "int32"))
    with pytest.raises(ValueError, match="do not hold num_nodes"):
        trees_from_proto(packed)
    packed = trees_to_proto([tree("a", 3), tree("b", 2)])
    packed.num_nodes.CopyFrom(list_to_proto([6, -1], "int32"))
    with pytest.raises(ValueError, match="do not hold num_nodes"):
        trees_from_proto(packed)
