"""Forced proposals (the scale track): greedy verification accepts runs at the set rate."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from draft_service.forcing import ForcedProposals, ForcingConfig, load_records
from draft_service.types import DraftTree
from tandem.tree import children
from target_service.acceptance import accept_greedy

PROMPT = [5, 6, 7]
CONTINUATION = [11, 12, 13, 14, 15, 16, 17, 18]
VOCAB = 50


def wide_tree(root_position: int, depth: int = 5, width: int = 3) -> DraftTree:
    """`width` children per main-path node; the middle one has the best score."""
    tokens, parents, depths, scores = [], [], [], []
    parent = -1
    for d in range(1, depth + 1):
        level = []
        for w in range(width):
            tokens.append(40 + w)  # the draft's own (wrong) guesses
            parents.append(parent)
            depths.append(d)
            scores.append(-d - (0.0 if w == 1 else 1.0))
            level.append(len(tokens) - 1)
        parent = level[1]
    return DraftTree("r", CONTINUATION[0], root_position, tokens, parents, depths, [0.0] * len(tokens), scores)


def accepted_by_target(tree: DraftTree, truth: list[int]) -> int:
    """Greedy verification against a target whose argmax is `truth` along the sequence."""
    tokens = [tree.root_token] + tree.tokens
    parents = [-1] + [p + 1 for p in tree.parents]
    depth_of = [0] + tree.depths
    argmax_of = {n: truth[depth_of[n]] for n in range(len(tokens)) if depth_of[n] < len(truth)}
    return len(accept_greedy(tokens, children(parents), 0, argmax_of).accepted)


@pytest.fixture
def record(tmp_path):
    path = tmp_path / "record.jsonl"
    path.write_text(json.dumps({"tokens": PROMPT + CONTINUATION}) + "\n")
    return path


def forced(record, acceptance: float, seed: int = 0) -> ForcedProposals:
    cfg = ForcingConfig(str(record), acceptance, seed)
    return ForcedProposals(cfg, load_records(cfg.record), VOCAB)


@pytest.mark.parametrize("acceptance, expected", [(1.0, 5), (0.0, 0)])
def test_certain_rates_accept_all_or_nothing(record, acceptance, expected):
    known = PROMPT + CONTINUATION[:1]  # committed prompt, then the pending first output token
    tree = forced(record, acceptance).rewrite(wide_tree(len(known) - 1), known)
    assert accepted_by_target(tree, CONTINUATION[1:]) == expected


def test_mean_run_matches_the_geometric_law(record):
    rate, depth = 0.7, 5
    forcing = forced(record, rate)
    known = PROMPT + CONTINUATION[:1]
    runs = []
    for seed in range(2000):
        forcing.cfg = ForcingConfig(forcing.cfg.record, rate, seed)
        runs.append(accepted_by_target(forcing.rewrite(wide_tree(len(known) - 1, depth), known), CONTINUATION[1:]))
    expected = sum(rate ** k for k in range(1, depth + 1))
    assert abs(sum(runs) / len(runs) - expected) < 0.1
    assert forcing.forced == 2000 and forcing.unmatched == 0


def test_requests_on_one_record_meet_the_same_runs_whatever_their_ids(record):
    """Common random numbers: `always` and `auto` (two requests, two ids) drafting from the same
    position of one prompt are forced to the same run, so a comparison of modes is not one of draws."""
    rate = 0.5
    known = PROMPT + CONTINUATION[:1]
    runs = {}
    for request_id in ("always-7", "auto-42"):
        forcing = forced(record, rate)
        runs[request_id] = []
        for position in range(len(known) - 1, len(known) + 29):
            tree = replace(wide_tree(position), request_id=request_id)
            runs[request_id].append(accepted_by_target(forcing.rewrite(tree, known), CONTINUATION[1:]))
    assert runs["always-7"] == runs["auto-42"]
    assert len(set(runs["always-7"])) > 1  # the draws still vary with the position


def test_requests_off_their_record_keep_the_drafted_tokens(record):
    forcing = forced(record, 1.0)
    tree = wide_tree(3)
    assert forcing.rewrite(tree, PROMPT + [99]) == tree  # a different committed token
    assert forcing.rewrite(tree, [1, 2, 3, 4]) == tree  # another prompt
    assert forcing.unmatched == 2


def test_bad_record_files_are_refused(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_records(bad)
    with pytest.raises(ValueError, match="acceptance"):
        ForcingConfig(str(bad), 1.5)


def test_draft_command_refuses_a_bad_record_before_loading(tmp_path):
    import subprocess
    import sys

    from tests.services import REPO

    out = subprocess.run([sys.executable, "-m", "tandem.cli", "draft", "--model", str(tmp_path), "--target-model",
                          str(tmp_path), "--port", "0", "--force-record", str(tmp_path / "missing.jsonl")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    assert "error:" in out.stderr and "missing.jsonl" in out.stderr and "Traceback" not in out.stderr
