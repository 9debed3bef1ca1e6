"""The step tail's two greedy paths decide alike: the device one (tensor ops, what CUDA
graphs capture) and the host one (a Python walk, what a CPU runs), on random trees."""

from __future__ import annotations

import random

import numpy as np
import torch

from target_service.step_batch import StepBatch
from target_service.step_inputs import SAMPLING_REGIONS, InputShape, layout_for, max_tree, pack_step
from target_service.step_tail import StepTail, output_width
from target_service.types import SequenceStep

VOCAB = 11


def random_tree(rng: random.Random, size: int) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return [rng.randrange(VOCAB) for _ in range(size)], parents


def tail_for(items: list[SequenceStep], *, row_invariant: bool = False, spare_nodes: int = 1,
             device: str = "cpu") -> tuple[StepTail, StepBatch, InputShape]:
    """A step tail over the packed views of these items (a padding sequence, spare rows and
    `spare_nodes` of tree width beside them), on `device`."""
    batch = StepBatch.from_items(items)
    M = max_tree(batch)
    shape = InputShape(rows=int(batch.num_nodes.sum()) + 3, seqs=batch.size + 1, tree=M + spare_nodes, tiles=64,
                       updates=1, words=1)
    layout = layout_for(shape)
    buf = np.zeros(layout.size, dtype=np.int32)
    host_table = np.arange(64 * 8).reshape(64, 8)
    pack_step(batch, prefix_lens=np.full(batch.size, 3), table_rows=np.arange(batch.size), updates={},
              shape=shape, views=layout.host_views(buf), per_tile=16, padding_row=63, padding_update=0,
              host_table=host_table, block_size=4, trash_slot=999)
    views = layout.device_views(torch.from_numpy(buf).to(device))
    tail = StepTail(views=views, seqs=shape.seqs, tree=shape.tree, trash_slot=999,
                    block_table=torch.zeros(65, 8, dtype=torch.int32, device=device), k_cache=None, v_cache=None,
                    use_triton=False, row_invariant=row_invariant)
    return tail, batch, shape


def test_host_and_device_greedy_tails_agree_on_random_trees_with_duplicate_siblings():
    rng = random.Random(5)
    longest = 0
    for trial in range(46):
        plain = trial >= 40  # the last trials plain decode: one node each, nothing drafted
        items = []
        for b in range(rng.randint(1, 5)):
            tokens, parents = random_tree(rng, 1 if plain else rng.randint(1, 9))
            items.append(SequenceStep(f"s{b}", tuple(tokens), tuple(parents), 1))
        tail, batch, shape = tail_for(items)
        views = tail.v
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


def test_the_row_invariant_tail_decides_as_the_default_and_its_log_probs_agree_on_every_path():
    """The batch-invariant mode's tail (kernels.logsumexp, interpreted here) against torch's
    log-sum-exp: the same tokens and kept paths; log-probs within float32 rounding, for greedy,
    sampled and top log-probs, in a tree step and in a plain one (M = 1). On a GPU machine the
    tensors live on the GPU, where the compiled kernel runs (Triton cannot read host tensors)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(9)
    trees = [SequenceStep(f"s{b}", *random_tree(rng, size), 1) for b, size in enumerate((5, 1, 8))]
    plain = [SequenceStep.chain(f"p{b}", (rng.randrange(VOCAB),)) for b in range(3)]
    for items, spare in ((trees, 1), (plain, 0)):
        default, _, shape = tail_for(items, spare_nodes=spare, device=device)
        invariant, _, _ = tail_for(items, row_invariant=True, spare_nodes=spare, device=device)
        logits = 3 * torch.randn(shape.seqs * shape.tree, VOCAB,
                                 generator=torch.Generator().manual_seed(len(items))).to(device)
        width = output_width(shape.tree, 2)
        for decide in ("greedy", "sampled"):
            outs = []
            for tail in (default, invariant):
                decided = tail.greedy(logits)
                if decide == "sampled":
                    decided = tail.sampled(logits, decided)
                out = torch.zeros((shape.seqs, width), dtype=torch.int32, device=device)
                kept = tail.pack(decided, out, top_k=2, logits=logits)
                outs.append((kept, out))
            (kept_a, out_a), (kept_b, out_b) = outs
            assert torch.equal(kept_a, kept_b)
            as_float = (out_a.view(torch.float32), out_b.view(torch.float32))
            M = shape.tree
            if M == 1:  # count, bonus, token, log-prob, 1, then top ids and log-probs
                ints, floats = [0, 1, 2, 4, 5, 6], [3, 7, 8]
            else:
                ints = [0, 1, *range(2, 2 + M), *range(2 + 2 * M, 2 + 3 * M + M * 2)]
                floats = [*range(2 + M, 2 + 2 * M), *range(2 + 3 * M + M * 2, width)]
            assert torch.equal(out_a[:, ints], out_b[:, ints]), decide
            torch.testing.assert_close(as_float[0][:, floats], as_float[1][:, floats], rtol=1e-6, atol=1e-6)


def test_a_step_packed_without_attention_metadata_or_sampling_differs_only_in_those_regions():
    """A CPU's eager step without logits controls skips the sequence info, tiles and mask words
    (the torch attention takes its own description), and a greedy one decided on the host the
    sampling columns; every other region is packed alike."""
    rng = random.Random(3)
    for trial in range(12):
        items = []
        for b in range(rng.randint(1, 5)):
            if rng.random() < 0.4:  # a plain decode or a prompt chunk
                items.append(SequenceStep.chain(f"s{b}", tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 6)))))
            else:
                tokens, parents = random_tree(rng, rng.randint(1, 9))
                items.append(SequenceStep(f"s{b}", tuple(tokens), tuple(parents), 1))
        batch = StepBatch.from_items(items)
        R = int(batch.num_nodes.sum())
        shape = InputShape(rows=R + 2, seqs=batch.size + 1, tree=max_tree(batch), tiles=R + 1, updates=2, words=1)
        layout = layout_for(shape)
        packed = {}
        for metadata, sampling, fill in ((True, True, 0), (False, True, -3), (True, False, -3)):
            buf = np.full(layout.size, fill, dtype=np.int32)
            pack_step(batch, prefix_lens=np.arange(batch.size) + 5, table_rows=np.arange(batch.size),
                      updates={3: 7}, shape=shape, views=layout.host_views(buf), per_tile=4, padding_row=63,
                      padding_update=0, host_table=np.arange(64 * 8).reshape(64, 8), block_size=4, trash_slot=999,
                      attention_metadata=metadata, sampling=sampling)
            packed[metadata, sampling] = buf
        for skipped, regions in (((False, True), ("seq_info", "tiles", "mask")), ((True, False), SAMPLING_REGIONS)):
            for name, (at, n) in layout.spans.items():
                same = np.array_equal(packed[True, True][at: at + n], packed[skipped][at: at + n])
                assert same == (name not in regions), (trial, skipped, name)
