"""Batch-invariant kernels (issue 19): a row's result does not depend on what else is in the call.

Each op is checked two ways: a row computed alone and the same row computed
among 1, 7 and 63 others are bitwise equal, and the result is the torch
reference's within tolerance. Tree attention is also checked against the plain
decode of the same token: the property that makes a verify step's accepted
tokens the tokens plain decoding would give. On CPU the kernels run under
TRITON_INTERPRET=1 on small shapes.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import invariant_attention, matmul
from kernels.invariant_attention import (
    MAX_TAIL,
    SPLIT_LEN,
    ancestor_tails,
    plan_invariant,
    row_sequences,
    tree_attention_invariant,
)
from kernels.logsumexp import BLOCK as LSE_BLOCK
from kernels.logsumexp import logsumexp_reference, logsumexp_rows
from kernels.matmul import (
    BLOCK_K,
    BLOCK_M,
    MAX_SPLITS,
    MIN_K_PER_SPLIT,
    SPLIT_K_PROGRAMS,
    WIDE_BLOCK_M,
    WIDE_BLOCK_N,
    WIDE_FROM_M,
    block_n_for,
    k_splits_for,
    linear_invariant,
    tiles_for,
)
from kernels.rmsnorm import add_rms_norm_triton, rms_norm_triton
from kernels.tree_attention import StepLayout
from kernels.tree_metadata import metadata_from_layout, packed_mask
from tandem.tree import ancestor_mask
from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import InvalidStep, SequenceStep
from tests.services import REPO
from tests.test_kernels import (
    BRANCHY,
    CHAIN_THEN_TREE,
    DEVICES,
    SHAPES,
    TOL,
    Step,
    chain,
    make_step,
    random_tree,
    reference,
    scenarios,
)

OTHERS = (1, 7, 63)
# The linear layer also among 127 and 511 others: from WIDE_FROM_M rows it takes wider tiles.
LINEAR_OTHERS = (*OTHERS, 127, 511)
DTYPES = [torch.float32, torch.bfloat16]


def spy_launches(monkeypatch, module, name: str) -> list[tuple[int, ...]]:
    """The grids of module.<name>'s launches from now on (the kernel still runs)."""
    launches: list[tuple[int, ...]] = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(module, name, Spy())
    return launches


def _among(row: torch.Tensor, others: int, seed: int, where: int) -> tuple[torch.Tensor, int]:
    """`row` ([1, ...]) placed at index `where` (clamped) among `others` random rows."""
    g = torch.Generator(row.device).manual_seed(seed)
    rest = torch.randn(others, *row.shape[1:], generator=g, device=row.device).to(row.dtype)
    at = min(where, others)
    return torch.cat((rest[:at], row, rest[at:])), at


