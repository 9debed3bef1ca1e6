"""What the draft's catch-ups outside a verify cost a serve, from its DEBUG log.

    python bench/catch_up_log.py DRAFT_LOG[.gz] [--levels BENCH_JSON]

A draft at DEBUG (SERVE_LOG_LEVEL=DEBUG in bench/serve_and_run.sh) logs each catch-up that is not a verify's
single fixed-width round: a wake-up's gap (positions without features), a joining prompt. Each line says its
requests, rounds, positions, positions without features, eager forwards, fixed-width replays and host time.
Printed: such catch-ups with a gap (wake-ups) and without (prompts), each with its count, rounds, eager forwards and
replays summed, and the median, p90 and sum of their host milliseconds; with --levels (a `tandem bench` run's
bench.json, repeatable), the same per level, in each level's window (its started_at and ended_at).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import statistics
import sys
from datetime import datetime
from pathlib import Path

LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) draft DEBUG catch-up of (\d+) request\(s\): (\d+) "
                  r"round\(s\), (\d+) positions, (\d+) without features; (\d+) eager forward\(s\), (\d+) "
                  r"fixed-width; ([\d.]+) ms on the host")
KINDS = ("wake-up", "prompt")


def parse(text: str) -> list[dict]:
    """One dict per catch-up line: when (epoch seconds), kind, requests, rounds, positions, missing, eager,
    fixed, ms."""
    out = []
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        requests, rounds, positions, missing, eager, fixed = (int(g) for g in m.groups()[1:7])
        out.append({"when": datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(),
                    "kind": "wake-up" if missing else "prompt", "requests": requests, "rounds": rounds,
                    "positions": positions, "missing": missing, "eager": eager, "fixed": fixed,
                    "ms": float(m.group(8))})
    return out


def summary(rows: list[dict]) -> str:
    """count, rounds, eager, fixed, then median / p90 / sum of ms, as one line of columns."""
    if not rows:
        return f"{0:>6} {'':>7} {'':>6} {'':>6} {'':>8} {'':>8} {'':>9}"
    ms = sorted(r["ms"] for r in rows)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return (f"{len(rows):>6} {sum(r['rounds'] for r in rows):>7} {sum(r['eager'] for r in rows):>6} "
            f"{sum(r['fixed'] for r in rows):>6} {statistics.median(ms):>8.2f} {p90:>8.2f} {sum(ms):>9.1f}")


HEAD = f"{'count':>6} {'rounds':>7} {'eager':>6} {'fixed':>6} {'ms p50':>8} {'ms p90':>8} {'ms sum':>9}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--levels", type=Path, action="append", default=[], metavar="BENCH_JSON",
                    help="a tandem bench run's bench.json: also print each level's catch-ups (repeatable)")
    args = ap.parse_args(argv)
    try:
        raw = args.log.read_bytes()
        text = (gzip.decompress(raw) if args.log.suffix == ".gz" else raw).decode(errors="replace")
    except OSError as e:
        print(f"cannot read {args.log}: {e}", file=sys.stderr)
        return 1
    rows = parse(text)
    if not rows:
        print(f"no catch-up lines in {args.log} (a draft logging at DEBUG writes them)", file=sys.stderr)
        return 1
    print(f"{'kind':<8} {HEAD}")
    for kind in KINDS:
        print(f"{kind:<8} {summary([r for r in rows if r['kind'] == kind])}")
    levels = []
    for path in args.levels:
        try:
            levels += json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            print(f"cannot read the levels of {path}: {e}", file=sys.stderr)
            return 1
    levels = sorted((r for r in levels if r.get("started_at") is not None and r.get("ended_at") is not None),
                    key=lambda r: r["started_at"])
    if args.levels and not levels:
        print("no level windows in those files (a tandem bench older than started_at/ended_at)", file=sys.stderr)
        return 1
    if levels:
        print(f"\n{'mode':<7} {'conc':>5} {'round':>5} {'kind':<8} {HEAD}")
    for level in levels:
        inside = [r for r in rows if level["started_at"] <= r["when"] <= level["ended_at"]]
        for kind in KINDS:
            print(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {kind:<8} "
                  f"{summary([r for r in inside if r['kind'] == kind])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
