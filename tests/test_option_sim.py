"""bench/option_sim.py runs auto's choice among its tree options against simulated forced-acceptance trees."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_option_sim_prints_a_share_of_the_best_option_per_margin_and_a_whole_margin_drafts_the_configured_tree():
    proc = subprocess.run([sys.executable, "bench/option_sim.py", "--requests", "2", "--steps", "80", "--seeds", "2",
                           "--margins", "0,1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("2 requests: expected tok/s a sequence by option: 3/1/4 ")
    shares = [float(line.split("mean ")[1].split(",")[0]) for line in lines[1:]]
    assert len(shares) == 2 and all(0.5 < share <= 1.05 for share in shares)
    # another option must beat the configured tree by 100%: almost every step drafts the configured tree
    mix = dict(part.rsplit(" ", 1) for part in lines[2].split("steps: ")[1].split(", "))
    assert int(mix["5/4/8"].rstrip("%")) >= 90


def test_option_sim_refuses_a_load_it_has_no_step_costs_for():
    proc = subprocess.run([sys.executable, "bench/option_sim.py", "--requests", "3"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "no step costs for [3] requests" in proc.stderr and "Traceback" not in proc.stderr
