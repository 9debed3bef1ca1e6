"""bench/catch_up_log.py reads the draft's DEBUG lines of the catch-ups a verify does not explain (a wake-up's gap,
a joining prompt), from lines the draft engine itself writes."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import IngestItem
from tests.tiny_draft import make_tiny_eagle3

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine(tiny_llama, tmp_path_factory):
    target = tiny_llama("gqa")
    draft = make_tiny_eagle3(tmp_path_factory.mktemp("draft") / "draft", target)
    return DraftEngine(Eagle3Draft(draft, target), num_blocks=64, block_size=4)


def engine_lines(engine: DraftEngine, caplog) -> list[str]:
    """The draft's DEBUG lines for a joining prompt, then a wake-up's gap of 12 tokens, as its log has them."""
    width, vocab = engine.model.cfg.feature_width, engine.model.cfg.target_vocab_size
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (40,), generator=gen).tolist()
    with caplog.at_level(logging.DEBUG, logger="tandem.draft"):
        engine.ingest([IngestItem("r", 0, tuple(tokens[:21]), torch.randn(20, width, generator=gen))], catch_up=True)
        engine.ingest([IngestItem("r", 21, tuple(tokens[21:33]), None)])
        engine.ingest([IngestItem("r", 32, tuple(tokens[32:34]), torch.randn(1, width, generator=gen))],
                      catch_up=True)
    engine.release(["r"])
    stamp = datetime(2026, 12, 5, 10, 0, 0)
    return [f"{stamp.strftime('%Y-%m-%d %H:%M:%S')},{100 * i:03d} draft DEBUG {record.getMessage()}"
            for i, record in enumerate(r for r in caplog.records if r.getMessage().startswith("catch-up of"))]


def run_tool(tmp_path: Path, lines: list[str], *args: str) -> subprocess.CompletedProcess:
    log = tmp_path / "draft0.log"
    log.write_text("\n".join(["2026-12-05 10:00:00,000 draft INFO ready", *lines]) + "\n")
    return subprocess.run([sys.executable, "bench/catch_up_log.py", str(log), *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)


def test_a_prompt_and_a_wake_up_are_told_apart_with_their_rounds(engine, tmp_path, caplog):
    lines = engine_lines(engine, caplog)
    assert len(lines) == 2, lines
    proc = run_tool(tmp_path, lines)
    assert proc.returncode == 0, proc.stderr
    table = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[1:]}
    # The prompt: one round, one eager forward (20 positions, more than the fixed width).
    assert table["prompt"][:4] == ["1", "1", "1", "0"]
    # The gap: 12 positions without features, then the step's: the approximate head's forward and one round for
    # each position of the exact tail (on the CPU, eager).
    from draft_service.engine import EXACT_TAIL
    count, rounds, eager, fixed = (int(v) for v in table["wake-up"][:4])
    assert (count, rounds, eager + fixed) == (1, 1 + EXACT_TAIL, 1 + EXACT_TAIL)


def test_levels_take_the_catch_ups_in_their_windows(engine, tmp_path, caplog):
    lines = engine_lines(engine, caplog)
    start = datetime(2026, 12, 5, 10, 0, 0).timestamp()
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"meta": {}, "results": [
        {"mode": "auto", "concurrency": 4, "round": 1, "started_at": start - 1, "ended_at": start + 0.05},
        {"mode": "auto", "concurrency": 8, "round": 1, "started_at": start + 0.05, "ended_at": start + 1}]}))
    proc = run_tool(tmp_path, lines, "--levels", str(bench))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.split("\n\n")[1].splitlines()[1:]]
    counts = {(int(r[1]), r[3]): int(r[4]) for r in rows}
    assert counts == {(4, "wake-up"): 0, (4, "prompt"): 1, (8, "wake-up"): 1, (8, "prompt"): 0}


def test_a_log_without_catch_up_lines_says_so(tmp_path):
    proc = run_tool(tmp_path, [])
    assert proc.returncode == 1 and "no catch-up lines" in proc.stderr
