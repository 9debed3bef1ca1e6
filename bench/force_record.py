"""Record a target's greedy continuations of the held-out prompts, for `tandem draft --force-record` on any pair.

    python bench/force_record.py --model demo/target --out /tmp/demo_record.jsonl      # CPU, about a minute

The scale track (bench/scale_track.py) records its own random target this way; this does it for a real
checkpoint, so that the draft's trees can be forced to a set acceptance on the demo pair too: with
`--emulate-step-cost` on both services, the CPU then meets a GPU's costs and the scale track's acceptance
with real processes, e.g. (BENCHMARKS.md, "The sixty-sixth session")

    bash bench/serve_and_bench.sh OUT 1,2,4 never,always,auto 128 \\
      --target-args="--emulate-step-cost 14,0.05" \\
      --draft-args="--force-record /tmp/demo_record.jsonl --force-acceptance 0.6 --emulate-step-cost 3,0.02"

Each line is {"tokens": [...]}: the prompt's ids as the gateway tokenizes a completion's prompt, then the
target's greedy continuation (float32 on the CPU: the continuation the served target decodes greedily, where
no two logits tie).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scale_track import HELDOUT, record  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.model import LlamaModel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the target: a Hugging Face Llama directory")
    ap.add_argument("--out", type=Path, required=True, help="the JSONL to write")
    ap.add_argument("--prompts", type=Path, default=HELDOUT, help="JSONL with a 'prompt' field per line")
    ap.add_argument("--max-tokens", type=int, default=200,
                    help="recorded tokens per prompt; more than the bench generates, since trees reach past it")
    ap.add_argument("--limit", type=int, default=0, help="record the first N prompts only (0: all)")
    args = ap.parse_args(argv)
    if args.max_tokens < 1 or args.limit < 0:
        ap.error("--max-tokens must be at least 1 and --limit at least 0")
    if not (args.model / "config.json").exists():
        ap.error(f"{args.model} has no config.json")
    if not args.prompts.exists():
        ap.error(f"{args.prompts} does not exist")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    texts = texts[: args.limit] if args.limit else texts
    prompts = [list(tokenizer.encode(text)) for text in texts]
    longest = max(len(ids) for ids in prompts) + args.max_tokens
    engine = TargetEngine(LlamaModel(args.model), num_blocks=len(prompts) * (longest // 16 + 2), block_size=16)
    t0 = time.perf_counter()
    seqs = record(engine, prompts, args.max_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for seq in seqs:
            f.write(json.dumps({"tokens": seq}) + "\n")
    print(f"recorded {len(seqs)} continuations of {args.max_tokens} tokens in {time.perf_counter() - t0:.1f} s "
          f"into {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
