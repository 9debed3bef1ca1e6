"""`auto`'s choice among its tree options alone, against simulated trees: what share of the best single option's
rate it delivers, for several option margins.

    python bench/option_sim.py [--requests 2,4,8] [--steps 1500] [--seeds 20] [--margins 0,0.05,0.15,0.3,1]
                               [--acceptance 0.8]

A model, not a measurement. The scale track's forced acceptance: a request's next token of the main path is
accepted with probability --acceptance, level after level, and nothing off the main path is, so a tree or
chain of depth d accepts min(L, d) of a draw L shared by every option at that step. Each option's step takes
the milliseconds STEP_MS gives at that many requests (the H100 scale track's measured uniform steps, 2026-12-06,
or the cost model's prediction where an option was not drafted alone), less for trees given to fewer requests
(half the step above a plain one is shared, half per tree). The policy's cost model is told those very costs,
so what is left to go wrong is what the figures make of the draws: search_budgets and choose_budgets as the
gateway calls them, with every verified tree recorded as GatewayCore._apply records it (the book, the request's
own figures, its levels, the chains read off the main path, own figures aged). Per requests and margin, over
--seeds runs of --steps steps: the mean and minimum of auto's tokens over seconds divided by the best option's
expected rate, and the share of steps that drafted each option.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cost_replay import name as label  # noqa: E402  (a budget as "5/4/8")
from draft_service.types import DraftBudget  # noqa: E402
from gateway.acceptance import AcceptanceBook, MainPath, chains_would_accept  # noqa: E402
from gateway.cost_model import CostModel  # noqa: E402
from gateway.policy import NO_SPEC, Candidate, PolicyConfig, choose_budgets, search_budgets  # noqa: E402
from gateway.request import AcceptanceStats  # noqa: E402

# Milliseconds of a step with every request's tree of one option, and of a plain step, by requests: the H100 scale
# track (0.8, bench/results/gpu_2026-12-06_session53/call1_scale_0.8, auto_scale_0.8_prices.log: measured where an
# option was drafted alone at that load, else the cost model's mean prediction; plain: the audit's `never` steps).
STEP_MS: dict[int, dict[str, float]] = {
    1: {"plain": 6.4, "3/1/4": 11.5, "5/4/8": 11.7, "6/8/16": 12.9, "5/1/6": 12.1, "10/1/11": 13.7},
    2: {"plain": 6.5, "3/1/4": 11.2, "5/4/8": 12.9, "6/8/16": 14.1, "5/1/6": 13.0, "10/1/11": 16.6},
    4: {"plain": 6.5, "3/1/4": 11.8, "5/4/8": 13.2, "6/8/16": 14.9, "5/1/6": 13.6, "10/1/11": 15.7},
    8: {"plain": 6.6, "3/1/4": 13.6, "5/4/8": 15.1, "6/8/16": 17.2, "5/1/6": 14.5, "10/1/11": 18.7},
    16: {"plain": 6.8, "3/1/4": 18.7, "5/4/8": 18.2, "6/8/16": 24.0, "5/1/6": 17.9, "10/1/11": 22.6},
}


class TableCosts(CostModel):
    """A cost model that prices a step exactly as the simulation charges it (see step_seconds)."""

    def __init__(self, table: dict[str, float], seqs: int):
        super().__init__()
        self.table, self.seqs = table, seqs

    def step_time(self, tokens: int, seqs: int, budgets: list[DraftBudget]) -> float:
        live = [b for b in budgets if not b.empty]
        if not live:
            return self.table["plain"] / 1e3
        return step_seconds(self.table, live[0], len(live), self.seqs)

    def tree_step_line(self, seqs: int, levels: int, option: DraftBudget | None = None) -> tuple[float, float, float]:
        # search_budgets prices k trees as base + per_expansion * k * steps * topk (per_token 0: tokens are in it)
        assert option is not None
        whole = self.table[label(option)] / 1e3 - self.table["plain"] / 1e3
        per_tree = 0.5 * whole / self.seqs
        return self.table["plain"] / 1e3 + 0.5 * whole, 0.0, per_tree / (option.steps * option.topk)


def step_seconds(table: dict[str, float], option: DraftBudget, trees: int, seqs: int) -> float:
    """A step with `trees` trees of `option` among `seqs` sequences: half the tree step's extra is shared."""
    whole = table[label(option)] / 1e3 - table["plain"] / 1e3
    return table["plain"] / 1e3 + whole * (0.5 + 0.5 * trees / seqs)


