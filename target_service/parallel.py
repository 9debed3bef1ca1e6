"""Tensor parallelism over N processes: rank 0 serves, every rank runs each step.

Rank 0 sends each command (a step or a release) to every other rank over a pipe
of its own: a small JSON header, then for a step its columns as the wire's
packed bytes. All ranks then run the same engine call. Sampling is
deterministic given the seed, which rank 0 fills in before sending, so every
rank makes the same acceptance decisions and keeps identical KV bookkeeping.
(Commands went as two gloo broadcasts before: about 0.4 ms per step on the
2-core dev machine, where a pipe takes about 6 us, and rank 0's first
all-reduce of the step waits for the last rank to have its command.)

A grant (k plain steps, each feeding its tokens to the next) goes as one command:
every rank runs the engine's own grant loop, two steps in flight on CUDA graphs,
so no rank waits on the host between granted steps. The loop's decisions follow
from the tokens, which every rank computes alike, except whether to stop early
(an interrupt, known to rank 0 only): each time rank 0's loop asks, its answer
goes to every rank as a one-byte message, and their loops ask at the same points.

The other ranks' wait for rank 0's next message spins first where the step lanes' reads spin
(TANDEM_LANE_SPIN_US, which `tandem serve` sets; tandem/lane.py): a rank woken from a sleep runs its
step's host work cold (on an H100's host 3-10x slower, bench/host_wake.py), and every rank's first
all-reduce of the step waits for the last one to launch.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.l2_prefetch import WeightPrefetch
from kernels.tree_attention import warm_up
from tandem.errors import InvalidArgument, ResourceExhausted
from tandem.gc_pauses import GcWatch
from tandem.lane import spin_setup
from tandem.layers import DTYPES
from tandem.logging_setup import setup_logging
from tandem.model_config import load_llama_config
from tandem.v1 import target_pb2
from target_service.cuda_graphs import GraphConfig
from target_service.engine import FEATURE_PICK_BYTES, TargetEngine, batch_of_items
from target_service.grant import GrantStep
from target_service.model import LlamaModel, ParallelSpec, check_tp
from target_service.random_model import RandomInit, random_llama_model
from target_service.step_batch import StepBatch, StepResults
from target_service.types import KvLoad, SequenceResult, SequenceStep
from target_service.wire import GrantStops, batch_from_proto, batch_to_proto

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """Everything a rank needs to build its share of the engine."""

    model_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    num_blocks: int = 0  # 0: size the cache from kv_cache_gb
    block_size: int = 16
    kv_cache_gb: float = 1.0
    max_model_len: int | None = None
    random_weights: bool = False  # benchmarks: draw weights for model_dir's config.json
    cuda_graphs: bool = True  # on CUDA with TP=1: decode/verify steps replay captured graphs
    graph_max_batch: int = 128
    graph_chain_rows: int = 512  # GraphConfig.max_chain_rows: prompt chunks replay buckets of at most this many rows
    graph_ragged_rows: int = 1024  # GraphConfig.ragged_rows: ragged buckets for prompt chunks (0: off)
    graph_ragged_warm_rows: int = 64  # GraphConfig.ragged_warm_rows: those captured at start-up (0: none)
    batch_invariant: bool = False  # --deterministic: kernels whose rows do not depend on the step
    l2_prefetch_mb: int = 0  # on CUDA, ask L2 for up to this many MiB of each GEMM's weight ahead of it (0: off)
    feature_pick_bytes: int = FEATURE_PICK_BYTES  # TargetEngine's: verify steps this small pick features on the host

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.block_size <= 0:
            raise ValueError("--block-size must be positive")
        if self.l2_prefetch_mb < 0:
            raise ValueError(f"--l2-prefetch-mb must be >= 0, got {self.l2_prefetch_mb}")
        if self.feature_pick_bytes < 0:
            raise ValueError(f"feature_pick_bytes must be >= 0, got {self.feature_pick_bytes}")


def build_engine(spec: EngineSpec, tp: ParallelSpec) -> TargetEngine:
    device = spec.device
    if device == "cuda":
        torch.cuda.set_device(tp.rank)
        device = f"cuda:{tp.rank}"
    if spec.random_weights:
        raw = json.loads((Path(spec.model_dir) / "config.json").read_text())
        model = random_llama_model(load_llama_config(spec.model_dir), DTYPES[spec.dtype], device, tp,
                                   init=RandomInit.from_config_json(raw), batch_invariant=spec.batch_invariant)
    else:
        model = LlamaModel(spec.model_dir, DTYPES[spec.dtype], device, tp, batch_invariant=spec.batch_invariant)
    if spec.l2_prefetch_mb and model.device.type == "cuda":
        model.weight_prefetch = WeightPrefetch(model.device, spec.l2_prefetch_mb << 20)
        log.info("L2 prefetch: up to %d MiB of each GEMM's weight ahead of it", spec.l2_prefetch_mb)
    num_blocks = spec.num_blocks or max(
        1, int(spec.kv_cache_gb * 2**30 // (model.kv_bytes_per_token() * spec.block_size)))
    if model.device.type == "cuda" and model.attention.name == "triton":
        t0 = time.perf_counter()
        n = warm_up(model.heads_local, model.kv_heads_local, model.cfg.head_dim, spec.block_size, model.dtype,
                    model.device)
        log.info("compiled %d tree-attention variants in %.1f s", n, time.perf_counter() - t0)
    graphs = None
    if spec.cuda_graphs and model.device.type == "cuda" and model.attention.name == "triton":
        # At TP > 1 every rank captures the same buckets in the same order, the all-reduces
        # inside (NCCL collectives can be captured); ranks then replay in lockstep, since each
        # runs the same step sequence rank 0 broadcasts.
        graphs = GraphConfig(max_batch=spec.graph_max_batch, max_chain_rows=spec.graph_chain_rows,
                             ragged_rows=spec.graph_ragged_rows, ragged_warm_rows=spec.graph_ragged_warm_rows)
    engine = TargetEngine(model, num_blocks, spec.block_size, spec.max_model_len, graphs=graphs,
                          feature_pick_bytes=spec.feature_pick_bytes)
    if engine.graphs is not None:
        log.info("capturing %d CUDA graphs (batch up to %d) and %d ragged ones", len(engine.graphs.keys),
                 spec.graph_max_batch, len(graphs.warm_ragged_buckets()))
        log.info("CUDA graphs captured in %.1f s", engine.graphs.capture_all())
    return engine


def _rendezvous_file() -> str:
    """Where the ranks meet: a file store, because a TCP store's server listens on every
    interface whatever address it is given, and all ranks share this host anyway."""
    return str(Path(tempfile.mkdtemp(prefix="tandem-tp-")) / "rendezvous")


def _init_group(rank: int, world: int, rendezvous: str, device: str) -> dist.ProcessGroup:
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    return dist.new_group(backend="gloo")  # control messages travel on the CPU


_HEADER = struct.Struct("<I")  # the JSON header's length, before it


def _send(obj: dict, pipes: list[Connection], packed: bytes = b"") -> None:
    """A command to every other rank: a small JSON header, then (for a step) its columns as the
    wire's packed bytes (target_service.wire), not one JSON object per sequence."""
    header = json.dumps(obj).encode()
    message = _HEADER.pack(len(header)) + header + packed
    for pipe in pipes:
        pipe.send_bytes(message)


