"""Where a speculative round's wall time goes, hop by hop, from the three processes' timelines.

    TANDEM_TIMELINE=DIR tandem serve ...    # every service writes DIR/timeline-<pid>.txt (tandem/timeline.py)
    python bench/round_timeline.py DIR [--json OUT]

The marks share one clock (CLOCK_MONOTONIC), so they merge into one timeline. A round starts
at each `gw.round`; a speculative round is one with a draft call and one verify step. Within
it each mark of the round's critical path is the first at or after the one before it, and the
table gives the median (p10, p90) of each gap over the speculative rounds, in microseconds:
the gateway's own work, each message's trip between processes, the services' work around
their engines, and the engines. Plain rounds (no draft call) are summarised by the gap
between consecutive step replies. Read it at one request: at more, rounds overlap nothing
but their marks still name the slowest member. A benchmark tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

# The critical path of a speculative round, in order, and what each gap is.
PATH = [
    ("gw.round", "gateway: apply reports, schedule, budgets, ingests queued"),
    ("gw.draft.submit", "gateway: the call handed to the replica's worker (none inline), packed"),
    ("gw.draft.send", "gateway -> draft: the call's message"),
    ("draft.recv", "draft: into the call (trace span, readiness)"),
    ("draft.features.start", "draft: take pushed features, parse items, take the lock"),
    ("draft.engine.start", "draft engine: catch-up and tree growth"),
    ("draft.engine.end", "draft: forcing, metrics' load, the reply built"),
    ("draft.reply", "draft -> gateway: the reply's message"),
    ("gw.draft.reply", "gateway: parse trees, back to the loop thread"),
    ("gw.draft.end", "gateway: build the verify step, pack it"),
    ("gw.step.send", "gateway -> target: the step's message"),
    ("target.recv", "target: parse, take the lock"),
    ("target.engine.start", "target engine: the verify step"),
    ("target.engine.end", "target: features split and kept, the reply built"),
    ("target.reply", "target -> gateway: the reply's message"),
    ("gw.step.reply", "gateway: the outcome back to the loop"),
    ("gw.execute.end", "gateway: update (commit, stream out, feed drafts)"),
    ("gw.update.end", "gateway: record (metrics, the policy's figures)"),
    ("gw.record.end", "gateway: until the next round starts"),
]
# Marks that timelines written before them lack: such a timeline's rounds are read without them.
ADDED_LATER = {"gw.update.end"}
# Marks off the critical path, each timed from an anchor on it.
ASIDE = [
    ("draft.reply", "draft.sent", "draft: until gRPC resumes the handler after its reply"),
    ("target.reply", "target.sent", "target: until gRPC resumes the handler after its reply"),
    ("target.sent", "target.pushed", "target: features pushed, metrics recorded"),
    # Inside the engines (marks of the thirty-eighth session): host work before the launch, the wait for the
    # GPU, and what follows it. The served engines took 0.5-0.9 ms more than bench/engine_step.py and
    # bench/draft_step.py time the same shapes alone; these say whether host or GPU.
    ("target.engine.start", "target.engine.launched", "target engine: validate, pack, inputs in, graph launched"),
    # The same span in three (the sixty-fifth session): served it took 0.5 ms at one request on the H100 against
    # about 0.2 ms in bench/engine_step.py --phases (1 x 8 nodes with features), and these say which part.
    ("target.engine.start", "target.engine.reserved", "target engine: validate, KV reserved"),
    ("target.engine.reserved", "target.engine.packed", "target engine: bucket chosen, inputs packed on the host"),
    ("target.engine.packed", "target.engine.launched", "target engine: inputs in, graphs launched"),
    ("target.recv", "target.parsed", "target: the call's items parsed"),
    ("gw.round", "gw.scheduled", "gateway: reports applied, the plan and its budgets made"),
    ("draft.features.start", "draft.parsed", "draft: pushed features taken, items parsed"),
    ("target.engine.launched", "target.engine.synced", "target engine: until the GPU's results are in"),
    ("target.engine.synced", "target.engine.end", "target engine: results read, KV lengths, features"),
    ("draft.engine.start", "draft.catchup.end", "draft engine: ingest, catch-up"),
    ("draft.catchup.end", "draft.grow.launched", "draft engine: growth loaded and launched"),
    ("draft.grow.launched", "draft.grow.read", "draft engine: until the GPU's trees are in, trees read"),
    ("draft.grow.read", "draft.engine.end", "draft engine: trees filled in"),
    ("target.sent", "draft.push.recv", "target's push -> draft's subscriber thread"),
    ("draft.push.recv", "draft.push.stored", "draft: the push stored"),
    # --catch-up-on-push (the sixty-first session): the draft computes the push's positions before the gateway's call
    # brings them; a round's catch-up that ends after the next round began is counted in neither.
    ("draft.push.stored", "draft.push.catch_up.start", "draft: the push's catch-up takes the engine's lock"),
    ("draft.push.catch_up.start", "draft.push.catch_up.end", "draft engine: the catch-up on the push"),
]


def read_marks(directory: Path) -> list[tuple[int, str]]:
    marks = []
    for path in sorted(directory.glob("timeline-*.txt")):
        for line in path.read_text().splitlines():
            ns, _, label = line.partition(" ")
            if label:
                marks.append((int(ns), label))
    marks.sort()
    return marks


def split_rounds(marks: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The marks from each gw.round up to the next (the last round, unfinished, is dropped)."""
    starts = [i for i, (_, label) in enumerate(marks) if label == "gw.round"]
    return [marks[a:b + 1] for a, b in zip(starts, starts[1:], strict=False)]