# --- linear ---------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("others", LINEAR_OTHERS)
@pytest.mark.parametrize("splits", [1, 3], ids=["one_split", "split_k"])
def test_a_linear_row_alone_equals_the_same_row_among_others(device, dtype, others, splits):
    g = torch.Generator(device).manual_seed(0)
    # Sizes that are not multiples of the tiles, so edge tiles are masked: K = 136
    # is three BLOCK_K steps, the last 8 wide, so split-K runs three splits of one
    # step each and the partials kernel sums three.
    weight = torch.randn(100, 136, generator=g, device=device).to(dtype)
    bias = torch.randn(100, generator=g, device=device).to(dtype)
    row = torch.randn(1, 136, generator=g, device=device).to(dtype)
    alone = linear_invariant(row, weight, bias, splits=splits)
    # First, middle and last row, and the last row of a first tile of either shape.
    for where in (0, others // 2, others, BLOCK_M - 1, WIDE_BLOCK_M - 1):
        batch, at = _among(row, others, seed=others + where, where=where)
        together = linear_invariant(batch, weight, bias, splits=splits)
        assert torch.equal(together[at], alone[0]), f"row at {at} of {others + 1}"
    expect = F.linear(row.float(), weight.float(), bias.float())
    torch.testing.assert_close(alone.float(), expect, **TOL[dtype])


def test_the_linear_layer_takes_wider_tiles_from_wide_from_m_rows_except_without_tensor_cores():
    assert 1 < WIDE_FROM_M <= max(LINEAR_OTHERS) + 1  # the test above crosses the switch
    small, wide = tiles_for(WIDE_FROM_M - 1, 4096), tiles_for(WIDE_FROM_M, 4096)
    assert small[:2] == (BLOCK_M, block_n_for(4096)) and wide[:2] == (WIDE_BLOCK_M, WIDE_BLOCK_N)
    # float32 at IEEE precision has no tensor cores: small tiles at every M.
    assert tiles_for(4096, 4096, tensor_cores=False)[:2] == small[:2]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_wide_call_sums_its_splits_in_the_program_bitwise_as_the_partials_kernel(device, dtype, monkeypatch):
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 on the GPU has no tensor cores: its calls all take the small tiles")
    if device == "cuda" and not matmul._tma_fits(torch.zeros(1, 8, device=device), torch.zeros(1, 8, device=device)):
        pytest.skip("this GPU has no TMA: wide calls take the pointer kernel")
    g = torch.Generator(device).manual_seed(1)
    # 200 rows: two wide row tiles, the second masked; N = 100 and K = 200 leave edge tiles, and
    # four splits of one BLOCK_K step each, the last half past K, loaded as zeros.
    weight = torch.randn(100, 200, generator=g, device=device).to(dtype)
    bias = torch.randn(100, generator=g, device=device).to(dtype)
    x = torch.randn(200, 200, generator=g, device=device).to(dtype)
    wide_launches = spy_launches(monkeypatch, matmul, "_wide_linear_kernel")
    sum_launches = spy_launches(monkeypatch, matmul, "_sum_splits_kernel")
    in_program = linear_invariant(x, weight, bias, splits=4)
    assert len(wide_launches) == 1 and wide_launches[0][2] == 1 and not sum_launches
    monkeypatch.setattr(matmul, "WIDE_SPLITS_IN_PROGRAM", 0)
    tma_partials = linear_invariant(x, weight, bias, splits=4)
    assert wide_launches[1][2] == 4 and len(sum_launches) == 1
    monkeypatch.setattr(matmul, "WIDE_TMA", 0)
    pointer_partials = linear_invariant(x, weight, bias, splits=4)
    assert len(wide_launches) == 2 and len(sum_launches) == 2
    assert torch.equal(in_program, tma_partials) and torch.equal(in_program, pointer_partials)
    alone = linear_invariant(x[150:151], weight, bias, splits=4)  # the small tiles, partials summed apart
    assert torch.equal(in_program[150], alone[0])
    torch.testing.assert_close(in_program.float(), F.linear(x.float(), weight.float(), bias.float()), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("others", OTHERS)
def test_a_log_sum_exp_row_alone_equals_the_same_row_among_others(device, others):
    g = torch.Generator(device).manual_seed(others)
    vocab = 2 * LSE_BLOCK + 37  # two whole chunks and a masked one
    row = 4 * torch.randn(1, vocab, generator=g, device=device)
    row[0, :5] = float("-inf")  # masked tokens
    alone = logsumexp_rows(row)
    for where in (0, others // 2, others):
        batch, at = _among(row, others, seed=others + where, where=where)
        assert torch.equal(logsumexp_rows(batch)[at], alone[0]), f"row at {at} of {others + 1}"
    torch.testing.assert_close(alone, logsumexp_reference(row), rtol=1e-6, atol=1e-6)
    # A row with every token masked gives -inf, not NaN.
    assert logsumexp_rows(torch.full((2, vocab), float("-inf"), device=device)).eq(float("-inf")).all()


# Llama-3.1-8B's weights [N, K], whole and halved by TP=2.
LLAMA_8B_WEIGHTS = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
                    "down_proj": (4096, 14336), "lm_head": (128256, 4096), "qkv_tp2": (3072, 4096),
                    "o_proj_tp2": (4096, 2048), "gate_up_tp2": (14336, 4096), "down_proj_tp2": (4096, 7168)}


@pytest.mark.parametrize("name", list(LLAMA_8B_WEIGHTS))
def test_linear_splits_k_until_a_decode_row_has_enough_programs(name):
    n, k = LLAMA_8B_WEIGHTS[name]
    splits, k_per_split = k_splits_for(n, k)
    column_tiles = -(-n // block_n_for(n))
    # Enough programs, unless the splits would get shorter than MIN_K_PER_SPLIT (or more than MAX_SPLITS).
    assert column_tiles * splits >= SPLIT_K_PROGRAMS or splits == min(k // MIN_K_PER_SPLIT, MAX_SPLITS)
    assert (splits == 1) == (column_tiles >= SPLIT_K_PROGRAMS)  # wide weights keep the single kernel
    assert k_per_split % BLOCK_K == 0 and (splits - 1) * k_per_split < k <= splits * k_per_split  # none empty


@pytest.mark.parametrize("device", DEVICES)
def test_linear_keeps_leading_dimensions_and_rejects_a_weight_that_does_not_fit(device):
    x = torch.randn(2, 3, 8, device=device)
    weight = torch.randn(5, 8, device=device)
    assert linear_invariant(x, weight).shape == (2, 3, 5)
    torch.testing.assert_close(linear_invariant(x, weight), F.linear(x, weight), **TOL[torch.float32])
    with pytest.raises(ValueError, match="does not fit"):
        linear_invariant(x, torch.randn(5, 7, device=device))


# --- RMSNorm --------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("others", OTHERS)
def test_an_rms_norm_row_alone_equals_the_same_row_among_others(device, dtype, others):
    g = torch.Generator(device).manual_seed(1)
    weight = torch.randn(48, generator=g, device=device).to(dtype)
    row = torch.randn(1, 48, generator=g, device=device).to(dtype)
    residual = torch.randn(1, 48, generator=g, device=device).to(dtype)
    alone = rms_norm_triton(row, weight, 1e-5)
    alone_sum, alone_normed = add_rms_norm_triton(row, residual, weight, 1e-5)
    batch, at = _among(row, others, seed=others, where=others // 2)
    residuals, _ = _among(residual, others, seed=others + 1, where=others // 2)
    assert torch.equal(rms_norm_triton(batch, weight, 1e-5)[at], alone[0])
    total, normed = add_rms_norm_triton(batch, residuals, weight, 1e-5)
    assert torch.equal(total[at], alone_sum[0]) and torch.equal(normed[at], alone_normed[0])
    xf = row.float()
    expect = weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    torch.testing.assert_close(alone.float(), expect, **TOL[dtype])


# --- which ancestors a node sees -----------------------------------------------------


def _brute_tails(parents: list[int]) -> list[tuple[int, list[int]]]:
    """(chain length, the rest of its ancestors in depth order) per node."""
    out = []
    for i in range(len(parents)):
        path, j = [], i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path.reverse()
        c = 0
        while c < len(path) and path[c] == c:
            c += 1
        out.append((c, path[c:]))
    return out


@pytest.mark.parametrize("parents", [[-1], chain(70), BRANCHY, CHAIN_THEN_TREE, random_tree(40, 5),
                                     chain(66) + [64, 66, 67], [-1, 0, 0, 2, 3, 4]],
                         ids=["one", "chain70", "branchy", "chain_then_tree", "random40", "chain_then_branch",
                              "side_chain"])
def test_ancestor_tails_list_each_nodes_ancestors_past_its_leading_chain(parents):
    mask = ancestor_mask(parents).numpy()
    words = -(-len(parents) // 64)
    tails = ancestor_tails(torch.from_numpy(packed_mask(mask, words)))
    expect = _brute_tails(parents)
    for i, (c, rest) in enumerate(expect):
        assert int(tails.chain[i]) == c
        assert int(tails.depth[i]) == c + len(rest)
        assert tails.tail[i, : len(rest)].tolist() == rest


# --- tree attention ----------------------------------------------------------------


# On CPU the sequences are a few dozen keys, so splits are lowered there to give rows
# several splits (three, so that the order they are folded in shows), and rows over
# max_splits * split_len keys splits of doubled length. The bitwise tests (rows of ~20
# keys) take the smallest tiles too; the comparisons with the reference keep the default
# tile, since the interpreter's time goes by tiles visited: their longer rows ("wide",
# "prefill_chunk") still split, and double. The GPU runs the defaults.
SPLITS = {"cpu": dict(block_n=8, split_len=8, max_splits=3), "cuda": {}}
REFERENCE_SPLITS = {"cpu": dict(split_len=32, max_splits=2), "cuda": {}}


# Rows per program: the one-row kernel, and the multi-row one with four rows of a sequence per
# program (4 nodes x 4 heads fill the 16 M-rows for GQA group 4; group 1 leaves 12 spare) and
# with eight (a 32-row tile for group 4).
ROWS = [1, 4, 8]


def run_invariant(step: Step, splits: dict[str, dict[str, int]] = SPLITS, rows: int = 1) -> torch.Tensor:
    return tree_attention_invariant(step.q, step.k, step.v, step.cache_k, step.cache_v, step.layout, 0.17,
                                    rows_per_program=rows, **splits[step.q.device.type])


@pytest.fixture
def split_programs(monkeypatch) -> None:
    """Launches of few rows give each split a program of its own, folded by a second kernel,
    and launches of many rows fold a row's splits in its one program: on a GPU this follows
    its SM count; the interpreter runs one program per row unless its target is raised."""
    monkeypatch.setattr(invariant_attention, "INTERPRETER_PROGRAMS", 16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [0, 2], ids=lambda i: f"gqa{i}")
@pytest.mark.parametrize("name", ["decode_ragged", "trees", "prefill_chunk", "wide", "mixed"])
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"rows{r}")
def test_invariant_tree_attention_equals_the_reference(device, group, name, rows):
    step = make_step(scenarios(device)[name], SHAPES[device].gqa[group], device, torch.float32)
    torch.testing.assert_close(run_invariant(step, REFERENCE_SPLITS, rows), reference(step, 0.17),
                               **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
def test_invariant_tree_attention_in_bfloat16_equals_the_reference(device):
    step = make_step(scenarios(device)["mixed"], SHAPES[device].gqa[1], device, torch.bfloat16)
    torch.testing.assert_close(run_invariant(step).float(), reference(step, 0.17), **TOL[torch.bfloat16])


def _only(step: Step, index: int) -> Step:
    """Sequence `index` of the step on its own, over the same cache."""
    lay = step.layout
    rows = slice(lay.node_starts[index], lay.node_starts[index] + lay.node_counts[index])
    alone = StepLayout((0,), (lay.node_counts[index],), (lay.prefix_slots[index],), (lay.masks[index],))
    return Step(step.q[rows], step.k[rows], step.v[rows], step.cache_k, step.cache_v, alone,
                [step.tables[index]])


# GQA group 4 with one and four rows per program in both dtypes, and group 1 (four rows of one
# head each: 4 of the 16 M-rows) in float32 only, to spare the interpreter's time.
ROW_CASES = {"rows1-gqa4-f32": (1, 2, torch.float32), "rows1-gqa4-bf16": (1, 2, torch.bfloat16),
             "rows4-gqa4-f32": (4, 2, torch.float32), "rows4-gqa4-bf16": (4, 2, torch.bfloat16),
             "rows4-gqa1-f32": (4, 0, torch.float32)}
# Among 63 others the interpreter runs 64 sequences' programs (15-35 s a case on the 2-core CI machine):
# there, one case of each kind of program (one row, in bf16; four rows of one head each).
INTERPRETED_AMONG_63 = ("rows1-gqa4-bf16", "rows4-gqa1-f32")


@pytest.mark.parametrize("device,others,rows,group,dtype", [
    pytest.param(device, others, *case, id=f"{name}-{others}-{device}")
    for device in DEVICES for others in OTHERS for name, case in ROW_CASES.items()
    if device != "cpu" or others != 63 or name in INTERPRETED_AMONG_63])
def test_an_attention_row_alone_equals_the_same_row_among_other_sequences(device, others, rows, group, dtype,
                                                                           split_programs):
    bs, long = SHAPES[device].block_size, SHAPES[device].long_prefix
    rng = random.Random(others)
    kinds = [[-1], BRANCHY, chain(5), random_tree(9, 4)]
    seqs = [(rng.randrange(0, long + 1), rng.choice(kinds)) for _ in range(others)]
    at = others // 2
    seqs.insert(at, (long + bs // 2, CHAIN_THEN_TREE))
    step = make_step(seqs, SHAPES[device].gqa[group], device, dtype, seed=others)
    # Among 7 or 63 others a program runs all of a row's splits and folds them; alone
    # (too few rows to fill the machine) its splits run in programs of their own and a
    # second kernel folds them. With four rows per program the sequence's 8 nodes are two
    # programs, alone and among others, beside programs of other sequences' rows.
    together = run_invariant(step, rows=rows)
    alone = run_invariant(_only(step, at), rows=rows)
    start, count = step.layout.node_starts[at], step.layout.node_counts[at]
    assert torch.equal(together[start: start + count], alone)


def _plain_decode_of(step: Step, node: int) -> Step:
    """The one-node step that decodes `node`'s token after its ancestors were committed
    behind the prefix (their K/V written to the cache, in depth order)."""
    lay = step.layout
    bs = step.cache_k.shape[1]
    path = torch.nonzero(lay.masks[0][node].cpu()).flatten().tolist()  # ancestors first, the node last
    prefix = len(lay.prefix_slots[0])
    length = prefix + len(path) - 1
    extra = -(-length // bs) - len(step.tables[0])
    table = step.tables[0] + list(range(step.cache_k.shape[0], step.cache_k.shape[0] + extra))
    pad = torch.zeros(extra, *step.cache_k.shape[1:], dtype=step.cache_k.dtype, device=step.cache_k.device)
    cache_k, cache_v = torch.cat((step.cache_k, pad)), torch.cat((step.cache_v, pad))
    pos = torch.arange(length)
    slots = (torch.tensor(table)[pos // bs] * bs + pos % bs).to(step.q.device)
    for depth, own in enumerate(path[:-1]):
        cache_k.view(-1, *cache_k.shape[2:])[slots[prefix + depth]] = step.k[own]
        cache_v.view(-1, *cache_v.shape[2:])[slots[prefix + depth]] = step.v[own]
    one = torch.ones(1, 1, dtype=torch.bool, device=step.q.device)
    rows = slice(node, node + 1)
    return Step(step.q[rows], step.k[rows], step.v[rows], cache_k, cache_v,
                StepLayout((0,), (1,), (slots,), (one,)), [table])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parents", [BRANCHY, CHAIN_THEN_TREE, random_tree(12, 7)],
                         ids=["branchy", "chain_then_tree", "random12"])
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"rows{r}")
def test_a_tree_node_attends_bitwise_as_its_token_decoded_plainly(device, dtype, parents, rows, split_programs):
    # The prefix ends 2 keys before a split boundary (also a tile's and a block's): the
    # split holding a node's first ancestors mixes cache and step keys, and nodes deeper
    # than 2 have one split more. The tree's rows fold their splits in one program each,
    # a plain decode's single row gives each split a program (split_programs). With four
    # rows per program a node shares its program with three others, its plain decode with none.
    split_len = SPLITS[device].get("split_len", SPLIT_LEN)
    step = make_step([(2 * split_len - 2, parents)], SHAPES[device].gqa[1], device, dtype, seed=len(parents))
    tree = run_invariant(step, rows=rows)
    for node in range(len(parents)):
        plain = run_invariant(_plain_decode_of(step, node), rows=rows)
        assert torch.equal(tree[node], plain[0]), f"node {node}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", ROWS, ids=lambda r: f"rows{r}")
def test_padding_rows_and_tiles_of_a_bucket_belong_to_no_sequence_and_change_no_row(device, rows):
    """A CUDA graph's bucket pads the step's rows, tiles and sequences: the padding rows
    map to no sequence, and the step's rows come out bitwise as without the padding."""
    shapes = SHAPES[device]
    hq, hkv = shapes.gqa[1]
    step = make_step([(5, [-1]), (2 * shapes.block_size + 1, BRANCHY)], (hq, hkv), device, torch.float32, seed=5)
    real, pad = step.q.shape[0], 3
    meta = metadata_from_layout(step.layout, block_size=shapes.block_size, num_q_heads=hq, num_kv_heads=hkv,
                                device=device, max_batch=4, max_blocks=8, max_tiles=8, max_rows=real + pad)
    assert row_sequences(meta).tolist() == [0] + [1] * len(BRANCHY) + [-1] * pad
    q, k, v = (torch.cat((x, torch.randn(pad, *x.shape[1:], device=device))) for x in (step.q, step.k, step.v))
    padded = tree_attention_invariant(q, k, v, step.cache_k, step.cache_v, meta, 0.17, rows_per_program=rows,
                                      **SPLITS[device])
    assert torch.equal(padded[:real], run_invariant(step, rows=rows))


# --- several rows per program --------------------------------------------------------


def _doubling_threshold(device: str) -> int:
    """Rows longer than this split in doubled lengths (SPLITS' split_len x max_splits)."""
    splits = SPLITS[device]
    return splits.get("split_len", SPLIT_LEN) * splits.get("max_splits", invariant_attention.MAX_SPLITS)


def _straddling_step(device: str, heads: tuple[int, int], dtype: torch.dtype) -> Step:
    """Decodes, a chain longer than a program's rows, and a tree whose deepest rows are past
    the split-doubling threshold while the others are not (so they split differently)."""
    edge = _doubling_threshold(device)
    return make_step([(5, [-1]), (2, chain(9)), (edge - 4, CHAIN_THEN_TREE), (0, random_tree(6, 3))], heads,
                     device, dtype, seed=9)


def _split_doublings(length: int, device: str) -> int:
    splits = SPLITS[device]
    split_len, max_splits = splits.get("split_len", SPLIT_LEN), splits.get("max_splits", invariant_attention.MAX_SPLITS)
    doublings = 0
    while length > split_len * max_splits:
        split_len *= 2
        doublings += 1
    return doublings


def test_calls_of_wide_trees_group_more_rows_per_program_than_decodes(monkeypatch):
    monkeypatch.setattr(invariant_attention, "ROWS_PER_PROGRAM", 4)
    monkeypatch.setattr(invariant_attention, "TREE_ROWS_PER_PROGRAM", 8)
    rows_for = invariant_attention.rows_per_program_for
    assert rows_for(4, rows=64, sequences=64) == 4  # decode: one row per sequence
    assert rows_for(4, rows=256, sequences=64) == 4  # trees of 4 nodes
    assert rows_for(4, rows=512, sequences=64) == 8  # trees of 8 nodes
    assert rows_for(8, rows=512, sequences=64) == 4  # 8 query heads per KV head: 32 M-rows hold 4 rows
    assert rows_for(4, 1, rows=512, sequences=64) == 1  # asked for
    monkeypatch.setattr(invariant_attention, "TREE_ROWS_PER_PROGRAM", 0)
    assert rows_for(4, rows=512, sequences=64) == 4


@pytest.mark.parametrize("device", DEVICES)
def test_row_groups_hold_up_to_four_consecutive_rows_of_one_sequence_that_split_alike(device):
    shapes = SHAPES[device]
    hq, hkv = shapes.gqa[2]
    step = _straddling_step(device, (hq, hkv), torch.float32)
    lay, pad = step.layout, 3
    meta = metadata_from_layout(lay, block_size=shapes.block_size, num_q_heads=hq, num_kv_heads=hkv, device=device,
                                max_batch=6, max_tiles=12, max_rows=step.q.shape[0] + pad)
    plan = plan_invariant(meta, 4, **{k: v for k, v in SPLITS[device].items() if k != "block_n"})
    expect = []
    for start, count, slots, mask in zip(lay.node_starts, lay.node_counts, lay.prefix_slots, lay.masks):
        classes = [_split_doublings(len(slots) + int(mask[i].sum()), device) for i in range(count)]
        for local in range(count):
            if local % 4 == 0 or classes[local] != classes[local - 1]:
                expect.append([start + local, 0])
            expect[-1][1] += 1
    got = plan.groups.groups.tolist()
    assert got == expect + [[0, 0]] * (len(got) - len(expect))
    # The tree's deepest node (depth 5) is past the threshold, the rest of its window is not.
    tree_start = lay.node_starts[2]
    assert [tree_start + 7, 1] in expect and [tree_start + 4, 3] in expect


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [0, 2], ids=["gqa1", "gqa4"])
@pytest.mark.parametrize("fold", ["registers", "workspace"])
@pytest.mark.parametrize("rows", [4, 8], ids=lambda r: f"rows{r}")
def test_several_rows_per_program_compute_each_row_bitwise_as_one_row_per_program(device, dtype, group, fold, rows,
                                                                                 monkeypatch):
    # The interpreter folds a row's splits in its program unless its target of programs is
    # raised; then every split gets a program and the merge kernel folds them.
    monkeypatch.setattr(invariant_attention, "INTERPRETER_PROGRAMS", 1 if fold == "registers" else 64)
    step = _straddling_step(device, SHAPES[device].gqa[group], dtype)
    assert torch.equal(run_invariant(step, rows=rows), run_invariant(step, rows=1))


@pytest.mark.parametrize("device", DEVICES)
def test_a_tree_straddling_the_split_doubling_threshold_attends_bitwise_as_its_tokens_decoded_plainly(
        device, split_programs):
    # Nodes of depth 5 are past the threshold (their splits are twice as long): the
    # multi-row kernel puts them in programs of their own, beside the shallower nodes'.
    step = make_step([(_doubling_threshold(device) - 4, CHAIN_THEN_TREE)], SHAPES[device].gqa[2], device,
                     torch.float32, seed=11)
    tree = run_invariant(step, rows=4)
    for node in range(len(CHAIN_THEN_TREE)):
        assert torch.equal(tree[node], run_invariant(_plain_decode_of(step, node), rows=4)[0]), f"node {node}"
    torch.testing.assert_close(tree, reference(step, 0.17), **TOL[torch.float32])


# --- the target in the batch-invariant mode ---------------------------------------------

PROMPT = [7, 3, 21, 40, 11, 9]


def _engine(model: LlamaModel) -> TargetEngine:
    return TargetEngine(model, num_blocks=64, block_size=4)


def _greedy_alone(model: LlamaModel, n: int) -> tuple[list[int], list[float], TargetEngine]:
    engine = _engine(model)
    result = engine.step([SequenceStep.chain("ref", PROMPT, create=True)])[0]
    tokens, logprobs = list(result.tokens), list(result.logprobs)
    while len(tokens) < n:
        result = engine.step([SequenceStep.chain("ref", [tokens[-1]])])[0]
        tokens += result.tokens
        logprobs += result.logprobs
    return tokens, logprobs, engine


def _kv(engine: TargetEngine, rid: str, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    slots = engine.kv.slots(rid, 0, n)
    return [engine.kv.read(layer, slots) for layer in range(len(engine.kv.k))]


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def invariant_model(request, tiny_llama) -> LlamaModel:
    device = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU the kernels are interpreted
    return LlamaModel(tiny_llama("gqa_2layer"), dtype=request.param, device=device, batch_invariant=True)


def test_the_batch_invariant_target_verifies_a_tree_bitwise_as_plain_decoding(invariant_model):
    _verify_a_tree_as_plain_decoding(invariant_model)


def test_with_one_row_per_program_the_batch_invariant_target_verifies_a_tree_bitwise_as_plain_decoding(
        tiny_llama, monkeypatch):
    # The default groups several rows per program (the other engine tests run it); the
    # one-row kernel stays a choice (ROWS_PER_PROGRAM read when a step is planned), in
    # float32 only to spare the interpreter's time.
    monkeypatch.setattr(invariant_attention, "ROWS_PER_PROGRAM", 1)
    monkeypatch.setattr(invariant_attention, "TREE_ROWS_PER_PROGRAM", 0)
    launches = spy_launches(monkeypatch, invariant_attention, "_invariant_attention_kernel")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    _verify_a_tree_as_plain_decoding(LlamaModel(tiny_llama("gqa_2layer"), dtype=torch.float32, device=device,
                                                batch_invariant=True))
    assert launches  # the one-row kernel computed the steps


def _verify_a_tree_as_plain_decoding(model: LlamaModel) -> None:
    ref, ref_logprobs, plain = _greedy_alone(model, 8)
    engine = _engine(model)
    assert engine.step([SequenceStep.chain("t", PROMPT, create=True)])[0].tokens == ref[:1]
    vocab = model.cfg.vocab_size
    # The greedy path with two wrong siblings before it at every depth.
    tokens, parents, parent = [ref[0]], [-1], 0
    for token in ref[1:7]:
        for other in ((token + 1) % vocab, (token + 2) % vocab):
            tokens.append(other)
            parents.append(parent)
        tokens.append(token)
        parents.append(parent)
        parent = len(tokens) - 1
    result = engine.step([SequenceStep("t", tuple(tokens), tuple(parents), num_fixed=1)])[0]
    assert result.tokens == ref[1:8]
    assert result.logprobs == ref_logprobs[1:8]  # bitwise, not approximately
    for (k1, v1), (k2, v2) in zip(_kv(engine, "t", len(PROMPT) + 7), _kv(plain, "ref", len(PROMPT) + 7),
                                  strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_the_batch_invariant_target_decodes_a_request_among_others_bitwise_as_alone(invariant_model):
    ref, ref_logprobs, _ = _greedy_alone(invariant_model, 5)
    engine = _engine(invariant_model)
    engine.step([SequenceStep.chain("other", [5, 6, 7, 8, 9, 10, 11], create=True)])
    tokens: list[int] = []
    logprobs: list[float] = []
    for step in range(5):
        items = [SequenceStep.chain("t", PROMPT if step == 0 else [tokens[-1]], create=step == 0),
                 SequenceStep("other", (3, 4, 5, 6), (-1, 0, 0, 1), num_fixed=1),  # a tree beside it
                 SequenceStep.chain(f"new{step}", [1, 2, 3][: step + 1], create=True)]  # a prefill too
        results = engine.step(items)
        tokens += results[0].tokens
        logprobs += results[0].logprobs
    assert tokens == ref and logprobs == ref_logprobs


def test_the_batch_invariant_mode_refuses_a_tree_deeper_than_it_can_list(invariant_model):
    engine = _engine(invariant_model)
    engine.step([SequenceStep.chain("t", PROMPT, create=True)])
    deep = MAX_TAIL + 1
    with pytest.raises(InvalidStep, match=f"{deep} deep"):
        engine.step([SequenceStep("t", tuple([1] * (deep + 1)), tuple(range(-1, deep)), num_fixed=1)])


TP2_CHECK = """
import json, sys
from target_service.parallel import EngineSpec, ParallelEngine
from target_service.types import SequenceStep
from tests.test_batch_invariant import PROMPT

engine = ParallelEngine(EngineSpec(model_dir=sys.argv[1], num_blocks=64, block_size=4, batch_invariant=True,
                                   device=sys.argv[2]), tp_size=2)
try:
    def decode(rid, first, n, beside=()):
        out, logprobs = [], []
        for i in range(n):
            items = [SequenceStep.chain(rid, first if i == 0 else [out[-1]], create=i == 0), *beside]
            result = engine.step(items)[0]
            out += result.tokens
            logprobs += result.logprobs
            beside = [SequenceStep.chain(item.request_id, [3]) for item in beside]
        return out, logprobs

    alone = decode("alone", PROMPT, 5)
    among = decode("among", PROMPT, 5, beside=[SequenceStep.chain("other", [5, 6, 7, 8, 9], create=True)])
    first = engine.step([SequenceStep.chain("tree", PROMPT, create=True)])[0].tokens
    path = alone[0][1:4]
    tokens, parents = (first[0], (path[0] + 1) % 97, path[0], path[1], path[2]), (-1, 0, 0, 2, 3)
    verified = engine.step([SequenceStep("tree", tokens, parents, num_fixed=1)])[0]
    print(json.dumps({"alone": alone, "among": among, "verified": [verified.tokens, verified.logprobs]}))
finally:
    engine.shutdown()
"""


def test_at_tp2_the_batch_invariant_target_is_bitwise_the_same_alone_among_others_and_verifying(tiny_llama):
    """The ranks' parts are added in rank order, whatever the batch: the mode holds at TP=2 (NCCL on two GPUs,
    else gloo with the kernels interpreted on CPU)."""
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    env = dict(os.environ) if device == "cuda" else {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", TP2_CHECK, str(tiny_llama("gqa_2layer")), device], capture_output=True,
                         text=True, timeout=600, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    (tokens, logprobs), (among_tokens, among_logprobs) = got["alone"], got["among"]
    assert among_tokens == tokens and among_logprobs == logprobs
    assert got["verified"] == [tokens[1:5], logprobs[1:5]]
