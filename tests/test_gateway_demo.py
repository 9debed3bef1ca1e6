"""The gateway on the bundled demo pair: a draft that is right most of the time and one that almost never is."""

from __future__ import annotations

import json
import threading
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
    """20 held-out prompts; the trained head is accepted often, a random head almost never."""
    accepted = verify = 0
    for prompt in PROMPTS:
        plain, stats = greedy(demo_stack, prompt, "never")
        assert stats["verify_steps"] == 0
        for mode in ("always", "auto"):
            text, stats = greedy(demo_stack, prompt, mode)
            assert text == plain, (mode, prompt)
            if mode == "always":
                assert stats["verify_steps"] > 0
                accepted += stats["accepted_tokens"]
                verify += stats["verify_steps"]
    assert len(PROMPTS) >= 20
    per_step = accepted / verify
    if demo_stack.kind == "trained":
        assert per_step > 1.5, f"trained head accepted only {per_step:.2f} tokens per verify step"
    else:
        assert per_step < 0.2, f"random head accepted {per_step:.2f} tokens per verify step"


def _counters(st: Stack) -> tuple[float, float]:
    m = st.metrics()
    return m["tandem_spec_decode_num_drafts_total"], m["tandem_plain_decode_steps_total"]


def test_auto_speculates_alone_and_stops_under_load(tmp_path):
    st = Stack(tmp_path, DEMO / "target", [DEMO / "draft"], "--speculation", "auto", "--max-model-len", "1024",
               target_args=("--num-blocks", "4096", "--block-size", "16"))
    try:
        drafts0, plain0 = _counters(st)
        for prompt in PROMPTS[:4]:  # one request at a time
            greedy(st, prompt, "auto", 48)
        drafts1, plain1 = _counters(st)
        alone_share = (drafts1 - drafts0) / max(drafts1 - drafts0 + plain1 - plain0, 1)
        assert alone_share > 0.5, f"alone, auto speculated in only {alone_share:.0%} of decode steps"
        threads = [threading.Thread(target=greedy, args=(st, PROMPTS[i % len(PROMPTS)], "auto", 48))
                   for i in range(96)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        drafts2, plain2 = _counters(st)
        spec_share = (drafts2 - drafts1) / max(drafts2 - drafts1 + plain2 - plain1, 1)
        assert spec_share < 0.2, f"under load auto still speculated in {spec_share:.0%} of decode steps"
    finally:
        st.stop()
