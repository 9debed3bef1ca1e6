"""Grants at TP=2: every rank runs the grant loop, rank 0 tells the others when it stops early.

One subprocess runs the same scenario on a TP=1 and a TP=2 engine (gloo on CPU, or NCCL where
there are two GPUs) and prints every token; a rank that fell out of step would hang (the
subprocess's timeout) or die (the next command fails)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

SCENARIO = """
import json, sys
import numpy as np
from target_service.engine import batch_of_items
from target_service.parallel import EngineSpec, ParallelEngine
from target_service.types import SequenceStep
from target_service.wire import GrantStops

PROMPT = [5, 17, 3, 9, 33, 2, 40, 11]


def grant(engine, last, steps, limits, interrupt_after=None, close_after=None):
    rids = sorted(last)
    batch = batch_of_items([SequenceStep.chain(rid, [last[rid]]) for rid in rids])
    stops = GrantStops(max_new_tokens=np.array([limits[rid] for rid in rids], dtype=np.int32),
                       stop_token_ids=tuple(frozenset() for _ in rids))
    seen = {rid: [] for rid in rids}
    yielded = 0
    granted_steps = engine.grant(batch, stops, steps,
                                 lambda: interrupt_after is not None and yielded >= interrupt_after)
    for granted in granted_steps:
        yielded += 1
        if granted.results is not None:
            for row, rid in enumerate(granted.results.request_ids):
                seen[rid] += granted.results.new_tokens[row].tolist()
        if close_after is not None and yielded >= close_after:
            granted_steps.close()  # the caller went away mid-grant
            break
    return seen


def scenario(engine):
    log = []
    first = engine.step([SequenceStep.chain("a", PROMPT, create=True),
                         SequenceStep.chain("b", PROMPT[:5], create=True)])
    last = {r.request_id: r.tokens[-1] for r in first}
    log.append(last)
    for kw in (dict(steps=6, limits={"a": 6, "b": 3}), dict(steps=8, limits={"a": 8, "b": 8}, interrupt_after=2),
               dict(steps=8, limits={"a": 8, "b": 8}, close_after=1)):
        seen = grant(engine, last, **kw)
        log.append(seen)
    # Where each sequence is now, then a plain step after the grants. (Each grant feeds the
    # first step's token again rather than the last one emitted: TP=1 and TP=2 are fed alike.)
    lengths = {rid: engine.engine.kv.seqs[rid].length for rid in ("a", "b")}
    log.append(lengths)
    plain = engine.step([SequenceStep.chain(rid, [7]) for rid in ("a", "b")])
    log.append([r.tokens for r in plain])
    engine.release(["a"])
    log.append(engine.step([SequenceStep.chain("c", PROMPT[2:], create=True)])[0].tokens)
    return log


device = sys.argv[2]
out = {}
for tp in (1, 2):
    engine = ParallelEngine(EngineSpec(model_dir=sys.argv[1], num_blocks=64, block_size=4, device=device), tp_size=tp)
    try:
        out[tp] = scenario(engine)
    finally:
        engine.shutdown()
print(json.dumps(out))
"""


@pytest.mark.parametrize("spin_us", ["0", "3000"])
def test_a_grant_at_tp2_runs_on_every_rank_and_stops_early_in_step_with_tp1(tiny_llama, spin_us):
    """Whole, interrupted after two steps, and abandoned by its caller after one: the tokens, the
    sequences' lengths after each and the steps that follow are TP=1's, float32; with the other ranks'
    waits for rank 0 blocking, and spinning first (TANDEM_LANE_SPIN_US, as `tandem serve` sets it on a GPU)."""
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tiny_llama("gqa")), device], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env={**os.environ, "TANDEM_LANE_SPIN_US": spin_us})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    tp1, tp2 = got["1"], got["2"]
    assert tp2 == tp1
    _, whole, interrupted, abandoned, lengths, _, _ = tp1
    assert [len(whole["a"]), len(whole["b"])] == [6, 3]  # each item's max_new_tokens
    assert 2 <= len(interrupted["a"]) < 8  # ended early, after the steps in flight
    assert len(abandoned["a"]) == 1  # the caller saw one step; the rest ran out unseen
    assert lengths["a"] > lengths["b"]
