"""Where a serve's steps went, from the gateway's DEBUG log (a line per target step).

    python bench/step_log.py GATEWAY_LOG[.gz] [--since HH:MM:SS,mmm] [--until HH:MM:SS,mmm] [--runs] [--budgets]
                             [--levels BENCH_JSON [--options]]

Groups the `step N done: ...` lines (SERVE_LOG_LEVEL=DEBUG in bench/serve_and_run.sh) by kind: trees or
plain, granted or one call, fed to the draft or not, and prints per kind the steps, their summed
milliseconds at the gateway and the tokens they committed. --runs also prints each run of consecutive
steps of one kind (and batch size) with its quiet count, in order. A level's window comes from the
timestamps (a level starts where the previous one's last request ended). --budgets also prints, per
set of draft budgets a plan chose (its `step N: ... trees [...]` line, whose step is `step N+1 done`),
the tree steps, their milliseconds and committed tokens, tokens per step and tok/s: which trees auto
chose and what each delivered; and, where the lines carry them, the mean milliseconds of each gateway phase
(schedule, draft, execute, update) of those steps. --levels also prints, per level of the `tandem bench`
run whose bench.json it is given (each level's window: its started_at and ended_at), where the level's step
time went: decode steps with trees, plain decode steps that fed no draft, plain steps that fed the drafts, and
steps that carried prompt chunks; and its tok/s over all steps against over its decode steps alone (the gap is what
the load gate must charge an arm beyond its decode steps); then, where the lines carry them, the mean phases
of each level's tree steps, its tree rounds right after a step with a prompt chunk (where the draft takes the
joining prompt in) beside its other tree rounds, the steps whose plans the load gate judged at a lighter load
than the level's (between a request's end and its client's next request; where that load's verdict differs, they
wake or put to sleep the level's requests), and its tree steps that carried a joining prompt's chunk, under a
probe of trees and under a verdict (steps the gate does not record: what trees cost on the joins). --options
(with --levels) then prints, per level, its tree steps that gave every sequence a tree of one budget, by budget:
what `auto`'s other budgets delivered beside its configured tree's, and a step of the same trees in `auto` beside
one in `always`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from datetime import datetime
from pathlib import Path

STEP = re.compile(r"(\d\d:\d\d:\d\d,\d+) gateway DEBUG step (\d+) done: (\d+) seqs, (\d+) trees, granted (\d+), "
                  r"fed draft (\w+), decode (\w+), (\d+) committed, ([\d.]+) ms, quiet (\d+)"
                  r"(?:, ingests queued \d+, phases ([\d./]+) ms)?")  # phases: from 2026-12-04 (session 32)
PHASES = ("schedule", "draft", "execute", "update")
PHASE_HEAD = " ".join(f"{name:>8}" for name in PHASES)


def read_log(path: Path) -> str:
    """A gateway log's text, gzipped (.gz) or not."""
    return gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()


def parse_phases(field: str | None) -> list[float] | None:
    """A step line's phases ("0.20/3.60/7.50/0.70"), in ms; None where the line has none."""
    return [float(part) for part in field.split("/")] if field else None


def phase_means(logged: list[list[float]]) -> str:
    """The mean of each phase over these steps, as columns under PHASE_HEAD ("" for no step)."""
    return " ".join(f"{sum(column) / len(logged):>8.2f}" for column in zip(*logged)) if logged else ""
