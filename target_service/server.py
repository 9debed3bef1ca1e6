"""gRPC edge of the target service: protobuf <-> plain dataclasses, nothing else."""

from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from kernels.compile_watch import CompileWatch
from tandem import host_threads, telemetry, timeline
from tandem.errors import InvalidArgument, Unavailable
from tandem.feature_ring import FeatureRing, RingUnavailable
from tandem.feature_store import FeatureStore
from tandem.gc_pauses import GcWatch
from tandem.grpc_host import ServiceHost, map_errors, status_for
from tandem.lane import LaneMethod, LaneServer, add_lane_argument, direct_sender, lane_to_proto, start_lane
from tandem.load_proto import load_to_proto
from tandem.pacing import StepPacing, add_pacing_argument, pacing_from_args
from tandem.service_metrics import serve_metrics
from tandem.tensors import array_from_proto, tensor_to_proto
from tandem.tls import SERVICE_CA_HELP, add_server_tls_arguments, service_credentials
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.engine import FEATURE_PICK_BYTES, batch_of_items
from target_service.feature_sinks import (
    CommittedRows,
    FeatureSinks,
    batch_to_proto,
    single_to_proto,
    split_features,
    with_next_tokens,
)
from target_service.grant import GrantStep, check_grant, run_grant
from target_service.metrics import TargetMetrics
from target_service.parallel import EngineSpec, ParallelEngine
from target_service.step_batch import StepBatch, StepResults
from target_service.types import KvLoad, SamplingParams, SequenceResult, SequenceStep
from target_service.wire import GrantStops, batch_from_proto, results_to_proto

log = logging.getLogger("tandem.target")
STEP_CALL = "tandem.v1.TargetService/StepStream.call"  # one call on the stream, in traces
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name
DEFAULT_HELD_FEATURES = 16384  # rows: 384 MiB at Llama-3.1-8B's 3 x 4096 bf16 features per token
# A push written on a lane by the step's thread waits at most this long for a reader whose socket buffer is full
# (a stuck draft); then its subscription ends and the rows are held for a pull, so the target never stalls on it.
PUSH_WRITE_TIMEOUT_S = 2.0


def item_from_proto(m: target_pb2.SequenceStep) -> SequenceStep:
    s = m.sampling
    return SequenceStep(
        request_id=m.request_id, tokens=tuple(m.tokens), parents=tuple(m.parents),
        num_fixed=m.num_fixed, create=m.create,
        sampling=SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p if 0 < s.top_p < 1 else 1.0,
                                seed=s.seed if s.HasField("seed") else None),
        top_logprobs=m.top_logprobs, return_features=m.return_features)


def result_to_proto(r: SequenceResult) -> target_pb2.SequenceResult:
    out = target_pb2.SequenceResult(request_id=r.request_id, accepted_nodes=r.accepted_nodes,
                                     tokens=r.tokens, logprobs=r.logprobs, num_committed=r.num_committed)
    for ids, lps in r.top_logprobs:
        out.top_logprobs.add(token_ids=ids, logprobs=lps)
    if r.features is not None:
        out.features.CopyFrom(tensor_to_proto(r.features))
    return out


def _reply(results: StepResults, item_index: np.ndarray, load: KvLoad, seconds: float, index: int,
           done: bool) -> target_pb2.StepReply:
    return target_pb2.StepReply(results=results_to_proto(results, item_index), load=load_to_proto(load),
                                step_seconds=seconds, step_index=index, done=done)


@dataclass(frozen=True)
class _StepRun:
    """A step's outcome, and the features to push once its reply has left."""

    batch: StepBatch
    results: StepResults
    load: KvLoad
    seconds: float
    pushes: list[tuple[str, CommittedRows]]


class _CallReader:
    """The calls of one StepStream. Between steps the handler reads the next call itself; a
    grant asks `arrived` whether one came while it runs (an Interrupt, or any new call, ends
    it after the step in flight), and only then does a thread wait for it. A thread reading
    every call would add a hand-over between threads to every step's critical path."""

    def __init__(self, request_iterator):
        self._calls = request_iterator
        self._pending: queue.Queue | None = None  # the reader thread's one call, while one runs

    def _read(self):
        try:
            return next(self._calls, None)
        except Exception:  # the stream broke or was cancelled: nothing more will come
            return None

    def next(self):
        """The next call (None: the stream ended), waiting for it."""
        if self._pending is not None:
            call, self._pending = self._pending.get(), None
            return call
        return self._read()

    def arrived(self) -> bool:
        """Whether a call came; the first ask starts a thread that waits for it."""
        if self._pending is None:
            self._pending = queue.Queue(maxsize=1)
            pending = self._pending
            threading.Thread(target=lambda: pending.put(self._read()), name="step-stream-reader",
                             daemon=True).start()
            return False
        return not self._pending.empty()


