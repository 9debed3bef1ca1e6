"""gRPC edge of the draft service: protobuf <-> plain dataclasses, nothing else."""

from __future__ import annotations

import argparse
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from draft_service.device_tree import MAX_SLOTS
from draft_service.engine import DraftEngine
from draft_service.forcing import ForcedProposals, ForcingConfig, load_records
from draft_service.metrics import DraftMetrics
from draft_service.model import Eagle3Draft
from draft_service.target_features import DEFAULT_RING_BYTES, TargetFeatureReader
from draft_service.tree_wire import trees_to_proto
from draft_service.types import (
    MAX_DRAFT_TOKENS,
    MAX_STEPS,
    MAX_TOPK,
    DraftBudget,
    DraftItem,
    DraftTree,
    IngestItem,
    PushedRows,
    RequestStatus,
)
from kernels.compile_watch import CompileWatch
from kernels.topk import warm_up as warm_up_top_k
from kernels.tree_attention import warm_up
from kernels.tree_level import warm_up as warm_up_tree_level
from tandem import host_threads, telemetry, timeline
from tandem.errors import Unavailable
from tandem.gc_pauses import GcWatch
from tandem.grpc_host import ServiceHost, map_errors, status_for
from tandem.lane import LaneMethod, LaneServer, add_lane_argument, lane_to_proto, start_lane
from tandem.layers import DTYPES
from tandem.load_proto import load_to_proto
from tandem.pacing import StepPacing, add_pacing_argument, pacing_from_args
from tandem.service_metrics import serve_metrics
from tandem.tensors import tensor_from_proto, tensor_to_proto
from tandem.tls import SERVICE_CA_HELP, ClientTLS, add_server_tls_arguments, service_credentials
from tandem.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("tandem.draft")
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
DRAFT_CALL = "tandem.v1.DraftService/DraftStream.call"  # one call on the stream, in traces


# --- conversions ------------------------------------------------------------------------------

def ingest_from_proto(m: draft_pb2.IngestItem) -> IngestItem:
    features = tensor_from_proto(m.features) if m.HasField("features") else None
    return IngestItem(request_id=m.request_id, start_position=m.start_position, tokens=tuple(m.tokens),
                      features=features, target_feature_rows=m.target_feature_rows)


def item_from_proto(m: draft_pb2.DraftItem) -> DraftItem:
    b = m.budget
    return DraftItem(m.request_id, DraftBudget(b.steps, b.topk, b.num_draft_tokens), m.num_tokens or None)


def tree_to_proto(t: DraftTree, with_mask: bool) -> draft_pb2.DraftTree:
    out = draft_pb2.DraftTree(request_id=t.request_id, root_token=t.root_token, root_position=t.root_position,
                              tokens=t.tokens, parents=t.parents, depths=t.depths, logprobs=t.logprobs,
                              scores=t.scores)
    if with_mask:
        out.ancestor_mask.CopyFrom(tensor_to_proto(t.ancestor_mask()))
    return out


def status_to_proto(s: RequestStatus) -> draft_pb2.RequestStatus:
    return draft_pb2.RequestStatus(request_id=s.request_id, num_tokens=s.num_tokens, num_computed=s.num_computed,
                                   num_missing_features=s.num_missing_features, ready=s.ready)


# --- the servicer ---------------------------------------------------------------------------------