# A grant's "stop early?" answers, one byte each; a command is never this short.
_GO_ON, _STOP = b"\x00", b"\x01"


@dataclass(frozen=True)
class PipeWait:
    """How a rank waits for rank 0's next message: spinning in C for up to `seconds` first (tandem/spin_wait.py,
    without the GIL) where `waiter` is set, then blocking."""

    seconds: float = 0.0
    waiter: Callable[[int, float], int] | None = None

    @classmethod
    def from_env(cls) -> PipeWait:
        seconds, waiter = spin_setup()
        return cls(seconds, waiter) if waiter is not None else cls()

    def recv(self, pipe: Connection) -> bytes:
        if self.waiter is not None:
            self.waiter(pipe.fileno(), self.seconds)  # readable, or the spin ran out: the read then blocks
        return pipe.recv_bytes()


BLOCKING = PipeWait()


def _recv(pipe: Connection, wait: PipeWait = BLOCKING) -> tuple[dict, bytes]:
    raw = wait.recv(pipe)
    if len(raw) == 1:
        raise RuntimeError("tensor-parallel ranks out of step: a grant's answer arrived where a command was due")
    (n,) = _HEADER.unpack_from(raw)
    at = _HEADER.size
    return json.loads(raw[at: at + n]), raw[at + n:]


