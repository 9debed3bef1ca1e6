"""A served step never waits for Triton: the attention kernels' arguments that change with the
step's shape are not specialised on.

Triton compiles a variant of a kernel for each class of its integer arguments (1, a multiple of
16, other) and of its pointers' alignment, unless the argument is in `do_not_specialize`. Start-up
compiles the variants that constexprs pick (`kernels.tree_attention.warm_up`); any class that moves
with the number of rows in a step would compile again in the middle of serving. On the H200 the
demo pair (4 query heads) compiled the tree-attention kernel three times while serving, 1.3-1.4 s
each, before the split partials' row strides were left unspecialised.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from kernels import topk, tree_attention
from kernels.tree_metadata import build_tree_metadata
from target_service.step_inputs import InputLayout, InputShape


def _kernel_params(kernel) -> tuple[list[str], set[str]]:
    """(argument names, names not specialised) of a jitted kernel, compiled or interpreted."""
    names = list(kernel.arg_names)
    unspecialised = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    if unspecialised is None:  # a compiled JITFunction keeps indices
        unspecialised = [names[i] if isinstance(i, int) else i for i in getattr(kernel, "do_not_specialize", ())]
    return names, set(unspecialised)


def _classes(value) -> str | None:
    """The class Triton specialises an argument on (None: not a specialised kind)."""
    if isinstance(value, torch.Tensor):
        return "aligned" if value.data_ptr() % 16 == 0 else "unaligned"
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return "one" if value == 1 else "multiple of 16" if value % 16 == 0 else "other"


def _spy(monkeypatch, name: str, launches: dict, module=tree_attention, variants: list | None = None):
    """Record, per (kernel, constexprs, argument), the classes a specialised argument took;
    and each launch's (kernel, constexprs) in `variants`."""
    kernel = getattr(module, name)
    names, unspecialised = _kernel_params(kernel)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                variant = tuple(sorted((k, v) for k, v in constexprs.items() if k != "num_warps"))
                if variants is not None:
                    dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor))
                    variants.append((name, str(dtype), variant))
                for arg_name, value in zip(names, args, strict=False):
                    if arg_name not in unspecialised and (cls := _classes(value)) is not None:
                        launches[(name, variant, arg_name)].add(cls)
                return kernel[grid](*args, **constexprs)
            return launch

    monkeypatch.setattr(module, name, Spy())


def test_tree_attention_arguments_that_change_with_the_step_are_not_specialised(monkeypatch):
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 16  # the demo pair's 4 query heads
    launches: dict = defaultdict(set)
    for name in ("_tree_attention_kernel", "_merge_splits_kernel"):
        _spy(monkeypatch, name, launches)
    cache_k = torch.randn(8, block_size, kv_heads, head_dim)
    cache_v = torch.randn_like(cache_k)
    # Rows per step 1..9 (the class of rows x heads moves), with and without prefix splits.
    for rows in (1, 2, 3, 4, 5, 8, 9):
        for splits in (1, 2):
            mask = torch.ones(rows, rows, dtype=torch.bool).tril()
            meta = build_tree_metadata([[0, 1, 2]], [2 * block_size], [0], [mask], block_size=block_size,
                                       num_q_heads=heads, num_kv_heads=kv_heads, device="cpu", num_splits=splits)
            q = torch.randn(rows, heads, head_dim)
            k = torch.randn(rows, kv_heads, head_dim)
            tree_attention.tree_attention_triton(q, k, k, cache_k, cache_v, meta, 1.0)
    assert launches, "the spies saw no launch"
    moved = {f"{kernel}.{arg} ({sorted(classes)})" for (kernel, _, arg), classes in launches.items()
             if len(classes) > 1}
    assert not moved, f"specialised arguments whose class changes with the step: {sorted(moved)}"


def test_every_region_of_a_target_steps_inputs_starts_on_16_bytes_whatever_the_shape():
    # The kernels take views of one packed buffer (positions, slots, mask words): each view's
    # alignment class must not move with the step's rows, sequences or tree.
    for rows, seqs, tree, tiles, updates, words in ((1, 1, 1, 1, 1, 1), (3, 1, 3, 1, 0, 1), (5, 2, 3, 2, 1, 1),
                                                    (7, 3, 4, 3, 2, 2), (17, 5, 8, 9, 3, 1)):
        layout = InputLayout(InputShape(rows=rows, seqs=seqs, tree=tree, tiles=tiles, updates=updates, words=words))
        misaligned = {name: at for name, (at, _) in layout.spans.items() if (4 * at) % 16}
        assert not misaligned, f"regions off 16 bytes for rows={rows}, seqs={seqs}: {misaligned}"
        ends = sorted((at, at + n) for at, n in layout.spans.values())
        assert all(end <= start for (_, end), (start, _) in zip(ends, ends[1:])), "regions overlap"
        assert layout.size >= ends[-1][1]


def test_every_top_k_launch_of_a_served_call_is_a_variant_that_start_up_compiled(monkeypatch):
    # A tree's budget trimmed near max_tokens asks for other k (kept nodes) over other rows (its
    # candidates); on the H200 each new k compiled both kernels while serving, 0.05-0.11 s.
    launches: dict = defaultdict(set)
    launched: list = []
    for name in ("_chunk_top_k_kernel", "_merge_top_k_kernel"):
        _spy(monkeypatch, name, launches, module=topk, variants=launched)
    longest = 4 * topk.CHUNK  # a 4k vocabulary here; the draft warms up with its own
    topk.warm_up("cpu", longest)
    warmed = set(launched)
    assert warmed
    del launched[:]
    g = torch.Generator().manual_seed(0)
    for n in (8, 68, 264, 1000, longest):  # candidates of 1/8/16 .. 6/8/16 trees, and a vocabulary
        for k in (1, 3, 8, 15, 32):
            for dtype in (torch.float32, torch.float64):
                if k <= n:
                    values = torch.randn(2, n, generator=g).to(dtype)
                    got, index = topk.top_k_ranked_triton(values, k)
                    want, want_index = topk.top_k_ranked_reference(values, k)
                    assert torch.equal(index, want_index) and torch.equal(got, want)
    new = sorted(set(launched) - warmed)
    assert not new, f"variants a served call would compile: {new}"
    moved = {f"{kernel}.{arg}" for (kernel, _, arg), classes in launches.items() if len(classes) > 1}
    assert not moved, f"specialised arguments whose class changes with the call: {sorted(moved)}"
