"""Ask the GPU's L2 cache for a weight before the GEMM that reads it.

At one request the target's forward reads every weight once, and between its
GEMMs run small kernels (norms, RoPE, attention, the MLP's activation) that
leave HBM nearly idle: on the H200 the forward took 4.82 ms at batch 1 against
3.59 ms for its weights at 4.2 TB/s, and the one-row GEMMs of qkv, o and down
read at only 2.5-3.7 TB/s (BENCHMARKS.md, thirty-eighth session). Issued on a
side stream as soon as the previous GEMM is done, a bulk L2 prefetch
(`cp.async.bulk.prefetch.L2`, Hopper and later) streams the next weight's
first bytes while those small kernels run, so the GEMM finds them in L2. The
prefetch has no result: it cannot change any output, only the time.

CUDA only (sm_90+). Off unless asked for (`tandem target --l2-prefetch-mb`):
not yet measured on a GPU (`bench/l2_prefetch_cost.py`).
"""

from __future__ import annotations

import torch

from kernels._triton import tl, triton

CHUNK_BYTES = 1 << 16  # bytes per prefetch instruction
CHUNKS_PER_PROGRAM = 32  # one warp's worth: each lane issues one chunk
ALIGN = 16  # cp.async.bulk wants 16-byte aligned addresses and sizes


@triton.jit
def _prefetch_l2_kernel(Base, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    """Bulk L2 prefetches of bytes [0, nbytes) from Base (bytes), PER_PROGRAM chunks of CHUNK bytes a
    program (nbytes and Base 16-byte aligned; a lane past the end issues nothing)."""
    offs = (tl.program_id(0).to(tl.int64) * PER_PROGRAM + tl.arange(0, PER_PROGRAM)) * CHUNK
    live = offs < nbytes
    sizes = tl.where(live, tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    ptrs = Base + tl.where(live, offs, 0)
    tl.inline_asm_elementwise(
        "{ .reg .pred live; setp.ne.s32 live, $2, 0; @live cp.async.bulk.prefetch.L2.global [$1], $2; "
        "mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, sizes], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_bytes(weight: torch.Tensor, max_bytes: int) -> int:
    """How many of weight's first bytes a prefetch asks for: at most max_bytes, a multiple of 16; 0 where
    the weight cannot be prefetched as one range (not contiguous, or not 16-byte aligned)."""
    if not weight.is_contiguous() or weight.data_ptr() % ALIGN:
        return 0
    nbytes = min(weight.numel() * weight.element_size(), max_bytes)
    return nbytes - nbytes % ALIGN


def prefetch_l2(weight: torch.Tensor, max_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Enqueues, on the current stream, a kernel asking L2 for weight's first max_bytes; returns the bytes
    asked for (0: nothing launched)."""
    if chunk_bytes <= 0 or chunk_bytes % ALIGN:
        raise ValueError(f"prefetch chunks must be a positive multiple of {ALIGN} bytes, got {chunk_bytes}")
    nbytes = prefetch_bytes(weight, max_bytes)
    if nbytes:
        programs = triton.cdiv(triton.cdiv(nbytes, chunk_bytes), CHUNKS_PER_PROGRAM)
        # As bytes: one compiled kernel whatever the weight's dtype (WeightPrefetch compiles it before any capture).
        _prefetch_l2_kernel[(programs,)](weight.reshape(-1).view(torch.uint8), nbytes, CHUNK=chunk_bytes,
                                         PER_PROGRAM=CHUNKS_PER_PROGRAM, num_warps=1)
    return nbytes


class WeightPrefetch:
    """Prefetches of the weights a forward reads next, on a side stream: each waits for the work the
    forward's stream has enqueued so far (the GEMM before, whose weight L2 then no longer needs), and
    the forward's stream waits for them only at its end (join), so no kernel of the forward waits on a
    prefetch. Only inside a CUDA graph capture, where they become a branch of the graph: an eager step is
    bound by its launches, and a forward of 32 layers would add 129 launches and as many stream waits.

    max_bytes: the most asked for per weight. L2 holds 50 MB on an H100 or H200; a prefetch of more than
    the small kernels before a GEMM give it time to fetch would evict its own first bytes."""

    def __init__(self, device: torch.device, max_bytes: int, chunk_bytes: int = CHUNK_BYTES):
        if device.type != "cuda":
            raise ValueError(f"L2 prefetch runs on CUDA devices, not {device}")
        if max_bytes <= 0:
            raise ValueError(f"an L2 prefetch asks for at least 1 byte a weight, got {max_bytes}")
        self.device, self.max_bytes, self.chunk_bytes = device, max_bytes, chunk_bytes
        self.stream = torch.cuda.Stream(device=device)
        with torch.cuda.stream(self.stream):  # compiled now: no Triton build inside a capture
            prefetch_l2(torch.zeros(ALIGN, dtype=torch.uint8, device=device), ALIGN, chunk_bytes)
        self.stream.synchronize()

    def next(self, weight: torch.Tensor) -> None:
        """Prefetch `weight` once the forward's stream has done what it holds now (in a capture only)."""
        if not torch.cuda.is_current_stream_capturing():
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            prefetch_l2(weight, self.max_bytes, self.chunk_bytes)

    def join(self) -> None:
        """The forward's stream waits for every prefetch issued (a capture must end with its branches joined)."""
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
