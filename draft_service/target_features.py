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
items. A subscription takes a step's rows in one message and, where the
target is on this host, offers it a shared-memory ring for them
(tandem.feature_ring): the target writes the rows there, and its message says
only where they are. Rows the target no longer holds, or a target that cannot
be reached, leave those positions without features: the engine catches them
up from its own hidden state (approximate; output never depends on it).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable

import grpc

from draft_service.types import IngestItem, PushedRows
from tandem import timeline
from tandem.channels import open_channel
from tandem.errors import InvalidArgument
from tandem.feature_ring import FeatureRing, RingUnavailable
from tandem.feature_store import FeatureStore
from tandem.lane import LaneRefused, LaneStream
from tandem.tensors import dtype_from_name, list_from_proto, tensor_from_proto
from tandem.tls import ClientTLS
from tandem.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.draft")
WARN_EVERY_S = 60.0  # a target that cannot be reached is logged at most this often
# How long an ingest waits for pushed rows not yet here. They leave the target with the step's
# reply, and the gateway acts on the reply before it sends them on, so they are normally here
# first; a miss costs this wait and then a pull.
PUSH_WAIT_S = 0.05
PUSHED_ROWS = 16384  # rows kept until an ingest uses them (as the target's --max-held-features)
# The shared-memory ring a subscription offers the target (--feature-ring-mb): 128 MB keeps about
# 20 steps of 64 requests' rows on the 8B shapes (24 KB a row, about 4 rows a request a step).
DEFAULT_RING_BYTES = 128 << 20


