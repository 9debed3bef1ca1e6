"""The load gate alone, at one load, against simulated steps: what share of the better arm's rate it delivers.

    python bench/gate_sim.py [--seeds 300] [--first-bias 1.12] [--ratios 0.8,0.9,...] [--tree DIR]

A model, not a measurement: each step of plain decoding commits one token a sequence at PLAIN tok/s with
--plain-cv noise; each tree step commits --tokens-per-round a sequence at PLAIN x ratio tok/s with --trees-cv
noise, and the first --probe-steps tree steps read --first-bias higher (on the H200 scale track at 16
requests, 0.8, the first probes read trees 13% above plain where the level's decode steps tied). Under
trees, --incidental of the steps carry no tree (the cost model's choice) and are recorded as plain, as the
gateway records them. Per ratio of the trees' rate to plain's, over --seeds levels of --steps steps: the
mean, tenth percentile and minimum of tokens over seconds divided by the better arm's rate. --tree runs the
gate of another checkout (a `git worktree` or archive of an earlier commit) for a before/after.

--draws P,DEPTH draws each sequence's accepted tokens a tree step as the scale track forces them (accepted
level after level with probability P, at most DEPTH; the step's time is then --trees-cv noise alone, its
tokens the draws), and gives the gate the draws' mean as the step's expected tokens (LoadGate.record's
`expected`, where the gate takes it), times --book-bias: the acceptance book's figure, right or off.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import random
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def level(args: argparse.Namespace, gate_type: type, ratio: float, seed: int) -> float:
    """One level at one load; delivered tok/s over the better arm's."""
    rng = random.Random(seed)
    gate = gate_type()
    committed = seconds = 0.0
    tree_steps = 0
    for _ in range(args.steps):
        spec = gate.allow_spec(args.seqs)
        if spec and not gate.probing_spec(args.seqs) and rng.random() < args.incidental:
            spec = False
        expected = None
        if spec and args.draws:
            # The step takes what a step of the mean tokens takes at trees' rate; its tokens are drawn.
            tree_steps += 1
            mean = 1.0 + draw_mean(*args.draws)
            step = args.seqs * mean / (args.plain * ratio) * max(0.3, rng.gauss(1, args.trees_cv))
            tokens = sum(1 + draw(rng, *args.draws) for _ in range(args.seqs))
            expected = args.seqs * (1.0 + args.book_bias * (mean - 1.0))
        else:
            if spec:
                bias = args.first_bias if tree_steps < gate.probe_steps else 1.0
                tree_steps += 1
                rate = args.plain * ratio * bias * max(0.3, rng.gauss(1, args.trees_cv))
            else:
                rate = args.plain * max(0.3, rng.gauss(1, args.plain_cv))
            tokens = args.seqs * (args.tokens_per_round if spec else 1.0)
            step = tokens / rate
        gate.spend(args.seqs, int(tokens), step)
        told = {"expected": expected} if expected is not None and takes_expected(gate) else {}
        gate.record(args.seqs, spec, int(tokens), step, **told)
        committed += tokens
        seconds += step
    return committed / seconds / (args.plain * max(1.0, ratio))


def draw(rng: random.Random, acceptance: float, depth: int) -> int:
    """Drafted tokens accepted: level after level with probability `acceptance`, at most `depth`."""
    accepted = 0
    while accepted < depth and rng.random() < acceptance:
        accepted += 1
    return accepted


def draw_mean(acceptance: float, depth: int) -> float:
    return sum(acceptance ** k for k in range(1, depth + 1))


def takes_expected(gate) -> bool:
    """Whether this checkout's LoadGate.record takes a step's expected tokens."""
    return "expected" in inspect.signature(gate.record).parameters


def parse_draws(text: str) -> tuple[float, int]:
    try:
        acceptance, depth = text.split(",")
        out = float(acceptance), int(depth)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P,DEPTH (e.g. 0.6,5), got {text!r}") from None
    if not 0.0 <= out[0] <= 1.0 or out[1] < 1:
        raise argparse.ArgumentTypeError(f"P must be in [0, 1] and DEPTH at least 1, got {text!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=300, help="levels per ratio")
    ap.add_argument("--steps", type=int, default=600, help="arm steps a level")
    ap.add_argument("--seqs", type=int, default=16, help="sequences a step (the load)")
    ap.add_argument("--plain", type=float, default=3000.0, help="plain decoding's rate, tok/s")
    ap.add_argument("--plain-cv", type=float, default=0.03)
    ap.add_argument("--trees-cv", type=float, default=0.12)
    ap.add_argument("--tokens-per-round", type=float, default=3.6)
    ap.add_argument("--incidental", type=float, default=0.25)
    ap.add_argument("--first-bias", type=float, default=1.0)
    ap.add_argument("--ratios", default="0.8,0.9,0.95,1.0,1.05,1.1,1.2,1.4", help="trees' rate over plain's")
    ap.add_argument("--tree", type=Path, default=REPO, help="the checkout whose gate to run (default: this one)")
    ap.add_argument("--draws", type=parse_draws, default=None, metavar="P,DEPTH",
                    help="tree steps' tokens drawn as the scale track forces them (see above; e.g. 0.6,5)")
    ap.add_argument("--book-bias", type=float, default=1.0,
                    help="with --draws: the expected tokens given to the gate over the draws' mean (default 1)")
    args = ap.parse_args(argv)
    if args.seeds < 1 or args.steps < 1 or args.seqs < 1 or args.plain <= 0:
        raise SystemExit("error: --seeds, --steps and --seqs need positive integers, --plain a positive rate")
    # The gate has lived in gateway/load_gate.py since 2026-12-07, in gateway/policy.py before.
    module = next((name for name in ("load_gate", "policy") if (args.tree / "gateway" / f"{name}.py").exists()), None)
    if module is None:
        raise SystemExit(f"error: {args.tree} has no gateway/load_gate.py or gateway/policy.py")
    sys.path.insert(0, str(args.tree.resolve()))
    LoadGate = importlib.import_module(f"gateway.{module}").LoadGate  # noqa: N806 (a class, named as one)
    print(f"{'trees/plain':>11} {'mean':>6} {'p10':>6} {'min':>6}   delivered / the better arm's rate, "
          f"{args.seeds} levels each, first probe of trees x{args.first_bias}, gate of {args.tree}")
    for ratio in (float(r) for r in args.ratios.split(",")):
        runs = sorted(level(args, LoadGate, ratio, seed) for seed in range(args.seeds))
        print(f"{ratio:>11.2f} {statistics.mean(runs):>6.3f} {runs[len(runs) // 10]:>6.3f} {runs[0]:>6.3f}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
