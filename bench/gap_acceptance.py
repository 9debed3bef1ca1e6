"""What a draft's catch-up over positions without the target's features costs in acceptance and in forwards.

    python bench/gap_acceptance.py [--limit 32] [--max-new-tokens 128] [--gaps 1,2,4,7] [--long-gaps 8,2]

A request that decoded plainly for a while (auto's dormancy, or a probe of plain decoding) has sent its draft
tokens without features. Its draft computes those positions from its own states: exactly, one forward per
position (each takes the draft's h of the position before), or, from draft_service.engine.LONG_GAP positions
on, in one forward with every position of the run taking the h from before the run. On the bundled demo pair
(tandem's own target and draft engines, held-out prompts, greedy continuations, as demo/eval_acceptance.py),
each request drafts a tree (--tree) every round; every --every rounds its next g committed positions reach the
draft as tokens only. Printed per (LONG_GAP, g): the mean acceptance length of the --after rounds that follow each
gap, over all rounds, and the draft forwards the gaps' catch-ups took. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python3 bench/gap_acceptance.py`

import draft_service.engine as draft_engine  # noqa: E402
from demo.eval_acceptance import Continuation, accepted_below, greedy_continuations  # noqa: E402
from draft_service.engine import DraftEngine  # noqa: E402
from draft_service.model import Eagle3Draft  # noqa: E402
from draft_service.types import DraftBudget, DraftItem, IngestItem  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.model import LlamaModel  # noqa: E402

DEMO = REPO / "demo"


def replay_with_gaps(draft: DraftEngine, seqs: list[Continuation], budget: DraftBudget, gap: int, every: int,
                     after: int) -> dict:
    """demo/eval_acceptance.replay, but every `every` rounds a request's next `gap` positions go to the draft
    without features (as tokens committed by plain steps); returns the acceptance after gaps and overall."""
    ids = [f"s{i}" for i in range(len(seqs))]
    committed = {r: s.prompt_len for r, s in zip(ids, seqs)}
    ingest = {r: [IngestItem(r, 0, tuple(s.tokens[:s.prompt_len + 1]), s.features[:s.prompt_len])]
              for r, s in zip(ids, seqs)}
    rounds = dict.fromkeys(ids, 0)
    since_gap = dict.fromkeys(ids, after)  # rounds since the last gap (after: none pending)
    all_lengths, after_gap = [], []
    while ingest:
        active = list(ingest)
        # A call takes one item per request: a gap's tokens go in the draft call, behind the verify's item.
        gapped = [r for r in active if len(ingest[r]) > 1]
        if gapped:
            draft.ingest([ingest[r][0] for r in gapped])
        trees = draft.draft([DraftItem(r, budget, num_tokens=committed[r] + 1) for r in active],
                            ingest=[ingest[r][-1] for r in active])
        ingest = {}
        for r, tree in zip(active, trees):
            s, c = seqs[ids.index(r)], committed[r]
            accepted = accepted_below(tree, s.tokens, c)
            all_lengths.append(accepted + 1)
            if since_gap[r] < after:
                after_gap.append(accepted + 1)
            since_gap[r] += 1
            rounds[r] += 1
            new_c = c + 1 + accepted
            items = [IngestItem(r, c, tuple(s.tokens[c:new_c + 1]), s.features[c:new_c])]
            if rounds[r] % every == 0:  # plain steps: `gap` more positions, tokens only
                items.append(IngestItem(r, new_c, tuple(s.tokens[new_c:new_c + gap + 1]), None))
                new_c += gap
                since_gap[r] = 0
            if new_c + 1 + budget.steps < len(s.tokens):
                committed[r] = new_c
                ingest[r] = items
    draft.release(ids)
    mean = sum(all_lengths) / max(1, len(all_lengths))
    return {"after_gap": sum(after_gap) / max(1, len(after_gap)), "after_gap_rounds": len(after_gap),
            "overall": mean, "rounds": len(all_lengths)}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=32, help="the first N held-out prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gaps", default="1,2,4,7", help="positions without features per gap")
    ap.add_argument("--long-gaps", default="8,2", help="LONG_GAP settings to compare (8: today's)")
    ap.add_argument("--exact-tails", default="0", help="EXACT_TAIL settings to compare with each LONG_GAP")
    ap.add_argument("--tree", default="5/4/8")
    ap.add_argument("--every", type=int, default=6, help="rounds between gaps")
    ap.add_argument("--after", type=int, default=3, help="rounds after a gap whose acceptance is counted")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    prompts = [tok(row["prompt"], add_special_tokens=False)["input_ids"] for row in rows[:args.limit]]
    model = Eagle3Draft(DEMO / "draft", DEMO / "target")
    blocks = len(prompts) * ((max(map(len, prompts)) + args.max_new_tokens + 16) // 16 + 2)
    seqs = greedy_continuations(TargetEngine(LlamaModel(DEMO / "target"), num_blocks=blocks, block_size=16), prompts,
                                args.max_new_tokens, model.cfg.feature_layers)
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} greedy tokens each, float32, CPU "
          f"({time.time() - t0:.1f} s); tree {args.tree}, a gap every {args.every} rounds, the {args.after} rounds "
          "after each counted", flush=True)
    forward = model.forward
    forwards = [0]

    def counted(*a, **kw):
        forwards[0] += 1
        return forward(*a, **kw)

    model.forward = counted
    steps, topk, tokens = (int(x) for x in args.tree.split("/"))
    budget = DraftBudget(steps=steps, topk=topk, num_draft_tokens=tokens)
    print(f"{'LONG_GAP':>8} {'tail':>4} {'gap':>4} {'after gap':>9} {'rounds':>6} {'overall':>8} {'forwards':>8}")
    results = []
    today = draft_engine.LONG_GAP, draft_engine.EXACT_TAIL
    try:
        for gap in (int(g) for g in args.gaps.split(",")):
            for long_gap, tail in itertools.product((int(x) for x in args.long_gaps.split(",")),
                                                    [int(x) for x in args.exact_tails.split(",")]):
                draft_engine.LONG_GAP, draft_engine.EXACT_TAIL = long_gap, tail
                forwards[0] = 0
                stats = replay_with_gaps(DraftEngine(model, num_blocks=blocks, block_size=16), seqs, budget, gap,
                                         args.every, args.after)
                row = {"long_gap": long_gap, "exact_tail": tail, "gap": gap, **stats, "forwards": forwards[0]}
                results.append(row)
                print(f"{long_gap:>8} {tail:>4} {gap:>4} {stats['after_gap']:>9.3f} {stats['after_gap_rounds']:>6} "
                      f"{stats['overall']:>8.3f} {forwards[0]:>8}", flush=True)
    finally:
        draft_engine.LONG_GAP, draft_engine.EXACT_TAIL = today
    if args.out:
        args.out.write_text(json.dumps({"tree": args.tree, "every": args.every, "after": args.after,
                                        "prompts": len(prompts), "rows": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
