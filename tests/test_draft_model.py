"""The draft forward against a from-the-formulas reference, and checkpoint loading rules."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaForCausalLM

from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from tandem.model_config import ModelLoadError
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep
from tests.tiny_draft import ReferenceEagle3, make_tiny_eagle3

# Two draft shapes: GQA with default RoPE base; one KV head, head_dim != H/heads, another base.
SHAPES = {
    "gqa": dict(num_heads=4, num_kv_heads=2),
    "mqa_wide_heads": dict(num_heads=4, num_kv_heads=1, head_dim=24, rope_theta=5000.0, intermediate_size=80),
}


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama("gqa")


@pytest.fixture(scope="module")
def drafts(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("drafts")
    return {name: make_tiny_eagle3(root / name, target, seed=i + 1, **kw)
            for i, (name, kw) in enumerate(SHAPES.items())}


def history(n: int, width: int, seed: int, vocab: int = 101):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n + 1,), generator=gen).tolist()
    return tokens, torch.randn(n, width, generator=gen)


def cache_kv(engine: DraftEngine, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    return engine.kv.read(0, engine.kv.slots(rid, 0, engine.computed(rid)))


@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_matches_reference(target, drafts, shape):
    """KV, hidden state and log-probs of every position equal the reference (float32 vs float64, 1e-5)."""
    ref = ReferenceEagle3(drafts[shape], target)
    engine = DraftEngine(Eagle3Draft(drafts[shape], target), num_blocks=16, block_size=4)
    tokens, feats = history(13, engine.model.cfg.feature_width, seed=3)
    engine.ingest([IngestItem("r", 0, tuple(tokens), feats)], catch_up=True)
    ks, vs, hs, lps = ref.prefill(tokens, list(feats))
    k, v = cache_kv(engine, "r")
    torch.testing.assert_close(k.double(), torch.stack(ks), atol=1e-5, rtol=0)
    torch.testing.assert_close(v.double(), torch.stack(vs), atol=1e-5, rtol=0)
    h = engine.requests["r"].last_h
    torch.testing.assert_close(h.double(), hs[-1], atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.model.logprobs(h[None])[0].double(), lps[-1], atol=1e-5, rtol=0)

    # Every node of a branching tree: its log-prob given its own path (prefix + ancestors only).
    tree = engine.draft([DraftItem("r", DraftBudget(steps=4, topk=3, num_draft_tokens=12))])[0]
    assert len(tree) == 11
    inverse = {t: d for d, t in enumerate(ref.hot)}
    n = len(ks)
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        path = [i]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        path.reverse()  # root's child first, node i last
        tk, tv, g, lp = [], [], hs[-1], lps[-1]
        for depth, node in enumerate(path):
            if node == i:
                break
            k1, v1, g, lp = ref.step(ks + tk, vs + tv, n + depth, tree.tokens[node], g)
            tk.append(k1)
            tv.append(v1)
        assert tree.logprobs[i] == pytest.approx(float(lp[inverse[tok]]), abs=1e-5)
        expected = float(lp[inverse[tok]]) + (tree.scores[parent] if parent >= 0 else 0.0)
        assert tree.scores[i] == pytest.approx(expected, abs=2e-5)


def test_chain_draft_is_the_greedy_rollout(target, drafts):
    """topk=1: the tree is the argmax chain in which each step feeds back the draft's own h."""
    ref = ReferenceEagle3(drafts["gqa"], target)
    engine = DraftEngine(Eagle3Draft(drafts["gqa"], target), num_blocks=16, block_size=4)
    tokens, feats = history(9, engine.model.cfg.feature_width, seed=4)
    tree = engine.draft([DraftItem("c", DraftBudget(steps=5, topk=1, num_draft_tokens=6))],
                        ingest=[IngestItem("c", 0, tuple(tokens), feats)])[0]
    ks, vs, hs, lps = ref.prefill(tokens, list(feats))
    h, lp, expected = hs[-1], lps[-1], []
    for _ in range(5):
        best = int(lp.argmax())
        expected.append(ref.hot[best])
        k, v, h, lp = ref.step(ks, vs, len(ks), ref.hot[best], h)
        ks, vs = ks + [k], vs + [v]
    assert tree.tokens == expected
    assert tree.parents == [-1, 0, 1, 2, 3]
    assert tree.depths == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("fixed_wake_ups", [False, True], ids=["eager", "fixed-width"])