class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, model_name: str, target_model_name: str, pacing: StepPacing | None = None,
                 metrics: DraftMetrics | None = None):
        self.model_name = model_name
        self.pacing = pacing
        self.metrics = metrics  # None: --metrics-port is off, nothing is recorded
        self.target_model_name = target_model_name
        self.engine: DraftEngine | None = None
        self.forcing: ForcedProposals | None = None  # benchmarks' scale track only
        # --target: where features held at the target are read (IngestItem.target_feature_rows).
        self.target_features: TargetFeatureReader | None = None
        self.step_lane: LaneServer | None = None  # DraftStream on a same-host lane (--step-lane), named in GetInfo
        # One engine call at a time: requests' state and the KV cache are shared.
        self._lock = threading.Lock()

    def _ready(self) -> DraftEngine:
        if self.engine is None:
            raise Unavailable("the draft is still loading its model")
        return self.engine

    @map_errors
    def GetInfo(self, request, context):
        engine = self._ready()
        info = engine.info()
        return draft_pb2.DraftInfo(
            model_name=self.model_name, target_model_name=self.target_model_name,
            hidden_size=info.hidden_size, draft_vocab_size=info.draft_vocab_size,
            target_vocab_size=info.target_vocab_size, target_hidden_size=info.target_hidden_size,
            feature_layers=list(info.feature_layers), feature_width=info.feature_width,
            max_tokens=info.max_tokens, max_steps=MAX_STEPS, max_topk=min(MAX_TOPK, info.draft_vocab_size),
            max_draft_tokens=MAX_DRAFT_TOKENS, dtype=info.dtype, device=info.device,
            load=load_to_proto(engine.load()), reads_target_features=self.target_features is not None,
            feature_sink=self.target_features.sink if self.target_features is not None else "",
            step_lane=lane_to_proto(self.step_lane))

    def _with_features(self, items: list[IngestItem]) -> list[IngestItem]:
        """Items whose features the target holds, with those features read (outside the lock:
        the engine's state does not change until the items are applied, in order)."""
        if self.target_features is None:
            return items
        if not any(it.target_feature_rows for it in items):
            return items
        t0 = time.perf_counter()
        items = self.target_features.fill(items)
        if self.metrics is not None:
            self.metrics.record_feature_read(time.perf_counter() - t0)
        return items

    def catch_up_pushed(self, pushes: list[PushedRows]) -> None:
        """On the feature subscription's thread (TargetFeatureReader.on_push, --catch-up-on-push): compute
        the positions the target's pushed rows and tokens allow before the gateway's next call brings the
        same tokens; that call then finds them computed and drafts at once. Never raises: an error here
        would end the subscription."""
        engine = self.engine
        if engine is None:
            return
        try:
            with self._lock:
                timeline.mark("draft.push.catch_up.start")
                positions = engine.catch_up_pushed(pushes)
                timeline.mark("draft.push.catch_up.end")
                seconds = engine.last_call_seconds
            if self.metrics is not None:
                self.metrics.record_push_catch_up(positions, seconds)
        except Exception:
            log.exception("catching up on pushed features failed; the next ingest catches those positions up")

    @map_errors
    def Ingest(self, request, context):
        engine = self._ready()
        items = self._with_features([ingest_from_proto(m) for m in request.items])
        with self._lock:
            statuses = engine.ingest(items, catch_up=request.catch_up)
            load = engine.load()
            seconds = engine.last_call_seconds
        if self.metrics is not None:
            self.metrics.record_ingest(items, request.catch_up, seconds)
        return draft_pb2.IngestResponse(requests=[status_to_proto(s) for s in statuses], load=load_to_proto(load))

    def _draft(self, request: draft_pb2.DraftRequest) -> tuple[draft_pb2.DraftResponse, Callable[[], None]]:
        """The reply, and the recording of the call's metrics, which need not delay it."""
        engine = self._ready()
        timeline.mark("draft.features.start")
        ingest = self._with_features([ingest_from_proto(m) for m in request.ingest])
        items = [item_from_proto(m) for m in request.items]
        timeline.mark("draft.parsed")
        with self._lock:
            t0 = time.perf_counter()
            captured_before = engine.graphs_captured
            timeline.mark("draft.engine.start")
            trees = engine.draft(items, ingest)
            timeline.mark("draft.engine.end")
            captured = engine.graphs_captured - captured_before
            if self.forcing is not None:
                trees = [self.forcing.rewrite(t, engine.requests[t.request_id].tokens) for t in trees]
            if self.pacing is not None:
                # The draft's work: each tree level runs topk nodes per request.
                self.pacing.hold(t0, sum(it.budget.steps * it.budget.topk for it in items if not it.budget.empty))
            load = engine.load()
            seconds = time.perf_counter() - t0 if self.pacing is not None else engine.last_call_seconds

        def record() -> None:  # never raises: on a stream the reply has already left
            if self.metrics is not None:
                try:
                    self.metrics.record_draft(ingest, items, trees, seconds)
                except Exception:
                    log.exception("recording a draft call's metrics failed")

        if request.packed_trees:
            return draft_pb2.DraftResponse(packed=trees_to_proto(trees), load=load_to_proto(load),
                                           draft_seconds=seconds, graphs_captured=captured), record
        return draft_pb2.DraftResponse(trees=[tree_to_proto(t, request.return_ancestor_mask) for t in trees],
                                       load=load_to_proto(load), draft_seconds=seconds,
                                       graphs_captured=captured), record

    @map_errors
    def Draft(self, request, context):
        response, record = self._draft(request)
        record()
        return response

    def DraftStream(self, request_iterator, context):
        # map_errors covers unary calls; a stream maps its error the same way and ends.
        for request in request_iterator:
            timeline.mark("draft.recv")
            try:
                with telemetry.continued_span(DRAFT_CALL, request.traceparent):
                    response, record = self._draft(request)
            except Exception as exc:
                code, message = status_for(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("DraftStream failed")
                context.abort(code, message)
            timeline.mark("draft.reply")
            yield response
            timeline.mark("draft.sent")
            record()  # the reply has left: metrics off the round's critical path

    @map_errors
    def Release(self, request, context):
        engine = self._ready()
        with self._lock:
            n = engine.release(list(request.request_ids))
            if self.target_features is not None:
                self.target_features.release(list(request.request_ids))
            if self.forcing is not None:
                self.forcing.release(list(request.request_ids))
            load = engine.load()
        return draft_pb2.DraftReleaseResponse(released=n, load=load_to_proto(load))

    @map_errors
    def GetLoad(self, request, context):
        return load_to_proto(self._ready().load())


# --- the command ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem draft",
        description="Serve an EAGLE-3 draft head over gRPC (tandem.v1.DraftService), with its own KV cache "
                    "per request, growing token trees within the budgets the gateway gives.")
    p.add_argument("--model", required=True, help="EAGLE-3 draft directory in SGLang/SpecForge format "
                   "(config.json, safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d)")
    p.add_argument("--target-model", required=True, help="the target's Hugging Face directory: the draft "
                   "uses its embeddings and checks that the pair fits")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="gRPC port (0 picks a free one)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="weights and KV dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks; 0 sizes the cache from --kv-cache-gb")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="KV cache size in GiB when --num-blocks "
                   "is 0 (default 0.5: the draft has one layer, so that holds many tokens)")
    bench = p.add_argument_group("benchmarks only (the scale track; see draft_service/forcing.py)")
    bench.add_argument("--force-record", metavar="JSONL", default=None,
                       help="recorded greedy outputs of the target, one {\"tokens\": [...]} per prompt: the "
                       "draft still runs, then its trees' main paths are set to the record")
    bench.add_argument("--force-acceptance", type=float, default=0.8, metavar="P",
                       help="per-token probability that a forced main-path token is right (default 0.8)")
    bench.add_argument("--force-seed", type=int, default=0, help="seed of the forced draws (default 0)")
    add_pacing_argument(p, "Draft call", "its tree nodes expanded (steps x topk per request)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P",
                   help="serve Prometheus metrics on http://HOST:P/metrics (0 picks a free port; default off): "
                   "this replica's load, read at each scrape (tandem_draft_sequences, what its autoscaler scales "
                   "on, and tandem_draft_kv_cache_usage_ratio), Draft call time, tree nodes and requests per "
                   "call, catch-up time, feature bytes")
    p.add_argument("--target", metavar="HOST:PORT", default=None,
                   help="the target service, from which this replica takes its features so that they never "
                        "pass through the gateway (the gateway then sends only tokens): the target pushes them "
                        "as its steps commit them (SubscribeFeatures), and rows not pushed are read "
                        "(ReadFeatures). With --tls-ca this replica connects over TLS and presents "
                        "--tls-cert/--tls-key. Default: features come from the gateway")
    p.add_argument("--pull-features", action="store_true",
                   help="with --target: read every row with ReadFeatures, one round trip before each tree, "
                        "instead of subscribing to pushes (for comparison; default off)")
    p.add_argument("--catch-up-on-push", action="store_true",
                   help="with --target (pushed features): compute the draft KV of the positions a step committed "
                        "as soon as the target pushes their features and tokens, on the subscription's thread, "
                        "instead of when the gateway's next call brings the same tokens; that call then drafts at "
                        "once. Off by default: with blocking reads it took 0.22-0.38 ms off a 10 ms round at one "
                        "request on an H200, but with the lanes' reads spinning (tandem serve's default on a GPU host) "
                        "the gateway's call arrives before the push's catch-up ends, and on an H100 the round "
                        "was 0.11-0.66 ms longer at one request and 0.13 ms at 8 (BENCHMARKS.md, \"The "
                        "sixty-first session\" and \"The sixty-fifth session\")")
    p.add_argument("--feature-ring-mb", type=int, default=DEFAULT_RING_BYTES >> 20, metavar="MB",
                   help="with --target: a shared-memory ring of this size under /dev/shm for the pushed "
                        "features, used when the target runs on this host and can open it (the stream then "
                        "carries only where each step's rows are); 0 turns it off. Default "
                        f"{DEFAULT_RING_BYTES >> 20}")
    telemetry.add_otlp_argument(p)
    add_server_tls_arguments(p, SERVICE_CA_HELP)
    add_lane_argument(p, "DraftStream")
    p.add_argument("--fused-tree-levels", action=argparse.BooleanOptionalAction, default=True,
                   help="grow trees with each level's bookkeeping (the new candidates, the next frontier, its "
                        "tokens, positions and ancestor masks) in one Triton launch instead of about twenty torch "
                        "ops, each level's q, k and v written into their slots by the RoPE kernel, and the kept "
                        "nodes' selection in one launch instead of about fifteen; Triton attention only (a GPU). "
                        "On by default: on the H200 a draft call took 0.85-0.95 of the time it takes without, at "
                        "batch 1, 8 and 64, and a served round at one request 0.28 ms less (BENCHMARKS.md, \"A "
                        "growth level's bookkeeping in one launch\"); --no-fused-tree-levels: the torch ops")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)  # tests: where the port was bound
    return p


