"""How often speculation or batching changes greedy output, through a running gateway.

    python bench/greedy_equality.py --url http://127.0.0.1:8000 --prompts 64 --max-tokens 96 --out eq.json

Sends the held-out demo prompts greedily (ignore_eos, so every output has the
same length) in `never` and `always`, one at a time and 8 at once, and counts
the prompts whose text is identical: always vs never at 1 and at 8 concurrent
requests, and never alone vs never among 8. On CPU in float32 every count is
the number of prompts; on a GPU in bf16 it is not unless the target runs with
--deterministic (issue 19). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().parent.parent / "demo" / "heldout_prompts.jsonl"


def complete(url: str, prompt: str, mode: str, max_tokens: int) -> str:
    reply = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculation": mode, "ignore_eos": True})
    reply.raise_for_status()
    return reply.json()["choices"][0]["text"]


def texts(url: str, prompts: list[str], mode: str, max_tokens: int, concurrency: int) -> list[str]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: complete(url, p, mode, max_tokens), prompts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompts-file", type=Path, default=PROMPTS, help="JSON lines with a 'prompt' field")
    ap.add_argument("--out", type=Path, default=None, help="also write the counts and texts here (JSON)")
    ap.add_argument("--against", type=Path, default=None, metavar="JSON",
                    help="another run's --out (e.g. the same model at another --tp): also count the prompts "
                         "whose texts equal that run's, mode by mode")
    args = ap.parse_args(argv)
    rows = [json.loads(line) for line in args.prompts_file.read_text().splitlines() if line.strip()]
    prompts = [row["prompt"] for row in rows][: args.prompts]
    complete(args.url, prompts[0], "never", 4)  # warm-up
    runs = {(mode, c): texts(args.url, prompts, mode, args.max_tokens, c)
            for c in (1, 8) for mode in ("never", "always")}

    def same(a: tuple[str, int], b: tuple[str, int]) -> int:
        return sum(x == y for x, y in zip(runs[a], runs[b], strict=True))

    counts = {"always_vs_never_at_1": same(("always", 1), ("never", 1)),
              "always_vs_never_at_8": same(("always", 8), ("never", 8)),
              "never_alone_vs_among_8": same(("never", 1), ("never", 8))}
    if args.against:
        other = json.loads(args.against.read_text())["texts"]
        for (mode, c), texts_here in runs.items():
            there = other[f"{mode}@{c}"]
            counts[f"{mode}@{c}_vs_other_run"] = sum(x == y for x, y in zip(texts_here, there, strict=True))
    print(f"{len(prompts)} prompts x {args.max_tokens} greedy tokens; identical texts:")
    for name, count in counts.items():
        print(f"  {name:>28}: {count}/{len(prompts)}")
    if args.out:
        args.out.write_text(json.dumps({"prompts": len(prompts), "max_tokens": args.max_tokens, "identical": counts,
                                        "texts": {f"{m}@{c}": t for (m, c), t in runs.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
