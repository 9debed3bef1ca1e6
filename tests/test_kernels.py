"""Every Triton kernel equals its torch reference.

Without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py sets it
before triton is imported) on tiny shapes; with CUDA the same tests run compiled,
on Llama-8B-like shapes. Outputs are poisoned with NaN before each run, so an
element the kernel forgets to write fails the comparison.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import pytest
import torch

from kernels.activation import silu_mul_reference, silu_mul_triton
from kernels.backend import (
    BackendUnavailable,
    InvariantAttention,
    TorchAttention,
    TritonAttention,
    get_attention_backend,
)
from kernels.kv_write import kv_commit_reference, kv_commit_triton, kv_write_reference, kv_write_triton
from kernels.rmsnorm import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton
from kernels.rope import rope_qkv_reference, rope_qkv_triton, rope_reference, rope_triton
from kernels.tree_attention import StepLayout, causal_mask, tree_attention_reference, tree_attention_triton
from kernels.tree_metadata import build_tree_metadata, metadata_from_layout
from tandem.layers import Rotary, rms_norm
from tandem.model_config import RopeConfig
from tandem.tree import ancestor_mask

ON_GPU = torch.cuda.is_available()
# The device is a parameter so one test body serves both; only the present one is generated.
DEVICES = ["cuda"] if ON_GPU else ["cpu"]


@dataclass(frozen=True)
class Shapes:
    block_size: int
    head_dim: int
    long_prefix: int  # "a long prefix": several blocks under the interpreter, thousands on a GPU
    gqa: tuple[tuple[int, int], ...]  # (query heads, kv heads): groups 1, 2, 4
    block_n: int | None  # keys per kernel iteration; small on CPU so loops run several times


SHAPES = {
    "cpu": Shapes(block_size=4, head_dim=16, long_prefix=11, gqa=((2, 2), (4, 2), (4, 1)), block_n=16),
    "cuda": Shapes(block_size=16, head_dim=128, long_prefix=3001, gqa=((8, 8), (16, 8), (32, 8)),
                   block_n=None),
}
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def chain(n: int) -> list[int]:
    return [-1] + list(range(n - 1))


def random_tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1] + [rng.randrange(i) for i in range(1, n)]


# Trees with several branches: a drafted tree under one fixed node, and one
# under a fixed chain of two (a verify step after a plain one).
BRANCHY = [-1, 0, 0, 0, 1, 1, 2, 4, 4, 7]
CHAIN_THEN_TREE = [-1, 0, 1, 1, 1, 2, 3, 5]


def scenarios(device: str) -> dict[str, list[tuple[int, list[int]]]]:
    """name -> [(prefix length, parents)] per sequence of one step."""
    s = SHAPES[device]
    bs, long = s.block_size, s.long_prefix
    out = {
        # One-node decode, prefix 0, 1, exactly one block, crossing blocks, long.
        "decode_ragged": [(0, [-1]), (1, [-1]), (bs, [-1]), (bs + 3, [-1]), (long, [-1])],
        "trees": [(bs, BRANCHY), (5, CHAIN_THEN_TREE), (0, random_tree(12, 1))],
        # A prefill chunk of 37 tokens, from scratch and after a partial block.
        "prefill_chunk": [(0, chain(37)), (bs - 1, chain(37))],
        # More than 64 nodes: the ancestor mask spans two words.
        "wide": [(bs + 1, random_tree(70, 2)), (2, chain(66))],
        "mixed": [(long, BRANCHY), (3, [-1]), (2 * bs, chain(20)), (bs - 1, CHAIN_THEN_TREE)],
    }
    if device == "cuda":
        rng = random.Random(3)
        out["batch64_decode"] = [(rng.randrange(1000, 4096), [-1]) for _ in range(64)]
        out["batch32_verify"] = [(rng.randrange(1000, 4096), random_tree(16, i)) for i in range(32)]
    return out


@dataclass
class Step:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache_k: torch.Tensor
    cache_v: torch.Tensor
    layout: StepLayout
    tables: list[list[int]]


def make_step(seqs: list[tuple[int, list[int]]], heads: tuple[int, int], device: str,
              dtype: torch.dtype, seed: int = 0) -> Step:
    s = SHAPES[device]
    hq, hkv = heads
    bs, d = s.block_size, s.head_dim
    g = torch.Generator(device).manual_seed(seed)
    need = [-(-p // bs) for p, _ in seqs]
    num_blocks = sum(need) + 3
    # Blocks handed out in shuffled order, so a table is not a contiguous range.
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, slots, starts, counts, masks = [], [], [], [], []
    row = 0
    for (prefix, parents), n in zip(seqs, need):
        table = [free.pop() for _ in range(n)]
        pos = torch.arange(prefix)
        tables.append(table)
        slots.append((torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs).to(device))
        starts.append(row)
        counts.append(len(parents))
        masks.append(ancestor_mask(parents).to(device))
        row += len(parents)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    return Step(rand(row, hq, d), rand(row, hkv, d), rand(row, hkv, d), rand(num_blocks, bs, hkv, d),
                rand(num_blocks, bs, hkv, d), StepLayout(tuple(starts), tuple(counts), tuple(slots),
                                                          tuple(masks)), tables)


def reference(step: Step, scale: float) -> torch.Tensor:
    # The oracle runs in float32 on the same (already rounded) inputs.
    f = [x.float() for x in (step.q, step.k, step.v, step.cache_k, step.cache_v)]
    return tree_attention_reference(*f, step.layout, scale)


def run_triton(step: Step, device: str, **meta_kwargs) -> torch.Tensor:
    hq, hkv = step.q.shape[1], step.k.shape[1]
    meta = metadata_from_layout(step.layout, block_size=step.cache_k.shape[1], num_q_heads=hq,
                                num_kv_heads=hkv, device=device, **meta_kwargs)
    out = torch.full_like(step.q, float("nan"))
    tree_attention_triton(step.q, step.k, step.v, step.cache_k, step.cache_v, meta, 0.17,
                          block_n=SHAPES[device].block_n, out=out)
    return out


# --- tree attention ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [0, 1, 2], ids=lambda i: f"gqa{i}")
@pytest.mark.parametrize("name", list(scenarios(DEVICES[0])))
def test_tree_attention_float32(device, group, name):
    step = make_step(scenarios(device)[name], SHAPES[device].gqa[group], device, torch.float32)
    out = run_triton(step, device, num_splits=1)
    torch.testing.assert_close(out, reference(step, 0.17), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["decode_ragged", "mixed"])
def test_tree_attention_split_prefix(device, name):
    # Flash-decoding: the prefix is shared by several programs and merged. The
    # layout carries its block tables here (the engine's fast path).
    step = make_step(scenarios(device)[name], SHAPES[device].gqa[2], device, torch.float32, seed=1)
    step.layout = dataclasses.replace(step.layout, block_tables=tuple(step.tables))
    out = run_triton(step, device, num_splits=3)
    torch.testing.assert_close(out, reference(step, 0.17), **TOL[torch.float32])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,name,splits", [(torch.bfloat16, "mixed", 1),
                                               (torch.bfloat16, "decode_ragged", 2), (torch.float16, "trees", 1)],
                         ids=["bf16-mixed", "bf16-decode-split", "fp16-trees"])
def test_tree_attention_half(device, dtype, name, splits):
    step = make_step(scenarios(device)[name], SHAPES[device].gqa[1], device, dtype, seed=2)
    out = run_triton(step, device, num_splits=splits)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), reference(step, 0.17), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
def test_padded_metadata_is_reused_across_steps(device):
    """The CUDA-graph contract: fixed-shape metadata, overwritten in place by a later step
    of the same bucket; rows beyond the step are left alone."""
    shapes = SHAPES[device]
    heads = shapes.gqa[1]
    pad = dict(max_batch=4, max_blocks=8, max_tiles=8, max_rows=24, max_words=1, num_splits=2, block_m=16)
    first = make_step([(5, [-1]), (shapes.block_size, BRANCHY)], heads, device, torch.float32, seed=3)
    second = make_step([(2 * shapes.block_size + 1, CHAIN_THEN_TREE), (0, [-1]), (1, [-1, 0])], heads,
                       device, torch.float32, seed=4)

    def meta_of(step: Step):
        return build_tree_metadata(step.tables, [len(s) for s in step.layout.prefix_slots],
                                   step.layout.node_starts, step.layout.masks,
                                   block_size=shapes.block_size, num_q_heads=heads[0], num_kv_heads=heads[1],
                                   device=device, **pad)

    static = meta_of(first)
    for step in (first, second):
        static.copy_(meta_of(step))
        rows = step.q.shape[0]
        q = torch.zeros(24, *step.q.shape[1:], device=device)
        k = torch.zeros(24, *step.k.shape[1:], device=device)
        q[:rows], k[:rows] = step.q, step.k
        v = k.clone()
        v[:rows] = step.v
        out = torch.full_like(q, float("nan"))
        tree_attention_triton(q, k, v, step.cache_k, step.cache_v, static, 0.17, block_n=shapes.block_n,
                              out=out)
        torch.testing.assert_close(out[:rows], reference(step, 0.17), **TOL[torch.float32])
        assert out[rows:].isnan().all(), "rows outside the step were written"
    with pytest.raises(ValueError, match="another bucket"):
        static.copy_(build_tree_metadata([[0]], [1], [0], [ancestor_mask([-1])], block_size=shapes.block_size,
                                         num_q_heads=heads[0], num_kv_heads=heads[1], device=device))


def test_metadata_rejects_what_the_kernel_cannot_do():
    with pytest.raises(ValueError, match="ancestors must precede"):
        build_tree_metadata([[]], [0], [0], [torch.ones(2, 2, dtype=torch.bool)], block_size=4,
                            num_q_heads=2, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="see itself"):
        build_tree_metadata([[]], [0], [0], [torch.zeros(1, 1, dtype=torch.bool)], block_size=4,
                            num_q_heads=2, num_kv_heads=2, device="cpu")
    # Slots that are not "token t at table[t // bs], offset t % bs".
    layout = StepLayout((0,), (1,), (torch.tensor([0, 2, 1]),), (ancestor_mask([-1]),))
    with pytest.raises(ValueError, match="not token t"):
        metadata_from_layout(layout, block_size=4, num_q_heads=2, num_kv_heads=2, device="cpu")
    with pytest.raises(ValueError, match="over the padded size"):
        build_tree_metadata([[0, 1]], [5], [0], [ancestor_mask([-1])], block_size=4, num_q_heads=2,
                            num_kv_heads=2, device="cpu", max_blocks=1)


@pytest.mark.parametrize("n", [1, 2, 7, 190])
def test_a_run_of_positions_sees_itself_and_every_position_before_it(n):
    mask = causal_mask(n)
    assert mask.dtype == torch.bool and mask.device.type == "cpu" and mask.shape == (n, n)
    assert torch.equal(mask, torch.ones(n, n, dtype=torch.bool).tril())
    # The kernel's packing accepts it as a chain: each node after its ancestors.
    build_tree_metadata([[]], [0], [0], [mask], block_size=4, num_q_heads=2, num_kv_heads=2, device="cpu")


# --- kv write, rmsnorm, rope ------------------------------------------------


def assert_matches_rounding(out: torch.Tensor, expect: torch.Tensor) -> None:
    """Equal up to float32 noise, or for bf16 up to the final roundings. The
    interpreter rounds float32 -> bf16 toward zero (the GPU to nearest), so
    there an element may be off by a unit in the last place per rounding."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(out.float(), expect.float(), atol=1e-6, rtol=2 ** -6)
    if ON_GPU:  # rounding to nearest: nearly every element is bit-identical
        assert (out == expect).float().mean() > 0.95


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_write(device, dtype):
    shapes = SHAPES[device]
    hkv, d = shapes.gqa[2][1] if ON_GPU else 2, shapes.head_dim
    blocks, bs = (1000, 16) if ON_GPU else (6, 4)
    g = torch.Generator().manual_seed(5)
    cache_k = torch.randn(blocks, bs, hkv, d, generator=g).to(device, dtype)
    cache_v = torch.randn(blocks, bs, hkv, d, generator=g).to(device, dtype)
    T = 40 if ON_GPU else 9
    # v as the engine sees it: a strided view into a fused projection.
    fused = torch.randn(T, 3 * hkv * d, generator=g).to(device, dtype)
    k = fused[:, : hkv * d].view(T, hkv, d)
    v = fused[:, 2 * hkv * d:].view(T, hkv, d)
    rows = torch.tensor([0, 3, 4, 8, 1][: T], device=device)
    # An accepted path crossing a block boundary, written out of order.
    slots = torch.tensor([bs - 2, bs - 1, bs, 3 * bs + 1, bs + 3], device=device)
    expect_k, expect_v = cache_k.clone(), cache_v.clone()
    kv_write_reference(expect_k, expect_v, k, v, rows, slots)
    before_k, before_v = cache_k.clone(), cache_v.clone()
    kv_write_triton(cache_k, cache_v, k, v, rows, slots)
    assert torch.equal(cache_k, expect_k) and torch.equal(cache_v, expect_v)
    untouched = torch.ones(blocks * bs, dtype=torch.bool, device=device)
    untouched[slots] = False
    assert torch.equal(cache_k.view(blocks * bs, -1)[untouched], before_k.view(blocks * bs, -1)[untouched])
    assert torch.equal(cache_v.view(blocks * bs, -1)[untouched], before_v.view(blocks * bs, -1)[untouched])
    assert torch.equal(cache_k.view(-1, hkv, d)[slots], k[rows])
    assert torch.equal(cache_v.view(-1, hkv, d)[slots], v[rows])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(device, dtype):
    hidden = 4096 if ON_GPU else 48  # not a power of two on CPU: a masked tail
    g = torch.Generator().manual_seed(6)
    x = (3 * torch.randn(2, 7, hidden, generator=g)).to(device, dtype)
    w = (1 + torch.randn(hidden, generator=g) / 4).to(device, dtype)
    out = torch.full_like(x, float("nan"))
    rms_norm_triton(x, w, 1e-5, out=out)
    expect = rms_norm(x, w, 1e-5)
    torch.testing.assert_close(rms_norm_reference(x, w, 1e-5), expect, atol=0, rtol=0)
    assert_matches_rounding(out, expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope(device, dtype):
    shapes = SHAPES[device]
    d = shapes.head_dim if ON_GPU else 24  # half of 24 is not a power of two
    heads, kv_heads = (32, 8) if ON_GPU else (3, 1)
    rope = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, original_max_position=64)
    rotary = Rotary(d, rope, 4096 if ON_GPU else 200, torch.device(device))
    g = torch.Generator().manual_seed(7)
    T = 33 if ON_GPU else 5
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    q = qkv[:, : heads * d].view(T, heads, d)  # strided, as the model slices it
    positions = torch.randint(0, rotary.cos.shape[0], (T,), generator=g).to(device)
    out = torch.full_like(q, float("nan"))
    rope_triton(q, positions, rotary.cos, rotary.sin, out=out)
    expect = rotary.apply(q, positions)
    torch.testing.assert_close(rope_reference(q, positions, rotary.cos, rotary.sin), expect, atol=0, rtol=0)
    assert_matches_rounding(out, expect)


