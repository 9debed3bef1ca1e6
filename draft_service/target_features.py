"""The draft's link to the target's features: pushed to it as steps commit them, or read.

When a step ran with hold_features, the gateway sends the draft tokens and a
row count (IngestItem.target_feature_rows) instead of the features, so that
features go target -> draft once and never through the gateway. The reader
subscribes to the target under a sink name of its own (SubscribeFeatures;
DraftInfo.feature_sink tells the gateway the name, which it puts in its
steps): the target then pushes each step's rows as the step ends, and they
are here, or on their way, when an ingest needs them. Rows that were not
pushed (no live subscription when the step ran) are read from the target
(ReadFeatures, one call for all of a call's items) before the engine sees the
items. Rows the target no longer holds, or a target that cannot be reached,
leave those positions without features: the engine catches them up from its
own hidden state (approximate; output never depends on it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Callable

import grpc

from draft_service.types import IngestItem
from tandem.channels import open_channel
from tandem.feature_store import FeatureStore
from tandem.tensors import tensor_from_proto
from tandem.tls import ClientTLS
from tandem.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.draft")
WARN_EVERY_S = 60.0  # a target that cannot be reached is logged at most this often
# How long an ingest waits for pushed rows not yet here. They leave the target with the step's
# reply, and the gateway acts on the reply before it sends them on, so they are normally here
# first; a miss costs this wait and then a pull.
PUSH_WAIT_S = 0.05
PUSHED_ROWS = 16384  # rows kept until an ingest uses them (as the target's --max-held-features)


class TargetFeatureReader:
    """subscribe: take pushed rows (a subscription thread, reconnecting after a break);
    False: pull every row with ReadFeatures. on_rows(source, rows): told, per fill, how many
    rows were pushed, read, or absent (the service's metrics)."""

    def __init__(self, address: str, tls: ClientTLS | None = None, timeout: float = 10.0, subscribe: bool = True,
                 on_rows: Callable[[str, int], None] | None = None):
        self.address = address
        self.on_rows = on_rows
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self._warned_at = -WARN_EVERY_S
        self.sink = f"draft-{uuid.uuid4().hex}" if subscribe else ""
        self.pushed = FeatureStore(PUSHED_ROWS)
        self.live = False  # the target has confirmed the subscription and pushes to it
        self._closed = threading.Event()
        self._call = None
        self._thread = None
        if subscribe:
            self._thread = threading.Thread(target=self._subscribe, name="feature-subscription", daemon=True)
            self._thread.start()

    def _subscribe(self) -> None:
        backoff = 0.1
        while not self._closed.is_set():
            try:
                self._call = self.stub.SubscribeFeatures(target_pb2.SubscribeFeaturesRequest(sink=self.sink))
                for msg in self._call:
                    if not msg.request_id:
                        self.live, backoff = True, 0.1
                        log.info("features from the target at %s are pushed to this draft", self.address)
                        continue
                    self.pushed.hold(msg.request_id, msg.start_position, tensor_from_proto(msg.features))
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the target at %s pushes no features; this draft reads them", self.address)
                    return
                self._warn(f"feature subscription to the target at {self.address} broke "
                           f"({exc.code().name}: {exc.details()}); features are read until it is back")
            finally:
                self.live = False
            self._closed.wait(backoff)
            backoff = min(2 * backoff, 2.0)

    def fill(self, items: list[IngestItem]) -> list[IngestItem]:
        """The items with the target's rows for them in `features` (target_feature_rows
        cleared): what an inline feed would have sent. Pushed rows first, then a pull."""
        wanted = [i for i, it in enumerate(items) if it.target_feature_rows and it.features is None]
        if not wanted:
            return items
        out = [dataclasses.replace(it, target_feature_rows=0) for it in items]
        pulled = wanted
        if self.live:
            deadline = time.monotonic() + PUSH_WAIT_S
            missing = []
            for i in wanted:
                it = items[i]
                end = it.start_position + it.target_feature_rows
                self.pushed.wait_for(it.request_id, end, max(0.0, deadline - time.monotonic()))
                start, rows = self.pushed.read(it.request_id, it.start_position, end)
                if rows is not None and start == it.start_position:
                    out[i] = dataclasses.replace(out[i], features=rows)
                else:
                    missing.append(i)
            late = set(missing)
            self._count("pushed", [i for i in wanted if i not in late], out)
            pulled = missing
        if pulled:
            self._pull(items, pulled, out)
            self._count("read", pulled, out)
            if self.live and any(out[i].features is not None for i in pulled):  # held, not pushed: a sink not named
                self._warn(f"features of {len(pulled)} item(s) were held at the target, not pushed to this "
                           f"draft's sink {self.sink!r}: each such ingest waited {1000 * PUSH_WAIT_S:.0f} ms "
                           f"before reading them")
        if self.on_rows is not None:
            asked = sum(items[i].target_feature_rows for i in wanted)
            found = sum(int(out[i].features.shape[0]) for i in wanted if out[i].features is not None)
            self.on_rows("absent", asked - found)
        return out

    def _count(self, source: str, which: list[int], out: list[IngestItem]) -> None:
        if self.on_rows is not None:
            self.on_rows(source, sum(int(out[i].features.shape[0]) for i in which if out[i].features is not None))

    def _pull(self, items: list[IngestItem], wanted: list[int], out: list[IngestItem]) -> None:
        request = target_pb2.ReadFeaturesRequest(ranges=[
            target_pb2.FeatureRange(request_id=items[i].request_id, start_position=items[i].start_position,
                                    end_position=items[i].start_position + items[i].target_feature_rows)
            for i in wanted])
        try:
            reply = self.stub.ReadFeatures(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            self._warn(f"cannot read features from the target at {self.address} "
                       f"({exc.code().name}: {exc.details()}); those positions are caught up without them")
            return
        for i, rows in zip(wanted, reply.rows, strict=True):
            if not rows.HasField("features"):
                continue
            features = tensor_from_proto(rows.features)
            # Rows must start at the item's first position; a later start means the target
            # dropped the first ones, and the item cannot say where features begin.
            if rows.start_position == items[i].start_position:
                out[i] = dataclasses.replace(out[i], features=features)

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(message)

    def release(self, request_ids: list[str]) -> None:
        """Forget the pushed rows of requests the draft let go."""
        self.pushed.release(request_ids)

    def close(self) -> None:
        self._closed.set()
        if self._call is not None:
            self._call.cancel()
        self.channel.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
