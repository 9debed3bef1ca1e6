"""bench/timeline_compare.py: each run's gap medians side by side, and each later arm's mean less the
first arm's, with gaps a run lacks shown as missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_scripts import load_bench_script


def load_tool():
    return load_bench_script("timeline_compare")


def summary(path: Path, gaps: dict[str, float], plain: float) -> Path:
    path.write_text(json.dumps({"rounds": 10, "spec_rounds": 8, "plain_step_us": {"median": plain},
                                "gaps": [{"gap": gap, "median_us": us} for gap, us in gaps.items()]}))
    return path


def test_arms_are_compared_by_their_means_and_a_missing_gap_is_marked(tmp_path, capsys):
    tool = load_tool()
    a1 = summary(tmp_path / "a1.json", {"gw.round": 100, "round": 1000}, 500)
    a2 = summary(tmp_path / "a2.json", {"gw.round": 120, "round": 1100}, 510)
    b1 = summary(tmp_path / "b1.json", {"gw.round": 90, "round": 900, "draft.push.stored": 40}, 505)
    assert tool.main(["--arm", f"off={a1},{a2}", "--arm", f"spin={b1}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["off_1", "off_2", "spin_1", "spin-off"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    assert rows["gw.round"] == ["100", "120", "90", "-20"]
    assert rows["round"] == ["1000", "1100", "900", "-150"]
    assert rows["draft.push.stored"] == ["-", "-", "40", "-"]
    assert rows["plain"] == ["steps", "in", "grants", "500", "510", "505", "+0"]


def test_a_bad_arm_or_an_unreadable_summary_is_an_error_not_a_trace(tmp_path, capsys):
    tool = load_tool()
    assert tool.main(["--arm", f"a={tmp_path / 'missing.json'}"]) == 2
    assert "cannot read a summary" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        tool.main(["--arm", "no-files"])
    assert exit_.value.code == 2