def first_after(round_marks: list[tuple[int, str]], label: str, at: int) -> int | None:
    for ns, found in round_marks:
        if found == label and ns >= at:
            return ns
    return None


def spec_round_gaps(round_marks: list[tuple[int, str]],
                    path: list[tuple[str, str]] = PATH) -> dict[str, float] | None:
    """Each critical gap (us) of a speculative round along `path`, or None if this round is not one."""
    labels = [label for _, label in round_marks]
    if labels.count("gw.draft.send") != 1 or labels.count("gw.step.send") != 1:
        return None
    times: dict[str, int] = {}
    at = round_marks[0][0]
    for label, _ in path:
        found = first_after(round_marks, label, at)
        if found is None:
            return None
        times[label] = at = found
    times["next"] = round_marks[-1][0]  # the next round's gw.round
    names = [label for label, _ in path] + ["next"]
    gaps = {label: (times[after] - times[label]) / 1e3 for label, after in zip(names, names[1:], strict=False)}
    for anchor, label, _ in ASIDE:  # in order: a later one may be anchored on an earlier one
        found = first_after(round_marks, label, times[anchor]) if anchor in times else None
        if found is not None:
            gaps[f"{anchor}->{label}"] = (found - times[anchor]) / 1e3
            times[label] = found
    gaps["round"] = (times["next"] - times["gw.round"]) / 1e3
    return gaps


def plain_step_gaps(round_marks: list[tuple[int, str]]) -> list[float]:
    """Gaps (us) between consecutive step replies of a round with no draft call (a grant)."""
    if any(label == "gw.draft.send" for _, label in round_marks):
        return []
    replies = [ns for ns, label in round_marks if label == "gw.step.reply"]
    return [(b - a) / 1e3 for a, b in zip(replies, replies[1:], strict=False)]


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), pick(0.1), pick(0.9)


def summarise(directory: Path) -> dict:
    marks = read_marks(directory)
    present = {label for _, label in marks}
    path = [(label, what) for label, what in PATH if label in present or label not in ADDED_LATER]
    if len(path) < len(PATH):  # an older timeline: its last gateway gap covers the missing mark's too
        path = [(label, "gateway: update and record" if label == "gw.execute.end" else what) for label, what in path]
    rounds = split_rounds(marks)
    spec = [gaps for r in rounds if (gaps := spec_round_gaps(r, path)) is not None]
    plain = [gap for r in rounds for gap in plain_step_gaps(r)]
    rows = []
    keys = [(label, what) for label, what in path] + [(f"{a}->{b}", what) for a, b, what in ASIDE]
    for key, what in keys + [("round", "the whole round")]:
        values = [gaps[key] for gaps in spec if key in gaps]
        if values:
            median, p10, p90 = quantiles(values)
            rows.append({"gap": key, "what": what, "median_us": median, "p10_us": p10, "p90_us": p90,
                         "rounds": len(values)})
    out = {"rounds": len(rounds), "spec_rounds": len(spec), "gaps": rows}
    if plain:
        median, p10, p90 = quantiles(plain)
        out["plain_step_us"] = {"median": median, "p10": p10, "p90": p90, "steps": len(plain)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("directory", type=Path, help="the TANDEM_TIMELINE directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = ap.parse_args(argv)
    if not args.directory.is_dir():
        print(f"{args.directory}: no such directory", file=sys.stderr)
        return 2
    summary = summarise(args.directory)
    print(f"{summary['spec_rounds']} speculative rounds of {summary['rounds']}; microseconds, median (p10, p90)")
    for row in summary["gaps"]:
        print(f"  {row['median_us']:9.1f} ({row['p10_us']:8.1f}, {row['p90_us']:8.1f})  {row['gap']:<34} {row['what']}")
    if "plain_step_us" in summary:
        plain = summary["plain_step_us"]
        print(f"plain steps in grants: {plain['median']:.1f} us between replies ({plain['p10']:.1f}, "
              f"{plain['p90']:.1f}), {plain['steps']} steps")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
