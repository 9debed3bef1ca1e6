"""Single-request decode speed through a running gateway: never vs always vs auto.

    python bench/single_request.py --url http://127.0.0.1:8000 [--prompts 16 --max-tokens 96]

Sends the held-out demo prompts one at a time (greedy) in each speculation mode
and prints tokens per second, mean acceptance length (tokens committed per
verification step, bonus included) and the speedup over `never`. A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

PROMPTS = Path(__file__).resolve().parent.parent / "demo" / "heldout_prompts.jsonl"


def run(url: str, prompts: list[str], mode: str, max_tokens: int) -> dict:
    tokens = seconds = verify = accepted = 0
    texts = []
    for p in prompts:
        t0 = time.perf_counter()
        r = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "prompt": p, "max_tokens": max_tokens, "temperature": 0, "speculation": mode, "ignore_eos": True})
        r.raise_for_status()
        seconds += time.perf_counter() - t0
        body = r.json()
        tokens += body["usage"]["completion_tokens"]
        verify += body["spec_stats"]["verify_steps"]
        accepted += body["spec_stats"]["accepted_tokens"]
        texts.append(body["choices"][0]["text"])
    return {"mode": mode, "tok_per_s": tokens / seconds, "tokens": tokens,
            "acceptance_length": (accepted + verify) / verify if verify else None, "texts": texts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    prompts = [r.get("prompt") or r.get("text") for r in rows][: args.prompts]
    run(args.url, prompts[:2], "never", 8)  # warm-up
    results = {m: run(args.url, prompts, m, args.max_tokens) for m in ("never", "always", "auto")}
    same = all(results[m]["texts"] == results["never"]["texts"] for m in results)
    base = results["never"]["tok_per_s"]
    print(f"{len(prompts)} prompts x {args.max_tokens} tokens, greedy, one at a time; outputs identical: {same}")
    print(f"{'mode':>7} {'tok/s':>8} {'speedup':>8} {'accept len':>11}")
    for m, r in results.items():
        acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
        print(f"{m:>7} {r['tok_per_s']:8.1f} {r['tok_per_s'] / base:7.2f}x {acc:>11}")
    if args.json:
        Path(args.json).write_text(json.dumps({m: {k: v for k, v in r.items() if k != "texts"}
                                               for m, r in results.items()} | {"identical": same}, indent=1))


if __name__ == "__main__":
    main()
