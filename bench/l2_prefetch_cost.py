"""One-row GEMMs behind a window of other GPU work, with and without an L2 prefetch of their weight issued at
the window's start (kernels.l2_prefetch), for each weight shape of the 8B scale track.

    python bench/l2_prefetch_cost.py [--windows-us 0,3,6,12] [--caps-mb 8,16,32,64] [--out FILE.json]

Each case is one CUDA graph of --layers (window, then F.linear at one row), each layer on its own copy of the
weight (no GEMM finds its weight in L2 but by the prefetch). The window is torch.cuda._sleep, a spin kernel on
one SM that leaves HBM idle, as the norms, RoPE, attention and the activation do at one row. Printed per case:
microseconds per layer, the GEMM's part of it (the layer less the window timed alone) and the weight's bytes
over that part. What the forward gains is bench/step_cost.py --l2-prefetch-mb 0,CAP's to show; this says
which shapes and windows a prefetch pays for, and how large a cap is worth asking.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as `python3 bench/l2_prefetch_cost.py`

from bench.gemv_cost import SHAPES, time_graph  # noqa: E402
from kernels.l2_prefetch import WeightPrefetch  # noqa: E402
from tandem.graph_capture import capture_graphs  # noqa: E402


def cycles_per_us(iters: int) -> float:
    """torch.cuda._sleep's cycles per microsecond on this GPU, from a graph of long sleeps."""
    spins, cycles = 20, 1_000_000
    ms = time_graph(capture_graphs(lambda: [torch.cuda._sleep(cycles) for _ in range(spins)])[0], iters)
    return spins * cycles / (ms * 1e3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32, help="layers per graph, each on its own weight")
    ap.add_argument("--windows-us", default="0,3,6,12", help="the other work before each GEMM, microseconds")
    ap.add_argument("--caps-mb", default="8,16,32,64", help="L2 prefetch caps to time beside no prefetch, MiB")
    ap.add_argument("--chunk-kb", type=int, default=64, help="bytes per prefetch instruction, KiB")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down", help="of " + ",".join(name for name, *_ in SHAPES))
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    windows = [float(w) for w in args.windows_us.split(",")]
    caps = [0] + [int(c) for c in args.caps_mb.split(",")]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    per_us = cycles_per_us(args.iters)
    print(f"{torch.cuda.get_device_name(dev)}: torch.cuda._sleep at {per_us:.0f} cycles/us; "
          f"{args.layers} layers a graph, chunks of {args.chunk_kb} KiB", flush=True)
    print(f"{'shape':<8} {'window us':>9} {'cap MiB':>7} {'layer us':>9} {'gemm us':>8} {'TB/s':>6}")
    rows = []
    for name, n, k in SHAPES:
        if name not in args.shapes.split(","):
            continue
        weights = [torch.randn(n, k, device=dev, dtype=dtype) * 0.02 for _ in range(args.layers)]
        x = torch.randn(1, k, device=dev, dtype=dtype)
        for window in windows:
            cycles = int(window * per_us)
            alone_ms = 0.0  # no window: layers() launches no sleep
            if cycles:
                sleeps = capture_graphs(lambda c=cycles: [torch.cuda._sleep(c) for _ in range(args.layers)])[0]
                alone_ms = time_graph(sleeps, args.iters)
            for cap in caps:
                prefetch = WeightPrefetch(dev, cap << 20, args.chunk_kb << 10) if cap else None

                def layers(weights=weights, x=x, cycles=cycles, prefetch=prefetch) -> list[torch.Tensor]:
                    out = []
                    for weight in weights:
                        if prefetch is not None:
                            prefetch.next(weight)
                        if cycles:
                            torch.cuda._sleep(cycles)
                        out.append(F.linear(x, weight))
                    if prefetch is not None:
                        prefetch.join()
                    return out

                layer_us = 1e3 * time_graph(capture_graphs(layers)[0], args.iters) / args.layers
                gemm_us = layer_us - 1e3 * alone_ms / args.layers
                row = {"shape": name, "n": n, "k": k, "window_us": window, "cap_mb": cap,
                       "layer_us": round(layer_us, 2), "gemm_us": round(gemm_us, 2),
                       "tb_s": round(2 * n * k / (gemm_us * 1e-6) / 1e12, 3) if gemm_us > 0 else None}
                rows.append(row)
                print(f"{name:<8} {window:>9g} {cap:>7} {layer_us:>9.2f} {gemm_us:>8.2f} "
                      f"{row['tb_s'] if row['tb_s'] is not None else '-':>6}", flush=True)
        del weights
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "cycles_per_us": per_us,
                                        "layers": args.layers, "chunk_kb": args.chunk_kb, "rows": rows}, indent=2))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
