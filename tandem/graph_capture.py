"""Capturing CUDA graphs of fixed-shape steps: the one sequence every captured path uses."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture_graphs(*steps: Callable[[], None], pool=None) -> list[torch.cuda.CUDAGraph]:
    """One graph per step, in order. The steps first run once, eagerly, on a side stream:
    that compiles and autotunes their kernels and makes lazy allocations, none of which
    may happen inside a capture. `pool` (torch.cuda.graph_pool_handle()) lets graphs
    share memory; None gives each its own."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for step in steps:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        graphs.append(graph)
    return graphs
