"""The step tail's two greedy paths decide alike: the device one (tensor ops, what CUDA
graphs capture) and the host one (a Python walk, what a CPU runs), on random trees."""

from __future__ import annotations

import random

import numpy as np
import torch

from target_service.step_batch import StepBatch
from target_service.step_inputs import InputShape, layout_for, max_tree, pack_step
from target_service.step_tail import StepTail, output_width
from target_service.types import SequenceStep

VOCAB = 11


def random_tree(rng: random.Random, size: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return [rng.randrange(VOCAB) for _ in range(size)], parents


def test_host_and_device_greedy_tails_agree_on_random_trees_with_duplicate_siblings():
    rng = random.Random(5)
    longest = 0
    for trial in range(40):
        items = []
        for b in range(rng.randint(1, 5)):
            tokens, parents = random_tree(rng, rng.randint(1, 9))
            items.append(SequenceStep(f"s{b}", tuple(tokens), tuple(parents), 1))
        batch = StepBatch.from_items(items)
        M = max_tree(batch)
        shape = InputShape(rows=int(batch.num_nodes.sum()) + 3, seqs=batch.size + 1, tree=M + 1, tiles=64,
                           updates=1, words=1)
        layout = layout_for(shape)
        buf = np.zeros(layout.size, dtype=np.int32)
        host_table = np.arange(64 * 8).reshape(64, 8)
        pack_step(batch, prefix_lens=np.full(batch.size, 3), table_rows=np.arange(batch.size), updates={},
                  shape=shape, views=layout.host_views(buf), per_tile=16, padding_row=63, padding_update=0,
                  host_table=host_table, block_size=4, trash_slot=999)
        views = layout.device_views(torch.from_numpy(buf))
        tail = StepTail(views=views, seqs=shape.seqs, tree=shape.tree, trash_slot=999,
                        block_table=torch.zeros(65, 8, dtype=torch.int32), k_cache=None, v_cache=None,
                        use_triton=False)
        # Logits whose argmax is often a drafted child, so paths of several nodes are kept.
        logits = torch.randn(shape.seqs * shape.tree, VOCAB, generator=torch.Generator().manual_seed(trial))
        tokens = views["tokens"][views["tree_row"].long()]
        favour = torch.rand(len(tokens), generator=torch.Generator().manual_seed(100 + trial)) < 0.7
        child_token = tokens.roll(-1)
        logits[favour, child_token[favour].long()] += 10
        device_out = torch.full((shape.seqs, output_width(shape.tree, 0)), -7, dtype=torch.int32)
        host_out = device_out.clone()
        kept_device = tail.pack(tail.greedy(logits), device_out)
        kept_host = tail.greedy_on_host(logits, host_out)
        assert torch.equal(kept_device, kept_host), trial
        B = batch.size
        count = device_out[:B, 0]
        longest = max(longest, int(count.max()))
        assert torch.equal(count, host_out[:B, 0]) and torch.equal(device_out[:B, 1], host_out[:B, 1])
        for b in range(B):
            n = int(count[b]) + 1
            for lo in (2, 2 + shape.tree):  # new tokens, their log-probs
                assert torch.equal(device_out[b, lo: lo + n], host_out[b, lo: lo + n]), (trial, b)
            lo = 2 + 2 * shape.tree  # kept nodes
            assert torch.equal(device_out[b, lo: lo + n - 1], host_out[b, lo: lo + n - 1]), (trial, b)
        assert torch.equal(tail.committed_rows(kept_device), tail.committed_rows(kept_host))
    assert longest >= 3, "no trial kept a path of several drafted nodes"
