"""Early trees: a request's next tree, grown as soon as the target pushes its verify step's features.

In a speculative round the gateway waits for the target's verify reply, applies
it, and only then asks the draft for the next tree, which the draft grows after
catching up on the accepted tokens. But the target pushes the verify step's
features to the replica as the step ends (SubscribeFeatures), with the tokens
they belong to and the token it sampled after them: everything the next tree
needs. So the replica catches up and grows the request's next tree at once,
with the budget of the request's last Draft call, while the reply travels to
the gateway and the gateway updates and sends its call; the call then finds the
tree ready (DraftEngine.grow_early). A call with another budget, or that knows
other tokens, gets a tree grown anew. Output never depends on which tree the
target verifies, only speed does.

An order lasts one tree: a request the gateway stops drafting (a plain step
under auto) costs at most one tree nobody asks for, and the replica grows
nothing for requests that do not draft. The cost and the gain are measured in
BENCHMARKS.md ("Early trees").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from draft_service.target_features import PushedTokens
from draft_service.types import DraftBudget, DraftItem, DraftTree, IngestItem
from tandem.feature_store import FeatureStore

log = logging.getLogger("tandem.draft")

# How long the worker waits for the rest of a step's pushes once the first has come (the last of a
# step is marked step_end), so that a step's trees grow in one batch: on the H200 at 64 requests the
# rows (about 100 KB a request on the scale track) took longer than 2 ms to arrive, and trees grown
# in parts cost more than the batch (issue 12, BENCHMARKS.md "Early trees"). Only a lost step_end
# waits this long.
GATHER_S = 0.05


@dataclass(frozen=True)
class _Order:
    budget: DraftBudget
    root_position: int  # of the tree the call drafted: its verify step's rows start there


class EarlyTrees:
    """Orders from Draft calls, pushes from the target, and the thread that grows their trees.

    grow(items, ingest): the servicer's way into the engine (under its lock), given the due
    requests' draft items and their ingest items built from the pushes; rows: the reader's store
    of pushed rows, which the growth reads without freeing them (the gateway's call reads them too).
    """

    def __init__(self, grow: Callable[[list[DraftItem], list[IngestItem]], None], rows: FeatureStore,
                 gather_s: float = GATHER_S):
        self._grow = grow
        self._rows = rows
        self._gather_s = gather_s
        self._orders: dict[str, _Order] = {}
        self._due: list[tuple[PushedTokens, DraftBudget]] = []
        self._step_ended = False  # the due pushes include the last of their step
        self._lock = threading.Lock()
        self._woken = threading.Condition(self._lock)
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="early-trees", daemon=True)
        self._thread.start()

    def order(self, items: Sequence[DraftItem], trees: Sequence[DraftTree]) -> None:
        """After a Draft call: each request it drafted a tree for gets its next tree early, at that
        budget, once the target pushes the features of the step that verifies this one."""
        with self._lock:
            for it, tree in zip(items, trees, strict=True):
                if it.budget.empty or not tree.tokens:
                    self._orders.pop(it.request_id, None)
                else:
                    self._orders[it.request_id] = _Order(it.budget, tree.root_position)

    def forget(self, request_ids: Sequence[str]) -> None:
        gone = set(request_ids)
        with self._lock:
            for rid in gone:
                self._orders.pop(rid, None)
            self._due = [(push, budget) for push, budget in self._due if push.request_id not in gone]

    def pushed(self, push: PushedTokens) -> None:
        """The reader's listener (its subscription thread): the rows are in `rows` by now."""
        with self._lock:
            order = self._orders.get(push.request_id)
            # The verify step of the ordered tree commits from its root on. Rows from before it are
            # the ones its call waited for (they came after the call); rows from after it mean the
            # request moved on without verifying that tree: the order is void.
            if order is not None and push.start >= order.root_position:
                del self._orders[push.request_id]
                if push.start == order.root_position and len(push.tokens) >= 2:
                    self._due.append((push, order.budget))
            if push.step_end and self._due:
                self._step_ended = True
            if self._due:
                self._woken.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._woken.notify()
        self._thread.join(timeout=5)

    def _work(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._due:
                    self._woken.wait()
                deadline = time.monotonic() + self._gather_s
                while not self._closed and not self._step_ended and (left := deadline - time.monotonic()) > 0:
                    self._woken.wait(left)
                if self._closed:
                    return
                due, self._due, self._step_ended = self._due, [], False
            try:
                self._grow_due(due)
            except Exception:  # an early tree is an optimisation: the call grows its own
                log.exception("growing early trees failed")

    def _grow_due(self, due: list[tuple[PushedTokens, DraftBudget]]) -> None:
        items, ingest = [], []
        for push, budget in due:
            rows = len(push.tokens) - 1  # the last token is the sample after them: a root, no row
            features = self._rows.peek(push.request_id, push.start, push.start + rows)
            if features is None:  # read, or dropped, already: a tree from guessed states is not worth it
                continue
            ingest.append(IngestItem(push.request_id, push.start, push.tokens, features))
            items.append(DraftItem(push.request_id, budget))
        if items:
            self._grow(items, ingest)
