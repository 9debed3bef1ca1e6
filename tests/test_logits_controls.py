"""Logits controls in the target: every decode path decides as transformers' processors do.

Plain decode, tree verification and grants on the tiny GQA model give, token
for token, what `generate` gives with the equivalent logits processors; a tree
whose best path only wins under a penalty is verified as plain decoding would
decide; and sampling with penalties through trees is distributed as plain
sampling (the chi-square test of test_target_verify).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import (
    LlamaForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from tandem.v1 import target_pb2
from target_service import processors
from target_service.controls import ControlColumns, LogitsControls
from target_service.engine import TargetEngine
from target_service.grant import run_grant
from target_service.model import LlamaModel
from target_service.step_batch import StepBatch
from target_service.types import InvalidStep, SamplingParams, SequenceStep
from target_service.wire import GrantStops, batch_from_proto, batch_to_proto
from tests.test_target_verify import TINY_VOCAB, contingency_p
from tests.tiny_models import make_tiny_llama

PROMPT = [7, 3, 21, 40, 11, 9, 7, 3]
N = 14


class OutputPenalties(LogitsProcessor):
    """OpenAI's frequency and presence penalties (no transformers processor exists): a token
    seen c times in the output loses frequency * c + presence * (c > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out = input_ids[:, self.prompt_len:]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_processors(c: LogitsControls) -> LogitsProcessorList:
    """The transformers processors equivalent to `c`, in tandem's (vLLM's) order."""
    out = LogitsProcessorList()
    if c.logit_bias:
        out.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in c.logit_bias]))
    if c.min_tokens:
        out.append(MinNewTokensLengthLogitsProcessor(c.prompt_len, c.min_tokens, list(c.stop_ids)))
    if c.repetition_penalty != 1:
        out.append(RepetitionPenaltyLogitsProcessor(c.repetition_penalty))
    if c.frequency_penalty or c.presence_penalty:
        out.append(OutputPenalties(c.prompt_len, c.frequency_penalty, c.presence_penalty))
    if c.min_p:
        out.append(MinPLogitsWarper(c.min_p))
    return out


@pytest.fixture(scope="module")
def checkpoint(tiny_llama):
    return tiny_llama("gqa")


@pytest.fixture(scope="module")
def model(checkpoint):
    return LlamaModel(checkpoint)


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return LlamaForCausalLM.from_pretrained(checkpoint).eval()


def hf_greedy(hf_model, controls: LogitsControls, prompt=PROMPT, n=N) -> list[int]:
    with torch.no_grad():
        ids = hf_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=0, do_sample=False,
                                logits_processor=hf_processors(controls), pad_token_id=0, eos_token_id=None)
    return ids[0, len(prompt):].tolist()


def new_engine(model) -> TargetEngine:
    return TargetEngine(model, num_blocks=128, block_size=4)


def decode_plain(engine: TargetEngine, rid: str, controls: LogitsControls, n: int = N) -> list[int]:
    out = engine.step([SequenceStep.chain(rid, PROMPT, create=True, controls=controls)])[0].tokens
    while len(out) < n:
        out += engine.step([SequenceStep.chain(rid, [out[-1]], controls=controls)])[0].tokens
    return out[:n]


def draft_tree(pending: int, guess: list[int], decoy: list[int], vocab: int) -> tuple[list[int], list[int]]:
    """A tree below `pending`: at each depth a decoy child first (never the guess), then the
    guessed child, which the next depth hangs below; decoys get a child of their own."""
    tokens, parents = [pending], [-1]
    at = 0
    for depth, tok in enumerate(guess):
        alt = decoy[depth] if decoy[depth] != tok else (tok + 1) % vocab
        tokens += [alt, (alt + 7) % vocab]
        parents += [at, len(tokens) - 2]
        tokens.append(tok)
        parents.append(at)
        at = len(tokens) - 1
    return tokens, parents


def decode_speculative(engine: TargetEngine, rid: str, controls: LogitsControls, guesses: list[int],
                       decoys: list[int], n: int = N, depth: int = 4) -> list[int]:
    """Verification steps whose trees hold `guesses` (with every third token wrong) among decoys."""
    vocab = engine.model.cfg.vocab_size
    out = engine.step([SequenceStep.chain(rid, PROMPT, create=True, controls=controls)])[0].tokens
    while len(out) < n:
        k = len(out)
        guess = list(guesses[k: k + depth]) + [0] * max(0, k + depth - len(guesses))
        guess = [(t + 1) % vocab if (k + i) % 3 == 2 else t for i, t in enumerate(guess)]
        decoy = list(decoys[k: k + depth]) + [1] * max(0, k + depth - len(decoys))
        tokens, parents = draft_tree(out[-1], guess, decoy, vocab)
        res = engine.step([SequenceStep(rid, tuple(tokens), tuple(parents), 1, controls=controls)])[0]
        out += res.tokens
    return out[:n]