PLAN = re.compile(r"gateway DEBUG step (\d+): \d+ items, \d+ tokens, trees \[([^\]]*)\]")
GATE = re.compile(r"gateway DEBUG step \d+: .*, gate (\d+)-(\d+) sequences(.*)")  # the load the plan was judged at
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")  # the logging module's asctime
STEP_KINDS = ("trees", "plain", "fed", "prompt")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--since", default="00:00:00,000")
    ap.add_argument("--until", default="99:99:99,999")
    ap.add_argument("--runs", action="store_true", help="print each run of steps of one kind")
    ap.add_argument("--budgets", action="store_true", help="print what each set of draft budgets delivered")
    ap.add_argument("--levels", type=Path, action="append", default=[], metavar="BENCH_JSON",
                    help="print where each level of this tandem bench run spent its step time (repeatable: one "
                         "serve's benches, one bench.json each)")
    ap.add_argument("--options", action="store_true",
                    help="with --levels: per level, its tree steps that gave every sequence one budget, by budget")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        ap.error(f"no such log: {args.log}")
    if args.options and not args.levels:
        ap.error("--options reads each level's window from --levels BENCH_JSON")
    text = read_log(args.log)
    rows = [m.groups() for m in map(STEP.search, text.splitlines()) if m]
    rows = [row for row in rows if args.since <= row[0] <= args.until]
    if not rows:
        print("no step lines in that window (was the gateway at DEBUG?)", file=sys.stderr)
        return 1

    def kind(row: tuple[str, ...]) -> tuple[str, str, str]:
        return ("trees" if row[3] != "0" else "plain", "granted" if row[4] != "0" else "one call",
                "fed" if row[5] == "True" else "not fed")

    totals: dict[tuple[str, str, str], list[float]] = {}
    run: list[tuple[str, ...]] = []
    for row in [*rows, None]:
        if run and (row is None or (kind(row), row[2]) != (kind(run[-1]), run[-1][2])):
            ms, committed = sum(float(r[8]) for r in run), sum(int(r[7]) for r in run)
            if args.runs:
                print(f"{run[0][0]} steps {run[0][1]}-{run[-1][1]}: {run[0][2]} seqs, {', '.join(kind(run[0]))}, "
                      f"{len(run)} steps, {ms:.1f} ms, {committed} committed, quiet {run[0][9]}-{run[-1][9]}")
            total = totals.setdefault(kind(run[0]), [0, 0.0, 0])
            total[0] += len(run)
            total[1] += ms
            total[2] += committed
            run = []
        if row is not None:
            run.append(row)
    print(f"{'kind':<32} {'steps':>6} {'ms':>9} {'committed':>9} {'ms/step':>8}")
    for what, (steps, ms, committed) in sorted(totals.items()):
        print(f"{', '.join(what):<32} {steps:>6} {ms:>9.1f} {committed:>9} {ms / steps:>8.2f}")
    if args.budgets:
        print_budgets(text, rows)
    if args.levels:
        return print_levels(text, args.levels, options=args.options)
    return 0


def print_budgets(text: str, rows: list[tuple[str, ...]]) -> None:
    """Tree steps by the budgets their plan chose ("3/1/4 x2, 5/4/8": three requests' trees)."""
    chosen = {}  # step number of the `done` line -> the plan's budgets
    for step, budgets in plan_budgets(text).items():
        if budgets:
            budgets.sort()
            chosen[step] = ", ".join(f"{b} x{budgets.count(b)}" if budgets.count(b) > 1 else b
                                     for b in dict.fromkeys(budgets))
    by_budgets: dict[str, list[float]] = {}
    phase_ms: dict[str, list[list[float]]] = {}  # budgets -> each step's (schedule, draft, execute, update) ms
    for row in rows:
        if row[3] != "0" and int(row[1]) in chosen:
            total = by_budgets.setdefault(chosen[int(row[1])], [0, 0.0, 0])
            total[0] += 1
            total[1] += float(row[8])
            total[2] += int(row[7])
            if row[10]:
                phase_ms.setdefault(chosen[int(row[1])], []).append(parse_phases(row[10]))
    # Where a step's milliseconds went, by the gateway's phases (the mean over the steps that logged them).
    phase_head = PHASE_HEAD if phase_ms else ""
    print(f"\n{'budgets':<32} {'steps':>6} {'ms':>9} {'committed':>9} {'per step':>8} {'tok/s':>8} {phase_head}")
    for budgets, (steps, ms, committed) in sorted(by_budgets.items(), key=lambda item: -item[1][0]):
        print(f"{budgets:<32} {steps:>6} {ms:>9.1f} {committed:>9} {committed / steps:>8.2f} "
              f"{1000 * committed / ms:>8.1f} {phase_means(phase_ms.get(budgets, []))}".rstrip())


def step_kind(trees: str, fed: str, decode: str) -> str:
    """One of STEP_KINDS for a `step N done` line's fields."""
    if decode != "True":
        return "prompt"  # a prompt chunk rode in it (or it was all prefill)
    if trees != "0":
        return "trees"
    return "fed" if fed == "True" else "plain"


def plan_budgets(text: str) -> dict[int, list[str]]:
    """Each plan's budgets ("5/4/8" per tree), by the number of the `step N done` line of the step it made."""
    return {int(m.group(1)) + 1: [b.strip().strip("'") for b in m.group(2).split(",") if b.strip()]
            for m in map(PLAN.search, text.splitlines()) if m}


