"""Summarise a `py-spy record --threads --format raw` file.

    python spysum.py RAW [THREAD] [N]

Prints the samples per thread, then the N (default 60) frames with the most samples inclusive and the 25 with the
most self samples, counting only the stacks of threads whose name contains THREAD ("" for all).
"""

import collections
import re
import sys

SITE = re.compile(r"\(/work/main/|\(/tmp/fresh34/.venv/lib/python3.11/site-packages/")


def main() -> None:
    path = sys.argv[1]
    want = sys.argv[2] if len(sys.argv) > 2 else ""
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 60
    inclusive, own, threads = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0
    with open(path) as lines:
        for line in lines:
            line = line.rstrip()
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            samples = int(count)
            frames = stack.split(";")
            threads[frames[0]] += samples
            if want not in frames[0]:
                continue
            total += samples
            for frame in {SITE.sub("(", f) for f in frames[1:]}:
                inclusive[frame] += samples
            own[SITE.sub("(", frames[-1])] += samples
    for thread, samples in threads.most_common():
        print(samples, thread)
    print("total", total)
    print("--- inclusive")
    for frame, samples in inclusive.most_common(top):
        print(f"{samples:6d} {100 * samples / total:5.1f}% {frame}")
    print("--- self")
    for frame, samples in own.most_common(25):
        print(f"{samples:6d} {100 * samples / total:5.1f}% {frame}")


if __name__ == "__main__":
    main()
