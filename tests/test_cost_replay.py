"""bench/cost_replay.py replays a gateway's DEBUG log through the cost model: what each option was priced at."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from draft_service.types import DraftBudget
from gateway.cost_model import CostModel
from tests.test_step_log import START, stamped

REPO = Path(__file__).resolve().parents[1]
PROFILE = CostModel(target_base=7.6e-3, target_per_token=1.8e-5, target_per_seq=0.0, draft_base=8.9e-4,
                    draft_per_level=3.2e-4, draft_per_expansion=2.9e-6, ratios={(2, True): 1.1},
                    option_ratios={(2, DraftBudget(5, 4, 8)): 1.1})


def round_lines(at: float, step: int, ms: float) -> list[str]:
    """A plan giving both of 2 requests a 5/4/8 tree, and its step done in `ms` (the plan line as the gateway
    logs it since the drafts behind were counted; test_the_replay_prices_the_options_at_each_auto_levels_start
    has one without them)."""
    return [f"{stamped(at)} gateway DEBUG step {step}: 2 items, 2 tokens, trees ['5/4/8', '5/4/8'], 0 drafts behind, "
            "gate 2-3 sequences",
            f"{stamped(at + 0.01)} gateway DEBUG step {step + 1} done: 2 seqs, 2 trees, granted 0, fed draft True, "
            f"decode True, 8 committed, {ms:.2f} ms, quiet 0, ingests queued 0, phases 0.25/3.50/9.00/0.25 ms"]


def replay(tmp_path: Path, lines: list[str], *flags: str) -> list[list[str]]:
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "bench/cost_replay.py", str(log), "--options", "5,4,8;10,1,11", *flags],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return [row.split() for row in proc.stdout.splitlines()[1:]]


def test_the_replay_prices_each_option_beside_what_it_measured_and_shows_what_two_stalled_rounds_did(tmp_path):
    lines = [f"{stamped(0)} gateway INFO cost model: {PROFILE!r}"]
    for i in range(10):
        lines += round_lines(1 + i, 2 * i, 13.0)
    lines += round_lines(20, 100, 25.1) + round_lines(21, 102, 44.1)
    (conc, label, pred_tree, meas_tree, pred_chain, meas_chain), = replay(tmp_path, lines)
    assert (conc, label) == ("2", "end")
    assert float(meas_tree) == round((10 * 13.0 + 25.1 + 44.1) / 12, 1)
    assert meas_chain == "nan"  # never drafted alone
    profiled = 1000 * PROFILE.profiled_time(16, 2, [DraftBudget(5, 4, 8)] * 2)
    assert 13.0 < float(pred_tree) <= 13.0 * 1.1 * 1.1  # the stalls moved it 10% each at most
    (row,) = replay(tmp_path, lines, "--outlier-step", "100")  # as before OUTLIER_STEP existed
    uncapped = float(row[2])
    assert uncapped > 1.5 * 13.0 and uncapped > float(pred_tree)
    assert float(pred_tree) > profiled  # 13 ms rounds against a profile of less


def test_the_replay_prices_the_options_at_each_auto_levels_start(tmp_path):
    lines = [f"{stamped(0)} gateway INFO cost model: {PROFILE!r}"]
    for i in range(10):
        lines += round_lines(1 + i, 2 * i, 13.0)
    bench = tmp_path / "bench.json"  # started_at is epoch seconds; stamped() counts from START
    bench.write_text(json.dumps({"meta": {}, "results": [
        {"mode": "always", "concurrency": 2, "round": 1, "started_at": START + 1, "ended_at": START + 10.5},
        {"mode": "auto", "concurrency": 2, "round": 1, "started_at": START + 11, "ended_at": START + 12},
    ]}))
    lines += [f"{stamped(12)} gateway DEBUG step 99: 2 items, 2 tokens, trees [], gate 2-3 sequences"]
    (conc, label, pred_tree, *_), = replay(tmp_path, lines, "--levels", str(bench))
    assert (conc, label) == ("2", "1")  # the auto level alone, round 1
    assert abs(float(pred_tree) - 13.0) < 0.6  # ten 13 ms rounds taught it


def test_the_replay_prices_a_shape_with_the_round_timed_for_it_at_start_up(tmp_path):
    """A profile line with shape_factors (gateway.profiling.price_rounds) prices the never-drafted 10/1/11 chain
    at its timed round times the ratio that 5/4/8's rounds taught."""
    timed = dataclasses.replace(PROFILE, shape_factors={(2, (1, 11)): 1.4, (2, (4, 8)): 1.0})
    priced = {}
    for name, profile in (("fits", PROFILE), ("timed", timed)):
        lines = [f"{stamped(0)} gateway INFO cost model: {profile!r}"]
        for i in range(10):
            lines += round_lines(1 + i, 2 * i, 13.0)
        (row,) = replay(tmp_path, lines)
        priced[name] = float(row[2]), float(row[4])
    assert priced["timed"][0] == priced["fits"][0]  # 5/4/8: the fits' own round, factor 1
    assert priced["timed"][1] == pytest.approx(1.4 * priced["fits"][1], abs=0.15)