def print_levels(text: str, bench_jsons: list[Path], options: bool = False) -> int:
    """Per level of these bench.json files, the step lines inside its window by kind (see the module's doc);
    `options`: then its tree steps by budget (print_level_options)."""
    results = []
    for path in bench_jsons:
        try:
            results += json.loads(path.read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            print(f"cannot read the levels of {path}: {e}", file=sys.stderr)
            return 1
    # (epoch seconds, kind, committed, ms, the step's phases in ms or None, the top of the gate's bucket at its plan,
    # whether it drafted trees, whether its plan's gate line said a probe of trees was under way, its sequences,
    # its plan's budgets)
    chosen = plan_budgets(text) if options else {}
    steps = []
    judged_at, probing = 0, False  # as the last plan's gate line said (0: none yet)
    for line in text.splitlines():
        stamp, step, gate = STAMP.match(line), STEP.search(line), GATE.search(line)
        if gate:
            judged_at, probing = int(gate.group(2)), "probing trees" in gate.group(3)
        if stamp and step:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            row = step.groups()
            steps.append((when, step_kind(row[3], row[5], row[6]), int(row[7]), float(row[8]), parse_phases(row[10]),
                          judged_at, row[3] != "0", probing, int(row[2]), chosen.get(int(row[1]), [])))
    levels = sorted((r for r in results if r.get("started_at") is not None and r.get("ended_at") is not None),
                    key=lambda r: r["started_at"])
    if not levels:
        print("no level windows in those files (a tandem bench older than started_at/ended_at)", file=sys.stderr)
        return 1
    shares = " ".join(f"{kind + ' %':>8}" for kind in STEP_KINDS)
    print(f"\n{'mode':<7} {'conc':>5} {'round':>5} {'steps':>6} {'ms':>9} {shares} {'committed':>9} "
          f"{'tok/s':>8} {'decode tok/s':>12}")
    for level in levels:
        inside = [s for s in steps if level["started_at"] <= s[0] <= level["ended_at"]]
        ms = {kind: sum(s[3] for s in inside if s[1] == kind) for kind in STEP_KINDS}
        committed = {kind: sum(s[2] for s in inside if s[1] == kind) for kind in STEP_KINDS}
        total_ms, decode_ms = sum(ms.values()), ms["trees"] + ms["plain"]
        share = " ".join(f"{100 * ms[kind] / total_ms if total_ms else 0.0:>8.1f}" for kind in STEP_KINDS)
        rate = 1000 * sum(committed.values()) / total_ms if total_ms else 0.0
        decode_rate = 1000 * (committed["trees"] + committed["plain"]) / decode_ms if decode_ms else 0.0
        print(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {len(inside):>6} "
              f"{total_ms:>9.1f} {share} {sum(committed.values()):>9} {rate:>8.1f} {decode_rate:>12.1f}")
    print_level_phases(levels, steps)
    print_rounds_after_prompts(levels, steps)
    print_load_dips(levels, steps)
    print_trees_on_joins(levels, steps)
    if options:
        print_level_options(levels, steps)
    return 0


def print_level_options(levels: list[dict], steps: list[tuple]) -> None:
    """Per level, its decode steps whose plan gave every sequence a tree of one budget, by budget: how many, their
    mean ms, committed tokens a sequence, tok/s and mean phases. Set beside `always`'s steps of the configured tree
    at the same load, what `auto`'s choice of another budget delivered, and what a step of the same trees cost it
    (the same trees in both modes: any difference is the gateway's own or the draft's)."""
    rows = []
    for level in levels:
        by_budget: dict[str, list[tuple]] = {}
        for s in steps:
            if (level["started_at"] <= s[0] <= level["ended_at"] and s[1] == "trees" and len(s[9]) == s[8]
                    and len(set(s[9])) == 1):
                by_budget.setdefault(s[9][0], []).append(s)
        for budget, group in sorted(by_budget.items(), key=lambda item: -len(item[1])):
            ms, committed = sum(s[3] for s in group), sum(s[2] for s in group)
            per_seq = committed / sum(s[8] for s in group)
            rows.append(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {budget:>8} "
                        f"{len(group):>6} {ms / len(group):>8.2f} {per_seq:>8.2f} "
                        f"{1000 * committed / ms if ms else 0.0:>8.1f} "
                        f"{phase_means([s[4] for s in group if s[4]])}".rstrip())
    if rows:
        print("\ntree steps that gave every sequence one budget, by budget: steps, mean ms, committed a sequence, "
              f"tok/s, mean phases\n{'mode':<7} {'conc':>5} {'round':>5} {'budget':>8} {'steps':>6} {'ms':>8} "
              f"{'per seq':>8} {'tok/s':>8} {PHASE_HEAD}")
        print("\n".join(rows))


def print_trees_on_joins(levels: list[dict], steps: list[tuple]) -> None:
    """Per `auto` level, its tree steps that carried a joining prompt's chunk: under a probe of trees (a first
    probe runs on them; a re-probe waits for a step that only decodes) and under a verdict for trees (a load
    that dipped as a wave of requests was replaced): how many, their ms and share of the level's step ms. The
    gate records none of them, so what they cost beyond plain steps is only seen here. (Other modes' plans log
    the gate's state too, but it does not choose their trees.)"""
    rows = []
    for level in (level for level in levels if level["mode"] == "auto"):
        inside = [s for s in steps if level["started_at"] <= s[0] <= level["ended_at"]]
        total_ms = sum(s[3] for s in inside)
        joins = [s for s in inside if s[1] == "prompt" and s[6]]
        if not joins or not total_ms:
            continue
        cells = []
        for under_probe in (True, False):
            group = [s for s in joins if s[7] == under_probe]
            ms = sum(s[3] for s in group)
            cells.append(f"{len(group):>6} {ms:>8.1f} {100 * ms / total_ms:>6.1f}")
        rows.append(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {'  '.join(cells)}")
    if rows:
        group_head = f"{'ms':>8} {'ms %':>6}"
        print("\nauto's tree steps that carried a joining prompt's chunk, under a probe of trees and under a verdict: "
              f"steps, ms, % of the level's step ms\n{'mode':<7} {'conc':>5} {'round':>5} {'probe':>6} {group_head}  "
              f"{'verdict':>6} {group_head}")
        print("\n".join(rows))


def print_load_dips(levels: list[dict], steps: list[tuple]) -> None:
    """Per level, the steps planned after its first one judged at the level's own load that were judged at a
    lighter one (a request ended, its client's next not yet in): how many spells, their steps, their share of
    the level's step ms, and how many of them drafted trees or fed the drafts. Where the lighter load's verdict
    differs, these are the steps that wake (or put to sleep) a level's requests between two plans."""
    rows = []
    for level in levels:
        inside = [s for s in steps if level["started_at"] <= s[0] <= level["ended_at"]]
        total_ms = sum(s[3] for s in inside)
        full = next((i for i, s in enumerate(inside) if s[5] >= level["concurrency"]), None)
        if full is None or not total_ms:
            continue
        dipped = [s for s in inside[full:] if 0 < s[5] < level["concurrency"]]
        spells = sum(1 for prev, cur in zip(inside[full:], inside[full + 1:])
                     if prev[5] >= level["concurrency"] and 0 < cur[5] < level["concurrency"])
        woke = sum(1 for s in dipped if s[1] in ("trees", "fed"))
        rows.append(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {spells:>6} "
                    f"{len(dipped):>6} {100 * sum(s[3] for s in dipped) / total_ms:>6.1f} {woke:>13}")
    if rows:
        print("\nsteps judged at a lighter load than the level's, after its first at its own: spells, steps, % of the "
              f"level's step ms, and of them trees or fed\n{'mode':<7} {'conc':>5} {'round':>5} {'spells':>6} "
              f"{'steps':>6} {'ms %':>6} {'trees or fed':>13}")
        print("\n".join(rows))


def print_level_phases(levels: list[dict], steps: list[tuple]) -> None:
    """Per level, the mean gateway phases of its tree steps (where the lines carry them): whether one mode's
    tree steps cost more than another's at the same load, and in which phase."""
    rows = []
    for level in levels:
        trees = [s[4] for s in steps if level["started_at"] <= s[0] <= level["ended_at"] and s[1] == "trees" and s[4]]
        if trees:
            rows.append(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {len(trees):>6} "
                        f"{phase_means(trees)}")
    if rows:
        print(f"\ntree steps' phases, mean ms\n{'mode':<7} {'conc':>5} {'round':>5} {'steps':>6} {PHASE_HEAD}")
        print("\n".join(rows))


def print_rounds_after_prompts(levels: list[dict], steps: list[tuple]) -> None:
    """Per level, the tree rounds right after a step that carried a prompt chunk beside the other tree rounds:
    how many, their mean draft phase and their mean ms (where the lines carry phases). The round after a
    joining prompt is where the draft takes that prompt in; what it costs beyond the other rounds is the
    joins' price beside the prompt steps' own."""
    rows = []
    for level in levels:
        inside = [s for s in steps if level["started_at"] <= s[0] <= level["ended_at"]]
        after, other = [], []
        for prev, cur in zip(inside, inside[1:]):
            if cur[1] == "trees" and cur[4]:
                (after if prev[1] == "prompt" else other).append(cur)
        if after or other:
            cells = []
            for group in (after, other):
                draft = sum(s[4][1] for s in group) / len(group) if group else float("nan")
                ms = sum(s[3] for s in group) / len(group) if group else float("nan")
                cells.append(f"{len(group):>6} {draft:>8.2f} {ms:>8.2f}")
            rows.append(f"{level['mode']:<7} {level['concurrency']:>5} {level.get('round', 1):>5} {'  '.join(cells)}")
    if rows:
        group_head = f"{'draft':>8} {'ms':>8}"
        print("\ntree rounds right after a step with a prompt chunk, and the others: count, mean draft phase ms, "
              f"mean ms\n{'mode':<7} {'conc':>5} {'round':>5} {'after':>6} {group_head}  {'others':>6} {group_head}")
        print("\n".join(rows))


if __name__ == "__main__":
    raise SystemExit(main())