def decode_granted(engine: TargetEngine, rid: str, controls: LogitsControls, n: int = N, k: int = 5) -> list[int]:
    out = engine.step([SequenceStep.chain(rid, PROMPT, create=True, controls=controls)])[0].tokens
    while len(out) < n:
        batch = StepBatch.from_items([SequenceStep.chain(rid, [out[-1]], controls=controls)])
        stops = GrantStops(max_new_tokens=np.array([n - len(out)], dtype=np.int32), stop_token_ids=(frozenset(),))
        for step in run_grant(engine.run, batch, stops, k, lambda: False):
            out += step.results.new_tokens[:, 0].tolist()
    return out[:n]


CONTROLS = {
    "repetition": LogitsControls(repetition_penalty=2.5),
    "frequency": LogitsControls(frequency_penalty=1.8),
    "presence": LogitsControls(presence_penalty=2.0, frequency_penalty=-0.3),
    "logit_bias": LogitsControls(logit_bias=((17, -100.0), (50, 6.0), (84, 2.5))),
    "min_tokens": LogitsControls(min_tokens=9, stop_ids=(17, 84, 97)),
    "min_p": LogitsControls(min_p=0.3),
    "all": LogitsControls(repetition_penalty=1.25, frequency_penalty=0.75, presence_penalty=0.375, min_p=0.0625,
                          min_tokens=6, stop_ids=(84,), logit_bias=((50, 3.0), (8, -2.0))),
}


def with_prompt(c: LogitsControls) -> LogitsControls:
    return LogitsControls(**{**c.__dict__, "prompt_len": len(PROMPT)})


@pytest.mark.parametrize("name", list(CONTROLS))
def test_every_decode_path_equals_transformers_generate_with_the_processors(name, model, hf_model):
    controls = with_prompt(CONTROLS[name])
    expected = hf_greedy(hf_model, controls)
    raw = hf_greedy(hf_model, LogitsControls())
    if name != "min_p":  # min_p never changes the argmax; every other control must matter here
        assert expected != raw
    assert decode_plain(new_engine(model), "plain", controls) == expected
    # Trees holding the expected tokens among decoys (the uncontrolled output where it differs).
    assert decode_speculative(new_engine(model), "spec", controls, expected, raw) == expected
    # Trees holding the uncontrolled output: what a draft unaware of the controls proposes.
    assert decode_speculative(new_engine(model), "naive", controls, raw, expected) == expected
    assert decode_granted(new_engine(model), "grant", controls) == expected


def test_a_tree_whose_best_path_wins_only_under_the_penalty_is_verified_as_plain_decoding_decides(model,
                                                                                                    hf_model):
    controls = with_prompt(LogitsControls(frequency_penalty=1.8))
    penalized = hf_greedy(hf_model, controls)
    raw = hf_greedy(hf_model, LogitsControls())
    split = next(i for i, (a, b) in enumerate(zip(penalized, raw)) if a != b)
    engine = new_engine(model)
    out = decode_plain(engine, "t", controls, split)
    # Below the pending token: the uncontrolled continuation first, the penalized one second, each
    # four deep; only under the penalty (counted along each node's own path) does the second win.
    pending = out[-1]
    raw_path, pen_path = raw[split: split + 4], penalized[split: split + 4]
    tokens = [pending] + raw_path + pen_path
    parents = [-1, 0, 1, 2, 3, 0, 5, 6, 7]
    res = engine.step([SequenceStep("t", tuple(tokens), tuple(parents), 1, controls=controls)])[0]
    assert res.accepted_nodes == [5, 6, 7, 8]
    assert res.tokens == penalized[split: split + 5]
    # Without the controls, the same tree keeps the other branch: the test tells them apart.
    bare = new_engine(model)
    decode_plain(bare, "t", LogitsControls(), split)
    # (the bare engine's own prefix differs, so build the raw tree on its own output)
    assert raw[:split] == penalized[:split]
    res = bare.step([SequenceStep("t", tuple(tokens), tuple(parents), 1)])[0]
    assert res.accepted_nodes == [1, 2, 3, 4]


