"""The gateway on the bundled demo pair: a draft that is right most of the time and one that almost never is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.stack import Stack
from tests.tiny_draft import make_tiny_eagle3

DEMO = Path(__file__).resolve().parent.parent / "demo"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][::5][:20]


@pytest.fixture(scope="module", params=["trained", "random"])
def demo_stack(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    draft = DEMO / "draft"
    if request.param == "random":
        draft = make_tiny_eagle3(tmp / "random_draft", DEMO / "target", draft_vocab_size=512, head_dim=64,
                                 intermediate_size=256, seed=7)
    st = Stack(tmp, DEMO / "target", [draft], "--max-model-len", "1024",
               target_args=("--num-blocks", "2048", "--block-size", "16"))
    st.kind = request.param
    yield st
    st.stop()


def greedy(st: Stack, prompt: str, mode: str, n: int = 32) -> tuple[str, dict]:
    r = st.complete(prompt, max_tokens=n, temperature=0, speculation=mode, ignore_eos=True)
    return r["choices"][0]["text"], r["spec_stats"]


def test_greedy_equal_in_every_mode(demo_stack):
    """20 held-out prompts; the trained head is accepted often, a random head almost never (10 prompts:
    its trees, all rejected, make it the suite's slowest test with 20)."""
    accepted = verify = 0
    prompts = PROMPTS if demo_stack.kind == "trained" else PROMPTS[:10]
    for prompt in prompts:
        plain, stats = greedy(demo_stack, prompt, "never")
        assert stats["verify_steps"] == 0
        for mode in ("always", "auto"):
            text, stats = greedy(demo_stack, prompt, mode)
            assert text == plain, (mode, prompt)
            if mode == "always":
                assert stats["verify_steps"] > 0
                accepted += stats["accepted_tokens"]
                verify += stats["verify_steps"]
    assert len(prompts) >= (20 if demo_stack.kind == "trained" else 10)
    per_step = accepted / verify
    if demo_stack.kind == "trained":
        assert per_step > 1.5, f"trained head accepted only {per_step:.2f} tokens per verify step"
    else:
        assert per_step < 0.2, f"random head accepted {per_step:.2f} tokens per verify step"