def draw(rng: random.Random, acceptance: float, most: int) -> int:
    """How many main-path tokens in a row a draft gets right, at most `most`."""
    run = 0
    while run < most and rng.random() < acceptance:
        run += 1
    return run


def expected_rate(table: dict[str, float], option: DraftBudget, acceptance: float, spread: float = 0.0) -> float:
    """An option's expected committed tokens a sequence a second, every request drafting it (with `spread`: over
    requests of equal length whose acceptance is uniform within acceptance +- spread, clipped as simulate clips it,
    so the harmonic mean of their rates)."""
    rates = [(1 + sum(a ** k for k in range(1, option.steps + 1))) / (table[label(option)] / 1e3)
             for a in acceptance_grid(acceptance, spread)]
    return len(rates) / sum(1 / rate for rate in rates)


def acceptance_grid(acceptance: float, spread: float) -> list[float]:
    """Requests' acceptances, uniform within acceptance +- spread and clipped as simulate clips them."""
    if not spread:
        return [acceptance]
    return [min(0.99, max(0.01, acceptance + spread * (2 * (k + 0.5) / 100 - 1))) for k in range(100)]


def oracle_rate(table: dict[str, float], options: tuple[DraftBudget, ...], acceptance: float, spread: float) -> float:
    """At one request: tokens a second were each request given the best of plain decoding and every option for its
    own acceptance (requests of equal length: the harmonic mean of their best rates)."""
    best = [max([1e3 / table["plain"], *(expected_rate(table, o, a) for o in options)])
            for a in acceptance_grid(acceptance, spread)]
    return len(best) / sum(1 / rate for rate in best)


