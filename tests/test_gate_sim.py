"""bench/gate_sim.py runs the load gate against simulated steps and says what share of the better arm it delivered."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
    assert proc.returncode != 0 and "has no gateway/policy.py" in proc.stderr and "Traceback" not in proc.stderr
