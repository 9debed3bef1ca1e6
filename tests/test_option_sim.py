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


def test_option_sim_compares_own_weights_on_requests_that_end_and_differ_and_at_one_request_names_each_ones_best():
    proc = subprocess.run([sys.executable, "bench/option_sim.py", "--requests", "1", "--steps", "120", "--seeds", "2",
                           "--margins", "0.05", "--own-weights", "2,auto", "--request-tokens", "32", "--spread", "0.3"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "each request's best, plain included: " in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["  margin 0.05, own weight  2.0",
                                                          "  margin 0.05, own weight auto"]
    # each request's best is at least any one option's rate for it, so their harmonic mean is at least each option's
    oracle = float(lines[0].rsplit(": ", 1)[1])
    rates = [float(part.rsplit(" ", 1)[1]) for part in lines[0].split("option: ")[1].split(" (best")[0].split(", ")]
    assert oracle >= max(rates) and all("/ each request's best " in line for line in lines[1:])


def test_option_sim_refuses_a_spread_of_one_or_more():
    proc = subprocess.run([sys.executable, "bench/option_sim.py", "--spread", "1"], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--spread" in proc.stderr and "Traceback" not in proc.stderr
