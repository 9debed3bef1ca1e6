"""The catch-up benchmark runs end to end: speculation keeps greedy output, bytes are counted."""

from __future__ import annotations

import pytest

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from tests.bench_scripts import load_bench_script
from tests.tiny_draft import make_tiny_eagle3

draft_catchup = load_bench_script("draft_catchup")


@pytest.mark.parametrize("mode", ["exact", "tokens"])
def test_catchup_bench_on_a_tiny_pair(tiny_llama, tmp_path, mode):
    target_dir = tiny_llama("gqa")
    target = TargetEngine(LlamaModel(target_dir), num_blocks=64, block_size=8)
    draft_dir = make_tiny_eagle3(tmp_path / "d", target_dir, seed=41)
    draft = DraftEngine(Eagle3Draft(draft_dir, target_dir), num_blocks=64, block_size=8)
    run = draft_catchup.measure(target, draft, [[5, 17, 3, 9, 33, 2, 40, 11]], off_tokens=5, spec_steps=3,
                                budget=DraftBudget(3, 2, 5), mode=mode)
    assert run.outputs_match and run.verify_steps == 3 and run.drafted == 12
    assert 1.0 <= run.acceptance_length <= 4.0
    # Exact catch-up ships 5 tokens x 3 layers x 64 float32 values; token-only ships none.
    assert run.feature_bytes == (5 * 3 * 64 * 4 if mode == "exact" else 0)
    assert draft.load().num_sequences == 0 and target.load().num_sequences == 0
