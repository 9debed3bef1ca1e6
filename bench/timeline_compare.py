"""Arms of an A/B side by side, hop by hop, from bench/round_timeline.py's JSON summaries.

    python bench/timeline_compare.py --arm blocking=off_1.json,off_2.json --arm spin=spin_1.json,spin_2.json

Each arm is one or more runs: `timeline_TRACK_TAG.json`, which `bash bench/h200_hot_path.sh timeline`
writes, or, where that did not come back, any other file holding one summary as round_timeline.py prints
it (the stage's log in a device call's output). The table gives every gap's median in each run, in the
order the arms' runs were named, then each later arm's mean less the first arm's: the table the sessions'
A/Bs report. Rows: the gaps of the round's critical path and beside it, the whole round, and the plain
steps in grants (microseconds between replies). A gap a run lacks (a mark its code does not make) shows
as "-". A benchmark tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

PLAIN = "plain steps in grants"
# A printed summary's lines: "  median (p10, p90)  gap  what it is", and "plain steps in grants: N us between ..."
PRINTED_GAP = re.compile(r"^\s*([\d.]+) \(\s*[\d.]+,\s*[\d.]+\)\s+(\S+)")
PRINTED_PLAIN = re.compile(r"^plain steps in grants: ([\d.]+) us between replies")


def read_printed(text: str) -> dict[str, float]:
    """gap -> median us from a log holding one summary as round_timeline.py prints it."""
    medians: dict[str, float] = {}
    for line in text.splitlines():
        if found := PRINTED_GAP.match(line):
            if found.group(2) in medians:
                raise ValueError(f"{found.group(2)} appears twice: the log holds several runs' summaries")
            medians[found.group(2)] = float(found.group(1))
        elif found := PRINTED_PLAIN.match(line):
            medians[PLAIN] = float(found.group(1))
    if not medians:
        raise ValueError("no summary printed by round_timeline.py in it")
    return medians


def read_run(path: Path) -> dict[str, float]:
    """gap -> median us of one run's summary, with the plain steps' gap under PLAIN."""
    if path.suffix != ".json":
        try:
            return read_printed(path.read_text())
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    summary = json.loads(path.read_text())
    medians = {gap["gap"]: float(gap["median_us"]) for gap in summary.get("gaps", [])}
    plain = summary.get("plain_step_us") or {}
    if plain.get("median") is not None:
        medians[PLAIN] = float(plain["median"])
    return medians


def parse_arm(text: str) -> tuple[str, list[Path]]:
    name, sep, files = text.partition("=")
    if not sep or not name or not files:
        raise argparse.ArgumentTypeError(f"an arm is NAME=FILE[,FILE...], got {text!r}")
    return name, [Path(f) for f in files.split(",") if f]


def table(arms: list[tuple[str, list[dict[str, float]]]]) -> list[str]:
    """The comparison's lines (see the module's docstring)."""
    gaps: list[str] = []
    for _, runs in arms:
        for run in runs:
            gaps += [gap for gap in run if gap not in gaps]
    heads = [f"{name}_{i + 1}" for name, runs in arms for i in range(len(runs))]
    diffs = [f"{name}-{arms[0][0]}" for name, _ in arms[1:]]
    width = max([len(gap) for gap in gaps] + [10])
    lines = [" " * width + "".join(f"{head:>13s}" for head in heads + diffs)]
    for gap in gaps:
        cells = [run.get(gap) for _, runs in arms for run in runs]
        row = "".join(f"{cell:13.0f}" if cell is not None else f"{'-':>13s}" for cell in cells)
        base = [run[gap] for run in arms[0][1] if gap in run]
        for _, runs in arms[1:]:
            other = [run[gap] for run in runs if gap in run]
            row += f"{statistics.mean(other) - statistics.mean(base):+13.0f}" if base and other else f"{'-':>13s}"
        lines.append(f"{gap:{width}s}{row}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True, metavar="NAME=FILE[,FILE...]",
                        help="an arm and its runs' JSON summaries (or logs with the printed summary); the first "
                             "arm is the baseline")
    args = parser.parse_args(argv)
    try:
        arms = [(name, [read_run(path) for path in paths]) for name, paths in args.arm]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"timeline_compare: cannot read a summary: {exc}", file=sys.stderr)
        return 2
    print("\n".join(table(arms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
