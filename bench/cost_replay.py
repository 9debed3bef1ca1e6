"""What the `auto` cost model predicted for each tree option, replayed from a gateway's DEBUG log.

    python bench/cost_replay.py GATEWAY_LOG[.gz] [--levels BENCH_JSON] [--options "5,4,8;5,1,6"]
                                [--outlier-step X] [--accepted A] [--plain]

The gateway logs its start-up profile (`cost model: CostModel(...)`), each plan's trees (`step N: ...
trees [...]`) and each step's wall time (`step N+1 done: ...`). This replays the steps through
gateway.cost_model.CostModel.observe as the gateway's _record does, and prints, at the start of each `auto`
level of the `tandem bench` run whose bench.json --levels names (or once, at the log's end), the round
each option was priced at with every one of the level's requests drafting it; beside it, the mean round
that option x that many requests measured over the whole log (steps whose plan gave every request that
option: `always` levels measure the configured tree). A price far above what the option measures is an
option `auto` will not draft, and so will not measure again.

An approximation: the log does not say which rounds captured a draft graph or waited on a joining prompt's
ingest, which the gateway leaves out of the cost model; the replay counts them. --outlier-step replays with
another gateway.cost_model.OUTLIER_STEP (100: as before it existed).

--plain prints, per batch bucket, what a plain step was priced at as each grant began, learned a step at a time (as
the gateway learned it until 5e6f445) and learned a grant at a time (its steps' mean, as GatewayCore._learn_grant
does since 5e6f445), beside what the plain steps took on average. A grant's first step carries the plan's round
trip: learned a step at a time, the ratio a plan reads has just taken in the cheap ones.

--accepted A: each row also gives the configured tree's goodput with every request drafting it, as
gateway.policy.search_budgets predicts it (the audit's 'cfg pred') from the replayed model and a book in
which every configured tree accepted A drafted tokens, for requests with no figures of their own (a
dormant request's): set beside the audit's prediction, it says whether the live figure's excess is in
the model or in the tokens expected.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.step_log import PLAN, STAMP, STEP, read_log  # noqa: E402
from draft_service.types import DraftBudget  # noqa: E402
from gateway import cost_model  # noqa: E402
from gateway.acceptance import AcceptanceBook  # noqa: E402
from gateway.cost_model import CostModel  # noqa: E402
from gateway.policy import Candidate, PolicyConfig, search_budgets  # noqa: E402

PROFILE = re.compile(r"cost model: (CostModel\(.*\))\s*$")


def parse_budget(text: str) -> DraftBudget:
    steps, topk, tokens = (int(part) for part in re.split(r"[,/]", text.strip().strip("'")))
    return DraftBudget(steps, topk, tokens)


def name(budget: DraftBudget) -> str:
    return f"{budget.steps}/{budget.topk}/{budget.num_draft_tokens}"


def load_profile(text: str) -> CostModel:
    """The CostModel of a `cost model: CostModel(...)` log line (its repr: numbers, dicts of tuples, DraftBudget)."""
    return eval(text, {"__builtins__": {}}, {"CostModel": CostModel, "DraftBudget": DraftBudget})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--levels", type=Path, metavar="BENCH_JSON", help="price the options at each auto level's start")
    ap.add_argument("--options", default=None,
                    help='"steps,topk,tokens;..." (default: the auto options of the default PolicyConfig)')
    ap.add_argument("--outlier-step", type=float, default=None, help="replay with this OUTLIER_STEP")
    ap.add_argument("--accepted", type=float, default=None, metavar="A",
                    help="also the configured tree's predicted tok/s, every tree accepting A drafted tokens")
    ap.add_argument("--plain", action="store_true",
                    help="also what a plain step was priced at as each grant began, learned per grant and step by step")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        ap.error(f"no such log: {args.log}")
    if args.accepted is not None and args.accepted < 0:
        ap.error(f"--accepted must be at least 0, got {args.accepted}")
    options = ([parse_budget(o) for o in args.options.split(";")] if args.options
               else list(PolicyConfig().auto_options()))
    if args.outlier_step is not None:
        cost_model.OUTLIER_STEP = args.outlier_step
    starts: list[tuple[float, int, int]] = []  # (epoch seconds, concurrency, round) of each auto level
    if args.levels:
        try:
            results = json.loads(args.levels.read_text())["results"]
        except (OSError, ValueError, KeyError) as e:
            print(f"cannot read the levels of {args.levels}: {e}", file=sys.stderr)
            return 1
        starts = sorted((r["started_at"], r["concurrency"], r.get("round", 1)) for r in results
                        if r.get("mode") == "auto" and r.get("started_at") is not None)
    text = read_log(args.log)

    costs: CostModel | None = None
    per_grant: CostModel | None = None  # --plain: plain steps learned a grant at a time (their mean)
    grant: dict[int, list[float]] = {}  # the grant under way: sequences -> its steps' seconds
    plain: dict[int, list[float]] = {}  # --plain: batch bucket -> [grants, priced stepwise, per grant, steps, s]
    planned: dict[int, list[DraftBudget]] = {}  # step number of the `done` line -> its plan's trees
    measured: dict[tuple[DraftBudget, int], list[float]] = {}  # (option, requests) -> [rounds, ms]
    printed: list[tuple[int, str, list[float], float | None]] = []  # (requests, round or "end", prices, cfg rate)
    for line in text.splitlines():
        stamp = STAMP.match(line)
        if stamp and starts and costs is not None:
            when = datetime.strptime(stamp.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            while starts and when >= starts[0][0]:
                _, conc, round_ = starts.pop(0)
                printed.append((conc, str(round_), price(costs, options, conc), configured(costs, conc, args.accepted)))
        if costs is None:
            if m := PROFILE.search(line):
                costs, per_grant = load_profile(m.group(1)), load_profile(m.group(1))
            continue
        if m := PLAN.search(line):
            planned[int(m.group(1)) + 1] = [parse_budget(b) for b in m.group(2).split(",") if b.strip()]
            continue
        if not (m := STEP.search(line)):
            continue
        row = m.groups()
        seqs, trees, granted, fed, decode, ms = int(row[2]), int(row[3]), int(row[4]), row[5], row[6], float(row[8])
        budgets = planned.get(int(row[1]), []) if trees else []
        if granted <= 1:  # a new plan's step: the grant before it ended
            learn_grant(per_grant, grant)
        if decode == "True" and (trees or fed == "False"):  # GatewayCore._record's arm steps, as far as a log says
            if not trees:
                figures = plain.setdefault(cost_model.batch_bucket(seqs), [0, 0.0, 0.0, 0, 0.0])
                if granted == 1:  # priced as the grant's plan was, before its steps are learned
                    figures[0] += 1
                    figures[1] += costs.step_time(seqs, seqs, [])
                    figures[2] += per_grant.step_time(seqs, seqs, [])
                figures[3] += 1
                figures[4] += ms / 1000
                if granted:
                    grant.setdefault(seqs, []).append(ms / 1000)
                else:
                    per_grant.observe(seqs, seqs, [], ms / 1000)
            costs.observe(seqs, seqs, budgets, ms / 1000)
        if trees and len(budgets) == seqs and len(set(budgets)) == 1:
            total = measured.setdefault((budgets[0], seqs), [0, 0.0])
            total[0] += 1
            total[1] += ms
    if costs is None:
        print("no `cost model:` line in the log (was the gateway at INFO or DEBUG?)", file=sys.stderr)
        return 1
    head = " ".join(f"{name(o) + ' pred':>14} {'meas':>6}" for o in options)
    print(f"{'conc':>5} {'round':>5} {head}" + (f" {'cfg tok/s':>10}" if args.accepted is not None else ""))
    if not args.levels:  # the log's end: every batch size an option was measured at
        printed = [(seqs, "end", price(costs, options, seqs), configured(costs, seqs, args.accepted))
                   for seqs in sorted({s for _, s in measured})]
    for conc, label, prices, rate in printed:
        print_row(options, measured, conc, label, prices, rate)
    if args.plain:
        print_plain(plain)
    return 0


def learn_grant(costs: CostModel, grant: dict[int, list[float]]) -> None:
    """A grant's plain steps learned as one measurement per batch size: their mean."""
    for seqs, seconds in grant.items():
        costs.observe(seqs, seqs, [], sum(seconds) / len(seconds))
    grant.clear()


