"""bench/draft_step.py --phases: each part of a Draft call timed on its own, the clocks taken off afterwards."""

from __future__ import annotations

import json

from draft_service.device_tree import BatchTreeGrowth
from draft_service.engine import DraftEngine
from tests.bench_scripts import load_bench_script

draft_step = load_bench_script("draft_step")


def test_draft_step_phases_time_each_part_of_a_call_within_the_call_and_restore_the_engine(tmp_path):
    originals = {(owner, name): vars(owner)[name] for owner, name in draft_step.PHASES}
    out = tmp_path / "draft_step.json"
    assert draft_step.main(["--tiny", "--batches", "1,2", "--budgets", "3,1,4;5,4,8", "--iters", "2", "--phases",
                            "--out", str(out)]) == 0
    assert {(owner, name): vars(owner)[name] for owner, name in draft_step.PHASES} == originals
    rows = json.loads(out.read_text())["rows"]
    assert [row["batch"] for row in rows] == [1, 2]
    for row in rows:
        assert set(row["phases_ms"]) == {"3/1/4", "5/4/8"}
        for parts in row["phases_ms"].values():
            assert set(parts) == {name for _, name in draft_step.PHASES} | {"rest"}
            inside = sum(ms for name, ms in parts.items() if name not in ("draft", "rest"))
            assert 0 < inside <= parts["draft"]  # the parts run inside the call
            assert parts["_apply"] > 0 and parts["_catch_up"] > 0 and parts["run"] > 0  # each call ingests and grows


def test_draft_step_phases_of_calls_that_ingest_nothing_apply_nothing(tmp_path, capsys):
    out = tmp_path / "draft_step.json"
    assert draft_step.main(["--tiny", "--batches", "1", "--budgets", "3,1,4", "--iters", "2", "--grow-only",
                            "--phases", "--out", str(out)]) == 0
    parts = json.loads(out.read_text())["rows"][0]["phases_ms"]["3/1/4"]
    assert parts["_apply"] == 0 and parts["run"] > 0
    assert "mean ms a call spends in each part" in capsys.readouterr().out
    assert DraftEngine.draft is vars(DraftEngine)["draft"] and BatchTreeGrowth.run is vars(BatchTreeGrowth)["run"]
