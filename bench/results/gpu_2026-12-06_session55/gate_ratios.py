"""The load gate's delivered trees / plain ratio per bucket, from a gateway DEBUG log: every step line's
figures (goodput with the prompts' charges), first, min, median and max over the serve.

    python bench/results/gpu_2026-12-06_session55/gate_ratios.py GATEWAY_LOG[.gz]
"""
import gzip
import re
import statistics
import sys

LINE = re.compile(r"gate (\d+-\d+) sequences: trees ([\d.]+) tok/s \((\d+) steps.*?plain ([\d.]+) tok/s \((\d+) steps"
                  r"(?:.*?prompts add (\d+) us a token to trees and (\d+) to plain)?")


def main(path: str) -> None:
    ratios: dict[str, list[float]] = {}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as log:
        for line in log:
            m = LINE.search(line)
            if not m:
                continue
            trees, plain = float(m[2]), float(m[4])
            if trees <= 0 or plain <= 0:
                continue
            trees_charge, plain_charge = float(m[6] or 0) * 1e-6, float(m[7] or 0) * 1e-6
            delivered = (1 / (1 / trees + trees_charge)) / (1 / (1 / plain + plain_charge))
            ratios.setdefault(m[1], []).append(delivered)
    for bucket, values in sorted(ratios.items(), key=lambda kv: int(kv[0].split("-")[0])):
        print(f"{bucket:>7} sequences: delivered trees / plain first {values[0]:.3f}, min {min(values):.3f}, "
              f"median {statistics.median(values):.3f}, max {max(values):.3f} over {len(values)} step lines")


if __name__ == "__main__":
    main(sys.argv[1])
