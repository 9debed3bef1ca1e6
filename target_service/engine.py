"""The target's one operation: extend sequences by token trees, keep the accepted paths.

A step, in phases:

    validate(batch)                      # the whole step, before anything changes
    reserve KV blocks                    # host allocator; new block-table entries queued
    pack inputs -> one host-to-device copy
    forward, acceptance, KV commit       # on the device: a replayed graph, or eagerly
    one device-to-host copy of results   # then host bookkeeping (lengths, trims)

Per-request state the step needs lives on the device and changes by what each
step adds (the block table); acceptance and the kept path are decided on the
device and the kept nodes' KV is moved there, so a plain-decode step waits on
the device once. BENCHMARKS.md ("Plain decoding at the speed of the forward") has
what each part cost on an H200.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch

from kernels.invariant_attention import MAX_TAIL
from kernels.tree_attention import StepLayout
from kernels.tree_metadata import TreeAttnMetadata, choose_block_m, choose_num_splits
from tandem import timeline
from tandem.host_copy import to_device_queued
from tandem.tree import ancestor_mask, validate_tree
from target_service.cuda_graphs import GraphConfig, StepGraphs
from target_service.grant import GrantStep, check_grant, run_grant
from target_service.model import LlamaModel
from target_service.pipelined_grant import PipelinedGrant, pipelined
from target_service.processors import PenaltyHistory, StepControls, apply_controls, record_committed
from target_service.step_batch import StepBatch, StepResults
from target_service.step_inputs import (
    InputLayout,
    InputShape,
    layout_for,
    max_tree,
    pack_step,
    shape_for,
    tree_depths,
)
from target_service.step_tail import StepTail, output_width
from target_service.types import InvalidStep, KvLoad, OutOfCapacity, SequenceResult, SequenceStep
from target_service.wire import GrantStops

MAX_TOP_LOGPROBS = 20
# Sequences the device block table has rows for, at most: a sequence holds at least
# one block, so more rows than blocks are never used.
MAX_SEQS = 4096
# Input layouts whose views of the host buffer the engine keeps (the shapes seen last).
KEPT_INPUT_LAYOUTS = 32
# Steps of up to this many items are validated on their columns read as Python numbers, larger ones by numpy
# reductions: a reduction costs about a microsecond whatever its length, a Python comparison 30-50 ns.
SMALL_STEP = 8
# A verify step whose rows' features are at most this many bytes sends every row to the host in the results'
# wait and keeps the committed ones there (committed_rows); larger ones move the committed rows to the front on
# the device first and copy only those, after a second wait. On an H100 (8B shapes, bf16, 24 KiB a row) reading a
# 1 x 8 verify step's results took 175 us of host work with 4 MiB against 288 the device's way (BENCHMARKS.md, "The
# sixty-sixth session"), but served at one request the round was not shorter in both of two alternated pairs (the
# rule set before the run; "The sixty-seventh session"): off by default, `tandem target --feature-pick-kib`.
FEATURE_PICK_BYTES = 0


def asked_rows(batch: StepBatch) -> np.ndarray:
    """int64: the step rows (its nodes in batch order) of the items that asked for features."""
    return np.flatnonzero(np.repeat(batch.return_features, batch.num_nodes))


def committed_rows(batch: StepBatch, num_accepted: np.ndarray, accepted_nodes: np.ndarray) -> np.ndarray:
    """int64: the step rows a verify step committed for the items that asked for features, in row order:
    each item's fixed chain, then its accepted nodes (node indices, parents before children)."""
    starts = batch.starts
    parts = []
    for b in np.flatnonzero(batch.return_features).tolist():
        start = int(starts[b])
        parts.append(np.arange(start, start + int(batch.num_fixed[b])))
        parts.append(start + accepted_nodes[b, : int(num_accepted[b])].astype(np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


class HostInputs(NamedTuple):
    """One step's inputs on the host: the buffer (its first layout.size words) and its regions,
    as numpy arrays to pack into and, on a CPU (where the host is the device), as tensors of the
    same memory."""

    buffer: torch.Tensor
    arrays: dict[str, np.ndarray]
    tensors: dict[str, torch.Tensor] | None
    tail: StepTail | None  # on a CPU, the step tail over `tensors` (it keeps nothing of a step)


def outside(values: np.ndarray, stop: int) -> np.ndarray:
    """bool: values < 0 or >= stop; one comparison for int32 columns (a negative one read as
    uint32 is at least 2**31)."""
    if values.dtype == np.int32:
        return values.view(np.uint32) >= stop
    return (values < 0) | (values >= stop)


@functools.lru_cache(maxsize=4096)
def _tree_well_formed(tree_parents: tuple[int, ...]) -> bool:
    """A tree part (StepBatch.drafted_trees) whose every drafted node's parent comes before it."""
    return all(0 <= parent < m for m, parent in enumerate(tree_parents) if m)


def batch_of_items(items: list[SequenceStep]) -> StepBatch:
    """A step given as items (the unary Step, tests), in columns; checks what columns cannot show."""
    for it in items:
        if len(it.tokens) != len(it.parents):
            raise InvalidStep(f"request {it.request_id!r}: {len(it.tokens)} tokens but {len(it.parents)} parents")
    return StepBatch.from_items(items)


class TargetEngine:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int = 16,
                 max_model_len: int | None = None, graphs: GraphConfig | None = None,
                 max_seqs: int | None = None, feature_pick_bytes: int = FEATURE_PICK_BYTES):
        if feature_pick_bytes < 0:
            raise ValueError(f"feature_pick_bytes must be >= 0, got {feature_pick_bytes}")
        self.model = model
        self.feature_pick_bytes = feature_pick_bytes  # see FEATURE_PICK_BYTES
        self.kv = model.new_kv_cache(num_blocks, block_size)
        self.max_model_len = min(max_model_len or model.cfg.max_position, model.cfg.max_position)
        self.table = self.kv.keep_block_table(max_seqs or min(num_blocks, MAX_SEQS), self.max_model_len)
        # The caches as [layers, slots, kv heads, head dim]: what a step's KV commit writes into.
        flat = (self.kv.k_all.shape[0], -1, *self.kv.k_all.shape[3:])
        self._flat_kv = (self.kv.k_all.view(flat), self.kv.v_all.view(flat))
        self.device = model.device
        self.triton = model.attention.name == "triton"
        self.group = model.heads_local // model.kv_heads_local
        self._pinned = self.device.type == "cuda"
        self._host_buf = torch.zeros(0, dtype=torch.int32)
        self._kept_inputs: OrderedDict[InputLayout, HostInputs] = OrderedDict()
        self._out_host = torch.zeros(0, dtype=torch.int32)
        self.last_step_seconds = 0.0
        self._seed_source = random.Random()
        # Token counts of the sequences whose penalties need them (target_service.processors).
        self.penalty_history = PenaltyHistory(model.cfg.vocab_size, self.device)
        # Decode and verify steps replay captured CUDA graphs when configured (GPU, triton, TP=1).
        self.graphs = StepGraphs(self, graphs) if graphs is not None else None

    # --- queries ----------------------------------------------------------
    def load(self) -> KvLoad:
        return KvLoad(num_sequences=len(self.kv.seqs), block_size=self.kv.block_size,
                      total_blocks=self.kv.num_blocks, free_blocks=self.kv.free_blocks)

    def length(self, request_id: str) -> int:
        return self.kv.seqs[request_id].length

    def resolve_feature_layers(self, layers: tuple[int, ...] | list[int]) -> tuple[int, ...]:
        layers = tuple(layers) or self.model.cfg.default_feature_layers
        bad = [i for i in layers if not 0 <= i <= self.model.cfg.num_layers]
        if bad:
            raise InvalidStep(f"feature layer(s) {bad} out of range 0..{self.model.cfg.num_layers}")
        return layers

    def draw_seed(self) -> int:
        return self._seed_source.getrandbits(63)

    # --- validation -------------------------------------------------------
    def _validate(self, batch: StepBatch) -> np.ndarray:
        """Check the whole step; returns each item's end (its length after the step, at most)."""
        if batch.size == 0:
            raise InvalidStep("a step needs at least one item")
        seqs = self.kv.seqs
        if len(set(batch.request_ids)) != batch.size:
            seen: set[str] = set()
            dup = next(r for r in batch.request_ids if r in seen or seen.add(r))
            raise InvalidStep(f"request {dup!r} appears twice in one step")
        prefix = np.zeros(batch.size, dtype=np.int64)
        for b, rid in enumerate(batch.request_ids):
            if not rid:
                raise InvalidStep("request_id must not be empty")
            seq = seqs.get(rid)
            if batch.create[b]:
                if seq is not None:
                    raise InvalidStep(f"request {rid!r} already exists; release it before creating it again")
            elif seq is None:
                raise InvalidStep(f"unknown request {rid!r} (set create=true for a new sequence)")
            else:
                prefix[b] = seq.length
        # Plain decode (each item one fixed node whose parent is -1) in one pass; any other step,
        # or a plain one that fails it, through the check that names the malformed item.
        plain = self._plain_decode(batch)
        if not plain:
            self._check_trees(batch)
        vocab = self.model.cfg.vocab_size
        if not self._tokens_in_range(batch.tokens, vocab):
            row = int(np.flatnonzero(outside(batch.tokens, vocab))[0])
            b = int(np.searchsorted(batch.starts, row, side="right") - 1)
            raise InvalidStep(f"request {batch.request_ids[b]!r}: token id {int(batch.tokens[row])} out of range "
                              f"[0, {vocab})")
        if not self._sampling_fields_valid(batch):
            t = batch.temperature
            bad = (~(t >= 0) | (batch.top_k < 0) | np.isnan(batch.top_p)
                   | outside(batch.top_logprobs, MAX_TOP_LOGPROBS + 1))
            b = int(np.argmax(bad))
            what = (f"temperature must be >= 0, got {t[b]}" if not t[b] >= 0 else
                    f"top_k must be >= 0, got {batch.top_k[b]}" if batch.top_k[b] < 0 else
                    "top_p must be a number" if np.isnan(batch.top_p[b]) else
                    f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
            raise InvalidStep(f"request {batch.request_ids[b]!r}: {what}")
        end = prefix + 1 if plain else prefix + self._tree_depths(batch) + 1
        if end.max() > self.max_model_len:
            b = int(np.argmax(end > self.max_model_len))
            raise InvalidStep(f"request {batch.request_ids[b]!r}: sequence would reach {end[b]} tokens, over the "
                              f"model's maximum length {self.max_model_len}")
        return end

    @staticmethod
    def _plain_decode(batch: StepBatch) -> bool:
        """Every item one fixed node whose parent is -1. A few items' columns are read as Python
        numbers: a numpy comparison costs about a microsecond whatever its length, and this check
        took six of them (SMALL_STEP)."""
        if len(batch.tokens) != batch.size:
            return False
        if batch.size <= SMALL_STEP:
            return (all(n == 1 for n in batch.num_nodes.tolist()) and all(f == 1 for f in batch.num_fixed.tolist())
                    and all(p == -1 for p in batch.parents.tolist()))
        return not ((batch.num_nodes != 1) | (batch.num_fixed != 1) | (batch.parents != -1)).any()

    @staticmethod
    def _sampling_fields_valid(batch: StepBatch) -> bool:
        """Every temperature >= 0 (not NaN), top_k >= 0, top_p a number and top_logprobs in
        0..MAX_TOP_LOGPROBS. A few items' columns are read as Python numbers (SMALL_STEP); more, from
        five reductions read as Python numbers (a NaN makes a min NaN and its comparison false). The
        masks that name the culprit are built only when this fails."""
        if batch.size <= SMALL_STEP:
            return (all(t >= 0 for t in batch.temperature.tolist()) and all(k >= 0 for k in batch.top_k.tolist())
                    and all(p == p for p in batch.top_p.tolist())
                    and all(0 <= n <= MAX_TOP_LOGPROBS for n in batch.top_logprobs.tolist()))
        least_top_p = batch.top_p.min()
        return bool(batch.temperature.min() >= 0 and batch.top_k.min() >= 0 and least_top_p == least_top_p
                    and 0 <= batch.top_logprobs.min() and batch.top_logprobs.max() <= MAX_TOP_LOGPROBS)

    @staticmethod
    def _tokens_in_range(tokens: np.ndarray, vocab: int) -> bool:
        """Every id in [0, vocab): an int32 column's largest id read as uint32 (a negative one is at
        least 2**31), one reduction where a mask then its any() took two."""
        if tokens.dtype != np.int32 or not tokens.size:
            return not outside(tokens, vocab).any()
        return int(tokens.view(np.uint32).max()) < vocab

    @staticmethod
    def _check_trees(batch: StepBatch) -> None:
        """Every item's nodes a chain of num_fixed >= 1 nodes, then drafted nodes whose parents
        come before them, below the chain's last."""
        if TargetEngine._verify_step_well_formed(batch):
            return
        n, nf = batch.num_nodes.astype(np.int64), batch.num_fixed.astype(np.int64)
        bad = (nf < 1) | (nf > n)  # so every item has a node
        if batch.tokens.size:
            seq_of_row = np.repeat(np.arange(batch.size), n)
            local = np.arange(len(batch.tokens)) - batch.starts[:-1][seq_of_row]
            nf_row = nf[seq_of_row]
            p = batch.parents.astype(np.int64)
            wrong = np.where(local < nf_row, p != local - 1, (p >= local) | (p < nf_row - 1))
            bad |= np.bincount(seq_of_row[wrong], minlength=batch.size) > 0
        if bad.any():
            b = int(np.argmax(bad))
            nodes = slice(batch.starts[b], batch.starts[b + 1])
            problem = validate_tree(batch.parents[nodes].tolist(), int(nf[b]))
            raise InvalidStep(f"request {batch.request_ids[b]!r}: {problem}")

    @staticmethod
    def _verify_step_well_formed(batch: StepBatch) -> bool:
        """True for a well-formed verify step (every item one fixed node, its root, then its drafted
        tree): the root's parent is -1 and each tree is checked once per shape (_tree_well_formed),
        half the array operations of the general check. False means only: not shown here."""
        if not ((batch.num_fixed == 1).all() and (batch.num_nodes > 0).all()):
            return False
        if not (batch.parents[batch.starts[:-1]] == -1).all():
            return False
        return all(_tree_well_formed(tree) for tree in batch.drafted_trees.values())

    def _tree_depths(self, batch: StepBatch) -> np.ndarray:
        """Each item's depth (its fixed chain's, then its drafted tree's), checked against
        the batch-invariant mode's limit."""
        depth = batch.num_fixed.astype(np.int64) - 1
        for b, parents in batch.drafted_trees.items():
            tree_depth = int(tree_depths(parents).max())
            if self.model.batch_invariant and tree_depth > MAX_TAIL:
                raise InvalidStep(f"request {batch.request_ids[b]!r}: a drafted tree {tree_depth} deep; the "
                                  f"batch-invariant mode takes trees up to {MAX_TAIL} deep")
            depth[b] += tree_depth
        return depth

    # --- the step ---------------------------------------------------------
    def step(self, items: list[SequenceStep], feature_layers: tuple[int, ...] = ()) -> list[SequenceResult]:
        return self.run(batch_of_items(items), feature_layers).sequence_results()

    @torch.inference_mode()
    def run(self, batch: StepBatch, feature_layers: tuple[int, ...] = ()) -> StepResults:
        t0 = time.perf_counter()
        end = self._validate(batch)
        self._validate_controls(batch)
        layers = self.resolve_feature_layers(feature_layers) if batch.return_features.any() else ()
        kv = self.kv
        ends = end.tolist()  # Python ints: the allocator's arithmetic is per sequence
        need = sum(kv.extra_blocks_needed(rid, e) for rid, e in zip(batch.request_ids, ends))
        if need > kv.free_blocks:
            raise OutOfCapacity(f"step needs {need} more KV blocks, {kv.free_blocks} free")
        creates = batch.create.tolist()
        created = [rid for rid, new in zip(batch.request_ids, creates) if new]
        if len(created) > kv.free_rows:
            raise OutOfCapacity(f"step creates {len(created)} sequences, {kv.free_rows} sequence slots free")
        try:
            for rid, new, e in zip(batch.request_ids, creates, ends):
                if new:
                    kv.create(rid)
                kv.reserve(rid, e)
            if batch.controls is not None:
                for b in np.flatnonzero(batch.controls.needs_history & batch.create).tolist():
                    self.penalty_history.create(batch.request_ids[b])
            timeline.mark("target.engine.reserved")
            results = self._execute(batch, layers)
        except Exception:
            for rid in created:
                kv.release(rid)
                self.penalty_history.release(rid)
            for rid in batch.request_ids:
                if rid in kv.seqs:
                    kv.trim(rid)
            raise
        self.last_step_seconds = time.perf_counter() - t0
        return results

    @torch.inference_mode()
    def grant(self, batch: StepBatch, stops: GrantStops, steps: int,
              interrupted: Callable[[], bool], feature_layers: tuple[int, ...] = ()) -> Iterator[GrantStep]:
        """Up to `steps` plain-decode steps of `batch` fed forward on the target (check_grant
        first). On CUDA-graph buckets two steps are in flight at once (pipelined_grant);
        otherwise, and where items ask for their features (`feature_layers`, as `run` takes
        them: a fed grant), one step after another."""
        check_grant(batch, stops)
        self._validate(batch)
        # A sequence is never fed past the model's length, whatever the caller's limit.
        room = np.array([self.max_model_len - self.kv.seqs[rid].length for rid in batch.request_ids])
        stops = dataclasses.replace(stops, max_new_tokens=np.minimum(stops.max_new_tokens, room).astype(np.int32))
        if pipelined(self, batch):
            yield from PipelinedGrant(self, batch, stops, steps, interrupted)
        else:
            yield from run_grant(lambda part: self.run(part, feature_layers), batch, stops, steps, interrupted)

    def _host_inputs(self, layout: InputLayout) -> HostInputs:
        """The host input buffer laid out by `layout`, with its views; kept for the shapes seen
        last (building the 19 regions' views twice cost a CPU's plain step about 30 us, a tenth of
        its host part: BENCHMARKS.md, "Target step on CPU")."""
        kept = self._kept_inputs.get(layout)
        if kept is not None:
            self._kept_inputs.move_to_end(layout)
            return kept
        if self._host_buf.numel() < layout.size:
            size = max(layout.size, 2 * self._host_buf.numel(), 1 << 14)
            self._host_buf = torch.zeros(size, dtype=torch.int32, pin_memory=self._pinned)
            self._kept_inputs.clear()  # they would keep the old buffer alive
        buf = self._host_buf[: layout.size]
        tensors = layout.device_views(buf) if self.device.type == "cpu" else None
        tail = self.new_tail(tensors, layout.shape) if tensors is not None else None
        kept = self._kept_inputs[layout] = HostInputs(buf, layout.host_views(buf.numpy()), tensors, tail)
        if len(self._kept_inputs) > KEPT_INPUT_LAYOUTS:
            self._kept_inputs.popitem(last=False)
        return kept

    def pack(self, batch: StepBatch, updates: dict[int, int], shape: InputShape, block_m: int,
             views: dict[str, np.ndarray], decided_on_host: bool = False) -> np.ndarray:
        """Pack `batch` into host `views` with this engine's KV facts; returns each sequence's
        committed length (its prefix). decided_on_host: the step is decided by
        StepTail.greedy_on_host, which reads no sampling column."""
        seqs = [self.kv.seqs[rid] for rid in batch.request_ids]
        prefix = np.array([s.length for s in seqs], dtype=np.int64)
        rows = np.array([s.row for s in seqs], dtype=np.int64)
        pack_step(batch, prefix_lens=prefix, table_rows=rows, updates=updates, shape=shape, views=views,
                  per_tile=block_m // self.group, padding_row=self.table.padding_row,
                  padding_update=self.table.padding_row * self.table.max_blocks, host_table=self.table.host,
                  block_size=self.kv.block_size, trash_slot=self.kv.trash_slot,
                  attention_metadata=self.triton or batch.controls is not None, sampling=not decided_on_host)
        return prefix

    def _execute(self, batch: StepBatch, layers: tuple[int, ...]) -> StepResults:
        updates = self.table.take_pending()
        top_k = int(batch.top_logprobs.max())
        greedy_only = top_k == 0 and batch.controls is None and not (batch.temperature > 0).any()
        graph = self.graphs.bucket_for(batch, layers, len(updates)) if self.graphs is not None else None
        if graph is not None:
            shape, block_m, splits = graph.shape, graph.block_m, graph.num_splits
        else:
            # A validated step's items have a node each: as many rows as items is plain decode.
            plain = len(batch.tokens) == batch.size
            block_m = choose_block_m(1 if plain else int(batch.num_nodes.max()), self.group)
            shape = shape_for(batch, 1 if plain else max_tree(batch), len(updates), block_m // self.group)
        layout = graph.layout if graph is not None else layout_for(shape)
        inputs = self._host_inputs(layout)
        on_host = graph is None and greedy_only and self.device.type == "cpu"  # _decide_eagerly's host walk
        prefix = self.pack(batch, updates, shape, block_m, inputs.arrays, decided_on_host=on_host)
        timeline.mark("target.engine.packed")
        if graph is not None:
            graph.load_inputs(inputs.buffer)
            committed, out = graph.replay(greedy_only)
            logits, features = graph.logits, graph.features
            tail = graph.tail
            if not greedy_only:
                out = graph.out_buffer(top_k)
                committed = self._decide_eagerly(tail, logits, batch, out, top_k, greedy_only)
                tail.commit(committed, graph.k_scratch, graph.v_scratch)
        else:
            # Splits are for a GPU's attention programs; a CPU's is always 1 (no max of the prefixes to take).
            splits = 1 if self.device.type == "cpu" else choose_num_splits(
                shape.tiles * self.model.kv_heads_local, int(prefix.max()), self.device)
            if inputs.tensors is not None:  # a CPU: the host buffer is the device's
                dev, views, tail = inputs.buffer, inputs.tensors, inputs.tail
            else:
                dev = inputs.buffer.to(self.device, non_blocking=self._pinned)
                views = layout.device_views(dev)
                tail = self.new_tail(views, shape)
            if updates:
                tail.apply_table_updates()
            k_scratch, v_scratch = self.model.new_scratch(shape.rows)
            torch_layout = None if self.triton else self._torch_layout(batch, prefix)
            logits, features = self.forward(dev, layout, views, block_m, splits, layers, k_scratch, v_scratch,
                                            torch_layout)
            out = torch.empty(shape.seqs, output_width(shape.tree, top_k), dtype=torch.int32, device=self.device)
            committed = self._decide_eagerly(tail, logits, batch, out, top_k, greedy_only)
            tail.commit(committed, k_scratch, v_scratch)
        timeline.mark("target.engine.launched")
        return self._read_results(batch, shape.tree, out, top_k, tail, committed, features, layers)

    # --- device work ----------------------------------------------------------
    def new_tail(self, views: dict[str, torch.Tensor], shape: InputShape) -> StepTail:
        k_cache, v_cache = self._flat_kv
        return StepTail(views=views, seqs=shape.seqs, tree=shape.tree,
                        trash_slot=self.kv.trash_slot, block_table=self.table.table, k_cache=k_cache,
                        v_cache=v_cache, use_triton=self.triton,
                        row_invariant=self.model.batch_invariant and self.triton)

    def forward(self, buffer: torch.Tensor, layout: InputLayout, views: dict[str, torch.Tensor], block_m: int,
                splits: int, layers: tuple[int, ...], k_scratch: torch.Tensor, v_scratch: torch.Tensor,
                torch_layout: StepLayout | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model over the step's rows (inputs in `buffer`, laid out by `layout`, `views`
        its device views); logits [B * M, V] for the tree rows, and features [R, F] when
        layers are asked."""
        shape = layout.shape
        if self.triton:
            plan = TreeAttnMetadata(ints=buffer, info_off=layout.spans["seq_info"][0],
                                    tile_off=layout.spans["tiles"][0], block_table=self.table.table,
                                    mask_words=views["mask"], batch=shape.seqs, num_tiles=shape.tiles,
                                    block_size=self.kv.block_size, group=self.group, block_m=block_m,
                                    num_splits=splits)
            tokens, positions = views["tokens"], views["positions"]
        else:  # the torch ops index faster with int64 than with the buffer's int32
            plan = torch_layout
            tokens, positions = views["tokens"].long(), views["positions"].long()
        out = self.model.forward(tokens, positions, plan, self.kv, views["tree_row"].long(), layers,
                                 scratch=(k_scratch, v_scratch))
        return out.logits, out.features

    def _torch_layout(self, batch: StepBatch, prefix: np.ndarray) -> StepLayout:
        """The reference attention's per-sequence description (CPU path)."""
        counts = batch.num_nodes.tolist()
        starts = [0, *itertools.accumulate(counts)]  # Python ints, which the loop and StepLayout take
        slots, masks = [], []
        for b, (rid, length) in enumerate(zip(batch.request_ids, prefix.tolist())):
            slots.append(torch.from_numpy(self.kv.host_slots(rid, 0, length)))
            masks.append(ancestor_mask(batch.parents[starts[b]: starts[b + 1]].tolist()))
        return StepLayout(tuple(starts[:-1]), tuple(counts), tuple(slots), tuple(masks))

    def _decide_eagerly(self, tail: StepTail, logits: torch.Tensor, batch: StepBatch, out: torch.Tensor,
                        top_k: int, greedy_only: bool) -> torch.Tensor | None:
        """Acceptance and results into `out`; returns the committed rows (StepTail.committed_rows).
        greedy_only: every sequence greedy, no top log-probs and no logits controls."""
        if batch.controls is None:
            if greedy_only and logits.is_cpu:  # (its step was packed without sampling columns)
                return tail.committed_rows(tail.greedy_on_host(logits, out))
            decided = tail.greedy(logits)
            if not batch.greedy.all():
                decided = tail.sampled(logits, decided)
            return tail.committed_rows(tail.pack(decided, out, top_k, logits))
        # Logits controls: every tree row processed from its own path, then the same rules.
        slots = self.penalty_history.slot_array(batch.request_ids, tail.B)
        ctl = StepControls.build(batch.controls, slots, tail.B, tail.M, self.device)
        processed = apply_controls(logits, tail.v, ctl, self.penalty_history)
        decided = tail.greedy(logits, processed)
        if not batch.greedy.all():
            decided = tail.sampled(logits, decided, processed, ctl.min_p if ctl.any_min_p else None)
        committed = tail.committed_rows(tail.pack(decided, out, top_k, logits))
        record_committed(self.penalty_history, tail.v, ctl, committed)
        return committed

    def _validate_controls(self, batch: StepBatch) -> None:
        """Logits controls in range, and penalties only for sequences whose counts are kept
        (asked for from the step that created them)."""
        cols = batch.controls
        if cols is None:
            return
        bad = cols.problem(self.model.cfg.vocab_size)
        if bad is not None:
            raise InvalidStep(f"request {batch.request_ids[bad[0]]!r}: {bad[1]}")
        for b in np.flatnonzero(cols.needs_history & ~batch.create).tolist():
            if batch.request_ids[b] not in self.penalty_history:
                raise InvalidStep(f"request {batch.request_ids[b]!r}: penalties must be asked for from the "
                                  "sequence's first step (the target counts its tokens from there)")

    # --- results --------------------------------------------------------------
    def _out_buffer(self, words: int) -> torch.Tensor:
        if self._out_host.numel() < words:
            self._out_host = torch.zeros(max(words, 2 * self._out_host.numel(), 1 << 12), dtype=torch.int32,
                                         pin_memory=self._pinned)
        return self._out_host[:words]

    def _read_results(self, batch: StepBatch, M: int, out: torch.Tensor, top_k: int, tail: StepTail,
                      committed: torch.Tensor | None, features: torch.Tensor | None,
                      layers: tuple[int, ...]) -> StepResults:
        B = batch.size
        if out.is_cpu:
            host = out
        else:
            host = self._out_buffer(out.numel()).view(out.shape)
            host.copy_(out, non_blocking=self._pinned)
        feature_rows = every_row = None
        if layers and not batch.drafted_trees:
            # No drafted nodes: every row is committed, so the rows of the sequences that asked are known
            # here. They leave in the same wait as the results, gathered on the device where only some
            # sequences asked, into a pinned tensor of their own: a boolean index on the device waited on
            # the GPU twice more (on the H200 a decode step with features then cost 0.30 / 0.67 / 1.75 ms
            # more than one without at 1 / 8 / 64 requests, BENCHMARKS.md, "What asking for features adds
            # to a target step"), and taking the rows on the host afterwards copied them once more there
            # (13 ms for a 1024-token prompt's rows on the dev machine).
            rows = asked_rows(batch)
            feature_rows = torch.empty(len(rows), features.shape[1], dtype=features.dtype, pin_memory=self._pinned)
            asked = features[: len(rows)] if len(rows) == len(batch.tokens) else features.index_select(
                0, to_device_queued(rows, self.device))
            feature_rows.copy_(asked, non_blocking=self._pinned)
        elif layers and len(batch.tokens) * features.shape[1] * features.element_size() <= self.feature_pick_bytes:
            # Every row to the host in the results' wait; the committed ones are picked there, below.
            every_row = torch.empty(len(batch.tokens), features.shape[1], dtype=features.dtype,
                                    pin_memory=self._pinned)
            every_row.copy_(features[: len(batch.tokens)], non_blocking=self._pinned)
        elif layers:
            # Committed rows of the sequences that asked, in row order, moved to the front on the device
            # by a stable sort of the mask: nothing waits for the GPU here (a boolean index counts its rows
            # first, and the mask's flags came through pageable memory: two waits, then a third for a
            # pageable copy out). How many rows there are is known from the results, below.
            row_seq = tail.v["row_seq"]
            want = row_seq.ge(0) if committed is None else committed & row_seq.ge(0)
            if not batch.return_features.all():
                want &= to_device_queued(batch.return_features, self.device)[row_seq.long().clamp(min=0)]
            first = torch.sort(want.logical_not().to(torch.uint8), stable=True).indices
            compacted = features[: want.shape[0]][first]
        if self._pinned:
            torch.cuda.current_stream().synchronize()
        timeline.mark("target.engine.synced")
        raw = host.numpy()[:B]
        if host is not out:  # the engine's reused output buffer: results must not change under the caller
            raw = raw.copy()
        # Views of `raw` (a CPU step's own output): one copy at most instead of one per column.
        count = raw[:, 0]
        new_tokens = raw[:, 2: 2 + M]
        logprobs = raw[:, 2 + M: 2 + 2 * M].view(np.float32)
        accepted = raw[:, 2 + 2 * M: 2 + 3 * M] + (batch.num_fixed[:, None] - 1)  # tree index -> node index
        committed_now = batch.num_fixed.astype(np.int64) + count
        num_committed = np.empty(B, dtype=np.int64)
        kv = self.kv
        for b, rid in enumerate(batch.request_ids):
            seq = kv.seqs[rid]
            seq.length += int(committed_now[b])
            kv.trim(rid)
            num_committed[b] = seq.length
        results = StepResults(request_ids=batch.request_ids, num_accepted=count, accepted_nodes=accepted,
                              new_tokens=new_tokens, logprobs=logprobs, num_committed=num_committed)
        if top_k:
            at = 2 + 3 * M
            results.top_ids = raw[:, at: at + M * top_k].reshape(B, M, top_k)
            results.top_logprobs = raw[:, at + M * top_k: at + 2 * M * top_k].view(np.float32).reshape(B, M, top_k)
            results.top_k = batch.top_logprobs
        if every_row is not None:
            feature_rows = every_row[torch.from_numpy(committed_rows(batch, count, accepted))]
        elif layers and batch.drafted_trees:  # the first rows of `compacted`: each asking sequence's committed rows
            n = int(committed_now[batch.return_features].sum())
            # A tensor of its own (torch's pinned-memory cache makes it cheap): a clone of a reused buffer
            # cost a host copy of every row, 7 MB at 64 x 8 nodes.
            feature_rows = torch.empty(n, compacted.shape[1], dtype=compacted.dtype, pin_memory=self._pinned)
            feature_rows.copy_(compacted[:n], non_blocking=self._pinned)
            if self._pinned:
                torch.cuda.current_stream().synchronize()
        if feature_rows is not None:
            results.features = feature_rows.cpu()  # in the model dtype: bf16 on a GPU, half the bytes of float32
            results.feature_counts = np.where(batch.return_features, committed_now, 0)
        return results

    def release(self, request_ids: list[str]) -> int:
        for r in request_ids:
            self.penalty_history.release(r)
        return sum(self.kv.release(r) for r in request_ids)

