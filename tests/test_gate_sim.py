"""bench/gate_sim.py runs the load gate against simulated steps and says what share of the better arm it delivered."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_gate_sim_prints_a_share_of_the_better_arm_per_ratio_and_refuses_a_tree_without_a_gate(tmp_path):
    proc = subprocess.run([sys.executable, "bench/gate_sim.py", "--seeds", "3", "--steps", "120", "--ratios",
                           "0.7,1.5"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["0.70", "1.50"]
    assert all(0.5 < float(value) <= 1.0 for row in rows for value in row[1:])
    proc = subprocess.run([sys.executable, "bench/gate_sim.py", "--tree", str(tmp_path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "has no gateway/load_gate.py or gateway/policy.py" in proc.stderr


def test_gate_sim_draws_tree_steps_tokens_as_the_scale_track_forces_them_and_refuses_a_bad_draw():
    sys.path.insert(0, str(REPO))
    from bench.gate_sim import draw, draw_mean

    rng = random.Random(0)
    draws = [draw(rng, 0.6, 5) for _ in range(20000)]
    assert set(draws) == {0, 1, 2, 3, 4, 5}
    assert sum(draws) / len(draws) == pytest.approx(draw_mean(0.6, 5), abs=0.03)
    assert draw_mean(0.6, 5) == pytest.approx(0.6 + 0.36 + 0.216 + 0.1296 + 0.07776)
    proc = subprocess.run([sys.executable, "bench/gate_sim.py", "--seeds", "3", "--steps", "150", "--seqs", "1",
                           "--plain", "157", "--draws", "0.6,5", "--ratios", "0.8,1.4"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[1:]]
    assert [row[0] for row in rows] == ["0.80", "1.40"]
    assert all(0.3 < float(value) <= 1.1 for row in rows for value in row[1:])
    proc = subprocess.run([sys.executable, "bench/gate_sim.py", "--draws", "1.5,5"], capture_output=True, text=True,
                          timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "P must be in [0, 1]" in proc.stderr and "Traceback" not in proc.stderr
