"""What catching a draft up costs: exact features against the draft's own hidden states.

    python bench/draft_catchup.py --target DIR --draft DIR [--out catchup.json]
    python bench/draft_catchup.py --tiny         # CPU smoke run on a tiny random pair

(with the package installed, `pip install -e .`, or PYTHONPATH set to the repo root).

A request decodes plainly ("speculation off") for K tokens after its prompt,
then speculates. During the plain stretch the draft is fed either
- exact: the target's features of every committed token (the target computes
  and sends them although nobody drafts: bytes on the wire), or
- tokens: token ids only; the draft catches up by feeding its own pre-norm
  hidden state where the features are missing (what training-time test trains).
Then S verify steps run greedily with the given tree budget, features flowing
again in both modes. Reported per K: mean acceptance length (tokens committed
per verify step, bonus included, EAGLE's tau), feature bytes the plain stretch
sent, and the draft's catch-up time (exact catch-up is one batched forward;
token-only is one forward per position, since each needs the previous h).
Greedy output is checked to equal plain greedy decoding in every run.

Only a trained pair gives meaningful acceptance; with --tiny (random weights)
acceptance is near zero in both modes and only shows the script works. Label
figures with the track they come from: the JSON records the model paths.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from tandem.layers import DTYPES
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

MODES = ("exact", "tokens")


@dataclass
class CatchupRun:
    mode: str
    off_tokens: int
    requests: int
    verify_steps: int
    drafted: int
    accepted: int
    acceptance_length: float  # (accepted + verify steps) / verify steps
    feature_bytes: int  # features sent during the plain stretch
    catchup_seconds: float  # the draft's catch-up after the plain stretch, summed over requests
    outputs_match: bool  # speculative greedy output == plain greedy output


def plain_greedy(target: TargetEngine, rid: str, prompt: list[int], n: int) -> list[int]:
    out = target.step([SequenceStep.chain(rid, prompt, create=True)])[0].tokens
    while len(out) < n:
        out += target.step([SequenceStep.chain(rid, [out[-1]])])[0].tokens
    target.release([rid])
    return out[:n]


def run_request(target: TargetEngine, draft: DraftEngine, rid: str, prompt: list[int], off_tokens: int,
                spec_steps: int, budget: DraftBudget, mode: str) -> tuple[list[int], dict]:
    """One request: prefill, off_tokens plain steps, spec_steps verify steps. Returns its new tokens."""
    layers = draft.info().feature_layers
    stats = dict(verify_steps=0, drafted=0, accepted=0, feature_bytes=0, catchup_seconds=0.0)
    r = target.step([SequenceStep.chain(rid, prompt, create=True, return_features=True)], layers)[0]
    tokens = list(prompt) + r.tokens
    draft.ingest([IngestItem(rid, 0, tuple(tokens), r.features)])
    for _ in range(off_tokens):
        exact = mode == "exact"
        r = target.step([SequenceStep.chain(rid, [tokens[-1]], return_features=exact)], layers)[0]
        start = len(tokens) - 1
        tokens += r.tokens
        draft.ingest([IngestItem(rid, start, tuple(tokens[start:]), r.features if exact else None)])
        if exact:
            stats["feature_bytes"] += r.features.numel() * r.features.element_size()
    t0 = time.perf_counter()
    draft.catch_up([rid])
    stats["catchup_seconds"] = time.perf_counter() - t0
    for _ in range(spec_steps):
        tree = draft.draft([DraftItem(rid, budget, len(tokens))])[0]
        nodes, parents, num_fixed = tree.verify_tree()
        r = target.step([SequenceStep(rid, tuple(nodes), tuple(parents), num_fixed, return_features=True)],
                        layers)[0]
        start = len(tokens) - 1
        tokens += r.tokens
        draft.ingest([IngestItem(rid, start, tuple(tokens[start:]), r.features)])
        stats["verify_steps"] += 1
        stats["drafted"] += len(tree)
        stats["accepted"] += len(r.accepted_nodes)
    target.release([rid])
    draft.release([rid])
    return tokens[len(prompt):], stats


def measure(target: TargetEngine, draft: DraftEngine, prompts: list[list[int]], off_tokens: int,
            spec_steps: int, budget: DraftBudget, mode: str) -> CatchupRun:
    totals = dict(verify_steps=0, drafted=0, accepted=0, feature_bytes=0, catchup_seconds=0.0)
    match = True
    for i, prompt in enumerate(prompts):
        out, stats = run_request(target, draft, f"{mode}-{off_tokens}-{i}", prompt, off_tokens, spec_steps,
                                 budget, mode)
        match &= out == plain_greedy(target, f"plain-{i}", prompt, len(out))
        for key, value in stats.items():
            totals[key] += value
    steps = max(totals["verify_steps"], 1)
    return CatchupRun(mode, off_tokens, len(prompts), totals["verify_steps"], totals["drafted"], totals["accepted"],
                      (totals["accepted"] + totals["verify_steps"]) / steps, totals["feature_bytes"],
                      totals["catchup_seconds"], match)


def tiny_pair(root: Path) -> tuple[Path, Path]:
    from tests.tiny_draft import make_tiny_eagle3
    from tests.tiny_models import make_tiny_llama

    target = make_tiny_llama(root / "target")
    return target, make_tiny_eagle3(root / "draft", target, draft_vocab_size=48)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, help="target Hugging Face directory")
    ap.add_argument("--draft", type=Path, help="EAGLE-3 draft directory")
    ap.add_argument("--tiny", action="store_true", help="a tiny random pair (CPU smoke run)")
    ap.add_argument("--prompts", type=int, default=4, help="requests per setting (default 4)")
    ap.add_argument("--prompt-len", type=int, default=32, help="tokens per random prompt (default 32)")
    ap.add_argument("--prompt-file", type=Path, help="text prompts, one per line, tokenized with the "
                    "target's tokenizer (default: random token ids, which only a random pair deserves)")
    ap.add_argument("--off", default="0,16,64", help="plain-decode stretches K, comma-separated (default 0,16,64)")
    ap.add_argument("--spec-steps", type=int, default=16, help="verify steps after the stretch (default 16)")
    ap.add_argument("--budget", default="5,4,8", help="steps,topk,num_draft_tokens (default 5,4,8)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--out", type=Path, help="also write the results as JSON")
    args = ap.parse_args(argv)
    if not args.tiny and not (args.target and args.draft):
        ap.error("give --target and --draft, or --tiny")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = tiny_pair(Path(tmp)) if args.tiny else (args.target, args.draft)
        dtype = DTYPES[args.dtype]
        target = TargetEngine(LlamaModel(target_dir, dtype, args.device), num_blocks=4096, block_size=16)
        draft = DraftEngine(Eagle3Draft(draft_dir, target_dir, dtype, args.device), num_blocks=4096, block_size=16)
        if args.prompt_file:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(target_dir)
            prompts = [tok.encode(line) for line in args.prompt_file.read_text().splitlines() if line.strip()]
        else:
            gen = torch.Generator().manual_seed(0)
            vocab = target.model.cfg.vocab_size
            prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
                       for _ in range(args.prompts)]
        budget = DraftBudget(*map(int, args.budget.split(",")))
        track = "tiny random pair" if args.tiny else f"{Path(target_dir).name} + {Path(draft_dir).name}"
        measure(target, draft, prompts[:1], 0, 2, budget, "exact")  # warm-up, not reported
        runs = [measure(target, draft, prompts, int(k), args.spec_steps, budget, mode)
                for k in map(int, args.off.split(",")) for mode in (MODES if int(k) else MODES[:1])]
    print(f"track: {track}; budget {budget}; {len(prompts)} prompts; {args.spec_steps} verify steps each")
    print(f"{'off K':>6} {'mode':>7} {'accept len':>11} {'drafted/step':>13} {'feature MB':>11} "
          f"{'catch-up ms':>12} {'greedy ok':>10}")
    for r in runs:
        print(f"{r.off_tokens:>6} {r.mode:>7} {r.acceptance_length:>11.3f} {r.drafted / max(r.verify_steps, 1):>13.2f} "
              f"{r.feature_bytes / 2**20:>11.3f} {1000 * r.catchup_seconds:>12.1f} {str(r.outputs_match):>10}")
    if args.out:
        args.out.write_text(json.dumps({"track": track, "target": str(target_dir), "draft": str(draft_dir),
                                        "budget": asdict(budget), "runs": [asdict(r) for r in runs]}, indent=2))
    return 0 if all(r.outputs_match for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
