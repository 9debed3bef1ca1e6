"""CUDA graphs of the target step, one pair per (batch bucket, nodes-per-request bucket).

A bucket holds a decode or verify step of up to B sequences with up to N nodes
each (N = 1 is plain decode). Its inputs are views of one static device buffer
that every step overwrites with one copy (target_service.step_inputs); padding
rows run through the layers like any row but attend to nothing and are written
to the cache's trash slot. Two graphs per bucket:

- forward: the step's new block-table entries, then the model (logits of every
  row, K/V into the step's scratch, features of the default layers);
- greedy tail: acceptance, the kept nodes' K/V moved into the cache, results
  packed into one buffer.

A step with sampled sequences or top log-probs replays the forward graph and
runs the tail eagerly. A graph never depends on what the previous step did, so a
step that speculates and one that does not replay the same way. A prompt
chunk is a fixed chain of nodes: it replays a bucket too where the padding stays
small (GraphConfig.max_chain_rows). With GraphConfig.ragged_rows a step with prompt
chunks that no such bucket takes replays a ragged bucket instead, (batch, tree
nodes, rows): its rows are the step's own, rounded up to a power of two, not
every sequence padded to the longest chunk. A step the buckets do not cover
(longer or heavier prompt chunks, other feature layers) runs eagerly.

With capture=False the same padded buffers run eagerly: the CPU tests use it to
check that padding changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kernels.tree_metadata import SEQ_INFO_FIELDS, choose_block_m, choose_num_splits
from tandem.graph_capture import capture_graphs
from target_service.step_batch import StepBatch
from target_service.step_inputs import PADDING_ROW, InputLayout, InputShape, max_tree
from target_service.step_tail import output_width

if TYPE_CHECKING:
    from target_service.engine import TargetEngine

log = logging.getLogger(__name__)


def _pow2_upto(limit: int) -> list[int]:
    out, b = [], 1
    while b < limit:
        out.append(b)
        b *= 2
    return out + [limit]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GraphConfig:
    max_batch: int = 128  # sequences; batch buckets are 1, 2, 4, ... up to this
    max_nodes: int = 64  # nodes per sequence; node buckets are 1, 2, 4, ... up to this
    max_tokens: int = 4096  # buckets with batch * nodes above this are not captured
    capture: bool = True  # False: run the padded buffers eagerly (tests on CPU)
    # A step with a prompt chunk (or another fixed chain) pads every sequence of its bucket to the
    # chunk's length, so it replays a graph only where the bucket has at most this many rows, or at
    # most twice the step's own: a short prompt joining a light batch (on the H200 scale track a 40-token
    # prompt beside 3 decoding requests took 16.3 ms eagerly and 9.5 ms through the 4 x 64 bucket), not
    # one joining 64 requests (the 64 x 64 bucket would compute 4096 rows for 124).
    max_chain_rows: int = 512
    # A step with prompt chunks that no bucket above takes (too much padding, or a chunk longer than
    # max_nodes) replays a ragged bucket of at most this many rows (0: off): its rows are packed sequence
    # after sequence, as an eager step's, and only their total is padded. On the H200 scale track (0.8,
    # 2026-12-04) steps with a joining prompt ran eagerly at 19-31 ms beside 5-9 ms decode and tree steps,
    # 38-43% of `never`'s time at 64 requests. With them (1024 rows) on an H100 (2026-12-05, same track)
    # `always` delivered 4-13% more at 8-64 requests and `never` about the same; `tandem target` serves 1024 rows
    # by default (--graph-ragged-rows), the engine alone none.
    ragged_rows: int = 0
    # A ragged bucket's tree nodes: 1 where every decode item is plain, else the tree bucket raised to at
    # least this (its rows are packed, so the bound costs no rows): trees of 2 to 16 nodes share buckets.
    ragged_tree: int = 16
    # capture_all also captures the ragged buckets of every batch bucket, trees 1 and ragged_tree, rows
    # from this many (or the batch) up to ragged_rows (0: none; the rest are captured on first use). On an
    # H100 (2026-12-05) 38 ragged buckets met in one serve took 0.04-0.08 s each, and four of them, met
    # in the first steps of one level's first probe of trees, made that probe read trees at 2449 tok/s
    # where they then ran at 3234: plain decoding won the verdict and auto delivered 0.82 of `always`.
    ragged_warm_rows: int = 64

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_nodes < 1 or self.max_tokens < 1 or self.max_chain_rows < 0 \
                or self.ragged_rows < 0 or self.ragged_tree < 1 or self.ragged_warm_rows < 0:
            raise ValueError("CUDA graph limits: max batch, nodes, tokens and ragged tree must be positive, "
                             "chain, ragged and warm ragged rows not negative")

    def buckets(self) -> list[tuple[int, int]]:
        return [(b, n) for b in _pow2_upto(self.max_batch) for n in _pow2_upto(self.max_nodes)
                if b * n <= self.max_tokens]

    def ragged_tree_bucket(self, tree: int) -> int | None:
        """The tree nodes of the ragged bucket for decode items of up to `tree` nodes (None: past max_nodes)."""
        if tree > self.max_nodes:
            return None
        return 1 if tree == 1 else min(self.max_nodes, max(self.ragged_tree, 1 << (tree - 1).bit_length()))

    def warm_ragged_buckets(self) -> list[tuple[int, int, int]]:
        """The ragged buckets capture_all captures (see ragged_warm_rows)."""
        if not self.ragged_rows or not self.ragged_warm_rows:
            return []
        shared = self.ragged_tree_bucket(2)  # the bucket of every tree of 2 to ragged_tree nodes
        trees = [1] if shared is None else [1, shared]
        return [(b, n, rows) for b in _pow2_upto(self.max_batch) for n in trees
                for rows in _pow2_upto(self.ragged_rows) if rows >= max(b, self.ragged_warm_rows)
                and rows == 1 << (rows - 1).bit_length()]


def bucket_shape(engine: TargetEngine, batch: int, nodes: int) -> tuple[InputShape, int]:
    """A bucket's padded input shape and attention tile height."""
    block_m = choose_block_m(nodes, engine.group)
    tiles = batch * _cdiv(nodes, block_m // engine.group)
    # A step adds at most cdiv(nodes, block) + 1 blocks per sequence.
    updates = batch * (_cdiv(nodes, engine.kv.block_size) + 1)
    return InputShape(rows=batch * nodes, seqs=batch, tree=nodes, tiles=tiles, updates=updates,
                      words=_cdiv(nodes, 64)), block_m


def ragged_shape(engine: TargetEngine, batch: int, nodes: int, rows: int) -> tuple[InputShape, int]:
    """A ragged bucket's input shape and attention tile height: up to `batch` sequences whose tree parts
    have up to `nodes` nodes, `rows` rows in all, however they split among the sequences (a chain may
    take nearly all of them)."""
    block_m = choose_block_m(rows, engine.group)
    per_tile = block_m // engine.group
    # A sequence's last tile may be partial: at most one tile per sequence beyond the rows' own.
    tiles = _cdiv(rows, per_tile) + batch
    bs = engine.kv.block_size
    updates = batch * (_cdiv(nodes, bs) + 1) + _cdiv(rows, bs) + 1
    return InputShape(rows=rows, seqs=batch, tree=nodes, tiles=tiles, updates=updates,
                      words=_cdiv(rows, 64)), block_m


class BucketGraph:
    """The static buffers and graphs of one (batch, nodes) bucket, or one ragged (batch, nodes, rows)
    bucket (GraphConfig.ragged_rows)."""

    def __init__(self, owner: StepGraphs, batch: int, nodes: int, rows: int | None = None):
        engine = owner.engine
        model = engine.model
        self.owner = owner
        self.key = (batch, nodes) if rows is None else (batch, nodes, rows)
        self.shape, self.block_m = (bucket_shape(engine, batch, nodes) if rows is None
                                    else ragged_shape(engine, batch, nodes, rows))
        self.num_splits = choose_num_splits(self.shape.tiles * model.kv_heads_local, engine.max_model_len,
                                            model.device)
        self.layout = InputLayout(self.shape)
        self.buffer = owner.buffer
        self.views = self.layout.device_views(self.buffer)
        self.k_scratch = owner.k_scratch[:, : self.shape.rows]
        self.v_scratch = owner.v_scratch[:, : self.shape.rows]
        self.tail = engine.new_tail(self.views, self.shape)
        self.out = torch.zeros(batch, output_width(nodes, 0), dtype=torch.int32, device=model.device)
        self.logits: torch.Tensor | None = None
        self.features: torch.Tensor | None = None
        self.committed: torch.Tensor | None = None  # StepTail.committed_rows of the greedy tail
        self.forward_graph: torch.cuda.CUDAGraph | None = None
        self.tail_graph: torch.cuda.CUDAGraph | None = None

    # --- the two halves ---------------------------------------------------
    def _forward(self) -> None:
        engine = self.owner.engine
        self.tail.apply_table_updates()
        self.logits, self.features = engine.forward(self.buffer, self.layout, self.views, self.block_m,
                                                    self.num_splits, self.owner.feature_layers, self.k_scratch,
                                                    self.v_scratch)

    def _greedy_tail(self) -> None:
        self.committed = self.tail.committed_rows(self.tail.pack(self.tail.greedy(self.logits), self.out))
        self.tail.commit(self.committed, self.k_scratch, self.v_scratch)

    def _fill_padding(self) -> None:
        """A step of padding only: what capture runs over (it writes nothing but trash)."""
        v = self.views
        table = self.owner.engine.table
        self.buffer[: self.layout.size].zero_()
        v["row_seq"].fill_(-1)
        v["row_tree"].fill_(PADDING_ROW)
        v["seq_info"].view(-1, SEQ_INFO_FIELDS)[:, 3] = table.padding_row
        v["update_index"].fill_(table.padding_row * table.max_blocks)
        v["row_slot"].fill_(self.owner.engine.kv.trash_slot)
        v["greedy"].fill_(1)
        v["top_p"].fill_(1.0)

    def capture(self, pool) -> None:
        self._fill_padding()
        if not self.owner.cfg.capture:
            return
        t0 = time.perf_counter()
        self.forward_graph, self.tail_graph = capture_graphs(self._forward, self._greedy_tail, pool=pool)
        log.info("captured CUDA graphs for batch %d x %d nodes%s in %.2f s", *self.key[:2],
                 f", {self.key[2]} rows" if len(self.key) > 2 else "", time.perf_counter() - t0)

    # --- a step -----------------------------------------------------------
    def load_inputs(self, host: torch.Tensor) -> None:
        """host: one of the engine's pinned buffers on CUDA (asking a tensor is_pinned() costs a
        driver query, 84 us a step on the H200's host)."""
        self.buffer[: host.numel()].copy_(host, non_blocking=self.buffer.is_cuda)

    def replay(self, greedy_only: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run the step; with greedy_only also the tail (returns the committed rows and results)."""
        self.owner.replays += 1
        if self.forward_graph is None:
            self._forward()
        else:
            self.forward_graph.replay()
        if not greedy_only:
            return None, None
        if self.tail_graph is None:
            self._greedy_tail()
        else:
            self.tail_graph.replay()
        return self.committed, self.out

    def out_buffer(self, top_k: int) -> torch.Tensor:
        return torch.empty(self.shape.seqs, output_width(self.shape.tree, top_k), dtype=torch.int32,
                           device=self.buffer.device)


class StepGraphs:
    def __init__(self, engine: TargetEngine, cfg: GraphConfig):
        model = engine.model
        if cfg.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if model.attention.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend, not {model.attention.name!r}")
        self.engine, self.cfg = engine, cfg
        self.keys = cfg.buckets()
        self.feature_layers = model.cfg.default_feature_layers
        max_rows = max(cfg.ragged_rows, *(b * n for b, n in self.keys))
        sizes = [InputLayout(bucket_shape(engine, b, n)[0]).size for b, n in self.keys]
        if cfg.ragged_rows:  # a layout's size grows with each of batch, nodes and rows: the largest bounds all
            sizes.append(InputLayout(ragged_shape(engine, max(b for b, _ in self.keys),
                                                  max(n for _, n in self.keys), cfg.ragged_rows)[0]).size)
        self.buffer = torch.zeros(max(sizes), dtype=torch.int32, device=model.device)
        self.k_scratch, self.v_scratch = model.new_scratch(max_rows)
        self.pool = torch.cuda.graph_pool_handle() if cfg.capture else None
        self._buckets: dict[tuple[int, ...], BucketGraph] = {}
        self.replays = 0
        # A pipelined grant's alternating pinned input and output buffers (pipelined_grant):
        # a step's are not rewritten while it is in flight. Made on the first grant.
        self.grant_buffers: list[tuple[torch.Tensor, torch.Tensor]] = []

    def grant_buffer_pair(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.grant_buffers:
            pinned = self.buffer.device.type == "cuda"
            words_out = max(self.keys)[0] * output_width(1, 0)
            self.grant_buffers = [(torch.zeros(self.buffer.numel(), dtype=torch.int32, pin_memory=pinned),
                                   torch.zeros(words_out, dtype=torch.int32, pin_memory=pinned))
                                  for _ in range(2)]
        return self.grant_buffers[index]

    def bucket_for(self, batch: StepBatch, layers: tuple[int, ...], updates: int) -> BucketGraph | None:
        if layers and tuple(layers) != tuple(self.feature_layers):
            return None
        nodes = int(batch.num_nodes.max())
        fits = [(b, n) for b, n in self.keys if b >= batch.size and n >= nodes]
        key: tuple[int, ...] | None = min(fits, key=lambda bn: (bn[0] * bn[1], bn)) if fits else None
        # A new sequence's block-table row and its first blocks are host facts and step updates, as
        # any step's: the graph needs nothing else for a prompt chunk (see GraphConfig.max_chain_rows).
        chains = batch.create.any() or (batch.num_fixed != 1).any()
        if chains and (key is None or key[0] * key[1] > max(self.cfg.max_chain_rows, 2 * len(batch.tokens))):
            key = self._ragged_key(batch)
        if key is None:
            return None
        bucket = self._bucket(key)
        return bucket if updates <= bucket.shape.updates else None

    def _ragged_key(self, batch: StepBatch) -> tuple[int, int, int] | None:
        """The ragged bucket (batch, tree nodes, rows) of a step with prompt chunks, None where
        GraphConfig.ragged_rows is off or too small for it."""
        rows = 1 << max(len(batch.tokens) - 1, 0).bit_length()  # the step's rows, to a power of two
        if rows > self.cfg.ragged_rows:
            return None
        tree = self.cfg.ragged_tree_bucket(max_tree(batch))
        batches = [b for b, _ in self.keys if b >= batch.size]
        if not batches or tree is None:
            return None
        return min(batches), tree, max(rows, min(batches))

    def _bucket(self, key: tuple[int, ...]) -> BucketGraph:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = BucketGraph(self, *key)
            bucket.capture(self.pool)
        return bucket

    def release(self) -> None:
        """Drop every captured graph: at TP > 1 before the process group their all-reduces use is
        torn down (on two H200s NCCL's teardown never finished within 5 s on either rank while the
        graphs lived; whether they are why is for the next GPU run to show)."""
        for bucket in self._buckets.values():
            for graph in (bucket.forward_graph, bucket.tail_graph):
                if graph is not None:
                    graph.reset()
            bucket.forward_graph = bucket.tail_graph = None
        self._buckets.clear()

    def capture_all(self) -> float:
        """Capture every bucket now (largest first, so smaller graphs reuse the pool), then the ragged
        buckets of GraphConfig.ragged_warm_rows; returns seconds."""
        t0 = time.perf_counter()
        for key in sorted(self.keys, key=lambda bn: -bn[0] * bn[1]):
            self._bucket(key)
        for ragged in sorted(self.cfg.warm_ragged_buckets(), key=lambda key: (-key[2], -key[0], -key[1])):
            self._bucket(ragged)
        return time.perf_counter() - t0
