"""Throughput of a running gateway at a few concurrencies, for never, always and auto (greedy).

    python bench/load_sweep.py --url http://127.0.0.1:8000 [--concurrency 1,16,64] [--max-tokens 48]

Each client sends one held-out demo prompt and waits for the whole completion;
a level sends max(concurrency, 4) requests at once (one at a time at
concurrency 1). Prints total output tokens per second. A quick check, not the
full sweep of `tandem bench`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

HELDOUT = Path(__file__).resolve().parent.parent / "demo" / "heldout_prompts.jsonl"
PROMPTS = [json.loads(line)["prompt"] for line in HELDOUT.read_text().splitlines()]


def one(url: str, prompt: str, mode: str, max_tokens: int) -> None:
    httpx.post(f"{url}/v1/completions", timeout=900, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculation": mode,
        "ignore_eos": True}).raise_for_status()


def level(url: str, conc: int, mode: str, max_tokens: int) -> float:
    n = max(conc, 4)
    threads = [threading.Thread(target=one, args=(url, PROMPTS[i % len(PROMPTS)], mode, max_tokens))
               for i in range(n)]
    t0 = time.perf_counter()
    if conc == 1:
        for t in threads:
            t.start()
            t.join()
    else:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    return n * max_tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    print(f"{'conc':>5} {'never':>8} {'always':>8} {'auto':>8}  auto/max(never,always)   (tok/s)")
    for conc in map(int, args.concurrency.split(",")):
        r = {m: level(args.url, conc, m, args.max_tokens) for m in ("never", "always", "auto")}
        print(f"{conc:>5} {r['never']:8.1f} {r['always']:8.1f} {r['auto']:8.1f}  "
              f"{r['auto'] / max(r['never'], r['always']):.2f}", flush=True)


if __name__ == "__main__":
    main()
