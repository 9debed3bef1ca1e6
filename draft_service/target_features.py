"""The draft's one call to the target: read the features the target holds for it.

When a step ran with hold_features, the gateway sends the draft tokens and a
row count (IngestItem.target_feature_rows) instead of the features; before the
engine sees those items, this reads the rows from the target (ReadFeatures,
one call for all of a call's items), so features go target -> draft once and
never through the gateway. Rows the target no longer holds, or a target that
cannot be reached, leave those positions without features: the engine catches
them up from its own hidden state (approximate; output never depends on it).
"""

from __future__ import annotations

import dataclasses
import logging
import time

import grpc

from draft_service.types import IngestItem
from tandem.channels import open_channel
from tandem.tensors import tensor_from_proto
from tandem.tls import ClientTLS
from tandem.v1 import target_pb2, target_pb2_grpc

log = logging.getLogger("tandem.draft")
WARN_EVERY_S = 60.0  # a target that cannot be reached is logged at most this often


class TargetFeatureReader:
    def __init__(self, address: str, tls: ClientTLS | None = None, timeout: float = 10.0):
        self.address = address
        self.timeout = timeout
        self.channel = open_channel(address, tls)
        self.stub = target_pb2_grpc.TargetServiceStub(self.channel)
        self._warned_at = -WARN_EVERY_S

    def fill(self, items: list[IngestItem]) -> list[IngestItem]:
        """The items with the rows the target holds for them in `features` (target_feature_rows
        cleared): what an inline feed would have sent."""
        wanted = [i for i, it in enumerate(items) if it.target_feature_rows and it.features is None]
        if not wanted:
            return items
        request = target_pb2.ReadFeaturesRequest(ranges=[
            target_pb2.FeatureRange(request_id=items[i].request_id, start_position=items[i].start_position,
                                    end_position=items[i].start_position + items[i].target_feature_rows)
            for i in wanted])
        out = [dataclasses.replace(it, target_feature_rows=0) for it in items]
        try:
            reply = self.stub.ReadFeatures(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            self._warn(f"cannot read features from the target at {self.address} "
                       f"({exc.code().name}: {exc.details()}); those positions are caught up without them")
            return out
        for i, rows in zip(wanted, reply.rows, strict=True):
            if not rows.HasField("features"):
                continue
            features = tensor_from_proto(rows.features)
            # Rows must start at the item's first position; a later start means the target
            # dropped the first ones, and the item cannot say where features begin.
            if rows.start_position == items[i].start_position:
                out[i] = dataclasses.replace(out[i], features=features)
        return out

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(message)

    def close(self) -> None:
        self.channel.close()
