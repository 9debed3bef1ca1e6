"""bench/force_record.py records a checkpoint's greedy continuations for `tandem draft --force-record`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from draft_service.forcing import load_records
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

REPO = Path(__file__).resolve().parents[1]
DEMO_TARGET = REPO / "demo" / "target"


def test_a_record_holds_each_prompts_ids_then_the_targets_greedy_continuation_and_bad_input_is_refused(tmp_path):
    from transformers import AutoTokenizer

    out = tmp_path / "record.jsonl"
    proc = subprocess.run([sys.executable, "bench/force_record.py", "--model", str(DEMO_TARGET), "--out", str(out),
                           "--limit", "2", "--max-tokens", "6"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    records = load_records(out)
    texts = [json.loads(line)["prompt"] for line in (REPO / "demo" / "heldout_prompts.jsonl").read_text().splitlines()
             if line.strip()][:2]
    tokenizer = AutoTokenizer.from_pretrained(DEMO_TARGET)
    engine = TargetEngine(LlamaModel(DEMO_TARGET), num_blocks=64, block_size=16)
    assert len(records) == 2
    for i, (text, tokens) in enumerate(zip(texts, records, strict=True)):
        ids = list(tokenizer.encode(text))
        assert tokens[: len(ids)] == ids and len(tokens) == len(ids) + 6
        greedy = engine.step([SequenceStep.chain(f"r{i}", ids, create=True)])[0].tokens  # decoded one at a time
        while len(greedy) < 6:
            greedy += engine.step([SequenceStep.chain(f"r{i}", greedy[-1:])])[0].tokens
        assert tokens[len(ids):] == greedy[:6]
    proc = subprocess.run([sys.executable, "bench/force_record.py", "--model", str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "has no config.json" in proc.stderr and "Traceback" not in proc.stderr
