"""Acceptance length of a draft on held-out prompts, with tandem's own target and draft engines.

For each prompt, tandem's target decodes a greedy continuation (and gives the
features of every committed token). Speculative decoding is then replayed
over it exactly as greedy serving does it: the draft engine holds the
committed tokens and their features, grows a tree below the pending token,
and greedy verification accepts the deepest path whose tokens equal the
target's argmax (the continuation); the pending token plus the accepted
tokens are committed, the next continuation token becomes the new pending
one. Acceptance length = accepted draft tokens + 1 (the target's own token),
averaged over verify steps, as SGLang reports it. All prompts run together,
one draft call per round.

    python demo/eval_acceptance.py --target demo/target --draft demo/draft \\
        [--prompts demo/heldout_prompts.jsonl] [--max-new-tokens 128] [--trees 5/4/8,3/1/4] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from tandem.layers import DTYPES
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

DEMO = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Continuation:
    tokens: list[int]  # prompt + greedy continuation
    features: torch.Tensor  # [len(tokens) - 1, feature width]: every token but the last
    prompt_len: int


def greedy_continuations(engine: TargetEngine, prompts: list[list[int]], new_tokens: int,
                         feature_layers: tuple[int, ...]) -> list[Continuation]:
    """Batched greedy decoding of every prompt, one token per step, collecting features."""
    ids = [f"p{i}" for i in range(len(prompts))]
    res = engine.step([SequenceStep.chain(r, p, create=True, return_features=True) for r, p in zip(ids, prompts)],
                      feature_layers)
    toks = [list(p) + r.tokens for p, r in zip(prompts, res)]
    feats = [[r.features] for r in res]
    for _ in range(new_tokens - 1):
        res = engine.step([SequenceStep.chain(r, [t[-1]], return_features=True) for r, t in zip(ids, toks)],
                          feature_layers)
        for t, f, r in zip(toks, feats, res):
            t.extend(r.tokens)
            f.append(r.features)
    engine.release(ids)
    return [Continuation(t, torch.cat(f), len(p)) for t, f, p in zip(toks, feats, prompts)]


def accepted_below(tree, tokens: list[int], committed: int) -> int:
    """Drafted tokens greedy verification accepts below the pending token tokens[committed]: walking down,
    the child whose token is the continuation's next, as deep as one is."""
    accepted, node = 0, -1
    while True:
        at = committed + 1 + accepted
        want = tokens[at] if at < len(tokens) else None
        child = next((i for i, (t, p) in enumerate(zip(tree.tokens, tree.parents)) if p == node and t == want), None)
        if child is None:
            return accepted
        node, accepted = child, accepted + 1


def replay(draft: DraftEngine, seqs: list[Continuation], budget: DraftBudget) -> dict:
    """Greedy speculative decoding over known continuations; returns acceptance statistics."""
    ids = [f"s{i}" for i in range(len(seqs))]
    committed = {r: s.prompt_len for r, s in zip(ids, seqs)}  # the pending token is tokens[committed]
    ingest = {r: IngestItem(r, 0, tuple(s.tokens[:s.prompt_len + 1]), s.features[:s.prompt_len])
              for r, s in zip(ids, seqs)}
    lengths: list[int] = []
    by_depth = [0] * (budget.steps + 1)
    while ingest:
        active = list(ingest)
        trees = draft.draft([DraftItem(r, budget, num_tokens=committed[r] + 1) for r in active],
                            ingest=list(ingest.values()))
        ingest = {}
        for r, tree in zip(active, trees):
            s, c = seqs[ids.index(r)], committed[r]
            accepted = accepted_below(tree, s.tokens, c)
            lengths.append(accepted + 1)
            by_depth[accepted] += 1
            new_c = c + 1 + accepted
            if new_c + 1 + budget.steps < len(s.tokens):  # room for a full-depth check next round
                committed[r] = new_c
                ingest[r] = IngestItem(r, c, tuple(s.tokens[c:new_c + 1]), s.features[c:new_c])
    draft.release(ids)
    return {"mean_acceptance_length": sum(lengths) / max(1, len(lengths)), "verify_steps": len(lengths),
            "accepted_histogram": by_depth}


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=DEMO / "target")
    ap.add_argument("--draft", type=Path, default=DEMO / "draft")
    ap.add_argument("--prompts", type=Path, default=DEMO / "heldout_prompts.jsonl")
    ap.add_argument("--limit", type=int, help="use the first N prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--trees", default="5/4/8,3/1/4,7/1/8",
                    help="comma-separated steps/topk/num_draft_tokens budgets")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)

    t0 = time.time()
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    tok = AutoTokenizer.from_pretrained(args.target)
    rows = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [tok(r["prompt"], add_special_tokens=False)["input_ids"] for r in rows[:args.limit]]
    target = LlamaModel(args.target, dtype=dtype, device=device)
    model = Eagle3Draft(args.draft, args.target, dtype=dtype, device=device)
    max_len = max(map(len, prompts)) + args.max_new_tokens + 16
    blocks = len(prompts) * (max_len // 16 + 2)
    engine = TargetEngine(target, num_blocks=blocks, block_size=16)
    seqs = greedy_continuations(engine, prompts, args.max_new_tokens, model.cfg.feature_layers)
    t1 = time.time()
    results = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "device": str(device),
               "dtype": args.dtype, "trees": {}}
    print(f"{len(prompts)} held-out prompts, {args.max_new_tokens} greedy tokens each ({t1 - t0:.1f} s)")
    print(f"{'steps/topk/tokens':>18} {'accept len':>10} {'verify steps':>12}  accepted-draft-tokens histogram")
    for spec in args.trees.split(","):
        steps, topk, n = (int(x) for x in spec.split("/"))
        draft = DraftEngine(model, num_blocks=blocks, block_size=16)
        r = replay(draft, seqs, DraftBudget(steps=steps, topk=topk, num_draft_tokens=n))
        results["trees"][spec] = r
        print(f"{spec:>18} {r['mean_acceptance_length']:>10.3f} {r['verify_steps']:>12}  {r['accepted_histogram']}")
    print(f"({time.time() - t1:.1f} s)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
