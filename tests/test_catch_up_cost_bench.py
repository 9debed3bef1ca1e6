"""bench/catch_up_cost.py --profile writes a joining prompt's catch-up and a wake-up's ops (a tiny head on the CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_catch_up_profile_tables_a_prompt_and_a_wake_up(tmp_path):
    out = tmp_path / "catch_up_profile.txt"
    proc = subprocess.run([sys.executable, "bench/catch_up_cost.py", "--tiny", "--batches", "2", "--gaps", "5",
                           "--profile", str(out)], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    assert "== prompt catch-up: 2 requests, 64 positions each" in text
    assert "== wake-up: 2 requests, 5 positions each" in text
    assert text.count("by device time:") == 2 and "aten::" in text
