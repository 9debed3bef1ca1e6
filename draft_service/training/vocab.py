"""The draft vocabulary: the target's most frequent tokens in the training sequences.

As SpecForge builds it: count every token of the training data, keep the
draft_vocab_size most frequent (ties broken by the smaller id, so the result
is deterministic), fill up with the smallest unused ids when the data has
fewer distinct tokens, and sort ascending. Draft id i is then target id
target_ids[i]; the checkpoint stores d2t[i] = target_ids[i] - i and the mask
t2d over the target vocabulary.
"""

from __future__ import annotations

import torch


def draft_vocabulary(sequences: torch.Tensor, target_vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """int64 [draft_vocab_size] target ids, ascending."""
    if not 0 < draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft vocabulary size must be in 1..{target_vocab_size}, got {draft_vocab_size}")
    counts = torch.bincount(sequences.flatten().long(), minlength=target_vocab_size)[:target_vocab_size]
    # Stable sort on descending count keeps ascending id order among ties.
    order = torch.sort(-counts, stable=True).indices
    return order[:draft_vocab_size].sort().values


def coverage(sequences: torch.Tensor, target_ids: torch.Tensor, target_vocab_size: int) -> float:
    """Share of the tokens in `sequences` that the draft vocabulary holds."""
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return t2d[sequences.flatten().long()].float().mean().item()
