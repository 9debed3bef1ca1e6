"""Early trees (draft_service.early_trees): which pushes grow a request's next tree before its call.

An order comes from a Draft call that drafted a tree; the target's push of the rows from that
tree's root position on makes it due, once; pushes from before it (the rows its own call waited
for) leave it standing, pushes from after it void it. A step's pushes grow in one batch.
"""

from __future__ import annotations

import threading
import time

import torch

from draft_service.early_trees import EarlyTrees
from draft_service.target_features import PushedTokens
from draft_service.types import DraftBudget, DraftItem, DraftTree
from tandem.feature_store import FeatureStore

BUDGET = DraftBudget(steps=3, topk=2, num_draft_tokens=4)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[list[DraftItem], list]] = []
        self.grew = threading.Event()

    def __call__(self, items, ingest) -> None:
        self.calls.append((items, ingest))
        self.grew.set()


def tree(rid: str, root: int) -> DraftTree:
    return DraftTree(rid, root_token=7, root_position=root, tokens=[1, 2], parents=[-1, 0], depths=[1, 2])


def push(store: FeatureStore, rid: str, start: int, tokens: tuple[int, ...], step_end: bool = True) -> PushedTokens:
    store.hold(rid, start, torch.full((len(tokens) - 1, 3), float(start)))
    return PushedTokens(rid, start, tokens, step_end)


def wait_for(recorder: Recorder, calls: int) -> None:
    deadline = time.monotonic() + 10
    while len(recorder.calls) < calls:
        assert time.monotonic() < deadline, "no early growth"
        time.sleep(0.005)


def test_the_push_from_the_trees_root_grows_the_next_tree_once_with_its_features_and_budget():
    store, grow = FeatureStore(100), Recorder()
    early = EarlyTrees(grow, store)
    try:
        early.order([DraftItem("r", BUDGET)], [tree("r", 9)])
        early.pushed(push(store, "r", 5, (3, 4, 5, 6, 7)))  # the rows the call itself waited for: not these
        early.pushed(push(store, "r", 9, (7, 8, 9)))
        wait_for(grow, 1)
        [(items, ingest)] = grow.calls
        assert items == [DraftItem("r", BUDGET)]
        assert (ingest[0].start_position, ingest[0].tokens) == (9, (7, 8, 9))
        assert torch.equal(ingest[0].features, torch.full((2, 3), 9.0))
        assert store.read("r", 9, 11)[1] is not None  # the call's own read still finds the rows
        early.pushed(push(store, "r", 11, (9, 4)))  # no new call, no order: nothing grows
        time.sleep(0.05)
        assert len(grow.calls) == 1
    finally:
        early.close()


def test_an_order_is_void_once_the_request_moves_on_and_gone_when_it_is_released():
    store, grow = FeatureStore(100), Recorder()
    early = EarlyTrees(grow, store)
    try:
        early.order([DraftItem("a", BUDGET), DraftItem("b", BUDGET), DraftItem("c", DraftBudget(0, 0, 0))],
                    [tree("a", 4), tree("b", 4), DraftTree("c", 7, 4)])
        early.pushed(push(store, "a", 6, (1, 2)))  # a plain step after the tree was dropped: void
        early.pushed(push(store, "a", 4, (1, 2, 3)))  # (and a late one changes nothing)
        early.forget(["b"])
        early.pushed(push(store, "b", 4, (1, 2)))
        early.pushed(push(store, "c", 4, (1, 2)))  # an empty budget orders nothing
        time.sleep(0.05)
        assert grow.calls == []
    finally:
        early.close()


def test_a_steps_pushes_grow_together_and_wait_for_its_last():
    store, grow = FeatureStore(100), Recorder()
    early = EarlyTrees(grow, store, gather_s=30.0)  # it waits for the step's last push, not this long
    try:
        early.order([DraftItem(rid, BUDGET) for rid in "abc"], [tree(rid, 2) for rid in "abc"])
        early.pushed(push(store, "a", 2, (5, 6), step_end=False))
        early.pushed(push(store, "b", 2, (5, 6, 7), step_end=False))
        early.pushed(push(store, "c", 2, (5, 6), step_end=True))
        wait_for(grow, 1)
        time.sleep(0.02)
        assert [[it.request_id for it in items] for items, _ in grow.calls] == [["a", "b", "c"]]
    finally:
        early.close()
