"""bench/round_timeline.py: the three processes' marks merge into one timeline, and each gap of a
speculative round is the time from one mark of its critical path to the next."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.bench_scripts import load_bench_script

REPO = Path(__file__).resolve().parent.parent


def load_tool():
    return load_bench_script("round_timeline")


def write_round(files: dict[str, list[str]], start_us: int, gap_us: int) -> None:
    """One speculative round with every critical mark `gap_us` after the one before, each in the
    file of the process that makes it."""
    tool = load_tool()
    t = start_us
    for label, _ in tool.PATH:
        files[label.split(".")[0]].append(f"{t * 1000} {label}")
        t += gap_us


def test_gaps_of_speculative_rounds_are_read_across_the_processes_files(tmp_path):
    tool = load_tool()
    files: dict[str, list[str]] = {"gw": [], "draft": [], "target": []}
    per_round = len(tool.PATH)
    for r in range(3):
        write_round(files, start_us=r * per_round * 10, gap_us=10)
    files["gw"].append(f"{3 * per_round * 10 * 1000} gw.round")  # the next round's start ends the last
    files["gw"] += [f"{10_000_000_000} gw.round", f"{10_001_000_000} gw.step.reply",
                    f"{10_006_000_000} gw.step.reply", f"{10_010_000_000} gw.round"]  # a grant: 2 steps 5 ms apart
    for name, lines in files.items():
        (tmp_path / f"timeline-{name}.txt").write_text("\n".join(lines) + "\n")
    summary = tool.summarise(tmp_path)
    assert summary["spec_rounds"] == 3
    gaps = {row["gap"]: row["median_us"] for row in summary["gaps"]}
    assert all(gaps[label] == 10 for label, _ in tool.PATH)
    assert gaps["round"] == 10 * per_round
    assert summary["plain_step_us"]["median"] == 5000  # us
    run = subprocess.run([sys.executable, str(REPO / "bench" / "round_timeline.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "3 speculative rounds of 5" in run.stdout


def test_marks_go_to_a_file_per_process_only_when_the_timeline_is_on(tmp_path):
    code = ("from tandem import timeline; timeline.mark('gw.round'); timeline.mark('gw.draft.send')")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("TANDEM_TIMELINE", None)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=60, cwd=tmp_path)
    assert not list(tmp_path.rglob("timeline-*.txt"))
    subprocess.run([sys.executable, "-c", code], env={**env, "TANDEM_TIMELINE": str(tmp_path / "marks")},
                   check=True, timeout=60)
    [written] = list((tmp_path / "marks").glob("timeline-*.txt"))
    labels = [line.split()[1] for line in written.read_text().splitlines()]
    assert labels == ["gw.round", "gw.draft.send"]


def test_the_target_engines_host_part_is_split_into_reserve_pack_and_launch(tmp_path):
    tool = load_tool()
    files: dict[str, list[str]] = {"gw": [], "draft": [], "target": []}
    per_round = len(tool.PATH)
    write_round(files, start_us=0, gap_us=1000)
    start_us = 1000 * [label for label, _ in tool.PATH].index("target.engine.start")
    for label, after_us in [("target.engine.reserved", 30), ("target.engine.packed", 110),
                            ("target.engine.launched", 160)]:
        files["target"].append(f"{(start_us + after_us) * 1000} {label}")
    files["gw"].append(f"{per_round * 1000 * 1000} gw.round")
    for name, lines in files.items():
        (tmp_path / f"timeline-{name}.txt").write_text("\n".join(sorted(lines, key=lambda line: int(line.split()[0])))
                                                        + "\n")
    gaps = {row["gap"]: row["median_us"] for row in tool.summarise(tmp_path)["gaps"]}
    assert gaps["target.engine.start->target.engine.reserved"] == 30
    assert gaps["target.engine.reserved->target.engine.packed"] == 80
    assert gaps["target.engine.packed->target.engine.launched"] == 50
    assert gaps["target.engine.start->target.engine.launched"] == 160
