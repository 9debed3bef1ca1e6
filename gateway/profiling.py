"""Start-up profile of step costs, the input of the `auto` policy's cost model.

Runs real steps on throwaway sequences through the same gRPC path the loop
uses (so RPC overhead is part of the fit) and fits the linear models of
policy.CostModel by least squares. Plain decoding runs granted (the target
feeds its own tokens forward, steps overlapped), which a single step does not
show: a grant per batch size measures that, and the cost model's correction
for plain steps starts from a grant's steps plus the planned step before it.
"""

from __future__ import annotations

import itertools
import logging
import statistics
import time

import numpy as np
import torch

from draft_service.types import DraftBudget, IngestItem
from gateway.clients import TargetClient
from gateway.cost_model import CostModel, batch_bucket
from gateway.draft_pool import DraftReplica
from gateway.policy import PolicyConfig
from target_service.types import SequenceStep
from target_service.wire import GrantStops

log = logging.getLogger("tandem.gateway")
PREFIX = 32


def _median_time(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0: the best fit over each subset of the columns
    whose solution has no negative coefficient (a handful of columns: the subsets are few).

    Clamping the unconstrained solution instead keeps the other coefficients as they were balanced
    against the negative one. On the emulated-cost CI track (5 ms a draft call, nothing per level),
    a rerun of the test that failed in CI on 2026-12-02 fitted the draft's base at 12.9 ms, the
    per-level slope clamped to 0, where start-ups that passed fitted about 7 ms (5 ms emulated,
    the rest gRPC). Such a base prices every tree 5 ms too dear: a 3-token chain there pays from
    about 0.9 accepted, about what a lone request's first trees accept
    (tests/test_gateway_auto_phases.py)."""
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(ys, dtype=torch.float64)[:, None]
    columns = a.shape[1]
    best, best_residual = torch.zeros(columns, dtype=torch.float64), float(y.square().sum())
    for subset in itertools.chain.from_iterable(
            itertools.combinations(range(columns), n) for n in range(1, columns + 1)):
        cols = list(subset)
        coef = torch.linalg.lstsq(a[:, cols], y).solution
        residual = float((a[:, cols] @ coef - y).square().sum())
        if (coef >= 0).all() and residual < best_residual:
            best = torch.zeros(columns, dtype=torch.float64)
            best[cols] = coef[:, 0]
            best_residual = residual
    return best.tolist()


def _profile_target(target: TargetClient, block_size: int, free_blocks: int,
                    grant_steps: int) -> tuple[tuple[float, float, float], dict[int, float]]:
    """The fitted (base, per token, per sequence) of a step, and seconds per granted plain step by
    number of sequences (empty without grants)."""
    fits = free_blocks // -(-(PREFIX + 40) // block_size)  # sequences that fit with room to grow
    if fits < 2:
        raise RuntimeError(f"the KV cache is too small to profile ({free_blocks} blocks)")
    ids = [f"__profile_{i}" for i in range(min(8, fits))]
    prompt = [1 + i % 50 for i in range(PREFIX)]
    pending = {}
    for rid in ids:
        pending[rid] = target.step([SequenceStep.chain(rid, prompt, create=True)], ())[0][0].tokens[-1]
    rows, ys = [], []
    try:
        for seqs in sorted({1, max(1, len(ids) // 2), len(ids)}):
            for nodes in (1, 4, 16):
                def run(seqs=seqs, nodes=nodes):
                    items = []
                    for rid in ids[:seqs]:
                        toks = (pending[rid],) + tuple(1 + j % 50 for j in range(nodes - 1))
                        # The pending token, then a chain of drafted nodes below it.
                        items.append(SequenceStep(rid, toks, tuple(range(-1, nodes - 1)), num_fixed=1))
                    for result in target.step(items, ())[0]:
                        pending[result.request_id] = result.tokens[-1]
                ys.append(_median_time(run))
                rows.append([1.0, seqs * nodes, seqs])
        granted = _profile_grants(target, ids, pending, grant_steps) if grant_steps > 1 else {}
    finally:
        target.release(ids)
    return tuple(_fit(rows, ys)), granted


def _profile_grants(target: TargetClient, ids: list[str], pending: dict[str, int], steps: int) -> dict[int, float]:
    """Seconds per granted plain step (the median gap between replies after the first), by number of
    sequences: 1, 2 and the profile's half and whole batch, the loads below the gate's minimum."""
    out = {}
    for seqs in sorted({n for n in (1, 2, len(ids) // 2, len(ids)) if 1 <= n <= len(ids)}):
        items = [SequenceStep.chain(rid, [pending[rid]]) for rid in ids[:seqs]]
        stops = GrantStops(max_new_tokens=np.full(seqs, steps, dtype=np.int32),
                           stop_token_ids=tuple(frozenset() for _ in range(seqs)))
        gaps = []
        grant = target.grant(items, (), steps, stops)
        try:
            t0 = time.perf_counter()
            for results, _, _ in grant:
                now = time.perf_counter()
                gaps.append(now - t0)
                t0 = now
                for result in results:
                    pending[result.request_id] = result.tokens[-1]
        finally:
            grant.close()
        if gaps:
            out[seqs] = statistics.median(gaps[1:] or gaps)
    return out


def _profile_draft(replica: DraftReplica, cfg: PolicyConfig) -> tuple[float, float, float]:
    client = replica.client
    ids = [f"__profile_{i}" for i in range(4)]
    prompt = tuple(1 + i % 50 for i in range(PREFIX))
    client.ingest([IngestItem(rid, 0, prompt, None) for rid in ids], catch_up=True)
    rows, ys = [], []
    try:
        for budget in cfg.auto_options():
            for seqs in (1, 4):
                calls = [(rid, budget, len(prompt)) for rid in ids[:seqs]]
                ys.append(_median_time(lambda calls=calls: client.draft([], calls)))
                rows.append([1.0, budget.steps, seqs * budget.steps * budget.topk])
    finally:
        client.release(ids)
    return tuple(_fit(rows, ys))


# Batch buckets of the draft's growth graphs that the profile's calls (1 and 4 requests) leave uncaptured.
WARM_BATCHES = (2, 8, 16, 32, 64)
# Batch buckets at which each warmed option's depth cuts are warmed too. A request near its max_tokens drafts its
# option cut to the tokens it has left (GatewayCore._budgets), a graph of its own captured on first use, and a
# group of requests grows to its deepest member's depth (DraftEngine._grow_on_device), so a cut graph is met where
# one or two requests decode. On an H100 (demo track, bf16, one request, 2026-12-06) the first level of `auto` met
# five cuts of its 10/1/11 chain (9/1/11, 7/1/11, ...), each round's draft phase 4-17 ms against 2 ms: about 60 ms
# of a 429 ms level. Small buckets only: their graphs are small, where a cut at 64 requests would hold a large one.
CUT_BATCHES = (1, 2)


def depth_cuts(budget: DraftBudget) -> list[DraftBudget]:
    """The shallower trees of this budget that a request near its max_tokens drafts: its top-k and size, 1 to
    steps - 1 levels."""
    return [budget.cut(steps) for steps in range(1, budget.steps)]


def warm_draft(replica: DraftReplica, cfg: PolicyConfig, max_batch: int) -> int:
    """On a CUDA draft, one Draft call for each of auto's options at each batch bucket of WARM_BATCHES up to
    max_batch requests (and what the draft's free KV holds), on throwaway requests: a draft captures a graph for
    each (batch bucket, budget) on its first call, and under load that first call is a first probe of trees,
    its capture a pause of every request. On an H200 at 16 requests a 10/1/11 capture took 30 of a probe
    round's 43 ms draft phase; on an H100, before trees of several depths grew as one, captures took about
    190 ms of two rounds (BENCHMARKS.md, forty-third session). Each option's depth cuts get a call at each bucket
    of CUT_BATCHES (see there). Then, at each bucket of WARM_BATCHES, one call that first takes in a verify's
    worth of tokens with features: the fixed-width catch-up's graph of that bucket (10-70 ms a capture on an
    H100). Returns the calls made: none on a CPU draft, which captures nothing, and none where no bucket fits."""
    client = replica.client
    info = client.info()
    if info.device != "cuda" or cfg.mode == "never":
        return 0
    options = cfg.auto_options() if cfg.mode == "auto" else (cfg.fixed_budget,)
    deepest = max(o.num_draft_tokens for o in options)
    per_request = -(-(PREFIX + len(WARM_BATCHES) + deepest) // info.load.block_size)  # + a token a catch-up call
    room = info.load.free_blocks // per_request
    batches = [b for b in WARM_BATCHES if b <= min(max_batch, room)]
    cut_batches = [b for b in CUT_BATCHES if b <= min(max_batch, room)]
    if not batches and not cut_batches:
        return 0
    ids = [f"__warm_{i}" for i in range(max(batches + cut_batches))]
    prompt = tuple(1 + i % 50 for i in range(PREFIX))
    client.ingest([IngestItem(rid, 0, prompt, None) for rid in ids], catch_up=True)
    calls = 0
    known = {rid: list(prompt) for rid in ids}
    try:
        for budget in options:
            shapes = [(budget, batch) for batch in batches]
            shapes += [(cut, batch) for cut in depth_cuts(budget) for batch in cut_batches]
            for shape_budget, batch in shapes:
                client.draft([], [(rid, shape_budget, len(prompt)) for rid in ids[:batch]])
                calls += 1
        for batch in batches if info.feature_width else ():
            # The root and one accepted token, the root's features with them: as a verify step feeds the draft.
            ingest = []
            for rid in ids[:batch]:
                tokens, accepted = known[rid], 1 + len(known[rid]) % 50
                ingest.append(IngestItem(rid, len(tokens) - 1, (tokens[-1], accepted),
                                         torch.zeros(1, info.feature_width)))
                tokens.append(accepted)
            client.draft(ingest, [(rid, cfg.fixed_budget, len(known[rid])) for rid in ids[:batch]])
            calls += 1
    finally:
        client.release(ids)
    return calls


# Batch sizes at which price_rounds times each option's round: the smallest of each batch bucket.
ROUND_BATCHES = (1, 2, 4, 8, 16, 32, 64)
ROUND_REPEATS = 3  # timed calls of each kind per (batch, option), their median kept
PREFILL_TOKENS = 8192  # the most prompt tokens price_rounds hands either service in one call


def price_rounds(target: TargetClient, replica: DraftReplica, cfg: PolicyConfig, costs: CostModel,
                 max_batch: int, context: int = PREFIX) -> dict[tuple[int, tuple[int, int]], float]:
    """On a CUDA draft under `auto`: each of auto's options' round timed at each batch of ROUND_BATCHES up to
    max_batch (and what both services' free KV holds), on throwaway requests: a Draft call (the median of
    ROUND_REPEATS after one untimed), then the target's verify of the trees it drafted (the median of
    ROUND_REPEATS). The throwaway requests hold prompts of `context` tokens (the gateway's --profile-context):
    the round's attention, in the draft's levels and the target's verify, reads that much context. Returns,
    per (batch bucket, tree shape), that round over what `costs`' linear fits put it at, for
    CostModel.shape_factors; empty on a CPU draft (its costs swing with the host more than with the shape)
    and where no batch fits.

    Why: the fits see the draft at one and four requests, and are linear in levels and expansions, where a
    GPU's round is not: the verify's nodes bucket, a chain's ten levels at 16 requests. Run after
    warm_draft, so no capture is timed; the rounds see no features, which every shape pays alike (the
    learned ratios take them). Timed on 32-token prompts, a 10/1/11 chain at 16 requests was priced at
    18.3-21.8 ms where serving's 1,024-token contexts made it 23.4 (H100, BENCHMARKS.md, forty-sixth
    session): a chain's ten levels and a wide verify read the context more often than a 5/4/8 round does."""
    if context < 1:
        raise ValueError(f"the rounds' context must be >= 1 token, got {context}")
    draft, info = replica.client, replica.client.info()
    if info.device != "cuda" or cfg.mode != "auto":
        return {}
    options = cfg.auto_options()
    target_info = target.info()
    target_load = target_info.load
    # Each timed verify may keep a whole tree and its bonus token; a context past the model's length is cut to fit.
    growth = ROUND_REPEATS * sum(o.max_nodes + 1 for o in options)
    context = min(context, target_info.max_model_len - growth)
    if context < 1:
        return {}
    target_tokens = context + growth
    room = min(target_load.free_blocks // -(-target_tokens // target_load.block_size),
               info.load.free_blocks // -(-(context + max(o.num_draft_tokens for o in options))
                                           // info.load.block_size))
    batches = [b for b in ROUND_BATCHES if b <= min(max_batch, room)]
    if not batches:
        return {}
    ids = [f"__round_{i}" for i in range(batches[-1])]
    prompt = tuple(1 + i % 50 for i in range(context))
    per_call = max(1, PREFILL_TOKENS // context)  # requests whose prompts one call takes in
    factors: dict[tuple[int, tuple[int, int]], float] = {}
    try:
        pending: dict[str, int] = {}
        for start in range(0, len(ids), per_call):
            group = ids[start:start + per_call]
            draft.ingest([IngestItem(rid, 0, prompt, None) for rid in group], catch_up=True)
            pending |= {result.request_id: result.tokens[-1] for result in target.step(
                [SequenceStep.chain(rid, prompt, create=True) for rid in group], ())[0]}
        for batch in batches:
            for option in options:
                calls = [(rid, option, len(prompt)) for rid in ids[:batch]]
                trees = {tree.request_id: tree for tree in draft.draft([], calls).trees}
                drafting = _median_time(lambda calls=calls: draft.draft([], calls), ROUND_REPEATS)

                def verify(batch=batch, trees=trees):
                    steps = []
                    for rid in ids[:batch]:
                        tokens, parents, num_fixed = trees[rid].verify_tree()
                        tokens[0] = pending[rid]  # the tree hangs below the target's pending token
                        steps.append(SequenceStep(rid, tuple(tokens), tuple(parents), num_fixed))
                    for result in target.step(steps, ())[0]:
                        pending[result.request_id] = result.tokens[-1]

                verifying = _median_time(verify, ROUND_REPEATS)
                fitted = costs.target_time(batch * (1 + option.max_nodes), batch) + costs.draft_time([option] * batch)
                factors[(batch_bucket(batch), option.shape)] = min(max((drafting + verifying) / fitted, 0.25), 4.0)
    finally:
        target.release(ids)
        draft.release(ids)
    return factors


def profile_costs(target: TargetClient, drafts: list[DraftReplica], cfg: PolicyConfig,
                  grant_steps: int = 1) -> CostModel:
    """grant_steps: the plain steps the gateway may grant (1: none; plain steps then cost what a step costs)."""
    t0 = time.perf_counter()
    costs = CostModel()
    load = target.info().load
    try:
        (costs.target_base, costs.target_per_token, costs.target_per_seq), granted = _profile_target(
            target, load.block_size, load.free_blocks, grant_steps)
        for seqs, seconds in granted.items():
            # Plain decoding's time per step against the fitted step: where the correction of plain
            # steps starts. It runs as grants of grant_steps steps, each after a planned round of the
            # loop, whose step the fitted single step stands for (the H200's profile at one request:
            # 7 gaps of 4.9 ms and a 7.6 ms step, 5.2 ms a token; `never` then decoded a lone request
            # at 5.3 ms a token, where the granted gap alone said 4.9).
            single = costs.target_time(seqs, seqs)
            per_step = ((grant_steps - 1) * seconds + single) / grant_steps
            costs.ratios[(batch_bucket(seqs), False)] = min(max(per_step / max(single, 1e-9), 0.25), 4.0)
    except Exception as exc:
        log.warning("target profiling failed (%s); using default target costs", exc)
    if drafts:
        try:
            db, dl, de = _profile_draft(drafts[0], cfg)
            costs.draft_base, costs.draft_per_level, costs.draft_per_expansion = db, dl, de
        except Exception as exc:  # a failing draft must not stop the gateway
            log.warning("draft profiling failed (%s); using default draft costs", exc)
    log.info("profiled step costs in %.1f s", time.perf_counter() - t0)
    return costs
