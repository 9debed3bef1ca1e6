"""Where a serve's steps went, from the gateway's DEBUG log (a line per target step).

    python bench/step_log.py GATEWAY_LOG[.gz] [--since HH:MM:SS,mmm] [--until HH:MM:SS,mmm] [--runs] [--budgets]

Groups the `step N done: ...` lines (SERVE_LOG_LEVEL=DEBUG in bench/serve_and_run.sh) by kind: trees or
plain, granted or one call, fed to the draft or not, and prints per kind the steps, their summed
milliseconds at the gateway and the tokens they committed. --runs also prints each run of consecutive
steps of one kind (and batch size) with its quiet count, in order. A level's window comes from the
timestamps (a level starts where the previous one's last request ended). --budgets also prints, per
set of draft budgets a plan chose (its `step N: ... trees [...]` line, whose step is `step N+1 done`),
the tree steps, their milliseconds and committed tokens, tokens per step and tok/s: which trees auto
chose and what each delivered.
"""

from __future__ import annotations

import argparse
import gzip
import re
import sys
from pathlib import Path

STEP = re.compile(r"(\d\d:\d\d:\d\d,\d+) gateway DEBUG step (\d+) done: (\d+) seqs, (\d+) trees, granted (\d+), "
                  r"fed draft (\w+), decode (\w+), (\d+) committed, ([\d.]+) ms, quiet (\d+)")
PLAN = re.compile(r"gateway DEBUG step (\d+): \d+ items, \d+ tokens, trees \[([^\]]*)\]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--since", default="00:00:00,000")
    ap.add_argument("--until", default="99:99:99,999")
    ap.add_argument("--runs", action="store_true", help="print each run of steps of one kind")
    ap.add_argument("--budgets", action="store_true", help="print what each set of draft budgets delivered")
    args = ap.parse_args(argv)
    text = gzip.decompress(args.log.read_bytes()).decode() if args.log.suffix == ".gz" else args.log.read_text()
    rows = [m.groups() for m in map(STEP.search, text.splitlines()) if m]
    rows = [row for row in rows if args.since <= row[0] <= args.until]
    if not rows:
        print("no step lines in that window (was the gateway at DEBUG?)", file=sys.stderr)
        return 1

    def kind(row: tuple[str, ...]) -> tuple[str, str, str]:
        return ("trees" if row[3] != "0" else "plain", "granted" if row[4] != "0" else "one call",
                "fed" if row[5] == "True" else "not fed")

    totals: dict[tuple[str, str, str], list[float]] = {}
    run: list[tuple[str, ...]] = []
    for row in [*rows, None]:
        if run and (row is None or (kind(row), row[2]) != (kind(run[-1]), run[-1][2])):
            ms, committed = sum(float(r[8]) for r in run), sum(int(r[7]) for r in run)
            if args.runs:
                print(f"{run[0][0]} steps {run[0][1]}-{run[-1][1]}: {run[0][2]} seqs, {', '.join(kind(run[0]))}, "
                      f"{len(run)} steps, {ms:.1f} ms, {committed} committed, quiet {run[0][9]}-{run[-1][9]}")
            total = totals.setdefault(kind(run[0]), [0, 0.0, 0])
            total[0] += len(run)
            total[1] += ms
            total[2] += committed
            run = []
        if row is not None:
            run.append(row)
    print(f"{'kind':<32} {'steps':>6} {'ms':>9} {'committed':>9} {'ms/step':>8}")
    for what, (steps, ms, committed) in sorted(totals.items()):
        print(f"{', '.join(what):<32} {steps:>6} {ms:>9.1f} {committed:>9} {ms / steps:>8.2f}")
    if args.budgets:
        print_budgets(text, rows)
    return 0


def print_budgets(text: str, rows: list[tuple[str, ...]]) -> None:
    """Tree steps by the budgets their plan chose ("3/1/4 x2, 5/4/8": three requests' trees)."""
    chosen = {}  # step number of the `done` line -> the plan's budgets
    for m in map(PLAN.search, text.splitlines()):
        if m and m.group(2):
            budgets = sorted(b.strip().strip("'") for b in m.group(2).split(","))
            chosen[int(m.group(1)) + 1] = ", ".join(f"{b} x{budgets.count(b)}" if budgets.count(b) > 1 else b
                                                   for b in dict.fromkeys(budgets))
    by_budgets: dict[str, list[float]] = {}
    for row in rows:
        if row[3] != "0" and int(row[1]) in chosen:
            total = by_budgets.setdefault(chosen[int(row[1])], [0, 0.0, 0])
            total[0] += 1
            total[1] += float(row[8])
            total[2] += int(row[7])
    print(f"\n{'budgets':<32} {'steps':>6} {'ms':>9} {'committed':>9} {'per step':>8} {'tok/s':>8}")
    for budgets, (steps, ms, committed) in sorted(by_budgets.items(), key=lambda item: -item[1][0]):
        print(f"{budgets:<32} {steps:>6} {ms:>9.1f} {committed:>9} {committed / steps:>8.2f} "
              f"{1000 * committed / ms:>8.1f}")


if __name__ == "__main__":
    raise SystemExit(main())