def simulate(cfg: PolicyConfig, seqs: int, steps: int, acceptance: float, seed: int, *, own_weight: float | None = 2.0,
             request_tokens: int = 0, spread: float = 0.0) -> tuple[float, dict[str, int]]:
    """auto's committed tokens over seconds for `steps` steps of `seqs` requests, and the steps by option drafted.
    own_weight: AcceptanceBook.own_weight (None: estimated from the spread of ended requests, which needs
    request_tokens). request_tokens: a request ends once it has committed this many tokens and a new one takes
    its slot, with no figures of its own (0: requests never end). spread: each request's acceptance is drawn
    uniformly within `acceptance` +- spread (0: every request's is `acceptance`).
    The draws are common to every policy on one seed, as the scale track's forcing makes them: a request's
    acceptance is drawn from the seed and the request's serial, a tree's accepted run from those and the
    request's position (its committed tokens), so two policies compared on a seed differ by their choices alone."""
    table = STEP_MS[seqs]
    costs = TableCosts(table, seqs)
    book = AcceptanceBook(own_weight=AcceptanceBook.own_weight if own_weight is None else own_weight,
                          own_weight_from_spread=own_weight is None)

    def own_acceptance(serial: int) -> float:
        share = random.Random(f"{seed}/{serial}").random()
        return min(0.99, max(0.01, acceptance + spread * (2 * share - 1)))

    serials = list(range(seqs))  # each slot's request, numbered as they start
    owns = [AcceptanceStats() for _ in range(seqs)]
    rates = [own_acceptance(serial) for serial in serials]
    made = [0] * seqs  # tokens each slot's request has committed

    def end_requests() -> None:
        """After a step, plain or not: each request past request_tokens ends and a fresh one takes its slot."""
        for i in range(seqs):
            if request_tokens and made[i] >= request_tokens:
                book.request_ended(owns[i].raw, tuple(owns[i].first_level))
                serials[i] = max(serials) + 1
                owns[i], rates[i], made[i] = AcceptanceStats(), own_acceptance(serials[i]), 0
    explored = cfg.explored_options()
    committed, seconds, drafted = 0, 0.0, {}
    for _ in range(steps):
        cands = [Candidate(f"r{i}", {o: own.mean(o) for o in explored}, "auto", levels=own.levels)
                 for i, own in enumerate(owns)]
        search = search_budgets(cfg, costs, book, cands, 0, 0)
        budgets = choose_budgets(cfg, costs, book, cands, 0, 0, search=search)
        live = [(i, budgets.get(f"r{i}", NO_SPEC)) for i in range(seqs)]
        trees = [(i, b) for i, b in live if not b.empty]
        if not trees:
            seconds += table["plain"] / 1e3
            committed += seqs
            made = [n + 1 for n in made]
            for own in owns:
                own.fade(0.85)
            drafted["plain"] = drafted.get("plain", 0) + 1
            end_requests()
            continue
        options = {label(b) for _, b in trees}
        name = options.pop() if len(options) == 1 else "mixed"
        drafted[name] = drafted.get(name, 0) + 1
        option = max((b for _, b in trees), key=lambda b: table[label(b)])
        seconds += step_seconds(table, option, len(trees), seqs)
        committed += seqs - len(trees)
        made = [n + 1 for n in made]
        for i, budget in trees:
            rng = random.Random(f"{seed}/{serials[i]}/{made[i]}")
            run = draw(rng, rates[i], max(o.steps for o in cfg.auto_options()))
            accepted = min(run, budget.steps)
            committed += 1 + accepted
            made[i] += accepted
            path = MainPath(budget.steps, accepted)
            own = owns[i]
            book.record(budget, accepted)
            book.levels.record(path)
            chains = chains_would_accept(path, explored, budget)
            for chain, chain_accepted in chains:
                book.record(chain, chain_accepted)
            own.record(budget, accepted)
            own.record_path(path)
            for chain, chain_accepted in chains:
                own.record(chain, chain_accepted)
            own.age([budget, *(chain for chain, _ in chains)])
        end_requests()
    return committed / seconds, drafted


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="2,4,8")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--margins", default="0,0.05,0.15,0.3,1")
    ap.add_argument("--acceptance", type=float, default=0.8)
    ap.add_argument("--own-weights", default="2",
                    help="AcceptanceBook.own_weight values to compare, separated by commas; auto: estimated from the "
                         "spread of ended requests (needs --request-tokens; default 2)")
    ap.add_argument("--request-tokens", type=int, default=0,
                    help="a request ends after this many committed tokens and a fresh one takes its slot (0: never)")
    ap.add_argument("--spread", type=float, default=0.0,
                    help="each request's acceptance is uniform within --acceptance +- this (default 0: all alike)")
    args = ap.parse_args(argv)
    try:
        loads = [int(x) for x in args.requests.split(",")]
        margins = [float(x) for x in args.margins.split(",")]
        own_weights = [None if x == "auto" else float(x) for x in args.own_weights.split(",")]
    except ValueError:
        ap.error("--requests takes request counts, --margins shares and --own-weights weights, separated by commas")
    if unknown := [n for n in loads if n not in STEP_MS]:
        ap.error(f"no step costs for {unknown} requests (known: {sorted(STEP_MS)})")
    if not 0 < args.acceptance < 1 or args.steps < 1 or args.seeds < 1:
        ap.error("--acceptance must be in (0, 1), --steps and --seeds at least 1")
    if args.request_tokens < 0 or not 0 <= args.spread < 1 or any(w is not None and w < 0 for w in own_weights):
        ap.error("--request-tokens, --spread and --own-weights must be at least 0, --spread below 1")
    if any(not 0 <= m <= 1 for m in margins):
        ap.error("--margins must be in [0, 1] (PolicyConfig.option_margin)")
    base = PolicyConfig()
    for n in loads:
        table = STEP_MS[n]
        rates = {label(o): expected_rate(table, o, args.acceptance, args.spread) for o in base.auto_options()}
        best = max(rates, key=rates.get)
        oracle = oracle_rate(table, base.auto_options(), args.acceptance, args.spread) if n == 1 else None
        print(f"{n} requests: expected tok/s a sequence by option: "
              + ", ".join(f"{name} {rate:.0f}" for name, rate in rates.items()) + f" (best {best})"
              + ("" if oracle is None else f"; each request's best, plain included: {oracle:.0f}"))
        for margin, own_weight in itertools.product(margins, own_weights):
            cfg = replace(base, option_margin=margin)
            shares, drafted = [], {}
            for seed in range(args.seeds):
                rate, counts = simulate(cfg, n, args.steps, args.acceptance, seed, own_weight=own_weight,
                                        request_tokens=args.request_tokens, spread=args.spread)
                shares.append(rate / n / rates[best])
                for name, count in counts.items():
                    drafted[name] = drafted.get(name, 0) + count
            total = sum(drafted.values())
            mix = ", ".join(f"{name} {100 * count / total:.0f}%"
                            for name, count in sorted(drafted.items(), key=lambda item: -item[1]))
            mean = statistics.mean(shares)
            against_oracle = "" if oracle is None else f", / each request's best {mean * rates[best] / oracle:.3f}"
            weight = "auto" if own_weight is None else f"{own_weight:4.1f}"
            print(f"  margin {margin:4.2f}, own weight {weight}: auto / best option mean "
                  f"{mean:.3f}, min {min(shares):.3f}{against_oracle}; steps: {mix}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
