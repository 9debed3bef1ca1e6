"""What `--deterministic` costs, read from a `deterministic` stage's engine timings.

    python bench/det_report.py DIR

DIR holds the stage's `engine_det_off*.json` and `engine_det_on*.json` (`bench/engine_step.py --out`), written
off then on, pair after pair. Prints, for each (batch, nodes) shape, every run's ms per `TargetEngine.step`,
on / off pair by pair, the ratio of the medians, the same for the graphs replayed alone (forward + tail), and
whether issue 19's goal holds on the medians: at most 1.15x at batch 1 and 1.25x at batch 64.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

GOALS = {1: 1.15, 64: 1.25}  # on / off, by batch (issue 19, must-show 3)


def _pair_index(path: Path) -> int:
    match = re.fullmatch(r"engine_det_(?:on|off)(?:_(\d+))?\.json", path.name)
    return int(match.group(1) or 1) if match else -1


def load_runs(directory: Path, mode: str) -> list[dict]:
    """The runs of one mode ("on" or "off"), in the order they ran; variants (other file names) left out."""
    paths = [path for path in directory.glob(f"engine_det_{mode}*.json") if _pair_index(path) > 0]
    return [json.loads(path.read_text()) for path in sorted(paths, key=_pair_index)]


def _figures(run: dict, kind: str) -> dict[tuple[int, int], float]:
    """(batch, nodes) -> ms: a whole step ("graphs") or its graphs replayed alone ("replay", forward + tail)."""
    if kind == "graphs":
        return {(row["batch"], row["nodes"]): row["ms"] for row in run["rows"] if row["mode"] == "graphs"}
    return {(row["batch"], row["nodes"]): row["forward+tail"] for row in run["rows"] if row["mode"] == "replay"}


def report(directory: Path) -> str:
    off_runs, on_runs = load_runs(directory, "off"), load_runs(directory, "on")
    if not off_runs or len(off_runs) != len(on_runs):
        raise SystemExit(f"{directory}: {len(off_runs)} off and {len(on_runs)} on runs; need as many of each, "
                         "at least one")
    lines = [f"{len(off_runs)} pairs (off, on) from {directory}", "",
             "| batch x nodes | off, ms per step | on | on / off, pair by pair | median on / median off "
             "| replayed alone, median on / off | goal |",
             "|---|---|---|---|---|---|---|"]
    shapes = sorted(_figures(off_runs[0], "graphs"))
    for shape in shapes:
        off = [_figures(run, "graphs")[shape] for run in off_runs]
        on = [_figures(run, "graphs")[shape] for run in on_runs]
        ratio = statistics.median(on) / statistics.median(off)
        off_replay = statistics.median(_figures(run, "replay")[shape] for run in off_runs)
        on_replay = statistics.median(_figures(run, "replay")[shape] for run in on_runs)
        goal = GOALS.get(shape[0])
        verdict = "" if goal is None else f"{'met' if ratio <= goal else 'not met'} (at most {goal:.2f}x)"
        lines.append(
            f"| {shape[0]} x {shape[1]} | {', '.join(f'{ms:.2f}' for ms in off)} "
            f"| {', '.join(f'{ms:.2f}' for ms in on)} "
            f"| {', '.join(f'{b / a:.2f}x' for a, b in zip(off, on, strict=True))} | **{ratio:.2f}x** "
            f"| {on_replay:.2f} / {off_replay:.2f} = {on_replay / off_replay:.2f}x | {verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", type=Path, help="the stage's output folder (or a call's extracted results)")
    args = parser.parse_args(argv)
    print(report(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