def test_batched_sequences_with_and_without_controls_decide_independently(model, hf_model):
    """One step mixes a penalized tree, a biased plain decode and an uncontrolled prefill."""
    pen = with_prompt(CONTROLS["repetition"])
    bias = with_prompt(CONTROLS["logit_bias"])
    want_pen, want_bias, want_raw = (hf_greedy(hf_model, c, n=6) for c in (pen, bias, LogitsControls()))
    engine = new_engine(model)
    first = engine.step([SequenceStep.chain("p", PROMPT, create=True, controls=pen),
                         SequenceStep.chain("b", PROMPT, create=True, controls=bias)])
    assert [r.tokens[0] for r in first] == [want_pen[0], want_bias[0]]
    tokens, parents = draft_tree(want_pen[0], want_pen[1:5], want_raw[1:5], model.cfg.vocab_size)
    res = engine.step([SequenceStep("p", tuple(tokens), tuple(parents), 1, controls=pen),
                       SequenceStep.chain("b", [want_bias[0]], controls=bias),
                       SequenceStep.chain("r", PROMPT, create=True)])
    assert res[0].tokens == want_pen[1:6]
    assert res[1].tokens == [want_bias[1]]
    assert res[2].tokens == [want_raw[0]]


def test_controls_survive_the_wire_and_out_of_range_values_are_refused(model):
    c = with_prompt(CONTROLS["all"])
    batch = StepBatch.from_items([SequenceStep.chain("a", PROMPT, create=True, controls=c),
                                  SequenceStep.chain("b", PROMPT, create=True)])
    back = batch_from_proto(batch_to_proto(batch))
    assert back.controls.item(0) == c and back.controls.item(1) == LogitsControls()
    # As rank 0 broadcasts a step to the other tensor-parallel ranks: the packed bytes.
    items = batch.items()
    sent = target_pb2.PackedItems.FromString(batch_to_proto(batch).SerializeToString())
    assert batch_from_proto(sent).items() == items
    assert StepBatch.from_items([SequenceStep.chain("a", PROMPT, create=True)]).controls is None
    engine = new_engine(model)
    for bad in (LogitsControls(repetition_penalty=0.0), LogitsControls(frequency_penalty=2.5),
                LogitsControls(min_p=1.5), LogitsControls(logit_bias=((5, 101.0),)),
                LogitsControls(logit_bias=((model.cfg.vocab_size, 1.0),)), LogitsControls(min_tokens=-1)):
        with pytest.raises(InvalidStep):
            engine.step([SequenceStep.chain("x", PROMPT, create=True, controls=bad)])
    assert engine.load().num_sequences == 0
    # Penalties need the counts from the sequence's first step on.
    engine.step([SequenceStep.chain("late", PROMPT, create=True)])
    with pytest.raises(InvalidStep, match="first step"):
        engine.step([SequenceStep.chain("late", [5], controls=LogitsControls(repetition_penalty=2.0))])
    assert isinstance(ControlColumns.from_items([c]), ControlColumns)


def test_released_sequences_give_their_counts_back(model):
    engine = new_engine(model)
    c = with_prompt(CONTROLS["repetition"])
    engine.step([SequenceStep.chain(f"s{i}", PROMPT, create=True, controls=c) for i in range(6)])
    assert len(engine.penalty_history.slots) == 6
    engine.release([f"s{i}" for i in range(6)])
    assert not engine.penalty_history.slots
    # A slot used again starts from zero: a new sequence decodes as on a fresh engine.
    assert decode_plain(engine, "again", c, 6) == decode_plain(new_engine(model), "again", c, 6)


# --- sampling with controls keeps the target distribution --------------------------------

SAMPLED = LogitsControls(repetition_penalty=1.6, frequency_penalty=0.6, presence_penalty=0.3, min_p=0.05,
                         logit_bias=((4, 1.0),), prompt_len=3)
TRIALS = 3000


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    d = make_tiny_llama(tmp_path_factory.mktemp("v6c") / "m", "gqa", vocab_size=TINY_VOCAB, seed=3)
    return LlamaModel(d)


def sample_three_tokens(model, speculate: bool, trials: int, seed0: int) -> list[tuple[int, int, int]]:
    """(t1, t2, t3) after a fixed prompt for many seeded, penalized sequences at once; with
    speculate, t2 (and t3 when a child is kept) come from verifying a two-level tree."""
    engine = TargetEngine(model, num_blocks=trials * 3, block_size=4)
    sp = lambda i: SamplingParams(temperature=1.0, top_k=5, seed=seed0 + i)  # noqa: E731
    firsts = engine.step([SequenceStep.chain(f"s{i}", [1, 2, 1], create=True, sampling=sp(i), controls=SAMPLED)
                          for i in range(trials)])
    out = [list(r.tokens) for r in firsts]
    if speculate:
        # Children 3 and 5 (not in the prompt, often kept), each with itself and another token below:
        # whether the child repeats depends on counting the child, a drafted node, on its own path.
        tree = lambda t: (t, 3, 3, 0, 5, 5, 2)  # noqa: E731
        parents = (-1, 0, 1, 1, 0, 4, 4)
        items = [SequenceStep(f"s{i}", tree(o[0]), parents, 1, sampling=sp(i), controls=SAMPLED)
                 for i, o in enumerate(out)]
    else:
        items = [SequenceStep.chain(f"s{i}", [o[0]], sampling=sp(i), controls=SAMPLED) for i, o in enumerate(out)]
    for o, r in zip(out, engine.step(items), strict=True):
        o += r.tokens
    short = [i for i, o in enumerate(out) if len(o) < 3]
    if short:
        more = engine.step([SequenceStep.chain(f"s{i}", [out[i][-1]], sampling=sp(i), controls=SAMPLED)
                            for i in short])
        for i, r in zip(short, more, strict=True):
            out[i] += r.tokens
    return [tuple(o[:3]) for o in out]