def test_token_only_positions_use_the_previous_hidden_state(target, drafts, fixed_wake_ups):
    """Positions without features take the previous position's pre-norm h (zeros at position 0),
    however the history is split into ingests and lazy catch-ups, in eager forwards or fixed-width ones."""
    ref = ReferenceEagle3(drafts["gqa"], target)
    engine = DraftEngine(Eagle3Draft(drafts["gqa"], target), num_blocks=16, block_size=4)
    engine.fixed_wake_ups = fixed_wake_ups
    tokens, feats = history(12, engine.model.cfg.feature_width, seed=5)
    have = {1, 2, 5, 6, 7, 9}
    for a, b in [(0, 1), (1, 3), (3, 5), (5, 8), (8, 9), (9, 10), (10, 13)]:
        rows = feats[a:b] if a in have else None
        engine.ingest([IngestItem("t", a, tuple(tokens[a:b]), rows)])
        if a == 5:  # a draft in between computes positions 0..6 and leaves only scratch behind
            engine.draft([DraftItem("t", DraftBudget(3, 2, 5))])
            assert engine.computed("t") == 7
    assert engine.status("t").num_missing_features == 3  # positions 8, 10, 11
    engine.catch_up(["t"])
    ks, vs, hs, _ = ref.prefill(tokens, [feats[p] if p in have else None for p in range(12)])
    k, v = cache_kv(engine, "t")
    torch.testing.assert_close(k.double(), torch.stack(ks), atol=1e-5, rtol=0)
    torch.testing.assert_close(v.double(), torch.stack(vs), atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.requests["t"].last_h.double(), hs[-1], atol=1e-5, rtol=0)


def test_a_long_run_without_features_is_caught_up_in_one_forward_and_its_exact_tail_not_one_per_token(
        target, drafts):
    """A request that slept while auto decoded plainly wakes with a long gap of tokens without
    features: one forward for the run's head (each position takes the h from before the run), then one
    for each of its last EXACT_TAIL positions (exact, from the head), not one per token."""
    from draft_service.engine import EXACT_TAIL

    engine = DraftEngine(Eagle3Draft(drafts["gqa"], target), num_blocks=32, block_size=4)
    engine.fixed_wake_ups = True  # as on a GPU
    tokens, feats = history(40, engine.model.cfg.feature_width, seed=9)
    engine.ingest([IngestItem("t", 0, tuple(tokens[:4]), feats[:3])], catch_up=True)
    forwards, replays = [], []
    real_forward, real_fixed = engine.model.forward, engine._catch_up_fixed

    def counting_forward(*args, **kwargs):
        forwards.append(1)
        return real_forward(*args, **kwargs)

    def counting_fixed(batch):
        replays.append([b - a for _, a, b in batch])
        return real_fixed(batch)

    engine.model.forward, engine._catch_up_fixed = counting_forward, counting_fixed
    engine.ingest([IngestItem("t", 4, tuple(tokens[4:34]), None)])  # 30 positions without features
    engine.ingest([IngestItem("t", 34, tuple(tokens[34:37]), feats[34:36])])
    engine.catch_up(["t"])
    assert engine.computed("t") == 36
    # The head (27 positions, more than the fixed width) is one eager forward; each tail position is a
    # fixed-width one, and the last carries the positions with features after the run.
    assert len(forwards) == 1, f"{len(forwards)} eager forwards for a 31-position run and 2 with features"
    assert replays == [[1]] * (EXACT_TAIL - 1) + [[3]]
    k, v = cache_kv(engine, "t")
    assert torch.isfinite(k).all() and torch.isfinite(v).all()
    tree = engine.draft([DraftItem("t", DraftBudget(3, 2, 5))])[0]
    assert tree.tokens and tree.root_position == 36  # it drafts from where the target is


