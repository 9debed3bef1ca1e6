"""bench/engine_step.py --tp 2 runs whole steps and grants on a TP=2 ParallelEngine (a tiny model, gloo on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kernels.invariant_attention as invariant_attention
import kernels.matmul as matmul

REPO = Path(__file__).resolve().parents[1]


def test_engine_step_bench_at_tp2_times_every_batch_and_tree_size(tmp_path):
    out = tmp_path / "engine_step.json"
    # --tiny: batches 1,4, nodes 1,4, eager, on the CPU; rank 1 is a spawned process.
    proc = subprocess.run([sys.executable, "bench/engine_step.py", "--tiny", "--tp", "2", "--grant", "4",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["tp"] == 2
    steps = {(r["batch"], r["nodes"]): r["ms"] for r in data["rows"] if "grant" not in r}
    grants = {r["batch"]: r["ms"] for r in data["rows"] if "grant" in r}
    assert set(steps) == {(b, n) for b in (1, 4) for n in (1, 4)}
    assert set(grants) == {1, 4}
    assert all(ms > 0 for ms in [*steps.values(), *grants.values()])
    assert {r["mode"] for r in data["rows"]} == {"eager"}


def test_engine_step_bench_sets_the_invariant_kernels_configuration_by_name_and_refuses_unknown_names(monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import engine_step
    finally:
        sys.path.remove(str(REPO / "bench"))
    for name in engine_step.MATMUL_KNOBS:  # restored after the test
        monkeypatch.setattr(matmul, name, getattr(matmul, name))
    assert engine_step.set_matmul_config("BLOCK_N=128, num_warps=8") == {"BLOCK_N": 128, "NUM_WARPS": 8}
    assert (matmul.BLOCK_N, matmul.NUM_WARPS, matmul.block_n_for(4096)) == (128, 8, 128)
    assert engine_step.set_matmul_config("0,1") == {"MIN_PROGRAMS": 0, "SPLIT_K_PROGRAMS": 1}
    for bad in ("BLOCK_K=32", "BLOCK_N=wide", "BLOCK_N=0", "1,2,3"):
        with pytest.raises(ValueError):
            engine_step.set_matmul_config(bad)
    for name in engine_step.ATTENTION_KNOBS:
        monkeypatch.setattr(invariant_attention, name, getattr(invariant_attention, name))
    assert engine_step.set_attention_config("BLOCK_N=64,ROWS_PER_PROGRAM=8") == {"BLOCK_N": 64, "ROWS_PER_PROGRAM": 8}
    assert (invariant_attention.BLOCK_N, invariant_attention.ROWS_PER_PROGRAM) == (64, 8)
    with pytest.raises(ValueError):
        engine_step.set_attention_config("SPLIT_LEN=128")