@pytest.fixture(scope="module")
def plain_samples(tiny_vocab_model):
    return sample_three_tokens(tiny_vocab_model, False, TRIALS, seed0=0)


def test_speculative_sampling_with_penalties_keeps_the_target_distribution(tiny_vocab_model, plain_samples):
    spec = sample_three_tokens(tiny_vocab_model, True, TRIALS, seed0=50_000)
    assert contingency_p(plain_samples, spec) > 0.001  # 0.40 when written


def test_counting_only_committed_tokens_at_tree_nodes_is_caught(tiny_vocab_model, plain_samples, monkeypatch):
    """A tail that ignores the tree's drafted ancestors (counts from the committed tokens and
    the fixed chain only) samples from the wrong distribution, and the test sees it."""
    real = processors._node_context_counts

    def fixed_only(views, ctl, seqs, vocab):
        saved = views["mask"].clone()
        row_tree = views["row_tree"]
        # Keep each row's bits for fixed nodes only (drafted nodes sit after the root).
        first = views["seq_info"].view(-1, 4)[:, 1].long()[views["row_seq"].long().clamp(min=0)]
        local = torch.arange(views["mask"].shape[0], device=saved.device) - first
        fixed_bits = torch.where(row_tree == -1, local, -1)
        nf = torch.zeros(views["seq_info"].view(-1, 4).shape[0], dtype=torch.long)
        nf.scatter_reduce_(0, views["row_seq"].long().clamp(min=0), fixed_bits, "amax")
        limit = nf[views["row_seq"].long().clamp(min=0)] + 1
        keep = torch.where(limit >= 64, torch.tensor(-1), (torch.tensor(1) << limit) - 1)
        views["mask"][:, 0] &= keep
        try:
            return real(views, ctl, seqs, vocab)
        finally:
            views["mask"].copy_(saved)

    monkeypatch.setattr(processors, "_node_context_counts", fixed_only)
    spec = sample_three_tokens(tiny_vocab_model, True, TRIALS, seed0=50_000)
    assert contingency_p(plain_samples, spec) < 1e-6  # 1e-22 when written


def test_graph_buckets_with_controls_decide_as_the_eager_step(checkpoint):
    """Padded bucket buffers (captured graphs on a GPU; the same buffers eagerly on CPU) replay
    the forward and run the controls' tail eagerly, with the eager step's results."""
    from tests.test_target_graphs import DEVICE, engines, run_both, tree_with_path

    eager, graphs = engines((LlamaModel(checkpoint, device=DEVICE, attention_backend="torch"),
                             LlamaModel(checkpoint, device=DEVICE, attention_backend="triton")))
    controls = {"a": with_prompt(CONTROLS["all"]), "b": with_prompt(CONTROLS["frequency"]),
                "c": LogitsControls()}
    first = run_both(eager, graphs, [SequenceStep.chain(r, PROMPT, create=True, controls=c)
                                     for r, c in controls.items()])
    last = {r.request_id: r.tokens[-1] for r in first}
    for step in range(5):
        items = []
        for i, (rid, c) in enumerate(controls.items()):
            if (step + i) % 2:
                items.append(SequenceStep.chain(rid, [last[rid]], controls=c))
            else:
                toks, parents = tree_with_path(last[rid], [(last[rid] * 7 + k) % 97 for k in range(3)], {1: [5]})
                items.append(SequenceStep(rid, tuple(toks), tuple(parents), 1, controls=c))
        items = items if step % 2 else items[:2]  # 3 sequences pad to a bucket of 4
        last.update({r.request_id: r.tokens[-1] for r in run_both(eager, graphs, items)})
    assert graphs.graphs.replays == 6  # the prompts (a 3 x 8 chunk step, in the 4 x 8 bucket) and the five steps
