"""bench/engine_step.py --tp 2 runs whole steps and grants on a TP=2 ParallelEngine (a tiny model, gloo on CPU)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