def print_plain(plain: dict[int, list[float]]) -> None:
    print("\nplain steps by batch bucket: the mean price of a step as each grant began, learned a step at a time "
          "and a grant at a time (as served), beside the plain steps' mean (ms)")
    print(f"{'seqs':>7} {'grants':>7} {'stepwise':>10} {'per grant':>10} {'steps':>7} {'mean':>8}")
    for bucket, (grants, stepwise, per_grant, steps, seconds) in sorted(plain.items()):
        if grants:
            print(f"{cost_model.bucket_range(bucket):>7} {grants:>7} {1e3 * stepwise / grants:>10.3f} "
                  f"{1e3 * per_grant / grants:>10.3f} {steps:>7} {1e3 * seconds / steps:>8.3f}")


def price(costs: CostModel, options: list[DraftBudget], requests: int) -> list[float]:
    """Each option's predicted round in ms with every one of `requests` requests drafting it."""
    return [1000 * costs.step_time(requests * (1 + o.max_nodes), requests, [o] * requests) for o in options]


def configured(costs: CostModel, requests: int, accepted: float | None) -> float | None:
    """The configured tree's tok/s for `requests` requests with no figures of their own, each drafting it, as
    search_budgets predicts it from this model and a book whose configured trees each accepted `accepted`."""
    if accepted is None:
        return None
    cfg = PolicyConfig("auto")
    book = AcceptanceBook()
    for _ in range(500):  # the book's decayed count is then at its ceiling, as after a serve's first few hundred trees
        book.record(cfg.fixed_budget, accepted)
    cands = [Candidate(f"r{i}", dict.fromkeys(cfg.explored_options()), "auto") for i in range(requests)]
    return search_budgets(cfg, costs, book, cands, 0, 0).rates.configured


def print_row(options: list[DraftBudget], measured: dict, requests: int, label: str, prices: list[float],
              rate: float | None = None) -> None:
    cells = []
    for option, predicted in zip(options, prices):
        rounds, ms = measured.get((option, requests), (0, 0.0))
        cells.append(f"{predicted:>14.1f} {ms / rounds if rounds else float('nan'):>6.1f}")
    print(f"{requests:>5} {label:>5} {' '.join(cells)}" + (f" {rate:>10.1f}" if rate is not None else ""))


if __name__ == "__main__":
    raise SystemExit(main())
