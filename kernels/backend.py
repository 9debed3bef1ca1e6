"""Which tree-attention implementation a model runs, chosen once by name.

- "torch": tree_attention_reference; the CPU default and the tests' oracle.
- "triton": tree_attention_triton; the default on CUDA. On CPU it runs only
  under TRITON_INTERPRET=1 (slow; for tests).
- "flashinfer": reserved. It needs the step's tree K/V in the paged cache
  (scratch slots) before attention, which the engine does not do yet.

With batch_invariant=True the "triton" backend runs
kernels.invariant_attention instead: the same metadata, each node's result
independent of the rest of the step (slower; the --deterministic mode).

A backend has two calls: plan(), once per step, turns the StepLayout into
whatever the kernel reads (shared by every layer), and __call__ per layer.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from kernels._triton import HAS_TRITON, interpreting
from kernels.invariant_attention import InvariantPlan, plan_invariant, tree_attention_invariant
from kernels.tree_attention import StepLayout, tree_attention_reference, tree_attention_triton
from kernels.tree_metadata import TreeAttnMetadata, metadata_from_layout

ATTENTION_BACKENDS = ("torch", "triton", "flashinfer")


class BackendUnavailable(RuntimeError):
    """The named backend cannot run here; the message says why."""


class AttentionBackend(Protocol):
    name: str

    def plan(self, layout: StepLayout, *, block_size: int, num_q_heads: int, num_kv_heads: int,
             device: torch.device) -> object: ...

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, plan: object, scale: float) -> torch.Tensor: ...


class TorchAttention:
    name = "torch"

    def plan(self, layout: StepLayout, **_: object) -> StepLayout:
        return layout

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, plan: StepLayout, scale: float) -> torch.Tensor:
        return tree_attention_reference(q, k, v, cache_k, cache_v, plan, scale)


class TritonAttention:
    name = "triton"

    def plan(self, layout: StepLayout | TreeAttnMetadata, *, block_size: int, num_q_heads: int,
             num_kv_heads: int, device: torch.device) -> TreeAttnMetadata:
        # Metadata built by the caller (e.g. a CUDA graph's static buffers) passes through.
        if isinstance(layout, TreeAttnMetadata):
            return layout
        return metadata_from_layout(layout, block_size=block_size, num_q_heads=num_q_heads,
                                    num_kv_heads=num_kv_heads, device=device)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, plan: TreeAttnMetadata, scale: float) -> torch.Tensor:
        return tree_attention_triton(q, k, v, cache_k, cache_v, plan, scale)


class InvariantAttention(TritonAttention):
    """The triton backend's metadata, read by the batch-invariant kernel."""

    def plan(self, layout: StepLayout | TreeAttnMetadata, **kwargs: object) -> InvariantPlan:
        # Ancestor lists from the packed masks with device ops: also inside a captured graph.
        return plan_invariant(super().plan(layout, **kwargs))

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor,
                 cache_v: torch.Tensor, plan: InvariantPlan, scale: float) -> torch.Tensor:
        return tree_attention_invariant(q, k, v, cache_k, cache_v, plan, scale)


def default_attention_backend(device: torch.device | str) -> str:
    return "triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch"


def get_attention_backend(name: str | None, device: torch.device | str,
                          batch_invariant: bool = False) -> AttentionBackend:
    """The backend called `name` (None: the device's default), or BackendUnavailable."""
    device = torch.device(device)
    if batch_invariant:
        if name not in (None, "triton"):
            raise BackendUnavailable(f"the batch-invariant mode runs Triton kernels; attention backend "
                                     f"{name!r} cannot be used with it")
        name = "triton"
    name = name or default_attention_backend(device)
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(ATTENTION_BACKENDS)})")
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        what = "the batch-invariant mode (--deterministic)" if batch_invariant else "attention backend 'triton'"
        if not HAS_TRITON:
            raise BackendUnavailable(f"{what} runs Triton kernels, but triton is not installed")
        if device.type != "cuda" and not interpreting():
            raise BackendUnavailable(f"{what} needs a CUDA device (or TRITON_INTERPRET=1, "
                                     "set before triton is imported, to run it slowly on CPU)")
        return InvariantAttention() if batch_invariant else TritonAttention()
    if importlib.util.find_spec("flashinfer") is None:
        raise BackendUnavailable("attention backend 'flashinfer' selected, but flashinfer not installed")
    raise BackendUnavailable("attention backend 'flashinfer': flashinfer is installed, but tandem has no "
                             "flashinfer tree-attention path yet (it needs tree K/V in scratch cache slots); "
                             "use 'triton'")
