"""Load for the multi-host test, run on a 'client host' (`python -m tests.multihost_load ...`).

Phase 1: each prompt once greedy with speculation `never`, then `always`: the
reference outputs, from a stack where nothing changes; then it creates
--phase1-done. Phase 2: --workers threads send the prompts greedy with `always`
in a loop until --stop-file exists. Everything (outputs, spec_stats, errors)
goes to --out as JSON. Only the standard library: it runs wherever Python does.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path


def complete(url: str, prompt: str, mode: str, max_tokens: int) -> dict:
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "speculation": mode}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.loads(r.read())
    return {"text": out["choices"][0]["text"], "spec_stats": out["spec_stats"]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of prompts")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--phase1-done", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())

    reference = [complete(args.url, q, "never", args.max_tokens) for q in prompts]
    phase1 = [complete(args.url, q, "always", args.max_tokens) for q in prompts]
    Path(args.phase1_done).write_text("done")

    results: list[dict] = []
    errors: list[str] = []
    lock = threading.Lock()
    stop = Path(args.stop_file)

    def worker(w: int) -> None:
        i = w
        while not stop.exists():
            k = i % len(prompts)
            try:
                got = complete(args.url, prompts[k], "always", args.max_tokens)
                with lock:
                    results.append({"prompt": k, "finished_at": time.time(), **got})
            except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
                with lock:
                    errors.append(f"prompt {k}: {exc!r}")
            i += args.workers

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(args.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    Path(args.out).write_text(json.dumps({"reference": reference, "phase1": phase1, "phase2": results,
                                          "errors": errors}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