def _rope_qkv_case(device: str) -> tuple[int, int, int, Rotary]:
    """The fused q/k/v RoPE tests' shapes (head dim, heads, kv heads) and llama3-scaled rotary table."""
    d = SHAPES[device].head_dim if ON_GPU else 24
    heads, kv_heads = (32, 8) if ON_GPU else (4, 2)
    rope = RopeConfig(theta=500000.0, scaling_type="llama3", factor=8.0, original_max_position=64)
    return d, heads, kv_heads, Rotary(d, rope, 4096 if ON_GPU else 200, torch.device(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv_rotates_q_and_k_and_lands_k_v_in_scratch(device, dtype):
    d, heads, kv_heads, rotary = _rope_qkv_case(device)
    g = torch.Generator().manual_seed(17)
    T = 33 if ON_GPU else 5
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    positions = torch.randint(0, rotary.cos.shape[0], (T,), generator=g).to(device, torch.int32)
    scratch = torch.full((2, T + 3, kv_heads, d), float("nan"), dtype=dtype, device=device)
    q, k, v = rope_qkv_triton(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, scratch[0, :T], scratch[1, :T])
    eq, ek, ev = rope_qkv_reference(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads)
    assert_matches_rounding(q, eq)
    assert_matches_rounding(k, ek)
    assert torch.equal(v, ev)  # a copy, bit for bit
    assert k.data_ptr() == scratch[0].data_ptr() and torch.equal(scratch[1, :T], ev)
    assert scratch[:, T:].isnan().all(), "rows past the step were written"
    expect_q = rotary.apply(qkv[:, : heads * d].view(T, heads, d), positions.long())
    torch.testing.assert_close(eq, expect_q, atol=0, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_qkv_lands_each_tokens_q_k_and_v_in_the_row_it_is_given(device, dtype):
    """The draft's tree growth: a level's nodes go to their slots, which are not contiguous across requests."""
    d, heads, kv_heads, rotary = _rope_qkv_case(device)
    g = torch.Generator().manual_seed(19)
    T, N = 6, 16  # 3 requests x 2 nodes, into slots 2..3 of each request's 5 (rows 2, 3, 7, 8, 12, 13)
    rows = torch.tensor([b * 5 + 2 + j for b in range(3) for j in range(2)], device=device)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=g).to(device, dtype)
    positions = torch.randint(0, rotary.cos.shape[0], (T,), generator=g).to(device)
    q_out = torch.full((N, heads, d), float("nan"), dtype=dtype, device=device)
    k_out = torch.full((N, kv_heads, d), float("nan"), dtype=dtype, device=device)
    v_out = torch.full_like(k_out, float("nan"))
    rope_qkv_triton(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, k_out, v_out, q_out=q_out, rows=rows)
    eq, ek, ev = rope_qkv_triton(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads)
    assert torch.equal(q_out[rows], eq) and torch.equal(k_out[rows], ek) and torch.equal(v_out[rows], ev)
    others = torch.ones(N, dtype=torch.bool, device=device)
    others[rows] = False
    assert q_out[others].isnan().all() and k_out[others].isnan().all() and v_out[others].isnan().all()
    with pytest.raises(ValueError, match="rows must be"):
        rope_qkv_triton(qkv, positions, rotary.cos, rotary.sin, heads, kv_heads, k_out, v_out, rows=rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_equals_an_add_then_the_norm(device, dtype):
    hidden = 4096 if ON_GPU else 48
    g = torch.Generator().manual_seed(18)
    x = (3 * torch.randn(7, hidden, generator=g)).to(device, dtype)
    r = torch.randn(7, hidden, generator=g).to(device, dtype)
    w = (1 + torch.randn(hidden, generator=g) / 4).to(device, dtype)
    total, normed = add_rms_norm_triton(x, r, w, 1e-5)
    expect_total, expect_normed = add_rms_norm_reference(x, r, w, 1e-5)
    assert torch.equal(expect_total, x + r)
    assert_matches_rounding(total, expect_total)
    # The norm of the sum the kernel stored (the interpreter rounds that sum toward zero).
    assert_matches_rounding(normed, rms_norm_reference(total, w, 1e-5))
    if ON_GPU:
        assert_matches_rounding(normed, expect_normed)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_torch_ops(device, dtype):
    inter = 14336 if ON_GPU else 40
    g = torch.Generator().manual_seed(19)
    gate_up = (2 * torch.randn(6, 2 * inter, generator=g)).to(device, dtype)
    out = silu_mul_triton(gate_up)
    gate, up = gate_up.chunk(2, -1)
    expect = torch.nn.functional.silu(gate) * up
    assert torch.equal(silu_mul_reference(gate_up), expect)
    assert_matches_rounding(out, expect)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_commit_writes_every_layer_in_one_launch(device, dtype):
    layers, hkv, d = (4, 8, 128) if ON_GPU else (3, 2, 16)
    slots_total, T = (4096, 40) if ON_GPU else (24, 6)
    g = torch.Generator().manual_seed(20)
    cache_k = torch.randn(layers, slots_total, hkv, d, generator=g).to(device, dtype)
    cache_v = torch.randn(layers, slots_total, hkv, d, generator=g).to(device, dtype)
    scratch_k = torch.randn(layers, T + 2, hkv, d, generator=g).to(device, dtype)[:, :T]  # strided, as bucketed
    scratch_v = torch.randn(layers, T + 2, hkv, d, generator=g).to(device, dtype)[:, :T]
    trash = slots_total - 1
    slots = torch.full((T,), trash, dtype=torch.long)
    slots[:4] = torch.tensor([5, 2, 9, 3])  # kept rows, out of order; the rest go to trash
    slots = slots.to(device)
    expect_k, expect_v = cache_k.clone(), cache_v.clone()
    kv_commit_reference(expect_k, expect_v, scratch_k, scratch_v, slots)
    kv_commit_triton(cache_k, cache_v, scratch_k, scratch_v, slots)
    keep = torch.ones(slots_total, dtype=torch.bool, device=device)
    keep[trash] = False
    assert torch.equal(cache_k[:, keep], expect_k[:, keep]) and torch.equal(cache_v[:, keep], expect_v[:, keep])
    assert torch.equal(cache_k[:, slots[:4]], scratch_k[:, :4])


# --- the backend switch ----------------------------------------------------


def test_backend_selection(monkeypatch):
    assert isinstance(get_attention_backend("torch", "cpu"), TorchAttention)
    assert isinstance(get_attention_backend(None, "cpu"), TorchAttention)
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_attention_backend("cudnn", "cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="needs a CUDA device"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(BackendUnavailable, match=r"batch-invariant mode \(--deterministic\) needs a CUDA device"):
        get_attention_backend(None, "cpu", batch_invariant=True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert isinstance(get_attention_backend("triton", "cpu"), TritonAttention)
    assert isinstance(get_attention_backend(None, "cpu", batch_invariant=True), InvariantAttention)
    with pytest.raises(BackendUnavailable, match="'torch' cannot be used with it"):
        get_attention_backend("torch", "cpu", batch_invariant=True)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(BackendUnavailable, match="flashinfer not installed"):
        get_attention_backend("flashinfer", "cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_model_backends_agree(tiny_llama, device):
    """One flag switches the model's attention; a tree step's logits do not change."""
    from target_service.model import LlamaModel

    path = tiny_llama("llama3_tied")  # GQA group 4, head_dim 24
    models = {name: LlamaModel(path, torch.float32, device, attention_backend=name)
              for name in ("torch", "triton")}
    kv = models["torch"].new_kv_cache(num_blocks=8, block_size=4)
    g = torch.Generator().manual_seed(8)
    for layer in range(len(kv.k)):
        kv.k[layer].copy_(torch.randn(kv.k[layer].shape, generator=g))
        kv.v[layer].copy_(torch.randn(kv.v[layer].shape, generator=g))
    parents = [[-1, 0, 0, 1], [-1]]
    prefix = [6, 9]
    for i, length in enumerate(prefix):
        kv.create(str(i))
        kv.reserve(str(i), length + len(parents[i]))
        kv.seqs[str(i)].length = length
    layout = StepLayout((0, 4), (4, 1), tuple(kv.slots(str(i), 0, n) for i, n in enumerate(prefix)),
                        tuple(ancestor_mask(p).to(device) for p in parents))
    tokens = torch.tensor([5, 9, 11, 2, 7], device=device)
    positions = torch.tensor([6, 7, 7, 8, 9], device=device)
    rows = torch.arange(5, device=device)
    logits = {name: m.forward(tokens, positions, layout, kv, rows).logits for name, m in models.items()}
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_warm_up_compiles_every_variant_and_changes_nothing(device):
    from kernels.tree_attention import warm_up

    # Tile heights 16, 32, 64, each with no split and 2..32 splits (every merge width).
    assert warm_up(8, 2, 16, 4, torch.float32, device) == 18
    step = make_step(scenarios(device)["mixed"], SHAPES[device].gqa[1], device, torch.float32)
    torch.testing.assert_close(run_triton(step, device), reference(step, 0.17), **TOL[torch.float32])