def _item_sinks(call: target_pb2.PackedStep, size: int) -> list[str | None] | None:
    """Per item, the sink its held features go to (None: held), from the call's names and column."""
    if not call.feature_sinks:
        return None
    index = array_from_proto(call.item_feature_sink, "int32", "item_feature_sink")
    if index.shape != (size,) or ((index < -1) | (index >= len(call.feature_sinks))).any():
        raise InvalidArgument(f"item_feature_sink must hold one index in -1..{len(call.feature_sinks) - 1} "
                              f"per item ({size})")
    names = list(call.feature_sinks)
    return [names[i] if i >= 0 else None for i in index.tolist()]


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "added_tokens.json")


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, model_dir: Path, pacing: StepPacing | None = None, metrics: TargetMetrics | None = None,
                 max_held_features: int = DEFAULT_HELD_FEATURES):
        self.model_dir = model_dir
        # Features of hold_features steps, until a draft replica reads them (ReadFeatures).
        self.held_features = FeatureStore(max_held_features)
        # Readers subscribed to have features pushed to them (SubscribeFeatures).
        self.feature_sinks = FeatureSinks()
        self.pacing = pacing
        self.metrics = metrics  # None: --metrics-port is off, nothing is recorded
        self.model_name = model_dir.name
        self.engine: ParallelEngine | None = None
        self.step_lane: LaneServer | None = None  # StepStream on a same-host lane (--step-lane), named in GetInfo
        # One step at a time: the KV cache and the TP ranks see one command stream.
        self._lock = threading.Lock()

    def _ready(self) -> ParallelEngine:
        if self.engine is None:
            raise Unavailable("the target is still loading its model")
        return self.engine

    @map_errors
    def GetInfo(self, request, context):
        engine = self._ready()
        cfg = engine.model.cfg
        return target_pb2.TargetInfo(
            model_name=self.model_name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
            num_layers=cfg.num_layers, max_model_len=engine.engine.max_model_len,
            eos_token_ids=list(cfg.eos_token_ids), tp_size=engine.tp_size,
            dtype=str(engine.model.dtype).removeprefix("torch."), device=engine.model.device.type,
            default_feature_layers=list(cfg.default_feature_layers), load=load_to_proto(engine.load()),
            step_lane=lane_to_proto(self.step_lane))

    @map_errors
    def Step(self, request, context):
        engine = self._ready()
        batch = batch_of_items([item_from_proto(m) for m in request.items])
        run = self._run(engine, batch, tuple(request.feature_layers), request.hold_features)
        self._after_reply(run)
        return target_pb2.StepResponse(results=[result_to_proto(r) for r in run.results.sequence_results()],
                                       load=load_to_proto(run.load), step_seconds=run.seconds)

    def _run(self, engine: ParallelEngine, batch: StepBatch, layers: tuple[int, ...], hold: bool = False,
             sinks: list[str | None] | None = None) -> _StepRun:
        """sinks: per item, the subscriber its held features are pushed to (None: held)."""
        pushes: list[tuple[str, CommittedRows]] = []
        with self._lock:
            t0 = time.perf_counter()
            timeline.mark("target.engine.start")
            results = engine.run(batch, layers)
            timeline.mark("target.engine.end")
            if hold and results.features is not None:  # before the reply leaves: a reader told of them finds them
                results, pushes = self._keep_features(results, sinks)
            if self.pacing is not None:
                self.pacing.hold(t0, int(batch.num_nodes.sum()))
            load = engine.load()
            seconds = time.perf_counter() - t0 if self.pacing is not None else engine.engine.last_step_seconds
        return _StepRun(batch, results, load, seconds, pushes)

    def _keep_features(self, results: StepResults, sinks: list[str | None] | None
                       ) -> tuple[StepResults, list[tuple[str, CommittedRows]]]:
        """Hold each item's rows for a pull, or, where its sink has a subscriber, return them to
        be pushed once the reply has left (_after_reply); the results leave without them."""
        results, found = split_features(results)
        pushes = []
        for b, rows in found:
            sink = sinks[b] if sinks else None
            if sink is not None and self.feature_sinks.subscribed(sink):
                pushes.append((sink, rows))
            else:
                self._hold(rows)
        return results, pushes

    def _hold(self, rows: CommittedRows) -> None:
        # A copy: the rows are a view of the whole step's features (split_features), held until read.
        self.held_features.hold(rows.request_id, rows.start, rows.rows.clone())
        if self.metrics is not None:
            self.metrics.held_feature_bytes.inc(rows.rows.numel() * rows.rows.element_size())

    def _after_reply(self, run: _StepRun) -> None:
        """What a step's reply need not wait for: pushing its features to subscribers (the
        reader waits for pushed rows; a subscriber gone since is held for, as a pull), and its
        metrics: per verify step at one request on the dev machine 0.15 ms and 0.12 ms (py-spy),
        on a round's critical path before. Never raises: on a stream the reply has already left,
        and a second reply would be read as the next call's."""
        self._push(run.pushes, run.batch, run.results)
        try:
            if self.metrics is not None:
                self.metrics.record_batch(run.batch, run.results, run.seconds)
        except Exception:
            log.exception("after a step's reply: recording its metrics failed")

    def _push(self, pushes: list[tuple[str, CommittedRows]], batch: StepBatch | None,
              results: StepResults) -> None:
        """A step's rows to their subscribers, one message a subscriber (not one a sequence), with the
        token after each row where the step (`batch`, answered by `results`) decided it; the rows of a
        subscriber gone since are held for a pull. Never raises: it runs once the step's reply has left."""
        try:
            by_sink: dict[str, list[CommittedRows]] = {}
            for sink, rows in with_next_tokens(pushes, batch, results):
                by_sink.setdefault(sink, []).append(rows)
            for sink, sink_rows in by_sink.items():
                if self.feature_sinks.push(sink, sink_rows):
                    if self.metrics is not None:
                        self.metrics.pushed_feature_bytes.inc(
                            sum(rows.rows.numel() * rows.rows.element_size() for rows in sink_rows))
                else:
                    for rows in sink_rows:
                        self._hold(rows)
        except Exception:
            log.exception("after a step's reply: pushing its features failed")

    def _grant(self, engine: ParallelEngine, batch: StepBatch, layers: tuple[int, ...], stops: GrantStops,
               steps: int, interrupted) -> Iterator[tuple[GrantStep, KvLoad, float]]:
        """The grant's steps with the load after each and its seconds. Without emulated costs the
        engine runs it (two steps in flight on CUDA graphs; at TP > 1 on every rank) under the
        lock throughout; with them step by step through _run."""
        if self.pacing is not None:
            timing: dict[str, object] = {}

            def step(part: StepBatch) -> StepResults:
                run = self._run(engine, part, layers)
                self._after_reply(run)
                timing["load"], timing["seconds"] = run.load, run.seconds
                return run.results

            for granted in run_grant(step, batch, stops, steps, interrupted):
                yield granted, timing.get("load") or engine.load(), timing.get("seconds", 0.0)
            return
        granted_steps = engine.grant(batch, stops, steps, interrupted, layers)
        # closing(): a caller that goes away ends the grant here, under the lock (at TP > 1 the
        # other ranks finish it alike before the next command).
        with self._lock, closing(granted_steps):
            t0 = time.perf_counter()
            for granted in granted_steps:
                now = time.perf_counter()
                load = engine.load()
                if self.metrics is not None and granted.results is not None:
                    self.metrics.record_batch(granted.batch, granted.results, now - t0)
                yield granted, load, now - t0
                t0 = time.perf_counter()

    def StepStream(self, request_iterator, context):
        calls = _CallReader(request_iterator)
        while (call := calls.next()) is not None:
            timeline.mark("target.recv")
            if call.WhichOneof("call") == "step":  # an Interrupt with nothing running is moot
                with telemetry.continued_span(STEP_CALL, call.step.traceparent):
                    yield from self._answer(call.step, calls.arrived)

    def _answer(self, call: target_pb2.PackedStep, interrupted) -> Iterator[target_pb2.StepReply]:
        index = 0
        try:
            engine = self._ready()
            if call.release_request_ids:  # finished requests' release, riding on this step (before it)
                self._release(engine, list(call.release_request_ids))
            batch = batch_from_proto(call.items)
            timeline.mark("target.parsed")
            layers = tuple(call.feature_layers)
            if call.grant_steps <= 1:
                sinks = _item_sinks(call, batch.size) if call.hold_features else None
                run = self._run(engine, batch, layers, call.hold_features, sinks)
                reply = _reply(run.results, np.arange(batch.size), run.load, run.seconds, 1, True)
                timeline.mark("target.reply")
                try:
                    yield reply
                finally:  # the reply has left (or the stream is gone): the rest is off the critical path
                    timeline.mark("target.sent")
                    self._after_reply(run)
                    timeline.mark("target.pushed")
                return
            stops = GrantStops.from_proto(call.stops, batch.size)
            check_grant(batch, stops)
            batch = batch.with_seeds(engine.engine.draw_seed)  # one seed for the whole grant
            # A fed grant (items that ask for features, held here): each step's rows are held or pushed
            # as a single step's are, the push after that step's reply has left.
            sinks = _item_sinks(call, batch.size) if call.hold_features else None
            sink_of = dict(zip(batch.request_ids, sinks, strict=True)) if sinks else None
            for granted, load, seconds in self._grant(engine, batch, layers, stops, call.grant_steps, interrupted):
                index += 1
                if granted.results is None:
                    yield target_pb2.StepReply(load=load_to_proto(load), step_index=index, done=granted.last)
                    continue
                results, pushes = granted.results, []
                if call.hold_features and results.features is not None:
                    results, pushes = self._keep_features(
                        results, [sink_of[rid] for rid in results.request_ids] if sink_of else None)
                try:
                    yield _reply(results, granted.item_index, load, seconds, index, granted.last)
                finally:
                    self._push(pushes, granted.batch, results)
        except Exception as exc:
            code, message = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("StepStream step failed")
            yield target_pb2.StepReply(error=target_pb2.StepError(code=code.name, message=message),
                                       step_index=index + 1, done=True)

    @map_errors
    def Release(self, request, context):
        n, load = self._release(self._ready(), list(request.request_ids))
        return target_pb2.ReleaseResponse(released=n, load=load_to_proto(load))

    def _release(self, engine: ParallelEngine, request_ids: list[str]) -> tuple[int, KvLoad]:
        """Free these sequences' KV and held features; how many were held, and the load after."""
        with self._lock:
            n = engine.release(request_ids)
            load = engine.load()
        self.held_features.release(request_ids)
        return n, load

    @map_errors
    def ReadFeatures(self, request, context):
        self._ready()
        out = target_pb2.ReadFeaturesResponse()
        for wanted in request.ranges:
            if wanted.end_position < wanted.start_position:
                raise InvalidArgument(f"request {wanted.request_id!r}: feature range ends ({wanted.end_position}) "
                                      f"before it starts ({wanted.start_position})")
        for wanted in request.ranges:
            start, rows = self.held_features.read(wanted.request_id, wanted.start_position, wanted.end_position)
            found = out.rows.add(request_id=wanted.request_id, start_position=start)
            if rows is not None:
                found.features.CopyFrom(tensor_to_proto(rows))
        return out

    def SubscribeFeatures(self, request, context):
        if not request.sink:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a feature subscription needs a sink name")
        ring = None
        if request.batched and request.ring_name:
            try:
                ring = FeatureRing.attach(request.ring_name, request.ring_bytes)
            except RingUnavailable as exc:  # another host's, or not ours to open: rows go in the messages
                log.info("feature sink %s: %s; its rows go in the stream", request.sink, exc)
        sub = self.feature_sinks.subscribe(request.sink)
        context.add_callback(sub.close)  # the subscriber left: end the loop below
        try:
            if sub.closed:  # the target is stopping
                return
            # Live: steps naming this sink push here from now on.
            yield target_pb2.FeatureRows(ring_attached=ring is not None, step_lane=lane_to_proto(self.step_lane))
            send = direct_sender(context)
            if send is not None and request.batched:
                # On a lane the step's thread writes each push itself once its reply has left: handed to this
                # thread, a push waited for the step's thread to let go of the GIL (BENCHMARKS.md, "A same-host
                # lane"). The loop below then only waits for the end.
                sub.deliver_directly(lambda batch: send(batch_to_proto(batch, ring), PUSH_WRITE_TIMEOUT_S))
            for batch in sub:
                if request.batched:
                    yield batch_to_proto(batch, ring)
                else:
                    yield from (single_to_proto(rows) for rows in batch)
        finally:
            self.feature_sinks.leave(sub)
            if ring is not None:
                ring.close()

    @map_errors
    def GetLoad(self, request, context):
        return load_to_proto(self._ready().load())

    @map_errors
    def GetTokenizer(self, request, context):
        files = {name: (self.model_dir / name).read_bytes() for name in TOKENIZER_FILES
                 if (self.model_dir / name).is_file()}
        return target_pb2.TokenizerFiles(files=files)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem target",
        description="Serve a Llama-family target model over gRPC (tandem.v1.TargetService). "
                    "One operation, Step, serves prefill, plain decode and tree verification.")
    p.add_argument("--model", required=True, help="Hugging Face Llama-family directory (config.json, "
                   "safetensors weights)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, required=True, help="gRPC port (0 picks a free one)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: processes (GPUs) to "
                   "split the model over; must divide the attention heads (default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="default cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=0, help="KV blocks per rank; 0 sizes the cache "
                   "from --kv-cache-gb")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache size per rank in GiB when "
                   "--num-blocks is 0 (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest sequence accepted "
                   "(default: the model's max_position_embeddings)")
    p.add_argument("--no-cuda-graphs", action="store_true", help="run every step eagerly (by default, on "
                   "CUDA, decode and verify steps replay CUDA graphs captured at start-up, at any --tp)")
    p.add_argument("--graph-max-batch", type=int, default=128, help="largest batch captured in a CUDA "
                   "graph; larger steps run eagerly (default 128)")
    p.add_argument("--graph-chain-rows", type=int, default=512, metavar="ROWS",
                   help="a step with a prompt chunk replays a CUDA graph only where the graph's padded rows "
                   "(batch bucket x nodes bucket) are at most ROWS or at most twice the step's own; 0 keeps "
                   "prompt chunks eager unless they pad little (default 512)")
    p.add_argument("--graph-ragged-rows", type=int, default=1024, metavar="ROWS",
                   help="a step with a prompt chunk that no graph above takes replays a ragged graph sized by "
                   "the step's own rows (to a power of two, at most ROWS); 0 runs such steps eagerly "
                   "(default 1024)")
    p.add_argument("--graph-ragged-warm-rows", type=int, default=64, metavar="ROWS",
                   help="capture the ragged graphs of every batch for plain decode and for trees at start-up, "
                   "rows from ROWS to --graph-ragged-rows (78 graphs by default, a few seconds); the others, "
                   "and all with 0, are captured the first time a step needs them, which pauses that step "
                   "(default 64)")
    p.add_argument("--l2-prefetch-mb", type=int, default=0, metavar="MIB",
                   help="on CUDA (Hopper or later), ask the L2 cache for up to MIB MiB of each GEMM's weight on a "
                   "side stream while the kernels before that GEMM run; output unchanged, only its time "
                   "(default 0: off, not yet measured on a GPU)")
    p.add_argument("--feature-pick-kib", type=int, default=FEATURE_PICK_BYTES >> 10, metavar="KIB",
                   help="a verify step whose rows' features (what the drafts are fed) take at most KIB KiB sends "
                   "every row to the host with its results and keeps the committed ones there; a larger one moves "
                   f"the committed rows together on the GPU first and copies those, after a second wait (default "
                   f"{FEATURE_PICK_BYTES >> 10}, always on the GPU; 4096 took a 1 x 8 verify step of an 8B target from "
                   "288 to 175 us of host work on an H100, yet the served round was not shorter in both of two "
                   "pairs)")
    p.add_argument("--deterministic", action="store_true", help="batch-invariant kernels: a token's logits "
                   "do not depend on what else is in the step (other requests, a drafted tree around it), so "
                   "greedy output with speculation is bitwise the output without it, in bf16 too; needs CUDA "
                   "(Triton); slower (BENCHMARKS.md); default off")
    p.add_argument("--random-weights", action="store_true", help="benchmarks only: draw random weights "
                   "for --model's config.json instead of loading any (realistic step costs, no checkpoint)")
    p.add_argument("--max-held-features", type=int, default=DEFAULT_HELD_FEATURES, metavar="ROWS",
                   help="feature rows (one per token) held for draft replicas to read (ReadFeatures) before the "
                        f"oldest are dropped; a dropped row costs the draft some acceptance, never output "
                        f"(default {DEFAULT_HELD_FEATURES})")
    add_pacing_argument(p, "step", "its tokens")
    p.add_argument("--metrics-port", type=int, default=None, metavar="P", help="serve Prometheus metrics "
                   "(step time, tokens and sequences per step, acceptance by draft position, KV usage, feature "
                   "bytes) on http://HOST:P/metrics (0 picks a free port; default off)")
    telemetry.add_otlp_argument(p)
    add_server_tls_arguments(p, SERVICE_CA_HELP)
    add_lane_argument(p, "StepStream")
    p.add_argument("--port-file", default=None, help=argparse.SUPPRESS)  # tests: where the port was bound
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tp < 1:
        raise SystemExit("error: --tp must be >= 1")
    if args.graph_chain_rows < 0:
        raise SystemExit("error: --graph-chain-rows must be >= 0")
    if args.graph_ragged_rows < 0:
        raise SystemExit("error: --graph-ragged-rows must be >= 0")
    if args.graph_ragged_warm_rows < 0:
        raise SystemExit("error: --graph-ragged-warm-rows must be >= 0")
    if args.l2_prefetch_mb < 0:
        raise SystemExit("error: --l2-prefetch-mb must be >= 0")
    if args.feature_pick_kib < 0:
        raise SystemExit("error: --feature-pick-kib must be >= 0")
    host_threads.limit_for_gpu(args.device)
    pacing = pacing_from_args(args.emulate_step_cost)
    telemetry.setup_tracing("target", args.otlp_endpoint)  # before ServiceHost: it installs the interceptor
    spec = EngineSpec(model_dir=args.model, dtype=args.dtype or ("bfloat16" if args.device == "cuda"
                                                                 else "float32"),
                      device=args.device, num_blocks=args.num_blocks, block_size=args.block_size,
                      kv_cache_gb=args.kv_cache_gb, max_model_len=args.max_model_len,
                      random_weights=args.random_weights, cuda_graphs=not args.no_cuda_graphs,
                      graph_max_batch=args.graph_max_batch, graph_chain_rows=args.graph_chain_rows,
                      graph_ragged_rows=args.graph_ragged_rows,
                      graph_ragged_warm_rows=args.graph_ragged_warm_rows, l2_prefetch_mb=args.l2_prefetch_mb,
                      batch_invariant=args.deterministic, feature_pick_bytes=args.feature_pick_kib << 10)
    if args.max_held_features < 1:
        raise SystemExit("error: --max-held-features must be >= 1")
    servicer = TargetServicer(Path(args.model).resolve(), pacing, None, args.max_held_features)
    if args.metrics_port is not None:
        metrics = servicer.metrics = TargetMetrics(
            load=lambda: None if servicer.engine is None else servicer.engine.load())
        log.info("metrics on http://%s:%d/metrics", args.host, serve_metrics(metrics.registry, args.host,
                                                                            args.metrics_port))
    try:
        host = ServiceHost(args.host, args.port, [SERVICE_NAME], credentials=service_credentials(args))
    except OSError as exc:
        raise SystemExit(f"error: --port: {exc}") from None
    host.add(target_pb2_grpc.add_TargetServiceServicer_to_server, servicer)
    host.on_draining.append(servicer.feature_sinks.close_all)  # subscriptions must not hold the drain
    host.start()
    log.info("listening on %s:%d (loading %s, tp=%d)", args.host, host.port, args.model, args.tp)
    if args.step_lane:
        servicer.step_lane = start_lane(args.step_lane, f"target-{host.port}", {
            "StepStream": LaneMethod(servicer.StepStream, target_pb2.StepCall),
            # The drafts' feature subscriptions too: with the verify reply on the lane and the push on
            # gRPC, the push reached the draft after its next call (BENCHMARKS.md, "A same-host lane").
            "SubscribeFeatures": LaneMethod(servicer.SubscribeFeatures, target_pb2.SubscribeFeaturesRequest,
                                            unary=True)}, host)
    if args.port_file:
        Path(args.port_file).write_text(str(host.port))
    compiles, collections = CompileWatch(log), GcWatch(log)
    compiles.install()
    collections.install()
    try:
        servicer.engine = ParallelEngine(spec, args.tp)
    except Exception as exc:
        host.stop(0)
        if servicer.step_lane is not None:
            servicer.step_lane.stop()
        raise SystemExit(f"error: cannot load {args.model}: {exc}") from None
    load = servicer.engine.load()
    collections.ready()
    log.info("ready: %d KV blocks of %d tokens", load.total_blocks, load.block_size)
    compiles.mark_serving()
    if pacing is not None:
        log.warning("emulating step cost: every step lasts at least %g ms + %g ms per token",
                    pacing.base_ms, pacing.per_token_ms)
    host.set_serving(True)

    def stop() -> None:
        if servicer.step_lane is not None:  # its streams end before the engine goes
            servicer.step_lane.stop()
        servicer.engine.shutdown()

    host.run_until_signal(on_stop=stop)
    telemetry.shutdown_tracing()  # flush the spans still queued
    log.info("stopped")
    return 0
