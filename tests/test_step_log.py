"""bench/step_log.py reads a gateway's DEBUG log: steps by kind, and with --budgets the trees each plan chose."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START = datetime(2026, 12, 4, 10, 0, 0).timestamp()  # the --levels tests' levels start from here


def stamped(at: float) -> str:
    """The logging module's asctime `at` seconds after START, as a line of the gateway's log begins."""
    return datetime.fromtimestamp(START + at).strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]


def levels_table(tmp_path: Path, lines: list[str], levels: list[dict], which: int = -1,
                 extra: tuple[str, ...] = ()) -> list[str]:
    """A table `bench/step_log.py LOG --levels BENCH_JSON [extra]` prints for these log lines and levels (the
    last by default)."""
    log = tmp_path / "gateway.log"
    log.write_text("\n".join(lines))
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"meta": {}, "results": levels}))
    proc = subprocess.run([sys.executable, "bench/step_log.py", str(log), "--levels", str(bench), *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split("\n\n")[which].splitlines()


def plan(step: int, budgets: list[str]) -> str:
    return f"11:24:{10 + step:02d},000 gateway DEBUG step {step}: {len(budgets) or 1} items, 1 tokens, trees {budgets}"


def done(step: int, trees: int, committed: int, ms: float, quiet: int = 0) -> str:
    return (f"11:24:{10 + step:02d},500 gateway DEBUG step {step} done: {max(trees, 1)} seqs, {trees} trees, "
            f"granted 0, fed draft True, decode True, {committed} committed, {ms:.2f} ms, quiet {quiet}")


LOG = "\n".join([plan(3, ["3/1/4"]), done(4, 1, 3, 60), plan(4, ["5/4/8"]), done(5, 1, 5, 100),
                  plan(5, ["3/1/4"]), done(6, 1, 1, 40), plan(6, ["3/1/4", "5/4/8", "3/1/4"]), done(7, 3, 9, 50),
                  plan(7, []), done(8, 0, 1, 29, quiet=1)])


def test_budgets_table_joins_each_plan_to_the_step_it_made(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text(LOG)
    proc = subprocess.run([sys.executable, "bench/step_log.py", str(log), "--budgets"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    kinds, budgets = proc.stdout.split("\n\n")
    assert kinds.splitlines()[1].split()[-4:] == ["1", "29.0", "1", "29.00"]  # the plain step
    assert kinds.splitlines()[2].split()[-4:] == ["4", "250.0", "18", "62.50"]  # the four tree steps
    rows = {line[:32].strip(): line[32:].split() for line in budgets.splitlines()[1:]}
    assert rows == {"3/1/4": ["2", "100.0", "4", "2.00", "40.0"],
                    "5/4/8": ["1", "100.0", "5", "5.00", "50.0"],
                    "3/1/4 x2, 5/4/8": ["1", "50.0", "9", "9.00", "180.0"]}


def test_budgets_table_averages_the_gateway_phases_where_the_lines_carry_them(tmp_path):
    """A line that ends with the step's phases (schedule/draft/execute/update ms) adds their means per budgets;
    lines from before the phases were logged still parse, and count only in the other columns."""
    with_phases = [done(4, 1, 3, 60) + ", ingests queued 0, phases 0.50/20.00/35.00/4.50 ms",
                   done(5, 1, 5, 100),
                   done(6, 1, 1, 40) + ", ingests queued 2, phases 1.50/10.00/25.00/3.50 ms"]
    log = tmp_path / "gateway.log"
    log.write_text("\n".join([plan(3, ["3/1/4"]), with_phases[0], plan(4, ["5/4/8"]), with_phases[1],
                              plan(5, ["3/1/4"]), with_phases[2]]))
    proc = subprocess.run([sys.executable, "bench/step_log.py", str(log), "--budgets"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    budgets = proc.stdout.split("\n\n")[1].splitlines()
    assert budgets[0].split()[-4:] == ["schedule", "draft", "execute", "update"]
    rows = {line[:32].strip(): line[32:].split() for line in budgets[1:]}
    assert rows == {"3/1/4": ["2", "100.0", "4", "2.00", "40.0", "1.00", "15.00", "30.00", "4.00"],
                    "5/4/8": ["1", "100.0", "5", "5.00", "50.0"]}


def test_levels_table_splits_each_bench_levels_step_time_by_kind(tmp_path):
    """--levels: each level of a bench.json takes the step lines inside its window (its started_at and
    ended_at, against the log's own date and time), and says where its step time went."""

    def line(at: float, seqs: int, trees: int, granted: int, fed: bool, decode: bool, committed: int,
             ms: float) -> str:
        return (f"{stamped(at)} gateway DEBUG step 1 done: {seqs} seqs, {trees} trees, granted {granted}, "
                f"fed draft {fed}, decode {decode}, {committed} committed, {ms:.2f} ms, quiet 0, ingests queued 0")

    table = levels_table(tmp_path, [
        line(0.5, 4, 0, 1, False, True, 4, 10.0),  # never: granted plain steps and a joining prompt
        line(0.6, 4, 0, 1, False, True, 4, 10.0),
        line(0.7, 4, 0, 0, False, False, 3, 20.0),
        line(2.5, 4, 4, 0, True, True, 12, 30.0),  # always: trees, a fed plain step, a fed prompt
        line(2.6, 4, 0, 0, True, True, 4, 15.0),
        line(2.7, 4, 0, 0, True, False, 3, 35.0),
        line(9.0, 4, 0, 1, False, True, 4, 10.0),  # after the last level: in no window
    ], [{"mode": "never", "concurrency": 4, "round": 1, "started_at": START, "ended_at": START + 1},
        {"mode": "always", "concurrency": 4, "round": 1, "started_at": START + 2, "ended_at": START + 3}])
    assert table[0].split() == ["mode", "conc", "round", "steps", "ms", "trees", "%", "plain", "%", "fed", "%",
                                "prompt", "%", "committed", "tok/s", "decode", "tok/s"]
    assert table[1].split() == ["never", "4", "1", "3", "40.0", "0.0", "50.0", "0.0", "50.0", "11", "275.0", "400.0"]
    assert table[2].split() == ["always", "4", "1", "3", "80.0", "37.5", "0.0", "18.8", "43.8", "19", "237.5",
                                "400.0"]


def test_levels_table_is_followed_by_each_levels_tree_step_phases_where_the_lines_carry_them(tmp_path):
    """--levels then prints, per level with tree steps that logged their phases, the phases' means: which
    mode's tree steps cost more at one load, and in which phase."""

    def line(at: float, trees: int, ms: float, phases: str | None) -> str:
        tail = f", ingests queued 0, phases {phases} ms" if phases else ""
        return (f"{stamped(at)} gateway DEBUG step 1 done: 2 seqs, {trees} trees, granted 0, fed draft True, "
                f"decode True, 6 committed, {ms:.2f} ms, quiet 0{tail}")

    table = levels_table(tmp_path, [
        line(0.5, 2, 12.0, "0.20/3.60/7.50/0.70"),  # always
        line(0.6, 2, 12.0, "0.40/3.40/7.50/0.70"),
        line(0.7, 0, 6.0, "0.10/0.00/5.50/0.40"),  # a plain step: not a tree step
        line(2.5, 2, 12.5, "0.50/4.00/7.50/0.50"),  # auto
        line(2.6, 2, 12.5, None),  # a line from before the phases were logged
    ], [{"mode": "always", "concurrency": 2, "round": 1, "started_at": START, "ended_at": START + 1},
        {"mode": "auto", "concurrency": 2, "round": 1, "started_at": START + 2, "ended_at": START + 3}], which=-2)
    assert table[0] == "tree steps' phases, mean ms"
    assert table[1].split() == ["mode", "conc", "round", "steps", "schedule", "draft", "execute", "update"]
    assert table[2].split() == ["always", "2", "1", "2", "0.30", "3.50", "7.50", "0.70"]
    assert table[3].split() == ["auto", "2", "1", "1", "0.50", "4.00", "7.50", "0.50"]


def test_levels_table_ends_with_the_tree_rounds_right_after_a_prompt_step_beside_the_others(tmp_path):
    """The round after a joining prompt is where the draft takes the prompt in: --levels sets those rounds'
    count, draft phase and ms beside the level's other tree rounds."""

    def line(at: float, trees: int, decode: bool, ms: float, draft_ms: float) -> str:
        return (f"{stamped(at)} gateway DEBUG step 1 done: 3 seqs, {trees} trees, granted 0, fed draft True, "
                f"decode {decode}, 6 committed, {ms:.2f} ms, quiet 0, ingests queued 0, "
                f"phases 0.30/{draft_ms:.2f}/9.00/0.70 ms")

    table = levels_table(tmp_path, [
        line(0.1, 3, True, 15.0, 5.0),
        line(0.2, 2, False, 19.0, 5.0),  # a prompt joins beside two trees
        line(0.3, 3, True, 24.0, 14.0),  # the round after it
        line(0.4, 3, True, 16.0, 6.0),
    ], [{"mode": "always", "concurrency": 3, "round": 1, "started_at": START, "ended_at": START + 1}])
    assert table[1].split() == ["mode", "conc", "round", "after", "draft", "ms", "others", "draft", "ms"]
    # (a level's first step has no step before it inside the level: it is neither)
    assert table[2].split() == ["always", "3", "1", "1", "14.00", "24.00", "1", "6.00", "16.00"]


def test_levels_table_counts_the_steps_judged_at_a_lighter_load_than_the_levels_own(tmp_path):
    """Between a request's end and its client's next request the gateway holds one request fewer: --levels
    counts, per level, the spells and steps whose plan the gate judged below the level's concurrency (after
    its first plan at it), their share of the level's step ms, and how many of them drafted trees or fed."""

    def planned(at: float, lo: int, hi: int) -> str:
        return f"{stamped(at)} gateway DEBUG step 1: 4 items, 4 tokens, trees [], gate {lo}-{hi} sequences: trees"

    def line(at: float, trees: int, fed: bool, ms: float) -> str:
        return (f"{stamped(at)} gateway DEBUG step 1 done: 4 seqs, {trees} trees, granted 0, fed draft {fed}, "
                f"decode True, 4 committed, {ms:.2f} ms, quiet 0")

    table = levels_table(tmp_path, [
        planned(0.05, 2, 3), line(0.1, 0, False, 10.0),  # the level filling: not counted
        planned(0.15, 4, 7), line(0.2, 0, False, 10.0),
        planned(0.25, 2, 3), line(0.3, 0, True, 10.0),  # a dip, fed
        planned(0.35, 2, 3), line(0.4, 4, True, 20.0),  # the same dip, trees
        planned(0.45, 4, 7), line(0.5, 0, False, 10.0),
        planned(0.55, 2, 3), line(0.6, 0, False, 10.0),  # a second dip, plain
    ], [{"mode": "auto", "concurrency": 4, "round": 1, "started_at": START, "ended_at": START + 1}])
    assert table[1].split() == ["mode", "conc", "round", "spells", "steps", "ms", "%", "trees", "or", "fed"]
    assert table[2].split() == ["auto", "4", "1", "2", "3", "57.1", "2"]


def test_levels_table_ends_with_autos_tree_steps_on_joining_prompts_under_a_probe_and_under_a_verdict(tmp_path):
    """The gate records no step that carries a joining prompt's chunk: --levels counts, per `auto` level, the tree
    steps that did, split by whether their plan's gate line said a probe of trees was under way, with their ms
    and share of the level's step ms. Other modes log the gate's state but are not chosen by it: no row."""

    def planned(at: float, probing: bool) -> str:
        return (f"{stamped(at)} gateway DEBUG step 1: 4 items, 9 tokens, trees [], gate 4-7 sequences: trees 10.0 "
                f"tok/s (3 steps), plain 9.0 tok/s (3 steps){', probing trees (8 left)' if probing else ''}")

    def line(at: float, trees: int, decode: bool, ms: float) -> str:
        return (f"{stamped(at)} gateway DEBUG step 1 done: 4 seqs, {trees} trees, granted 0, fed draft True, "
                f"decode {decode}, 4 committed, {ms:.2f} ms, quiet 0")

    steps = [
        planned(0.05, True), line(0.1, 4, False, 30.0),  # a probe's tree step on a join
        planned(0.15, True), line(0.2, 4, True, 20.0),  # the probe on a step that only decodes: not counted
        planned(0.25, False), line(0.3, 3, False, 25.0),  # the verdict's trees on a join
        planned(0.35, False), line(0.4, 0, False, 25.0),  # plain on a join: not counted
    ]
    table = levels_table(tmp_path, steps + [line(1.5, 4, False, 30.0)], [
        {"mode": "auto", "concurrency": 4, "round": 1, "started_at": START, "ended_at": START + 1},
        {"mode": "always", "concurrency": 4, "round": 1, "started_at": START + 1, "ended_at": START + 2}])
    assert table[1].split() == ["mode", "conc", "round", "probe", "ms", "ms", "%", "verdict", "ms", "ms", "%"]
    assert table[2].split() == ["auto", "4", "1", "1", "30.0", "30.0", "1", "25.0", "25.0"]
    assert len(table) == 3


def test_options_table_sets_each_levels_one_budget_tree_steps_by_budget(tmp_path):
    """--options: per level, the tree steps whose plan gave every sequence a tree of one budget, by budget (the
    plan line of step N is the step that logs `step N+1 done`): steps, mean ms, committed a sequence, tok/s and
    mean phases. A step with a plain sequence or with two budgets is in no row."""

    def planned(at: float, step: int, budgets: list[str]) -> str:
        return f"{stamped(at)} gateway DEBUG step {step}: {len(budgets)} items, 2 tokens, trees {budgets}, gate 2-3"

    def line(at: float, step: int, trees: int, committed: int, ms: float, phases: str) -> str:
        return (f"{stamped(at)} gateway DEBUG step {step} done: 2 seqs, {trees} trees, granted 0, fed draft True, "
                f"decode True, {committed} committed, {ms:.2f} ms, quiet 0, ingests queued 0, phases {phases} ms")

    table = levels_table(tmp_path, [
        planned(0.1, 1, ["5/4/8", "5/4/8"]), line(0.11, 2, 2, 8, 10.0, "0.20/3.00/6.00/0.80"),
        planned(0.2, 2, ["6/8/16", "6/8/16"]), line(0.21, 3, 2, 9, 15.0, "0.40/4.00/9.00/1.60"),
        planned(0.3, 3, ["5/4/8", "5/4/8"]), line(0.31, 4, 2, 6, 10.0, "0.40/3.00/6.00/0.60"),
        planned(0.4, 4, ["5/4/8", "6/8/16"]), line(0.41, 5, 2, 7, 12.0, "0.30/3.50/7.00/1.20"),  # two budgets
        planned(0.5, 5, ["5/4/8"]), line(0.51, 6, 1, 5, 9.0, "0.30/3.00/5.00/0.70"),  # a sequence without a tree
    ], [{"mode": "auto", "concurrency": 2, "round": 1, "started_at": START, "ended_at": START + 1}],
        extra=("--options",))
    assert table[1].split() == ["mode", "conc", "round", "budget", "steps", "ms", "per", "seq", "tok/s", "schedule",
                                "draft", "execute", "update"]
    assert [row.split() for row in table[2:]] == [
        ["auto", "2", "1", "5/4/8", "2", "10.00", "3.50", "700.0", "0.30", "3.00", "6.00", "0.70"],
        ["auto", "2", "1", "6/8/16", "1", "15.00", "4.50", "600.0", "0.40", "4.00", "9.00", "1.60"]]


def test_options_table_needs_the_levels_windows(tmp_path):
    log = tmp_path / "gateway.log"
    log.write_text(LOG)
    proc = subprocess.run([sys.executable, "bench/step_log.py", str(log), "--options"], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 2
    assert "--options reads each level's window from --levels" in proc.stderr
