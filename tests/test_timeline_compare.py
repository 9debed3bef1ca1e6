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


def test_a_log_with_the_printed_summary_reads_as_its_json_would(tmp_path, capsys):
    tool = load_tool()
    log = tmp_path / "c1_0_1.log"
    log.write_text("""== timeline_scale_c1_0_1: rc=0 in 55 s
    1     1     285.6      291.9      13ms   11.7ms   18.3ms    3.69
278 speculative rounds of 427; microseconds, median (p10, p90)
      168.0 (   141.6,    213.8)  gw.round                           gateway: apply reports, schedule
      493.0 (   413.0,    645.9)  target.engine.start->target.engine.launched target engine: validate, pack
    11710.9 ( 11355.6,  12329.8)  round                              the whole round
plain steps in grants: 5993.7 us between replies (5876.8, 6121.3), 901 steps
""")
    as_json = summary(tmp_path / "b.json", {"gw.round": 150, "round": 11000}, 6000)
    assert tool.main(["--arm", f"log={log}", "--arm", f"json={as_json}"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows["gw.round"] == ["168", "150", "-18"]
    assert rows["target.engine.start->target.engine.launched"] == ["493", "-", "-"]
    assert rows["round"] == ["11711", "11000", "-711"]
    assert rows["plain"] == ["steps", "in", "grants", "5994", "6000", "+6"]
    # A log of two runs' summaries, or of none, is refused rather than read wrong.
    twice = tmp_path / "twice.log"
    twice.write_text(log.read_text() * 2)
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here\n")
    for bad, why in ((twice, "appears twice"), (empty, "no summary")):
        assert tool.main(["--arm", f"x={bad}"]) == 2
        assert why in capsys.readouterr().err