def target_tls(args: argparse.Namespace) -> ClientTLS | None:
    """This replica's TLS towards the target: the service CA verifies it, its own certificate
    identifies it (mutual TLS)."""
    if args.tls_ca is None:
        return None
    return ClientTLS(ca=Path(args.tls_ca), cert=Path(args.tls_cert) if args.tls_cert else None,
                     key=Path(args.tls_key) if args.tls_key else None)


def build_engine(args: argparse.Namespace) -> DraftEngine:
    dtype = DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    model = Eagle3Draft(args.model, args.target_model, dtype, args.device)
    num_blocks = args.num_blocks or max(
        1, int(args.kv_cache_gb * 2**30 // (model.kv_bytes_per_token() * args.block_size)))
    if model.device.type == "cuda" and model.attention.name == "triton":
        t0 = time.perf_counter()
        n = warm_up(model.num_heads, model.num_kv_heads, model.head_dim, args.block_size, model.dtype, model.device)
        log.info("compiled %d tree-attention variants in %.1f s", n, time.perf_counter() - t0)
        t0 = time.perf_counter()
        n = warm_up_top_k(model.device, model.cfg.draft_vocab_size)
        log.info("compiled the tree growth's top-k variants (%d launches) in %.1f s", n, time.perf_counter() - t0)
        if args.fused_tree_levels:
            t0 = time.perf_counter()
            n = warm_up_tree_level(model.device, MAX_TOPK, MAX_TOPK * (1 + MAX_SLOTS))
            log.info("compiled the tree growth's level and selection kernels (%d variants) in %.1f s", n,
                     time.perf_counter() - t0)
    return DraftEngine(model, num_blocks, args.block_size, fused_levels=args.fused_tree_levels)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.block_size <= 0 or args.num_blocks < 0 or args.kv_cache_gb <= 0:
        raise SystemExit("error: --block-size and --kv-cache-gb must be positive, --num-blocks >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but no CUDA device is visible")
    host_threads.limit_for_gpu(args.device)
    pacing = pacing_from_args(args.emulate_step_cost)
    telemetry.setup_tracing("draft", args.otlp_endpoint)  # before ServiceHost: it installs the interceptor
    servicer = DraftServicer(Path(args.model).resolve().name, Path(args.target_model).resolve().name, pacing)
    if args.pull_features and not args.target:
        raise SystemExit("error: --pull-features needs --target")
    if args.catch_up_on_push and (not args.target or args.pull_features):
        raise SystemExit("error: --catch-up-on-push needs --target and pushed features (not --pull-features)")
    if args.feature_ring_mb < 0:
        raise SystemExit(f"error: --feature-ring-mb must be >= 0, got {args.feature_ring_mb}")
    if args.target:
        try:
            servicer.target_features = TargetFeatureReader(args.target, target_tls(args),
                                                           subscribe=not args.pull_features,
                                                           ring_bytes=args.feature_ring_mb << 20,
                                                           on_push=servicer.catch_up_pushed
                                                           if args.catch_up_on_push else None)
        except ValueError as exc:
            raise SystemExit(f"error: {exc}") from None
    metrics = None
    if args.metrics_port is not None:
        metrics = servicer.metrics = DraftMetrics(load=lambda: servicer.engine and servicer.engine.load())
        if servicer.target_features is not None:
            servicer.target_features.on_rows = metrics.record_feature_rows
    forcing, records = None, []
    if args.force_record:  # checked before the (possibly long) model load
        try:
            forcing = ForcingConfig(args.force_record, args.force_acceptance, args.force_seed)
            records = load_records(forcing.record)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"error: {exc}") from None
    if metrics is not None:
        log.info("metrics on http://%s:%d/metrics", args.host, serve_metrics(metrics.registry, args.host,
                                                                            args.metrics_port))
    try:
        host = ServiceHost(args.host, args.port, [SERVICE_NAME], credentials=service_credentials(args))
    except OSError as exc:
        raise SystemExit(f"error: --port: {exc}") from None
    host.add(draft_pb2_grpc.add_DraftServiceServicer_to_server, servicer)
    host.start()  # health says NOT_SERVING until the model is loaded
    log.info("listening on %s:%d (loading %s for %s)", args.host, host.port, args.model, args.target_model)
    if args.step_lane:
        servicer.step_lane = start_lane(args.step_lane, f"draft-{host.port}",
                                        {"DraftStream": LaneMethod(servicer.DraftStream, draft_pb2.DraftRequest)},
                                        host)
    if args.port_file:
        Path(args.port_file).write_text(str(host.port))
    compiles, collections = CompileWatch(log), GcWatch(log)
    compiles.install()
    collections.install()
    try:
        servicer.engine = build_engine(args)
    except Exception as exc:
        host.stop(0)
        if servicer.step_lane is not None:
            servicer.step_lane.stop()
        raise SystemExit(f"error: cannot load draft {args.model}: {exc}") from None
    info, load = servicer.engine.info(), servicer.engine.load()
    if forcing is not None:
        servicer.forcing = ForcedProposals(forcing, records, info.target_vocab_size)
        log.info("forcing proposals to %d recorded outputs at acceptance %.2f (benchmark scale track)",
                 len(records), forcing.acceptance)
    collections.ready()
    log.info("ready: target feature layers %s (%s), %d KV blocks of %d tokens", list(info.feature_layers),
             f"read from the target at {args.target}" if args.target else "sent by the gateway",
             load.total_blocks, load.block_size)
    compiles.mark_serving()
    if pacing is not None:
        log.warning("emulating call cost: every Draft call lasts at least %g ms + %g ms per tree node "
                    "expanded (steps x topk per request)",
                    pacing.base_ms, pacing.per_token_ms)
    host.set_serving(True)

    def stop() -> None:
        if servicer.step_lane is not None:
            servicer.step_lane.stop()
        if servicer.target_features is not None:
            servicer.target_features.close()

    host.run_until_signal(on_stop=stop)
    telemetry.shutdown_tracing()  # flush the spans still queued
    log.info("stopped")
    return 0
