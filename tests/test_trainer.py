"""`tandem train-draft`: TTT alignment against the serving draft, the export format, the whole run, resume."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from draft_service.config import load_draft_config
from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.training.config import TrainConfig
from draft_service.training.data import iter_documents
from draft_service.training.export import export_draft
from draft_service.training.main import batch_indices, main
from draft_service.training.module import DraftShape, Eagle3TrainModel
from draft_service.training.target import TargetModel
from draft_service.training.ttt import ttt_hidden_states, ttt_loss, ttt_targets
from draft_service.training.vocab import draft_vocabulary
from draft_service.types import DraftBudget, DraftItem, IngestItem
from kernels.tree_attention import StepLayout
from tandem.cli import COMMANDS
from tandem.model_config import load_llama_config
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep
from tests.tiny_draft import eagle3_tensors

TEXT = '''def fibonacci(n):
    """Return the n-th Fibonacci number."""
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()
'''


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama("gqa")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    (d / "code.py").write_text(TEXT * 3)
    (d / "more.jsonl").write_text(json.dumps({"text": TEXT.upper()}) + "\n")
    return d


def random_draft(target_dir, draft_vocab: int = 40, seed: int = 0) -> tuple[Eagle3TrainModel, TargetModel]:
    tm = TargetModel(target_dir, torch.device("cpu"), torch.float32)
    c = tm.cfg
    shape = DraftShape(hidden_size=c.hidden_size, num_heads=4, num_kv_heads=2, head_dim=c.head_dim,
                       intermediate_size=96, draft_vocab_size=draft_vocab, target_vocab_size=c.vocab_size,
                       rms_norm_eps=c.rms_norm_eps, max_position=c.max_position)
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randperm(c.vocab_size, generator=gen)[:draft_vocab].sort().values
    torch.manual_seed(seed)
    model = Eagle3TrainModel(shape, tm.embed_tokens.float(), ids)
    with torch.no_grad():  # spread the weights so that a misalignment shows as a large difference
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model, tm


def test_ttt_steps_equal_chain_drafting_with_the_exported_checkpoint(target, tmp_path):
    """TTT step k at row t must compute what the serving draft computes for a chain node at depth k
    below a root at position t+1: same inputs, positions and visible keys. Checked against
    Eagle3Draft loading the exported checkpoint, for every k and several rows."""
    model, tm = random_draft(target)
    export_draft(model, tm.cfg, tm.feature_layers, tmp_path / "draft")
    serving = Eagle3Draft(tmp_path / "draft", target)
    T, K = 12, 4
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, tm.cfg.vocab_size, (T,), generator=gen)
    features, _ = tm.features_and_logits(tokens[None])
    with torch.no_grad():
        hs = list(ttt_hidden_states(model, tokens[None], features, K))
    kv = serving.new_kv_cache(1, 4)
    g_feat = serving.project(features[0])
    for t in (0, 3, T - K - 2):
        chain_g: list[torch.Tensor] = []  # a chain node's g is the h of the node before it
        for k in range(K):
            # Nodes: prefix rows 0..t (features, ground-truth tokens), then chain nodes 1..k.
            n = t + 1 + k
            g = torch.cat([g_feat[:t + 1], *chain_g])
            next_tokens = tokens[1:t + 2 + k]
            layout = StepLayout((0,), (n,), (torch.empty(0, dtype=torch.long),),
                                (torch.ones(n, n, dtype=torch.bool).tril(),))
            _, _, h = serving.forward(next_tokens, g, torch.arange(n), layout, kv)
            ours = torch.log_softmax(model.logits(hs[k][0, t]).float(), -1)
            torch.testing.assert_close(ours, serving.logprobs(h[-1:])[0], atol=2e-4, rtol=0)
            chain_g.append(h[-1:])


def test_ttt_labels_are_the_target_distribution_of_token_t_plus_2_plus_k(target):
    model, _ = random_draft(target, draft_vocab=101)  # full vocabulary: every argmax is in it
    B, T, V = 2, 10, 101
    tokens = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    # A target certain of the next token: row i predicts tokens[i + 1]; the last row, token 7.
    logits = torch.full((B, T, V), -30.0)
    logits[:, :-1].scatter_(-1, tokens[:, 1:, None], 30.0)
    logits[:, -1, 7] = 30.0
    following = torch.cat([tokens, torch.full((B, 1), 7)], 1)
    ids = model.target_ids.tolist()
    for k, (p, p_argmax, mask) in enumerate(ttt_targets(model, logits, 5)):
        for t in range(T):
            if t + 1 + k < T:  # the draft reads token t+1+k, so it can predict token t+2+k
                assert mask[0, t] and ids[p_argmax[0, t]] == following[0, t + 2 + k]
                assert p[0, t].sum().item() == pytest.approx(1.0, abs=1e-5)
            else:
                assert not mask[0, t]


def test_out_of_vocabulary_targets_are_masked(target):
    model, _ = random_draft(target, draft_vocab=30)
    outside, inside = int((~model.t2d).nonzero()[0]), int(model.target_ids[0])
    logits = torch.zeros(1, 6, 101)
    logits[0, :, inside] = 10.0
    logits[0, 2, outside] = 50.0
    _, _, mask = next(ttt_targets(model, logits, 1))  # step 0, row 1 reads target row 2
    assert not mask[0, 1] and mask[0, 0]


def test_export_has_exactly_sglangs_tensor_names_shapes_and_dtypes(target, tmp_path):
    model, tm = random_draft(target, draft_vocab=40)
    export_draft(model, tm.cfg, tm.feature_layers, tmp_path / "d")
    ours = load_file(str(tmp_path / "d" / "model.safetensors"))
    ref = eagle3_tensors(json.loads((target / "config.json").read_text()), 40, num_heads=4, num_kv_heads=2,
                         head_dim=tm.cfg.head_dim, intermediate_size=96)
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in ref.items()}
    assert ours["d2t"].dtype == torch.int64 and ours["t2d"].dtype == torch.bool
    assert all(v.dtype == torch.float32 for k, v in ours.items() if k not in ("d2t", "t2d"))
    assert torch.equal(ours["d2t"] + torch.arange(40), model.target_ids)
    assert torch.equal(ours["t2d"].nonzero().flatten(), model.target_ids)
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    # SGLang's ids are layer outputs: inputs of layers (2, 2, 1) are written as (1, 1, 0) ...
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 1, 0]
    # ... and the draft service maps them back to the layers the trainer read.
    assert load_draft_config(tmp_path / "d", load_llama_config(target)).feature_layers == (2, 2, 1)


def test_training_features_are_the_serving_targets_features(target):
    """The trainer reads features through transformers; the target service computes them itself.
    Both must be the residual stream at the input of the same layers."""
    tm = TargetModel(target, torch.device("cpu"), torch.float32, feature_layers=(1, 3, 4))
    tokens = [5, 9, 2, 77, 31, 8, 8, 40]
    feats, logits = tm.features_and_logits(torch.tensor([tokens]))
    engine = TargetEngine(LlamaModel(target), num_blocks=16, block_size=4)
    r = engine.step([SequenceStep.chain("f", tokens, create=True, return_features=True)], (1, 3, 4))[0]
    torch.testing.assert_close(feats[0], r.features, atol=1e-5, rtol=0)
    assert r.tokens[0] == int(logits[0, -1].argmax())


def test_draft_vocabulary_is_most_frequent_ascending_with_deterministic_ties():
    seqs = torch.tensor([[7, 7, 7, 3, 3, 9, 9, 1]])
    assert draft_vocabulary(seqs, 12, 2).tolist() == [3, 7]  # 7 (x3), then 3 and 9 tie (x2): 3 wins
    assert draft_vocabulary(seqs, 12, 3).tolist() == [3, 7, 9]
    # Fewer distinct tokens than asked for: filled up with the smallest unused ids.
    assert draft_vocabulary(seqs, 12, 6).tolist() == [0, 1, 2, 3, 7, 9]


def test_batches_are_a_function_of_the_step():
    a = [batch_indices(s, 10, 4, seed=1).tolist() for s in range(6)]
    b = [batch_indices(s, 10, 4, seed=1).tolist() for s in range(6)]
    assert a == b
    assert sorted(a[0] + a[1]) == sorted(set(a[0] + a[1]))  # no repeats within an epoch
    assert batch_indices(0, 3, 8, seed=0).numel() == 8  # fewer sequences than a batch


def test_data_reads_jsonl_text_and_directories(data, tmp_path):
    docs = list(iter_documents([data]))
    assert docs == [TEXT * 3, TEXT.upper()]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(iter_documents([bad]))


def test_config_is_validated():
    with pytest.raises(ValueError, match="prompt_len"):
        TrainConfig(seq_len=32, prompt_len=32)
    with pytest.raises(ValueError, match="ttt_steps"):
        TrainConfig(seq_len=8, prompt_len=2, ttt_steps=7)


def args(target, data, out, *extra: str) -> list[str]:
    return ["--target", str(target), "--data", str(data), "--out", str(out), "--device", "cpu",
            "--num-sequences", "24", "--gen-batch-size", "12", "--seq-len", "32", "--prompt-len", "12",
            "--batch-size", "8", "--draft-vocab-size", "48", "--draft-intermediate-size", "96",
            "--lr", "3e-3", "--warmup", "2", *extra]


def read_log(out) -> list[dict]:
    with (out / "train_log.csv").open() as f:
        return list(csv.DictReader(f))


def test_train_draft_end_to_end_on_cpu(target, data, tmp_path):
    out = tmp_path / "draft"
    assert "train-draft" in COMMANDS
    assert COMMANDS["train-draft"](args(target, data, out, "--steps", "40", "--log-every", "4",
                                        "--eval-every", "20", "--checkpoint-every", "20")) == 0
    rows = [r for r in read_log(out) if r["kind"] == "train"]
    # The loss is a cross-entropy against soft labels, so it falls towards the target's entropy,
    # not to zero: assert a clear drop, and that the draft agrees with the target more often.
    first, last = float(rows[0]["loss"]), float(rows[-1]["loss"])
    assert last < first - 1.5, f"loss did not decrease: {first:.3f} -> {last:.3f}"
    assert sum(float(r["loss"]) for r in rows[-3:]) < sum(float(r["loss"]) for r in rows[:3])
    assert float(rows[-1]["acc0"]) > float(rows[0]["acc0"]) + 0.15
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000020.pt", "step_00000040.pt"]
    # The draft service loads it and drafts a tree with it.
    draft = Eagle3Draft(out, target)
    assert draft.cfg.draft_vocab_size == 48 and draft.cfg.feature_layers == (2, 2, 1)
    engine = DraftEngine(draft, num_blocks=16, block_size=4)
    tokens = list(range(3, 13))
    engine.ingest([IngestItem("r", 0, tuple(tokens), torch.randn(9, draft.cfg.feature_width))])
    tree = engine.draft([DraftItem("r", DraftBudget(steps=3, topk=2, num_draft_tokens=6))])[0]
    assert len(tree.tokens) == 5 and all(t in draft.d2t.tolist() for t in tree.tokens)


def test_resume_continues_exactly_where_an_interrupted_run_stopped(target, data, tmp_path):
    common = ("--steps", "6", "--checkpoint-every", "3", "--eval-every", "3", "--log-every", "1")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(target, data, straight, *common)) == 0
    assert main(args(target, data, resumed, *common, "--stop-after", "3")) == 0
    assert not (resumed / "model.safetensors").exists()
    assert [p.name for p in (resumed / "checkpoints").iterdir()] == ["step_00000003.pt"]
    assert main(args(target, data, resumed, *common, "--resume")) == 0
    a = load_file(str(straight / "model.safetensors"))
    b = load_file(str(resumed / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=name)
    # A resume with settings that change the run is refused rather than mixing two runs.
    with pytest.raises(SystemExit, match="different settings"):
        main(args(target, data, resumed, *common, "--resume", "--ttt-steps", "3"))


def test_ttt_loss_reports_per_step_accuracy(target):
    model, tm = random_draft(target, draft_vocab=101)
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    feats, logits = tm.features_and_logits(tokens)
    r = ttt_loss(model, tokens, feats, logits, steps=7)
    assert r.step_accuracy.shape == (7,) and bool(((r.step_accuracy >= 0) & (r.step_accuracy <= 1)).all())
    assert r.step_rows.tolist() == [2 * (16 - 1 - k) for k in range(7)]
    r.loss.backward()
    assert model.fc.weight.grad is not None and model.embed_tokens.grad is None
