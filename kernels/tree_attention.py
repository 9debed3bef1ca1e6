"""Attention of a step's tree nodes over a paged KV prefix plus their own ancestors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class StepLayout:
    """Where each sequence's nodes sit in the flattened step, and what they see.

    node_starts[r]:node_starts[r]+node_counts[r] are sequence r's rows in q/k/v;
    prefix_slots[r] are the flat cache slots of its committed prefix; masks[r]
    is its [n, n] ancestor-or-self mask.
    """

    node_starts: tuple[int, ...]
    node_counts: tuple[int, ...]
    prefix_slots: tuple[torch.Tensor, ...]
    masks: tuple[torch.Tensor, ...]


def tree_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             cache_k: torch.Tensor, cache_v: torch.Tensor,
                             layout: StepLayout, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; cache_k/v: [blocks, block_size, Hkv, D].

    Returns [T, Hq, D]. Each node attends to its sequence's whole committed
    prefix and to the step nodes that are its ancestors or itself.
    """
    flat_k = cache_k.view(-1, *cache_k.shape[2:])
    flat_v = cache_v.view(-1, *cache_v.shape[2:])
    out = torch.empty_like(q)
    for start, count, slots, mask in zip(layout.node_starts, layout.node_counts,
                                         layout.prefix_slots, layout.masks, strict=True):
        rows = slice(start, start + count)
        keys = torch.cat((flat_k[slots], k[rows]))
        values = torch.cat((flat_v[slots], v[rows]))
        visible = torch.cat((torch.ones(count, len(slots), dtype=torch.bool, device=mask.device), mask), 1)
        attn = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=visible.to(q.device), scale=scale, enable_gqa=True)
        out[rows] = attn.transpose(0, 1)
    return out
