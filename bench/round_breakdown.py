"""Where a mode's step time went: the mean of every tandem_*_seconds histogram over one `tandem bench` mode.

    python bench/round_breakdown.py OUT MODE [--since EARLIER_MODE]

OUT is a bench/serve_and_bench.sh directory: after each mode it scraped the gateway's metrics
(metrics_after_MODE.txt) and each service's (metrics_after_MODE_target.txt, ..._draft0.txt). The
counters only grow, so the mode's own figures are the scrape after it minus the scrape after the
mode run before it (--since). The gateway's phases (tandem_step_phase_seconds) set beside the
services' own step times say how much of a round is the services' work and how much is between them.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

SAMPLE = re.compile(r"^(tandem_\w+_seconds)_(sum|count)(\{[^}]*\})? (\S+)$")


def read_histograms(path: Path) -> dict[tuple[str, str], dict[str, float]]:
    """(metric, labels) -> {"sum": s, "count": n} from one Prometheus text scrape."""
    out: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        match = SAMPLE.match(line)
        if match:
            name, kind, labels, value = match.groups()
            out[(name, labels or "")][kind] = float(value)
    return out


def scrapes(out_dir: Path, mode: str) -> dict[str, Path]:
    """service -> scrape file after `mode` ("gateway" for the gateway's own)."""
    found = {"gateway": out_dir / f"metrics_after_{mode}.txt"}
    for path in sorted(out_dir.glob(f"metrics_after_{mode}_*.txt")):
        found[path.stem.removeprefix(f"metrics_after_{mode}_")] = path
    return found


def breakdown(out_dir: Path, mode: str, since: str | None) -> list[tuple[str, str, str, float, int]]:
    """(service, metric, labels, mean ms, count) for every histogram that moved during `mode`."""
    rows = []
    earlier = scrapes(out_dir, since) if since else {}
    for service, path in scrapes(out_dir, mode).items():
        after = read_histograms(path)
        before = read_histograms(earlier[service]) if service in earlier else {}
        for (name, labels), figures in sorted(after.items()):
            base = before.get((name, labels), {})
            count = figures.get("count", 0.0) - base.get("count", 0.0)
            total = figures.get("sum", 0.0) - base.get("sum", 0.0)
            if count > 0:
                rows.append((service, name, labels, 1000 * total / count, int(count)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="a bench/serve_and_bench.sh output directory")
    parser.add_argument("mode", help="the mode whose figures to show (never, always, auto)")
    parser.add_argument("--since", help="the mode benched just before it in the same run (its scrape is subtracted)")
    args = parser.parse_args()
    rows = breakdown(args.out, args.mode, args.since)
    if not rows:
        raise SystemExit(f"no histograms moved for mode {args.mode!r} under {args.out}")
    print(f"{'service':10s} {'metric':40s} {'labels':24s} {'mean ms':>9s} {'count':>7s} {'total s':>8s}")
    for service, name, labels, mean_ms, count in rows:
        print(f"{service:10s} {name:40s} {labels:24s} {mean_ms:9.3f} {count:7d} {mean_ms * count / 1000:8.3f}")


if __name__ == "__main__":
    main()