def _answers_from(pipe: Connection, wait: PipeWait = BLOCKING) -> Callable[[], bool]:
    """A worker's side of a grant's "stop early?": rank 0's next answer."""
    def interrupted() -> bool:
        raw = wait.recv(pipe)
        if raw not in (_GO_ON, _STOP):
            raise RuntimeError("tensor-parallel ranks out of step: a command arrived where a grant's answer "
                               "was due")
        return raw == _STOP
    return interrupted


def _run_grant(engine: TargetEngine, packed: bytes, commands: Connection, layers: tuple[int, ...],
               wait: PipeWait = BLOCKING) -> None:
    call = target_pb2.PackedStep()
    call.ParseFromString(packed)
    batch = batch_from_proto(call.items)
    for _ in engine.grant(batch, GrantStops.from_proto(call.stops, batch.size), call.grant_steps,
                          _answers_from(commands, wait), layers):
        pass


def _teardown(engine: TargetEngine, who: str) -> None:
    """A rank's end: its graphs, which hold the group's all-reduces (StepGraphs.release), then the
    group itself."""
    if engine.graphs is not None:
        torch.cuda.synchronize(engine.model.device)
        engine.graphs.release()
    _destroy_group(5.0, who)


def _destroy_group(timeout: float, who: str) -> None:
    """Tear the process group down, giving up after `timeout` s (the process is ending anyway).
    On two H200s the TP=2 target outlived its stop grace, with no log of which phase hung;
    a teardown that waits for the other ranks is one candidate, so no rank waits on it long."""
    t0 = time.perf_counter()
    done = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
    done.start()
    done.join(timeout)
    if done.is_alive():
        log.warning("%s: the process group was not destroyed within %.0f s; leaving it", who, timeout)
    else:
        log.info("%s: process group destroyed in %.1f s", who, time.perf_counter() - t0)


