"""The draft engine: per-request state, lazy catch-up, and batched tree drafting.

State per request: the known tokens (committed by the target, then the pending
one), target features waiting for positions not yet computed, the draft KV of
computed positions (in the paged cache) and the pre-norm hidden state of the
last computed position. Ingesting only records tokens and features; KV is
computed when a tree is drafted (or on an explicit catch-up), for every
position whose next token is known. Tree nodes' K/V are scratch, never
committed: the next ingest brings the tokens the target actually accepted.

Every call is validated as a whole before anything changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from draft_service.catch_up import WIDTH, BatchCatchUp
from draft_service.device_tree import BatchTreeGrowth, GrowthShape, fits
from draft_service.feature_rows import FeatureRows
from draft_service.model import Eagle3Draft
from draft_service.staging import StagedInput, staged_chunks
from draft_service.tree_growth import TreeGrowth, top_children
from draft_service.types import (
    MAX_STEPS,
    DraftBudget,
    DraftInfo,
    DraftItem,
    DraftLoad,
    DraftTree,
    IngestItem,
    InvalidDraftInput,
    OutOfDraftCapacity,
    PushedRows,
    RequestStatus,
)
from kernels.tree_attention import StepLayout, causal_mask
from tandem import timeline
from tandem.host_copy import to_device_queued
from tandem.tree import ancestor_mask

MAX_REQUESTS = 1024  # rows of the device block table: requests one replica holds at once
MAX_GROWTH_BATCH = 64  # requests per tree-growth graph; more are grown in several
# Feature rows an eager catch-up copies to the GPU at a time, through a pinned buffer (_project_rows): 24 MiB
# for the 8B shapes' three 4096-wide layers in bf16.
STAGED_FEATURE_ROWS = 1024
log = logging.getLogger("tandem.draft")


def _bucket(n: int) -> int:
    """Batch buckets of the tree-growth graphs: 1, 2, 4, ... MAX_GROWTH_BATCH."""
    return min(MAX_GROWTH_BATCH, 1 << max(0, (n - 1).bit_length()))


@dataclass
class _Request:
    tokens: list[int] = field(default_factory=list)
    # Target features by position, only for positions not computed yet.
    features: FeatureRows = field(default_factory=FeatureRows)
    last_h: torch.Tensor | None = None  # pre-norm h of the last computed position


@dataclass
class _Growing:
    """One request's tree while it grows: the model-facing half of TreeGrowth."""

    tree: DraftTree
    growth: TreeGrowth
    length: int  # computed draft positions (= root position)
    root_h: torch.Tensor
    prefix_slots: torch.Tensor  # host
    block_table: list[int]  # host; with host masks, the kernel's metadata needs no device reads
    nodes: list[int] = field(default_factory=list)  # candidates run through the model so far
    node_parent: list[int] = field(default_factory=list)  # index into nodes, -1 = the root
    k: torch.Tensor | None = None  # scratch K/V of `nodes`
    v: torch.Tensor | None = None
    h: dict[int, torch.Tensor] = field(default_factory=dict)  # candidate -> its pre-norm h


# A position the target gave no features for takes the draft's own h of the position before, so a
# run of them is sequential: one forward per position. A request that slept through many tokens
# (auto's plain decoding sends no features) would stall the step that wakes it: at 16 requests a
# ~100-token gap cost the H200 stack ~250 ms. From LONG_GAP on, such a run is one forward, each of its
# positions taking the h from before the run: approximate, as every position without the target's
# features is, and only the draft's context for them; shorter runs stay exact.
LONG_GAP = 8
# ... but the run's last EXACT_TAIL positions are computed exactly, one forward each, from the
# approximate ones: the tree that follows grows from the last of them. Without it the approximation
# cost the next rounds 0.5-0.55 accepted tokens each (bench/gap_acceptance.py: demo pair, float32, 32
# held-out prompts, 5/4/8 trees, the 6 rounds after each gap: 4.24 against 4.76 exact after 16 positions,
# 4.02 against 4.56 after 48), which a probe of trees after a dormant spell measured as what trees
# deliver; with a tail of 4, 4.59 and 4.48, for 4 more forwards a wake-up (8: 4.66 and 4.68, 8 more).
EXACT_TAIL = 4