def _is_loopback(address: str) -> bool:
    """Whether HOST:PORT names this host by a loopback name or address."""
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TargetFeatureReader:
    """subscribe: take pushed rows (a subscription thread, reconnecting after a break);
    False: pull every row with ReadFeatures. on_rows(source, rows): told, per fill, how many
    rows were pushed, read, or absent (the service's metrics). A subscription asks for a step's
    rows in one message; where the target's address is a loopback one it also offers a
    shared-memory ring of ring_bytes for them (tandem.feature_ring; 0: none). on_push(pushes):
    called on the subscription's thread with each step's rows that came with next tokens, once
    they are stored (the draft may catch up on them before its next call)."""

    def __init__(self, address: str, tls: ClientTLS | None = None, timeout: float = 10.0, subscribe: bool = True,
                 on_rows: Callable[[str, int], None] | None = None, ring_bytes: int = DEFAULT_RING_BYTES,
                 on_push: Callable[[list[PushedRows]], None] | None = None):
        self.address = address
        self.on_rows = on_rows
        self.on_push = on_push
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self._warned_at = -WARN_EVERY_S
        self.sink = f"draft-{uuid.uuid4().hex}" if subscribe else ""
        self.pushed = FeatureStore(PUSHED_ROWS)
        self.live = False  # the target has confirmed the subscription and pushes to it
        self.ring_bytes = ring_bytes
        self.ring: FeatureRing | None = None  # the live subscription's, where the target writes into it
        self._ring_refused = False
        self._closed = threading.Event()
        self._call = None
        self._lane_offer: tuple[str, str] | None = None  # the target's step lane (path, token), to subscribe on
        self._lane_refused = False
        self._thread = None
        if subscribe:
            self._thread = threading.Thread(target=self._subscribe, name="feature-subscription", daemon=True)
            self._thread.start()

    def _new_ring(self) -> FeatureRing | None:
        # Only a target on this host can open the ring; one elsewhere (another pod, another node)
        # would leave it unused, so it is offered to a loopback address alone, and no more once a
        # target has not opened one.
        if self.ring_bytes <= 0 or self._ring_refused or not _is_loopback(self.address):
            return None
        try:
            return FeatureRing.create(self.ring_bytes)
        except RingUnavailable as exc:
            self._ring_refused = True
            log.info("%s; pushed features come in the stream", exc)
            return None

    def _subscribe(self) -> None:
        backoff = 0.1
        ring = None  # offered to the target; kept across attempts that fail before it answers
        try:
            while not self._closed.is_set():
                if ring is None:
                    ring = self._new_ring()  # about 0.1 s for 128 MB: not remade for every retry
                try:
                    request = target_pb2.SubscribeFeaturesRequest(
                        sink=self.sink, batched=True, ring_name=ring.name if ring else "",
                        ring_bytes=ring.data_bytes if ring else 0)
                    self._call = self._open(request)
                    for msg in self._call:
                        if msg.request_ids:
                            timeline.mark("draft.push.recv")
                            pushes = self._take_batch(msg)
                            timeline.mark("draft.push.stored")
                            if pushes:
                                self.on_push(pushes)
                        elif msg.request_id:  # a target that sends a message per sequence
                            self.pushed.hold(msg.request_id, msg.start_position, tensor_from_proto(msg.features))
                        else:
                            ring = self._went_live(msg, ring)
                            backoff = 0.1
                            if self._take_lane_offer(msg):
                                break  # and subscribe again there, now
                            log.info("features from the target at %s are pushed to this draft%s%s", self.address,
                                     " through shared memory" if ring is not None else "",
                                     " on its step lane" if isinstance(self._call, LaneStream) else "")
                except grpc.RpcError as exc:
                    if self._closed.is_set():
                        return
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        log.info("the target at %s pushes no features; this draft reads them", self.address)
                        return
                    self._warn(f"feature subscription to the target at {self.address} broke "
                               f"({exc.code().name}: {exc.details()}); features are read until it is back")
                except (InvalidArgument, ValueError) as exc:  # a message this draft cannot take: resubscribe
                    self._warn(f"feature subscription to the target at {self.address}: {exc}; subscribing again")
                finally:
                    self.live = False
                    if self.ring is not None:  # the target had it, and its file is gone: the next needs a new one
                        self.ring.close()
                        self.ring = ring = None
                if self._lane_offer is None:  # no wait before taking the lane
                    self._closed.wait(backoff)
                backoff = min(2 * backoff, 2.0)
        finally:
            if ring is not None:
                ring.close()

    def _open(self, request: target_pb2.SubscribeFeaturesRequest):
        """The subscription: on the target's step lane where it offered one that this host reaches (a
        push then skips gRPC's threads: 0.3-0.4 ms from the target's reply leaving to the draft's
        receipt against 0.5-0.6 on gRPC, dev machine), else over gRPC."""
        offer, self._lane_offer = self._lane_offer, None
        if offer is not None:
            try:
                stream = LaneStream(*offer, "SubscribeFeatures", target_pb2.FeatureRows)
            except LaneRefused as exc:
                self._lane_refused = True
                log.info("the target's step lane is out of reach (%s); features are pushed over gRPC", exc)
            else:
                stream.send(request)
                return stream
        return self.stub.SubscribeFeatures(request)

    def _take_lane_offer(self, msg: target_pb2.FeatureRows) -> bool:
        """Whether to leave a live gRPC subscription for the target's step lane, which its first
        message offered (once: an offer out of reach is not taken again)."""
        if isinstance(self._call, LaneStream) or self._lane_refused or not msg.step_lane.path:
            return False
        self._lane_offer = (msg.step_lane.path, msg.step_lane.token)
        self._call.cancel()
        return True

    def _went_live(self, msg: target_pb2.FeatureRows, ring: FeatureRing | None) -> FeatureRing | None:
        """The subscription's first message. The ring's file goes now either way: the target has
        mapped it, or will not (and is offered none again)."""
        if ring is not None:
            ring.unlink()
            if not msg.ring_attached:
                ring.close()
                ring = None
                self._ring_refused = True
        self.ring = ring
        self.live = True
        return ring

    def _take_batch(self, msg: target_pb2.FeatureRows) -> list[PushedRows]:
        """A step's rows for several sequences, from the message or the ring, stored; those that came with
        next tokens, for on_push (none without it). Plain lists, and no slice for a batch of one: the push
        runs cold, after the wait for a step, where each numpy or torch op costs tens of microseconds."""
        request_ids = msg.request_ids
        starts = list_from_proto(msg.start_positions, "int64", "start_positions")
        counts = list_from_proto(msg.row_counts, "int64", "row_counts")
        if not len(starts) == len(counts) == len(request_ids) or min(counts, default=0) < 0:
            raise InvalidArgument(f"a batch of {len(request_ids)} sequences with {len(starts)} starts "
                                  f"and {len(counts)} row counts")
        total = sum(counts)
        if msg.HasField("ring_rows"):
            if self.ring is None:
                raise InvalidArgument("rows in a ring this subscription has not attached")
            rows = self.ring.read(msg.ring_rows.start, tuple(msg.ring_rows.shape),
                                  dtype_from_name(msg.ring_rows.dtype))
            if rows is None:  # written over before it was read: those positions go without features
                self._warn(f"pushed features of {len(counts)} sequence(s) were overwritten in the shared-memory "
                           f"ring before this draft read them; a larger --feature-ring-mb keeps more steps")
                return []
        else:
            rows = tensor_from_proto(msg.features)
        if rows.dim() != 2 or rows.shape[0] != total:
            raise InvalidArgument(f"a batch of {total} rows came with rows of shape {list(rows.shape)}")
        if len(counts) == 1:
            entries = [(request_ids[0], starts[0], rows)]
        else:
            ends = itertools.accumulate(counts)
            entries = [(rid, start, rows[end - count: end])
                       for rid, start, count, end in zip(request_ids, starts, counts, ends)]
        self.pushed.hold_many(entries)
        if self.on_push is None or not msg.HasField("next_tokens"):
            return []
        tokens = list_from_proto(msg.next_tokens, "int32", "next_tokens")
        if len(tokens) != total or len(msg.next_tokens.shape) != 1:
            raise InvalidArgument(f"a batch of {total} rows came with {len(tokens)} next tokens")
        pushes, end = [], 0
        for (rid, start, part), count in zip(entries, counts):
            end += count
            if count and tokens[end - count] >= 0:
                pushes.append(PushedRows(rid, start, part, tuple(tokens[end - count: end])))
        return pushes

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
        self._closed.set()  # the subscription thread closes its ring as it ends
        if self._call is not None:
            self._call.cancel()
        self.channel.close()
        if self._thread is not None:
            self._thread.join(timeout=5)
