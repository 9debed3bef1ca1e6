"""`tandem bench` runs a short sweep on the demo pair and writes a well-formed JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.services import REPO


def test_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    # 16 tokens: long enough that `always` verifies trees once the draft has caught up.
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "--concurrency", "1,2", "--max-tokens", "16",
         "--requests-per-level", "2", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "bench.json").read_text())
    rows = data["results"]
    assert {(r["mode"], r["concurrency"]) for r in rows} == {(m, c) for m in ("never", "always", "auto")
                                                              for c in (1, 2)}
    for r in rows:
        assert r["requests"] == 2 and r["total_tok_s"] > 0 and r["ttft_p50_s"] > 0
        assert r["decode_tok_s"] > 0  # prefill left out: the rate a step's goodput compares with
        # auto's audit over the level, from the gateway's /metrics read before and after it.
        assert (r["audit"] is not None) == (r["mode"] == "auto")
        if r["mode"] == "auto":
            assert r["audit"]["plain"]["predicted"] > 0
            assert any(r["audit"][arm]["measured"] for arm in ("trees", "plain"))
        if r["mode"] == "never":
            assert r["acceptance_length"] is None
        if r["mode"] == "always":
            assert r["acceptance_length"] >= 1.0  # auto may or may not have speculated
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "auto / max(never, always)" in proc.stdout
    assert "auto's audit" in proc.stdout