class DraftEngine:
    def __init__(self, model: Eagle3Draft, num_blocks: int, block_size: int = 16, *, fused_levels: bool = True):
        """fused_levels: the device growth's bookkeeping between levels, and its selection of the kept
        nodes, in one Triton launch each (kernels.tree_level), and each level's q, k and v written into
        their slots by the RoPE kernel, where attention runs on Triton (the default); off, the same in torch ops."""
        self.model = model
        self.fused_levels = fused_levels and model.attention.name == "triton"
        self.kv = model.new_kv_cache(num_blocks, block_size)
        # Tree growth reads each request's blocks from a device table (device_tree).
        self.table = self.kv.keep_block_table(min(num_blocks, MAX_REQUESTS), model.max_position)
        self.capture_graphs = model.device.type == "cuda" and model.attention.name == "triton"
        self._growths: dict[GrowthShape, BatchTreeGrowth] = {}
        self._catch_ups: dict[int, BatchCatchUp] = {}  # batch bucket -> fixed-width catch-up
        # Segments of at most WIDTH positions, all with features (a verify's), take the fixed-width catch-up;
        # off: every segment is an eager forward (tests compare the two).
        self.fixed_catch_up = True
        # ... and so do those with positions without features (a wake-up's gap), where graphs replay them: a
        # replay costs the host far less than an eager forward, while on the CPU the padded rows cost more than
        # they save (tiny track, one request, a gap of 8: 1.77 ms fixed against 0.99 eager).
        # `bench/catch_up_cost.py` times the two.
        self.fixed_wake_ups = self.capture_graphs
        # CUDA graphs captured so far, each the first time its shape was met (during a call: that
        # call's time is not what the next call of its shape takes; see DraftResponse.graphs_captured).
        self.graphs_captured = 0
        # An eager catch-up's host feature rows reach the device through a pinned buffer (_project_rows), where
        # the device is a GPU; tests turn it on on the CPU too.
        self.stage_host_features = model.device.type == "cuda"
        self._feature_stage: StagedInput | None = None  # made by the first eager catch-up that stages rows
        self.requests: dict[str, _Request] = {}
        self.max_tokens = model.max_position - MAX_STEPS
        self.target_ids = model.d2t.tolist()  # draft id -> target id
        self.last_call_seconds = 0.0

    # --- queries ----------------------------------------------------------
    def info(self) -> DraftInfo:
        cfg = self.model.cfg
        return DraftInfo(hidden_size=cfg.hidden_size, draft_vocab_size=cfg.draft_vocab_size,
                         target_vocab_size=cfg.target_vocab_size, target_hidden_size=cfg.target_hidden_size,
                         feature_layers=cfg.feature_layers, feature_width=cfg.feature_width,
                         max_tokens=self.max_tokens, dtype=str(self.model.dtype).removeprefix("torch."),
                         device=self.model.device.type)

    def load(self) -> DraftLoad:
        return DraftLoad(len(self.requests), self.kv.block_size, self.kv.num_blocks, self.kv.free_blocks)

    def computed(self, request_id: str) -> int:
        return self.kv.seqs[request_id].length

    def status(self, request_id: str) -> RequestStatus:
        st = self.requests[request_id]
        done = self.computed(request_id)
        missing = sum(1 for p in range(done, len(st.tokens) - 1) if p not in st.features)
        return RequestStatus(request_id, len(st.tokens), done, missing)

    # --- validation -------------------------------------------------------
    def _check_ingest(self, items: list[IngestItem] | tuple[IngestItem, ...]) -> dict[str, int]:
        """Validate ingest items; return each request's number of known tokens after them."""
        vocab, width = self.model.cfg.target_vocab_size, self.model.cfg.feature_width
        after: dict[str, int] = {}
        for it in items:
            rid = it.request_id
            if not rid:
                raise InvalidDraftInput("request_id must not be empty")
            if rid in after:
                raise InvalidDraftInput(f"request {rid!r} is ingested twice in one call")
            st = self.requests.get(rid)
            known = st.tokens if st is not None else []
            start = it.start_position
            if st is None and start != 0:
                raise InvalidDraftInput(f"unknown request {rid!r}: start it with an ingest from position 0")
            if not 0 <= start <= len(known):
                raise InvalidDraftInput(f"request {rid!r}: start_position {start} is not within the "
                                        f"{len(known)} tokens the draft knows (no gaps allowed)")
            bad = [t for t in it.tokens if not 0 <= t < vocab]
            if bad:
                raise InvalidDraftInput(f"request {rid!r}: token id {bad[0]} out of range [0, {vocab})")
            for i, (old, new) in enumerate(zip(known[start:], it.tokens)):
                if old != new:
                    raise InvalidDraftInput(
                        f"request {rid!r}: position {start + i} holds token {old} but the ingest says {new}; "
                        f"committed tokens never change (release the request and ingest it again)")
            total = max(len(known), start + len(it.tokens))
            if total > self.max_tokens:
                raise InvalidDraftInput(f"request {rid!r} would hold {total} tokens, over the draft's "
                                        f"limit of {self.max_tokens}")
            f = it.features
            if f is not None:
                if f.dim() != 2 or f.shape[1] != width or not f.is_floating_point():
                    raise InvalidDraftInput(
                        f"request {rid!r}: features must be a float tensor [rows, {width}] "
                        f"({len(self.model.cfg.feature_layers)} target layers x {self.model.cfg.target_hidden_size}),"
                        f" got {f.dtype} {list(f.shape)}")
                if f.shape[0] > len(it.tokens):
                    raise InvalidDraftInput(f"request {rid!r}: {f.shape[0]} feature rows for "
                                            f"{len(it.tokens)} tokens")
            after[rid] = total
        new = sum(1 for rid in after if rid not in self.requests)
        if new > self.kv.free_rows:
            raise OutOfDraftCapacity(f"{new} new requests, but this replica holds {len(self.requests)} and has "
                                     f"room for {self.kv.free_rows} more")
        return after

    def _check_capacity(self, lengths: dict[str, int]) -> None:
        """lengths: request -> known tokens it will be caught up to."""
        need = sum(self.kv.extra_blocks_needed(rid, max(n - 1, 0)) for rid, n in lengths.items())
        if need > self.kv.free_blocks:
            raise OutOfDraftCapacity(f"catching up needs {need} more draft KV blocks, {self.kv.free_blocks} free")

    # --- ingest and catch-up ------------------------------------------------
    @torch.inference_mode()
    def ingest(self, items: list[IngestItem], catch_up: bool = False) -> list[RequestStatus]:
        """Record tokens and features; with catch_up, also compute the KV now (off the critical path)."""
        t0 = time.perf_counter()
        after = self._check_ingest(items)
        if catch_up:
            self._check_capacity(after)
        for it in items:
            self._apply(it)
        if catch_up:
            self._catch_up(list(after))
        self.last_call_seconds = time.perf_counter() - t0
        return [self.status(it.request_id) for it in items]

    def _apply(self, it: IngestItem) -> None:
        st = self.requests.get(it.request_id)
        if st is None:
            st = self.requests[it.request_id] = _Request()
            self.kv.create(it.request_id)
        st.tokens.extend(it.tokens[len(st.tokens) - it.start_position:])
        if it.features is not None:
            # Features of positions already computed come too late to matter.
            st.features.put(it.start_position, it.features,
                            first=max(0, self.computed(it.request_id) - it.start_position))

    @torch.inference_mode()
    def catch_up_pushed(self, pushes: list[PushedRows]) -> int:
        """Compute now what the target's pushed rows allow, ahead of the ingest that will bring the same
        tokens (which then finds those positions computed and drafts at once). Only for requests this
        draft holds up to the rows' first position; one whose tokens disagree with what it knows, or that
        would need blocks the cache lacks, is left to that ingest. Returns the positions computed."""
        t0 = time.perf_counter()
        items = []
        for push in pushes:
            rid, start, known = push.request_id, push.start_position, push.num_known
            st = self.requests.get(rid)
            if st is None or known == 0 or start >= len(st.tokens) or self.computed(rid) >= start + known:
                continue  # not held, nothing new, or a gap before the rows that only the gateway can fill
            item = IngestItem(request_id=rid, start_position=start,
                              tokens=(st.tokens[start], *push.next_tokens[:known]), features=push.rows[: known + 1])
            try:
                self._check_ingest([item])
            except InvalidDraftInput as exc:
                log.debug("pushed rows of %s not caught up on: %s", rid, exc)
                continue
            items.append(item)
        if not items:
            return 0
        after = {it.request_id: max(len(self.requests[it.request_id].tokens), it.start_position + len(it.tokens))
                 for it in items}
        try:
            self._check_capacity(after)
        except OutOfDraftCapacity:
            return 0  # the ingest's own check then says so, to the gateway
        before = sum(self.computed(rid) for rid in after)
        for it in items:
            self._apply(it)
        self._catch_up(list(after))
        self.last_call_seconds = time.perf_counter() - t0
        return sum(self.computed(rid) for rid in after) - before

    @torch.inference_mode()
    def catch_up(self, request_ids: list[str] | None = None) -> None:
        """Compute the draft KV of every position whose next token is known."""
        ids = list(self.requests) if request_ids is None else request_ids
        unknown = [r for r in ids if r not in self.requests]
        if unknown:
            raise InvalidDraftInput(f"unknown request {unknown[0]!r}")
        self._check_capacity({r: len(self.requests[r].tokens) for r in ids})
        self._catch_up(ids)

    def _segments(self, rid: str) -> list[tuple[int, int]]:
        """Positions to compute, in segments of one forward each. A position without features
        takes the previous position's h, which must exist first: a segment may start with one.
        A run of at least LONG_GAP of them is one segment whose positions all take the h from
        before the run, but for its last EXACT_TAIL positions, one segment each (see there)."""
        st, start, stop = self.requests[rid], self.computed(rid), len(self.requests[rid].tokens) - 1
        cuts = [start]
        p = start
        while p < stop:
            if p in st.features:
                p += 1
                continue
            end = p
            while end < stop and end not in st.features:
                end += 1
            if end - p < LONG_GAP:
                run = list(range(p, end))
            else:  # one approximate forward, then the run's last EXACT_TAIL positions one by one
                run = [p, *range(max(p + 1, end - EXACT_TAIL), end)]
            cuts += [q for q in run if q > start]
            p = end
        return [(a, b) for a, b in zip(cuts, [*cuts[1:], stop]) if a < b]

    def _catch_up(self, ids: list[str]) -> None:
        """Round r runs every request's r-th segment: those of at most WIDTH positions in the fixed-width
        catch-up (one graph replay per MAX_GROWTH_BATCH requests on a GPU; see _takes_fixed_width), the others
        in one batched eager forward. After a verify that is one round, all of it fixed-width; a wake-up's gap
        is one round per position of its exact tail, after the eager forward of its approximate head."""
        plans = {rid: self._segments(rid) for rid in ids}
        plans = {rid: p for rid, p in plans.items() if p}
        for rid, plan in plans.items():
            self.kv.reserve(rid, plan[-1][1])
        rounds = max((len(p) for p in plans.values()), default=0)
        t0 = time.perf_counter()
        replays = forwards = 0
        # Counted before the rounds run: a computed position's features are dropped.
        missing = (sum(1 for rid, plan in plans.items() for a, b in plan for q in range(a, b)
                       if q not in self.requests[rid].features) if log.isEnabledFor(logging.DEBUG) else 0)
        for r in range(rounds):
            batch = [(rid, *plan[r]) for rid, plan in plans.items() if r < len(plan)]
            fixed, eager = [], []
            for seg in batch:
                (fixed if self._takes_fixed_width(*seg) else eager).append(seg)
            for at in range(0, len(fixed), MAX_GROWTH_BATCH):
                self._catch_up_fixed(fixed[at: at + MAX_GROWTH_BATCH])
                replays += 1
            if eager:
                self._run_segments(eager)
                forwards += 1
        if (rounds > 1 or forwards) and log.isEnabledFor(logging.DEBUG):  # a wake-up's gap, a joining prompt
            positions = sum(b - a for plan in plans.values() for a, b in plan)
            log.debug("catch-up of %d request(s): %d round(s), %d positions, %d without features; %d eager "
                      "forward(s), %d fixed-width; %.2f ms on the host", len(plans), rounds, positions, missing,
                      forwards, replays, 1e3 * (time.perf_counter() - t0))

    def _takes_fixed_width(self, rid: str, a: int, b: int) -> bool:
        if not self.fixed_catch_up or b - a > WIDTH:
            return False
        features = self.requests[rid].features
        return self.fixed_wake_ups or all(p in features for p in range(a, b))

    def _catch_up_fixed(self, batch: list[tuple[str, int, int]]) -> None:
        """The fixed-width path (draft_service.catch_up): one graph replay for the whole batch. A position
        without features takes its request's h from before the segment, as in _run_segments."""
        bucket = _bucket(len(batch))
        catch = self._catch_ups.get(bucket)
        if catch is None:
            self.table.flush()
            catch = self._catch_ups[bucket] = BatchCatchUp(self.model, self.kv, bucket, self.capture_graphs)
            self.graphs_captured += self.capture_graphs
        self.table.flush()
        reqs = [self.requests[rid] for rid, _, _ in batch]
        host_prefix = None
        if self.model.attention.name == "torch":
            host_prefix = [self.kv.host_slots(rid, 0, a) for rid, a, _ in batch]
        model = self.model
        own_h = [st.last_h if st.last_h is not None  # position 0 has none: zeros
                 else torch.zeros(model.cfg.hidden_size, dtype=model.dtype, device=model.device) for st in reqs]
        featured = [[p in st.features for p in range(a, b)] for st, (_, a, b) in zip(reqs, batch)]
        runs = [run for st, (_, a, b), has in zip(reqs, batch, featured)
                for run in st.features.runs(p for p, on in zip(range(a, b), has) if on)]
        catch.load([st.tokens[a + 1: b + 1] for st, (_, a, b) in zip(reqs, batch)], [a for _, a, _ in batch],
                   featured, runs, own_h, [self.kv.seqs[rid].row for rid, _, _ in batch], host_prefix)
        catch.run()
        # One copy for the batch: the next call overwrites catch.last_h, and nothing writes into a last_h.
        last_hs = catch.last_h[: len(batch)].clone()
        for i, (st, (rid, a, b)) in enumerate(zip(reqs, batch)):
            self.kv.seqs[rid].length = b
            st.last_h = last_hs[i]
            st.features.drop(a, b)

    def _run_segments(self, batch: list[tuple[str, int, int]]) -> None:
        model, dev = self.model, self.model.device
        next_tokens: list[int] = []
        positions: list[int] = []
        starts, counts, prefix, masks, tables = [], [], [], [], []
        feat_runs: list[torch.Tensor] = []
        # Rows without features: each request's h before its segment, once, and per row the request's index.
        own_hs: list[torch.Tensor] = []
        feat_at, h_at, h_of = [], [], []
        for rid, a, b in batch:
            st, row = self.requests[rid], len(next_tokens)
            next_tokens += st.tokens[a + 1:b + 1]
            positions += range(a, b)
            starts.append(row)
            counts.append(b - a)
            prefix.append(torch.from_numpy(self.kv.host_slots(rid, 0, a)))
            tables.append(list(self.kv.seqs[rid].blocks))
            masks.append(causal_mask(b - a))
            featured, without = [], []
            for p in range(a, b):
                (featured if p in st.features else without).append(p)
            feat_runs += st.features.runs(featured)
            feat_at += [row + p - a for p in featured]
            if without:  # they take the draft's own state before the segment (exact at p == a); position 0 has
                # none: zeros
                own_hs.append(st.last_h if st.last_h is not None else torch.zeros(
                    model.cfg.hidden_size, dtype=model.dtype, device=dev))
                h_at += [row + p - a for p in without]
                h_of += [len(own_hs) - 1] * len(without)
        # Every index of the forward in one copy to the device, queued from pinned memory: a copy from
        # pageable memory waits for the GPU, and five of them a call made the host wait for the feature
        # projection, then for the whole forward, before it could queue the tree growth that follows.
        slots = np.concatenate([self.kv.host_slots(rid, a, b) for rid, a, b in batch])
        last_rows = np.add(starts, counts) - 1
        parts = (next_tokens, positions, slots, feat_at, h_at, h_of, last_rows)
        indices = to_device_queued(np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]), dev)
        tokens_on, positions_on, slots_on, feat_at_on, h_at_on, h_of_on, last_rows_on = torch.split(
            indices, [len(part) for part in parts])
        g = torch.empty(len(next_tokens), model.cfg.hidden_size, dtype=model.dtype, device=dev)
        if feat_runs:
            g[feat_at_on] = self._project_rows(feat_runs)
        if own_hs:
            # A gather on the device, not a stack of a tensor per row: a wake-up's approximate head is a
            # few hundred rows a request, all one h.
            g[h_at_on] = torch.stack(own_hs)[h_of_on]
        layout = StepLayout(tuple(starts), tuple(counts), tuple(prefix), tuple(masks), tuple(tables))
        k, v, h = model.forward(tokens_on, g, positions_on, layout, self.kv)
        self.kv.write(0, slots_on, k, v)
        # One gather for the batch: each request keeps a row of it (nothing writes into a last_h).
        last_hs = h[last_rows_on]
        for i, (rid, a, b) in enumerate(batch):
            st = self.requests[rid]
            self.kv.seqs[rid].length = b
            st.last_h = last_hs[i]
            st.features.drop(a, b)

    def _project_rows(self, runs: list[torch.Tensor]) -> torch.Tensor:
        """fc(features) of these runs of rows ([n, width] each, taken in order) on the model's device. Runs
        that arrived on the host reach a GPU through a pinned buffer: stacked into fresh pageable memory
        (whose pages are faulted in as the stack writes them) and copied from there, a joining prompt's rows
        (16 x 72 on an H100, 2026-12-05) took 34 ms of host time in the stack and 4.4 ms of device time in
        the pageable copy."""
        model = self.model
        if not self.stage_host_features or runs[0].is_cuda:
            rows = runs[0] if len(runs) == 1 else torch.cat(runs)
            return model.project(rows)
        if self._feature_stage is None:
            self._feature_stage = StagedInput((STAGED_FEATURE_ROWS, model.cfg.feature_width), model.dtype,
                                              model.device)
        # Projected at once, as before, not chunk by chunk: a GEMM's rows may round differently with its height.
        features = torch.empty(sum(run.shape[0] for run in runs), model.cfg.feature_width, dtype=model.dtype,
                               device=model.device)
        for at, chunk in staged_chunks(self._feature_stage, runs):
            features[at: at + len(chunk)] = chunk
        return model.project(features)

    # --- drafting -----------------------------------------------------------
    @torch.inference_mode()
    def draft(self, items: list[DraftItem], ingest: list[IngestItem] | tuple[IngestItem, ...] = ()
              ) -> list[DraftTree]:
        """Apply `ingest` (saves a round trip), catch up, and grow one tree per item."""
        t0 = time.perf_counter()
        after = self._check_ingest(ingest)
        seen: set[str] = set()
        lengths: dict[str, int] = {}
        for it in items:
            rid = it.request_id
            if rid in seen:
                raise InvalidDraftInput(f"request {rid!r} appears twice in one draft call")
            seen.add(rid)
            if rid not in self.requests and rid not in after:
                raise InvalidDraftInput(f"unknown request {rid!r}: ingest its tokens before drafting")
            problem = it.budget.problem(self.model.cfg.draft_vocab_size)
            if problem:
                raise InvalidDraftInput(f"request {rid!r}: {problem}")
            n = after.get(rid, len(self.requests[rid].tokens) if rid in self.requests else 0)
            if it.num_tokens is not None and it.num_tokens != n:
                raise InvalidDraftInput(f"request {rid!r}: the caller knows {it.num_tokens} tokens but the "
                                        f"draft holds {n}; ingest the missing ones first")
            if not it.budget.empty:
                lengths[rid] = n
        self._check_capacity(lengths)
        for ing in ingest:
            self._apply(ing)
        self._catch_up(list(lengths))
        timeline.mark("draft.catchup.end")
        trees = self._grow(items)
        self.last_call_seconds = time.perf_counter() - t0
        return trees

    def _grow(self, items: list[DraftItem]) -> list[DraftTree]:
        trees, growing = [], []
        # Trees that differ only in depth grow as one group, to the group's deepest (see _grow_on_device).
        on_device: dict[tuple[int, int], list[tuple[DraftTree, str, DraftBudget]]] = {}
        for it in items:
            st = self.requests[it.request_id]
            n = len(st.tokens) - 1
            tree = DraftTree(it.request_id, st.tokens[-1] if st.tokens else -1, max(n, 0))
            trees.append(tree)
            # A request with one known token has no draft position yet: no tree.
            if it.budget.empty or st.last_h is None:
                continue
            if fits(it.budget):
                on_device.setdefault(it.budget.shape, []).append((tree, it.request_id, it.budget))
            else:
                growing.append(_Growing(tree, TreeGrowth(it.budget), n, st.last_h,
                                        torch.from_numpy(self.kv.host_slots(it.request_id, 0, n)),
                                        list(self.kv.seqs[it.request_id].blocks)))
        for members in on_device.values():
            for at in range(0, len(members), MAX_GROWTH_BATCH):
                self._grow_on_device(members[at: at + MAX_GROWTH_BATCH])
        if not growing:
            return trees
        # Level 0: the root's children come from the last computed position.
        lp = self.model.logprobs(torch.stack([g.root_h for g in growing]))
        ids, lps = top_children(lp, max(g.growth.budget.topk for g in growing))
        for i, g in enumerate(growing):
            g.growth.expand_ranked(ids[i:i + 1], lps[i:i + 1])
        while active := [g for g in growing if not g.growth.done]:
            self._tree_level(active)
        for g in growing:
            self._emit(g)
        return trees

    def growth_for(self, batch: int, budget: DraftBudget) -> BatchTreeGrowth:
        """The buffers (and on CUDA the captured graph) of a batch bucket and budget, made once."""
        shape = GrowthShape(batch=_bucket(batch), budget=budget)
        growth = self._growths.get(shape)
        if growth is None:
            self.table.flush()
            growth = self._growths[shape] = BatchTreeGrowth(self.model, self.kv, shape, self.capture_graphs,
                                                            fused_levels=self.fused_levels)
            self.graphs_captured += self.capture_graphs
        return growth

    def _grow_on_device(self, members: list[tuple[DraftTree, str, DraftBudget]]) -> None:
        """One growth for trees of one top-k and size, whatever their depths: all grow to the deepest, and
        each keeps its best nodes no deeper than its own budget's (BatchTreeGrowth.load's depths), which are
        the nodes its own budget grows. The gateway gives a request with poor acceptance a shallower tree;
        grown apart, each depth was a graph replay of its own, and a graph captured on first use (on an H100 at
        16 requests two calls that met five depths took 154 and 158 ms in their draft phase, about 190 ms of it
        captures), where one replay of the deepest costs about what one of them did."""
        deepest = max((budget for _, _, budget in members), key=lambda budget: budget.steps)  # one shape, all
        growth = self.growth_for(len(members), deepest)
        self.table.flush()  # catch-up may have added blocks
        rids = [rid for _, rid, _ in members]
        host_slots = None
        if self.model.attention.name == "torch":
            host_slots = [self.kv.host_slots(rid, 0, self.computed(rid)) for rid in rids]
        growth.load([self.requests[rid].last_h for rid in rids],
                    [self.computed(rid) for rid in rids], [self.kv.seqs[rid].row for rid in rids],
                    self.table.padding_row, host_slots, depths=[budget.steps for _, _, budget in members])
        growth.run()
        timeline.mark("draft.grow.launched")
        grown = growth.trees([budget.max_nodes for _, _, budget in members])  # waits for the GPU
        timeline.mark("draft.grow.read")
        for (tree, _, _), (tokens, parents, depths, lps, scores) in zip(members, grown):
            tree.tokens, tree.parents, tree.depths, tree.logprobs, tree.scores = tokens, parents, depths, lps, scores

    def _tree_level(self, active: list[_Growing]) -> None:
        """Run every active request's frontier through the model and expand it.

        Frontier nodes attend to the committed prefix and to their tree ancestors,
        whose scratch K/V the earlier levels left. The attention kernel's rows are
        all nodes run so far; only the new ones ask queries (old rows get zero
        queries and their outputs are dropped), so nothing but attention repeats.
        """
        model, dev = self.model, self.model.device
        tokens, g_rows, positions = [], [], []
        for a in active:
            for c in a.growth.frontier:
                p = a.growth.parents[c]
                tokens.append(self.target_ids[a.growth.tokens[c]])
                g_rows.append(a.root_h if p < 0 else a.h[p])
                positions.append(a.length + a.growth.levels[c])
        g = torch.stack(g_rows)
        q_new, k_new, v_new = model.attention_inputs(torch.tensor(tokens, device=dev), g,
                                                     torch.tensor(positions, device=dev))
        qs, ks, vs, starts, counts, prefix, masks, tables, new_rows = [], [], [], [], [], [], [], [], []
        row = new = 0
        for a in active:
            f = len(a.growth.frontier)
            old = len(a.nodes)
            index = {c: i for i, c in enumerate(a.nodes)}
            a.node_parent += [index.get(a.growth.parents[c], -1) for c in a.growth.frontier]
            a.nodes += a.growth.frontier
            k_a, v_a = k_new[new:new + f], v_new[new:new + f]
            a.k = k_a if a.k is None else torch.cat((a.k, k_a))
            a.v = v_a if a.v is None else torch.cat((a.v, v_a))
            qs += [q_new.new_zeros(old, *q_new.shape[1:]), q_new[new:new + f]]
            ks.append(a.k)
            vs.append(a.v)
            starts.append(row)
            counts.append(old + f)
            prefix.append(a.prefix_slots)
            tables.append(a.block_table)
            masks.append(ancestor_mask(a.node_parent))
            new_rows += range(row + old, row + old + f)
            row += old + f
            new += f
        layout = StepLayout(tuple(starts), tuple(counts), tuple(prefix), tuple(masks), tuple(tables))
        attn = model.attend(torch.cat(qs), torch.cat(ks), torch.cat(vs), layout, self.kv)
        h = model.finish(attn[torch.tensor(new_rows, device=dev)], g)
        ids, lps = top_children(model.logprobs(h), max(a.growth.budget.topk for a in active))
        new = 0
        for a in active:
            frontier = a.growth.frontier
            for i, c in enumerate(frontier):
                a.h[c] = h[new + i]
            a.growth.expand_ranked(ids[new:new + len(frontier)], lps[new:new + len(frontier)])
            new += len(frontier)

    def _emit(self, g: _Growing) -> None:
        growth, tree = g.growth, g.tree
        chosen = growth.select()
        index = {c: i for i, c in enumerate(chosen)}
        for c in chosen:
            parent = growth.parents[c]
            if parent >= 0 and parent not in index:  # cannot happen: see tree_growth's docstring
                raise RuntimeError(f"tree for {tree.request_id!r} kept node {c} without its parent {parent}")
            tree.tokens.append(self.target_ids[growth.tokens[c]])
            tree.parents.append(index[parent] if parent >= 0 else -1)
            tree.depths.append(growth.levels[c] + 1)
            tree.logprobs.append(growth.logprobs[c])
            tree.scores.append(growth.scores[c])

    # --- lifecycle -----------------------------------------------------------
    def release(self, request_ids: list[str]) -> int:
        """Free the named requests' state; unknown ids are ignored (a release may be repeated)."""
        n = 0
        for rid in request_ids:
            if self.requests.pop(rid, None) is not None:
                n += 1
            self.kv.release(rid)
        return n