def test_a_long_runs_exact_tail_is_the_sequential_catch_up_where_it_covers_the_run(target, drafts, monkeypatch):
    """The tail is computed one position at a time from the state before it: where it covers the whole run
    (EXACT_TAIL at least the run's length), the catch-up is the exact one, as the reference computes it."""
    import draft_service.engine as draft_engine

    monkeypatch.setattr(draft_engine, "EXACT_TAIL", 64)
    ref = ReferenceEagle3(drafts["gqa"], target)
    engine = DraftEngine(Eagle3Draft(drafts["gqa"], target), num_blocks=32, block_size=4)
    tokens, feats = history(24, engine.model.cfg.feature_width, seed=11)
    engine.ingest([IngestItem("t", 0, tuple(tokens[:4]), feats[:3])])
    engine.ingest([IngestItem("t", 4, tuple(tokens[4:20]), None)])  # positions 3..19 without features
    engine.ingest([IngestItem("t", 20, tuple(tokens[20:25]), feats[20:24])])
    engine.catch_up(["t"])
    ks, vs, hs, _ = ref.prefill(tokens, [feats[p] if p < 3 or p >= 20 else None for p in range(24)])
    k, v = cache_kv(engine, "t")
    torch.testing.assert_close(k.double(), torch.stack(ks), atol=1e-5, rtol=0)
    torch.testing.assert_close(engine.requests["t"].last_h.double(), hs[-1], atol=1e-5, rtol=0)


# --- checkpoints -----------------------------------------------------------------------------

def test_sglang_checkpoint_loads_with_and_without_model_prefix(target, tmp_path):
    plain = Eagle3Draft(make_tiny_eagle3(tmp_path / "plain", target, seed=7), target)
    prefixed = Eagle3Draft(make_tiny_eagle3(tmp_path / "prefixed", target, seed=7, prefix="model."), target)
    for name in ("fc", "qkv", "o", "gate_up", "down", "norm", "lm_head", "d2t"):
        torch.testing.assert_close(getattr(plain, name), getattr(prefixed, name))
    assert plain.cfg.draft_vocab_size == 24 and plain.cfg.feature_width == 3 * 64
    # The draft embeds with the target's embedding table.
    target_embed = LlamaForCausalLM.from_pretrained(target).model.embed_tokens.weight
    torch.testing.assert_close(plain.embed, target_embed.detach())


@pytest.mark.parametrize("name, bad_shape", [
    ("midlayer.self_attn.q_proj.weight", (64, 64)),  # a plain Llama q_proj: input H, not 2H
    ("fc.weight", (64, 128)),  # two feature layers instead of three
    ("lm_head.weight", (101, 64)),  # full vocabulary though draft_vocab_size says 24
    ("d2t", (23,)),
])
def test_misshapen_tensor_is_refused_by_name(target, tmp_path, name, bad_shape):
    dtype = torch.int64 if name == "d2t" else torch.float32
    draft = make_tiny_eagle3(tmp_path / "d", target, tensors={name: torch.zeros(bad_shape, dtype=dtype)})
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' has shape \[{', '.join(map(str, bad_shape))}\]"):
        Eagle3Draft(draft, target)


@pytest.mark.parametrize("name", ["midlayer.hidden_norm.weight", "midlayer.mlp.down_proj.weight", "d2t",
                                  "lm_head.weight", "norm.weight"])
def test_missing_tensor_is_refused_by_name(target, tmp_path, name):
    draft = make_tiny_eagle3(tmp_path / "d", target, tensors={name: None})
    with pytest.raises(ModelLoadError, match=rf"tensor '{name}' is missing"):
        Eagle3Draft(draft, target)


def test_full_vocabulary_draft_needs_no_vocab_map(target, tmp_path):
    draft = make_tiny_eagle3(tmp_path / "d", target, draft_vocab_size=101, tensors={"d2t": None, "t2d": None})
    model = Eagle3Draft(draft, target)
    assert model.d2t.tolist() == list(range(101))


