"""The host side of this folder's two-tree timings: a probe (Python source printing JSON figures) run in each
tree of the code, each in its own process, the trees in turn, and one line printed per figure."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable


def compare(doc: str, probe: str, label: Callable[[str], str] = lambda key: f"batch {key}:") -> int:
    """`python SCRIPT BEFORE_TREE AFTER_TREE [--turns 3]`: the probe prints {key: {"warm_us", "cold_us"}}."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--turns", type=int, default=3)
    args = ap.parse_args()
    for turn in range(1, args.turns + 1):
        for name, tree in (("before", args.before), ("after", args.after)):
            out = subprocess.run([sys.executable, "-c", probe], cwd=tree, capture_output=True, text=True, check=True)
            for key, figures in json.loads(out.stdout).items():
                head = " ".join(part for part in (f"turn {turn}", f"{name:6s}", label(key)) if part)
                print(f"{head} warm {figures['warm_us']:6.1f} us  cold {figures['cold_us']:6.1f} us")
    return 0