def test_the_replay_predicts_the_configured_tree_for_every_request_from_its_round_and_the_acceptance_given(tmp_path):
    """--accepted: the audit's 'cfg pred' from the replayed model, every request committing its own token and the
    accepted tokens of its tree, over the configured tree's round (the book's prior still weighs a little)."""
    lines = [f"{stamped(0)} gateway INFO cost model: {PROFILE!r}"]
    for i in range(10):
        lines += round_lines(1 + i, 2 * i, 13.0)
    rates = {}
    for accepted in ("1.0", "3.0"):
        (row,) = replay(tmp_path, lines, "--accepted", accepted)
        assert len(row) == 7  # conc, label, two (pred, meas) pairs, the configured tree's tok/s
        rates[accepted] = float(row[6])
        per_request = 1 + float(accepted)
        assert rates[accepted] == pytest.approx(2 * per_request / (float(row[2]) / 1000), rel=0.06)
    assert rates["3.0"] > 1.9 * rates["1.0"]
    (row,) = replay(tmp_path, lines)
    assert len(row) == 6  # no column unless asked


def test_the_replay_refuses_a_negative_acceptance(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text(f"{stamped(0)} gateway INFO cost model: {PROFILE!r}\n")
    proc = subprocess.run([sys.executable, "bench/cost_replay.py", str(log), "--accepted", "-1"],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2 and "--accepted must be at least 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_replay_shows_a_plain_step_priced_short_when_learned_a_step_at_a_time_and_right_per_grant(tmp_path):
    """--plain: grants whose first step carries the plan's round trip (2 ms, then seven of 0.5). Learned a step at a
    time (as the gateway learned them until 5e6f445), a grant's plan read a ratio that had just taken in the cheap
    steps; learned per grant (as it does since), a plain step is priced near the steps' mean."""
    profile = dataclasses.replace(PROFILE, target_base=6e-4, target_per_token=0.0, ratios={}, option_ratios={})
    lines = [f"{stamped(0)} gateway INFO cost model: {profile!r}"]
    step = 0
    for grant in range(12):
        lines.append(f"{stamped(1 + grant)} gateway DEBUG step {step}: 1 items, 1 tokens, trees [], 0 drafts behind, "
                     "gate 1-1 sequences")
        for index, ms in enumerate([2.0] + [0.5] * 7, start=1):
            step += 1
            lines.append(f"{stamped(1 + grant + index / 100)} gateway DEBUG step {step} done: 1 seqs, 0 trees, "
                         f"granted {index}, fed draft False, decode True, 1 committed, {ms:.2f} ms, quiet 0")
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "bench/cost_replay.py", str(log), "--plain"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    (row,) = [line.split() for line in proc.stdout.splitlines() if line.split()[:1] == ["1-1"]]
    grants, stepwise, per_grant, steps, mean = int(row[1]), float(row[2]), float(row[3]), int(row[4]), float(row[5])
    assert (grants, steps) == (12, 96) and mean == pytest.approx(0.6875, abs=5e-4)
    assert per_grant == pytest.approx(mean, rel=0.1)
    assert stepwise < 0.85 * mean