@pytest.mark.parametrize("change, message", [
    (dict(tensors={"d2t": torch.full((24,), 200)}), "outside the target vocabulary"),
    (dict(tensors={"d2t": -torch.arange(24)}), "same target id"),
    (dict(tensors={"t2d": torch.ones(101, dtype=torch.bool)}), "disagree"),
    (dict(config={"num_hidden_layers": 2}), "one decoder layer"),
    (dict(config={"architectures": ["LlamaForCausalLMEagle"]}), "not an EAGLE-3 draft"),
    (dict(config={"vocab_size": 128256}), "differs from the target's"),
    (dict(config={"target_hidden_size": 4096}), "target_hidden_size is 4096"),
    (dict(config={"hidden_size": 32}), "hidden_size"),
    (dict(config={"draft_vocab_size": 0}), "draft_vocab_size"),
    (dict(aux_layer_ids=[0, 1, 4]), r"feature layer\(s\) \[5\]"),
    (dict(config={"eagle_config": {"eagle_aux_hidden_state_layer_ids": "0,1,2"}}), "list of integers"),
])
def test_bad_checkpoint_is_refused_with_a_reason(target, tmp_path, change, message):
    draft = make_tiny_eagle3(tmp_path / "d", target, **change)
    with pytest.raises(ModelLoadError, match=message):
        Eagle3Draft(draft, target)


# --- which target features --------------------------------------------------------------------

def test_feature_layers_follow_sglang(target, tmp_path):
    """Listed ids i mean the input of target layer i + 1; without a list, inputs of [2, L//2, L-3]."""
    listed = Eagle3Draft(make_tiny_eagle3(tmp_path / "listed", target, aux_layer_ids=[0, 1, 2]), target)
    assert listed.cfg.feature_layers == (1, 2, 3)
    default = Eagle3Draft(make_tiny_eagle3(tmp_path / "default", target), target)
    assert default.cfg.feature_layers == (2, 2, 1)  # L = 4
    engine = DraftEngine(listed, num_blocks=4)
    assert engine.info().feature_layers == (1, 2, 3)
    assert engine.info().feature_width == 3 * 64


def test_listed_ids_are_outputs_of_those_layers(target, tmp_path):
    """Against transformers: hidden_states[i + 1] is the output of layer i, which is what the
    target returns when asked for the input of layer i + 1 (the draft's GetInfo list)."""
    draft = Eagle3Draft(make_tiny_eagle3(tmp_path / "d", target, aux_layer_ids=[0, 2, 1]), target)
    tokens = [5, 17, 3, 9, 33, 2, 40]
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([hidden[i + 1][0] for i in (0, 2, 1)], -1)
    engine = TargetEngine(LlamaModel(target), num_blocks=8)
    result = engine.step([SequenceStep.chain("x", tokens, create=True, return_features=True)],
                         feature_layers=draft.cfg.feature_layers)[0]
    torch.testing.assert_close(result.features, expected, atol=1e-4, rtol=0)
    assert result.features.shape[1] == draft.cfg.feature_width


def test_config_without_rope_theta_uses_base_10000(target, tmp_path):
    draft = make_tiny_eagle3(tmp_path / "d", target)
    assert "rope_theta" not in json.loads((draft / "config.json").read_text())
    assert Eagle3Draft(draft, target).cfg.layer.rope.theta == 10000.0


def test_triton_attention_gives_the_same_trees(target, drafts):
    """The draft runs on the kernels' attention backends; on CPU the Triton one runs interpreted, on a GPU
    compiled (both backends then run there)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(8)
    feats = torch.randn(20, 192, generator=gen).to(device)
    results = []
    for backend in ("torch", "triton"):
        engine = DraftEngine(Eagle3Draft(drafts["gqa"], target, device=device, attention_backend=backend), 16, 4)
        trees = engine.draft([DraftItem("a", DraftBudget(4, 3, 10)), DraftItem("b", DraftBudget(3, 2, 6))],
                             ingest=[IngestItem("a", 0, tuple(range(1, 22)), feats[:15]),
                                     IngestItem("b", 0, tuple(range(3, 12)), feats[:8])])
        results.append((trees, cache_kv(engine, "a")))
    (torch_trees, torch_kv), (triton_trees, triton_kv) = results
    for a, b in zip(torch_trees, triton_trees):
        assert (a.tokens, a.parents) == (b.tokens, b.parents)
        assert a.scores == pytest.approx(b.scores, abs=1e-5)
    for a, b in zip(torch_kv, triton_kv):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_refuses_pickled_draft_weights(tmp_path, tiny_llama):
    target = tiny_llama("gqa")
    draft = make_tiny_eagle3(tmp_path / "draft", target)
    for shard in draft.glob("*.safetensors"):
        shard.unlink()
    (draft / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(ModelLoadError, match="pickled weights are never loaded"):
        Eagle3Draft(draft, target)
