"""CUDA graphs of the target's forward, one per (batch bucket, nodes-per-request bucket).

A graph holds a decode or verify step of up to B sequences with up to N nodes
each (N = 1 is plain decode). What a graph reads lives in static buffers that
every replay overwrites: token ids, positions and the attention metadata, padded
to the bucket. Padding rows run through the layers like any row but attend to
nothing and are never read back. A graph never depends on what the previous step
did, so a step that speculates and one that does not replay the same way; a
step the buckets do not cover (prefill chunks, fixed chains, TP > 1, other
feature layers) runs eagerly.

With capture=False the same padded buffers run eagerly: the CPU tests use it to
check that padding changes nothing.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kernels.tree_attention import StepLayout
from kernels.tree_metadata import TreeAttnMetadata, build_tree_metadata, choose_block_m, choose_num_splits
from tandem.kv_cache import PagedKVCache
from target_service.model import LlamaModel, StepOutput
from target_service.types import SequenceStep

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

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_nodes < 1 or self.max_tokens < 1:
            raise ValueError("CUDA graph limits (max batch, nodes, tokens) must be positive")

    def buckets(self) -> list[tuple[int, int]]:
        return [(b, n) for b in _pow2_upto(self.max_batch) for n in _pow2_upto(self.max_nodes)
                if b * n <= self.max_tokens]


@dataclass
class _Captured:
    meta: TreeAttnMetadata  # the static metadata the graph reads
    pad: dict  # build_tree_metadata's padding arguments for this bucket
    out: StepOutput | None = None  # the graph's static outputs
    graph: torch.cuda.CUDAGraph | None = None


class StepGraphs:
    def __init__(self, model: LlamaModel, kv: PagedKVCache, max_model_len: int, cfg: GraphConfig):
        if cfg.capture and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if model.attention.name != "triton":
            raise ValueError(f"CUDA graphs need the triton attention backend, not {model.attention.name!r}")
        if model.tp.size > 1:
            raise ValueError("CUDA graphs are not supported with tensor parallelism yet")
        self.model, self.kv, self.cfg = model, kv, cfg
        self.buckets = cfg.buckets()
        self.max_model_len = max_model_len
        self.max_blocks = _cdiv(max_model_len, kv.block_size)
        self.feature_layers = model.cfg.default_feature_layers
        max_rows = max(b * n for b, n in self.buckets)
        device = model.device
        # Rows 0.. hold the step's token ids, positions and the rows logits are read from.
        self.tokens = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_rows, dtype=torch.long, device=device)
        self.rows = torch.arange(max_rows, device=device)
        self.pool = torch.cuda.graph_pool_handle() if cfg.capture else None
        self._captured: dict[tuple[int, int], _Captured] = {}
        self.replays = 0

    # --- which bucket -------------------------------------------------------
    def bucket_for(self, items: list[SequenceStep], layers: tuple[int, ...]) -> tuple[int, int] | None:
        if layers and tuple(layers) != tuple(self.feature_layers):
            return None
        if any(it.create or it.num_fixed != 1 for it in items):
            return None  # prefill and fixed chains run eagerly
        nodes = max(len(it.tokens) for it in items)
        fits = [(b, n) for b, n in self.buckets if b >= len(items) and n >= nodes]
        return min(fits, key=lambda bn: (bn[0] * bn[1], bn)) if fits else None

    # --- capture ------------------------------------------------------------
    def _padding(self, batch: int, nodes: int) -> dict:
        m = self.model
        group = m.heads_local // m.kv_heads_local
        block_m = choose_block_m(nodes, group)
        tiles = batch * _cdiv(nodes, block_m // group)
        splits = choose_num_splits(tiles * m.kv_heads_local, self.max_model_len, m.device)
        return dict(max_batch=batch, max_blocks=self.max_blocks, max_tiles=tiles, max_rows=batch * nodes,
                    max_words=_cdiv(nodes, 64), block_m=block_m, num_splits=splits)

    def _metadata(self, layout: StepLayout, pad: dict, device: torch.device) -> TreeAttnMetadata:
        m = self.model
        return build_tree_metadata(layout.block_tables, [len(s) for s in layout.prefix_slots], layout.node_starts,
                                   layout.masks, block_size=self.kv.block_size, num_q_heads=m.heads_local,
                                   num_kv_heads=m.kv_heads_local, device=device, **pad)

    def _forward(self, meta: TreeAttnMetadata, rows: int) -> StepOutput:
        return self.model.forward(self.tokens[:rows], self.positions[:rows], meta, self.kv, self.rows[:rows],
                                  self.feature_layers)

    def _capture(self, batch: int, nodes: int) -> _Captured:
        pad = self._padding(batch, nodes)
        # Capture over an empty-prefix step of the bucket's shape; replays copy real metadata in.
        chain = torch.tril(torch.ones(nodes, nodes, dtype=torch.bool))
        layout = StepLayout(tuple(range(0, batch * nodes, nodes)), (nodes,) * batch,
                            (torch.zeros(0, dtype=torch.long),) * batch, (chain,) * batch, ([],) * batch)
        cap = _Captured(self._metadata(layout, pad, self.model.device), pad)
        if not self.cfg.capture:
            return cap
        t0 = time.perf_counter()
        rows = batch * nodes
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile and autotune outside the capture
            self._forward(cap.meta, rows)
        torch.cuda.current_stream().wait_stream(stream)
        cap.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cap.graph, pool=self.pool):
            cap.out = self._forward(cap.meta, rows)
        log.info("captured CUDA graph for batch %d x %d nodes in %.2f s", batch, nodes, time.perf_counter() - t0)
        return cap

    def capture_all(self) -> float:
        """Capture every bucket now (largest first, so smaller graphs reuse the pool); returns seconds."""
        t0 = time.perf_counter()
        for b, n in sorted(self.buckets, key=lambda bn: -bn[0] * bn[1]):
            if (b, n) not in self._captured:
                self._captured[(b, n)] = self._capture(b, n)
        return time.perf_counter() - t0

    # --- replay -------------------------------------------------------------
    def run(self, items: list[SequenceStep], tokens: list[int], positions: list[int], layout: StepLayout,
            layers: tuple[int, ...]) -> StepOutput | None:
        """The step's output (rows as the eager forward orders them, logits for every node),
        or None when no bucket covers it. Outputs are views of static buffers, valid until
        the next run."""
        key = self.bucket_for(items, layers)
        if key is None:
            return None
        cap = self._captured.get(key)
        if cap is None:
            cap = self._captured[key] = self._capture(*key)
        rows = len(tokens)
        staged = torch.tensor([tokens, positions], dtype=torch.long)
        self.tokens[:rows].copy_(staged[0], non_blocking=True)
        self.positions[:rows].copy_(staged[1], non_blocking=True)
        host_meta = self._metadata(layout, cap.pad, torch.device("cpu"))
        cap.meta.copy_(host_meta)
        if cap.graph is None:
            out = self._forward(cap.meta, key[0] * key[1])
        else:
            cap.graph.replay()
            out = cap.out
        self.replays += 1
        features = out.features[:rows] if (layers and out.features is not None) else None
        return StepOutput([k[:rows] for k in out.new_k], [v[:rows] for v in out.new_v], out.logits[:rows], features)
