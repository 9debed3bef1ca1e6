"""Attention and step kernels. Each op has a plain torch reference (CPU, and the
tests' oracle); Triton versions are added beside them for the GPU."""
