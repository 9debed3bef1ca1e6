"""Hold the host's CPU wake-up latency limit (PM QoS) while something else runs, to measure it served.

    python bench/cpu_latency.py                 # print cpu0's idle states and exit
    python bench/cpu_latency.py --hold-us 0     # hold the limit at 0 us until SIGTERM / Ctrl-C

tandem/cpu_wake.py says what the limit does; `tandem serve --cpu-wake-latency-us N` holds it for a serve.
This holds it beside a serve started without it (bench/h200_hot_path.sh's timeline runs), for an A/B.
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tandem.cpu_wake import held_wake_latency, idle_states  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-us", type=int, help="hold the limit at this many microseconds until stopped")
    args = parser.parse_args(argv)
    print("cpu0 idle states: " + (", ".join(f"{name} ({latency} us)" for name, latency in idle_states())
                                  or "none listed"), flush=True)
    if args.hold_us is None:
        return 0
    if args.hold_us < 0:
        parser.error("--hold-us must be 0 or more")
    with held_wake_latency(args.hold_us) as done:
        print(f"cpu wake-up latency limit {done}", flush=True)
        if not done.startswith("held"):
            return 1
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
