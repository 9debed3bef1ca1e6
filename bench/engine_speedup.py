"""Single-request speedup of speculative over plain greedy decoding, in process.

    python bench/engine_speedup.py [--device cuda] [--prompts 8] [--max-new-tokens 128] [--tree 5/4/8]

Runs tandem's target and draft engines in one process (no gRPC, no gateway) on
the bundled demo pair: plain decode is one one-node step per token; speculative
decode is draft (ingesting the last step's tokens and features) then one verify
step per round. Prints tokens per second for each and checks that both produce
the same tokens. It isolates the engines' cost from the services' RPC cost.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from tandem.layers import DTYPES
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

DEMO = Path(__file__).resolve().parent.parent / "demo"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def plain(target: TargetEngine, prompt: list[int], n: int) -> list[int]:
    out = target.step([SequenceStep.chain("p", prompt, create=True)])[0].tokens
    while len(out) < n:
        out += target.step([SequenceStep.chain("p", [out[-1]])])[0].tokens
    target.release(["p"])
    return out[:n]


def speculative(target: TargetEngine, draft: DraftEngine, prompt: list[int], n: int, budget: DraftBudget,
                layers: tuple[int, ...]) -> tuple[list[int], int]:
    r = target.step([SequenceStep.chain("s", prompt, create=True, return_features=True)], layers)[0]
    out = list(r.tokens)
    ingest = IngestItem("s", 0, tuple(prompt + out), r.features)
    rounds = 0
    while len(out) < n:
        tree = draft.draft([DraftItem("s", budget)], ingest=[ingest])[0]
        tokens, parents, num_fixed = tree.verify_tree()
        start = len(prompt) + len(out) - 1  # position of the pending token
        r = target.step([SequenceStep("s", tuple(tokens), tuple(parents), num_fixed, return_features=True)],
                        layers)[0]
        out += r.tokens
        ingest = IngestItem("s", start, tuple((prompt + out)[start:]), r.features)
        rounds += 1
    target.release(["s"])
    draft.release(["s"])
    return out[:n], rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tree", default="5/4/8")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()]
    prompts = [tok.encode(r["prompt"]) for r in rows[: args.prompts]]
    dtype = DTYPES[args.dtype]
    target = TargetEngine(LlamaModel(DEMO / "target", dtype, args.device), num_blocks=512, block_size=16)
    draft = DraftEngine(Eagle3Draft(DEMO / "draft", DEMO / "target", dtype, args.device), num_blocks=512)
    layers = draft.info().feature_layers
    budget = DraftBudget(*map(int, args.tree.split("/")))
    plain(target, prompts[0], 8)  # warm-up (kernels compile on first use)
    speculative(target, draft, prompts[0], 8, budget, layers)
    t_plain = t_spec = 0.0
    rounds = tokens = 0
    same = True
    for p in prompts:
        sync(args.device)
        t0 = time.perf_counter()
        a = plain(target, p, args.max_new_tokens)
        sync(args.device)
        t1 = time.perf_counter()
        b, r = speculative(target, draft, p, args.max_new_tokens, budget, layers)
        sync(args.device)
        t_spec += time.perf_counter() - t1
        t_plain += t1 - t0
        rounds += r
        tokens += len(a)
        same &= a == b
    result = {"device": args.device, "dtype": args.dtype, "tree": args.tree, "prompts": len(prompts),
              "new_tokens": args.max_new_tokens, "plain_tok_s": tokens / t_plain, "spec_tok_s": tokens / t_spec,
              "speedup": t_plain / t_spec, "tokens_per_round": tokens / max(rounds, 1), "identical": same}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