def _worker(rank: int, world: int, rendezvous: str, spec: EngineSpec, commands: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
    setup_logging(f"target-rank{rank}")  # a spawned process starts with no logging setup
    collections = GcWatch(log)  # a pause on any rank stalls every rank at the next collective
    collections.install()
    group = _init_group(rank, world, rendezvous, spec.device)
    engine = build_engine(spec, ParallelSpec(rank, world))
    collections.ready()
    wait = PipeWait.from_env()
    dist.barrier(group=group)
    while True:
        try:
            cmd, packed = _recv(commands, wait)
        except EOFError:  # rank 0 is gone
            break
        if cmd["op"] == "stop":
            break
        try:
            if cmd["op"] == "run":
                items = target_pb2.PackedItems()
                items.ParseFromString(packed)
                engine.run(batch_from_proto(items), tuple(cmd["layers"]))
            elif cmd["op"] == "grant":
                _run_grant(engine, packed, commands, tuple(cmd["layers"]), wait)
            elif cmd["op"] == "release":
                engine.release(cmd["ids"])
        except (InvalidArgument, ResourceExhausted):
            pass  # rank 0 raised the same error and reported it
    _teardown(engine, f"rank {rank}")


class ParallelEngine:
    """The engine as seen by the server: one object whatever the TP degree."""

    def __init__(self, spec: EngineSpec, tp_size: int = 1):
        self.tp_size = tp_size
        self._procs: list[mp.Process] = []
        self._pipes: list[Connection] = []  # rank 0's ends, one per other rank
        self._group = None
        if tp_size == 1:
            self.engine = build_engine(spec, ParallelSpec())
            return
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # all ranks share this host
        check_tp(load_llama_config(spec.model_dir), tp_size)  # fail before spawning any rank
        self._rendezvous = _rendezvous_file()
        ctx = mp.get_context("spawn")
        for rank in range(1, tp_size):
            theirs, ours = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, args=(rank, tp_size, self._rendezvous, spec, theirs), daemon=True,
                            name=f"tandem-target-rank{rank}")
            p.start()
            theirs.close()  # the child has its own copy
            self._procs.append(p)
            self._pipes.append(ours)
        self._group = _init_group(0, tp_size, self._rendezvous, spec.device)
        self.engine = build_engine(spec, ParallelSpec(0, tp_size))
        dist.barrier(group=self._group)

    @property
    def model(self) -> LlamaModel:
        return self.engine.model

    def load(self) -> KvLoad:
        return self.engine.load()

    def step(self, items: list[SequenceStep], feature_layers: tuple[int, ...] = ()) -> list[SequenceResult]:
        return self.run(batch_of_items(items), feature_layers).sequence_results()

    def run(self, batch: StepBatch, feature_layers: tuple[int, ...] = ()) -> StepResults:
        """The step in columns (the stream's path); seeds are filled in here, once."""
        batch = batch.with_seeds(self.engine.draw_seed)
        if self._group is not None:
            self._check_workers()
            _send({"op": "run", "layers": list(feature_layers)}, self._pipes,
                  batch_to_proto(batch).SerializeToString())
        return self.engine.run(batch, feature_layers)

    def grant(self, batch: StepBatch, stops: GrantStops, steps: int,
              interrupted: Callable[[], bool], feature_layers: tuple[int, ...] = ()) -> Iterator[GrantStep]:
        """Up to `steps` plain steps of `batch` (seeds filled in by the caller), each rank
        running the engine's grant loop (see the module's docstring). Closing this before
        its last step ends the grant after the steps in flight, on every rank alike.
        feature_layers: as for `run`, for items that ask for their features (a fed grant)."""
        if self._group is None:
            yield from self.engine.grant(batch, stops, steps, interrupted, feature_layers)
            return
        self._check_workers()
        call = target_pb2.PackedStep(items=batch_to_proto(batch), grant_steps=steps, stops=stops.to_proto())
        _send({"op": "grant", "layers": list(feature_layers)}, self._pipes, call.SerializeToString())
        abandoned = False

        def told_to_every_rank() -> bool:
            stop = abandoned or interrupted()
            for pipe in self._pipes:
                pipe.send_bytes(_STOP if stop else _GO_ON)
            return stop

        granted_steps = self.engine.grant(batch, stops, steps, told_to_every_rank, feature_layers)
        try:
            # Not `yield from`: that would close granted_steps with this generator, unfinished.
            for granted in granted_steps:  # noqa: UP028
                yield granted
        finally:
            # Closed early (the caller went away): rank 0's loop must still ask, and hear "stop",
            # as often as the other ranks' loops do, or the next command would be read as an answer.
            abandoned = True
            with suppress(InvalidArgument, ResourceExhausted):
                for _ in granted_steps:
                    pass

    def release(self, request_ids: list[str]) -> int:
        if self._group is not None:
            self._check_workers()
            _send({"op": "release", "ids": list(request_ids)}, self._pipes)
        return self.engine.release(request_ids)

    def _check_workers(self) -> None:
        dead = [p.name for p in self._procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker(s) died: {', '.join(dead)}")

    def shutdown(self) -> None:
        if self._group is not None:
            # Each phase is logged with its time: at TP=2 over NCCL on two H200s `tandem serve` had to
            # kill the target after its stop grace, and nothing said which phase hung.
            t0 = time.perf_counter()
            for pipe, proc in zip(self._pipes, self._procs, strict=True):
                if proc.is_alive():
                    try:
                        _send({"op": "stop"}, [pipe])
                    except OSError:  # it died meanwhile
                        pass
                pipe.close()
            # Every rank tears its group down at once (a teardown may wait for the other ranks),
            # rank 0 while it waits for the workers to end.
            teardown = threading.Thread(target=_teardown, args=(self.engine, "rank 0"), daemon=True)
            teardown.start()
            for p in self._procs:
                p.join(timeout=10)
                if p.is_alive():
                    log.warning("tensor-parallel worker %s did not stop within 10 s; terminating it", p.name)
                    p.terminate()
            log.info("tensor-parallel workers stopped in %.1f s", time.perf_counter() - t0)
            teardown.join(6.0)
            self._group = None
            shutil.rmtree(Path(self._rendezvous).parent, ignore_errors=True)
