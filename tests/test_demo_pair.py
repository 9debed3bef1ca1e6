"""The bundled demo pair: transformers loads it, tandem's greedy output equals transformers', the draft helps.

Moves to tests/ together with the commit that adds demo/target and demo/draft
(it fails, never skips, without them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from demo.eval_acceptance import greedy_continuations, replay
from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep

DEMO = Path(__file__).resolve().parents[1] / "demo"
TARGET, DRAFT = DEMO / "target", DEMO / "draft"
# On CI's two cores tandem's CPU engine and transformers each take ~30 ms a token here, so the
# greedy comparison uses every third held-out prompt (38 of 113) and 24 tokens.
NEW_TOKENS = 24
EVERY = 3


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    rows = [json.loads(line) for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 64
    return [r["prompt"] for r in rows]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET)


def test_the_pair_is_bundled_and_small():
    for d, names in ((TARGET, ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                               "generation_config.json")), (DRAFT, ("config.json", "model.safetensors"))):
        missing = [n for n in names if not (d / n).is_file()]
        assert not missing, f"{d} lacks {missing}: build it with demo/make_demo.sh"
    total = sum(p.stat().st_size for d in (TARGET, DRAFT) for p in d.iterdir() if p.is_file())
    assert total <= 40_000_000, f"demo pair is {total / 1e6:.1f} MB, over 40 MB"


def test_transformers_loads_the_target_and_its_tokenizer(tokenizer, prompts):
    model = AutoModelForCausalLM.from_pretrained(TARGET)
    assert model.config.model_type == "llama"
    n = sum(p.numel() for p in model.parameters())
    assert 5e6 <= n <= 15e6, f"{n / 1e6:.1f}M parameters"
    assert tokenizer.eos_token_id == model.config.eos_token_id
    for p in prompts[:16]:
        assert tokenizer.decode(tokenizer(p)["input_ids"]) == p  # byte-level BPE round-trips


def test_greedy_output_equals_tandems_on_the_heldout_prompts(tokenizer, prompts):
    hf = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[::EVERY]]
    engine = TargetEngine(LlamaModel(TARGET, dtype=torch.float32), num_blocks=len(ids) * 24, block_size=16)
    rids = [f"p{i}" for i in range(len(ids))]
    ours = [r.tokens for r in engine.step([SequenceStep.chain(r, p, create=True) for r, p in zip(rids, ids)])]
    for _ in range(NEW_TOKENS - 1):
        for out, r in zip(ours, engine.step([SequenceStep.chain(r, [o[-1]]) for r, o in zip(rids, ours)])):
            out.extend(r.tokens)
    mismatched = []
    with torch.no_grad():
        for i, p in enumerate(ids):
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=tokenizer.pad_token_id)[0, len(p):].tolist()
            if ref != ours[i]:
                mismatched.append(i)
    assert not mismatched, f"greedy output differs from transformers' on prompts {mismatched}"


def test_the_draft_loads_and_is_accepted_on_heldout_prompts(tokenizer, prompts):
    draft = Eagle3Draft(DRAFT, TARGET)
    assert draft.cfg.feature_layers == LlamaModel(TARGET).cfg.default_feature_layers
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts[1::10]]
    engine = TargetEngine(LlamaModel(TARGET), num_blocks=len(ids) * 16, block_size=16)
    seqs = greedy_continuations(engine, ids, 48, draft.cfg.feature_layers)
    stats = replay(DraftEngine(draft, num_blocks=len(ids) * 16, block_size=16), seqs,
                   DraftBudget(steps=5, topk=4, num_draft_tokens=8))
    # A sanity floor (an untrained head scores about 1.0); demo/README.md has the measured numbers.
    assert stats["mean_acceptance_length"] >= 2.0, stats
