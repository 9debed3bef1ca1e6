"""never, always and auto side by side from one serve_and_bench.sh run (one bench.json per mode).

    python3 bench/auto_report.py OUT [OUT ...]

bench/serve_and_bench.sh runs `tandem bench` once per mode (to scrape the services' metrics between
modes), so each run's own table lacks the other modes: auto / max(never, always) and the audit's
`always` and `never` columns are printed here from OUT/{never,always,auto}/bench.json, or from
OUT/all/bench.json where the modes ran in one bench (BENCH_INTERLEAVED=1, with --rounds).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tandem.bench import MODES, LevelResult, print_table


def load_rows(out: Path) -> list[LevelResult]:
    rows = []
    for mode in (*MODES, "all"):
        path = out / mode / "bench.json"
        if path.exists():
            rows += [LevelResult(**row) for row in json.loads(path.read_text())["results"]]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outs", nargs="+", type=Path, help="directories written by bench/serve_and_bench.sh")
    args = p.parse_args()
    for out in args.outs:
        rows = load_rows(out)
        if not rows:
            raise SystemExit(f"error: no {{never,always,auto,all}}/bench.json under {out}")
        print(f"== {out}")
        print_table(rows)


if __name__ == "__main__":
    main()
