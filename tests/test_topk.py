"""The ranked top-k kernel equals a stable descending sort's first k, ties to the lower index.

Runs interpreted on a CPU (tests/conftest.py sets TRITON_INTERPRET=1) and compiled on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernels.topk import CHUNK, MAX_K, top_k_ranked, top_k_ranked_reference, top_k_ranked_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stable_top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ranked = torch.sort(values, dim=-1, descending=True, stable=True)
    return ranked.values[..., :k], ranked.indices[..., :k]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ties_go_to_the_lower_index_across_chunks_as_a_stable_sort_orders_them(dtype):
    rng = random.Random(3)
    # Widths inside one chunk, at its edge, and over several (the last chunk shorter than k).
    for width in (1, 5, 68, CHUNK, CHUNK + 1, 2 * CHUNK + 7):
        for _ in range(4):
            k = rng.randint(1, min(width, MAX_K))
            # Few distinct values, -inf among them: most of the k places are decided by ties.
            choices = torch.tensor([0.0, -1.0, -2.5, -1e9, float("-inf")], dtype=dtype)
            values = choices[torch.randint(0, len(choices), (3, width), generator=torch.Generator().manual_seed(
                width + k))].to(DEVICE)
            got = top_k_ranked_triton(values, k)
            want = stable_top_k(values, k)
            assert torch.equal(got[1], want[1]), (width, k)
            assert torch.equal(got[0], want[0]), (width, k)


def test_a_vocabulary_wide_row_of_log_probs_gives_the_references_choice():
    width = 32000 if DEVICE == "cuda" else 3000
    rows = 64 if DEVICE == "cuda" else 4
    logits = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logprobs = torch.log_softmax(logits.float(), -1).to(DEVICE)  # bf16 logits: many exact ties
    for k in (1, 4, 8, 16):
        got = top_k_ranked_triton(logprobs.view(rows // 2, 2, width), k)
        want = top_k_ranked_reference(logprobs.view(rows // 2, 2, width), k)
        assert got[0].shape == (rows // 2, 2, k) and got[1].dtype == torch.long
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_a_row_of_nans_gives_indices_inside_the_row():
    values = torch.full((2, 40), float("nan"), device=DEVICE)
    _, index = top_k_ranked_triton(values, 4)
    assert bool(((index >= 0) & (index < 40)).all())


def test_k_outside_the_kernels_range_is_refused_and_the_dispatch_takes_the_reference():
    values = torch.randn(2, 100, device=DEVICE)
    with pytest.raises(ValueError, match="k must be within"):
        top_k_ranked_triton(values, MAX_K + 1)
    with pytest.raises(ValueError, match="k must be within"):
        top_k_ranked_triton(values[:, :3], 4)
    got = top_k_ranked(values, MAX_K + 1, use_triton=True)
    assert torch.equal(got[1], stable_top_k(values, MAX_K + 1)[1])
