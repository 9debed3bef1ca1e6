"""bench/step_log.py reads a gateway's DEBUG log: steps by kind, and with --budgets the trees each plan chose."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def plan(step: int, budgets: list[str]) -> str:
    return f"11:24:{10 + step:02d},000 gateway DEBUG step {step}: {len(budgets) or 1} items, 1 tokens, trees {budgets}"


def done(step: int, trees: int, committed: int, ms: float, quiet: int = 0) -> str:
    return (f"11:24:{10 + step:02d},500 gateway DEBUG step {step} done: {max(trees, 1)} seqs, {trees} trees, "
            f"granted 0, fed draft True, decode True, {committed} committed, {ms:.2f} ms, quiet {quiet}")


LOG = "\n".join([plan(3, ["3/1/4"]), done(4, 1, 3, 60), plan(4, ["5/4/8"]), done(5, 1, 5, 100),
                  plan(5, ["3/1/4"]), done(6, 1, 1, 40), plan(6, ["3/1/4", "5/4/8", "3/1/4"]), done(7, 3, 9, 50),
                  plan(7, []), done(8, 0, 1, 29, quiet=1)])


def test_budgets_table_joins_each_plan_to_the_step_it_made(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text(LOG)
    proc = subprocess.run([sys.executable, "bench/step_log.py", str(log), "--budgets"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    kinds, budgets = proc.stdout.split("\n\n")
    assert kinds.splitlines()[1].split()[-4:] == ["1", "29.0", "1", "29.00"]  # the plain step
    assert kinds.splitlines()[2].split()[-4:] == ["4", "250.0", "18", "62.50"]  # the four tree steps
    rows = {line[:32].strip(): line[32:].split() for line in budgets.splitlines()[1:]}
    assert rows == {"3/1/4": ["2", "100.0", "4", "2.00", "40.0"],
                    "5/4/8": ["1", "100.0", "5", "5.00", "50.0"],
                    "3/1/4 x2, 5/4/8": ["1", "50.0", "9", "9.00", "180.0"]}
