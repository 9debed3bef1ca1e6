"""Does a thread polling a socket (as a spinning lane read) slow another thread of the same process?

    python bench/results/cpu_2026-12-07_session63/gil_spin.py [NAP_S] [SWITCH_INTERVAL_S]

Thread B answers a message every 5 ms after twenty small torch ops (a push's store, say); thread A
meanwhile blocks on a socket of its own ("blocking"), polls it without pause ("polling"), waits on it
in NAP_S naps (select with a timeout, "napping"), or spins in C without the GIL (tandem/spin_wait.py,
"c-spin"). The round trip to B and B's work, medians, microseconds.
A throwaway probe of the sixty-third session (BENCHMARKS.md), kept with its log.
"""

import select
import socket
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))
from tandem.spin_wait import native_waiter  # noqa: E402


def work() -> None:
    rows = torch.zeros(16, 64)
    for i in range(10):
        rows[i: i + 2].clone()
        torch.tensor([i, i + 1])


def other_thread(conn: socket.socket, mode: str, nap_s: float, stop: threading.Event) -> None:
    conn.settimeout(0.05 if mode == "blocking" else None)
    while not stop.is_set():
        if mode == "c-spin":
            if native_waiter()(conn.fileno(), 0.02) > 0:
                conn.recv(64)
        elif mode == "napping":
            if select.select([conn], [], [], nap_s)[0]:
                conn.recv(64)
        elif mode == "polling":
            try:
                conn.recv(64, socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass
        else:
            try:
                conn.recv(64)
            except TimeoutError:
                pass


def answerer(conn: socket.socket, works: list[float]) -> None:
    while (data := conn.recv(64)) and data != b"q":
        t0 = time.perf_counter()
        work()
        works.append(time.perf_counter() - t0)
        conn.sendall(b"r")


def run(mode: str, nap_s: float, samples: int = 150) -> tuple[float, float, float]:
    a_ours, a_theirs = socket.socketpair()
    b_ours, b_theirs = socket.socketpair()
    stop = threading.Event()
    works: list[float] = []
    spinner = threading.Thread(target=other_thread, args=(a_theirs, mode, nap_s, stop), daemon=True)
    answering = threading.Thread(target=answerer, args=(b_theirs, works), daemon=True)
    spinner.start()
    answering.start()
    work()
    trips = []
    for _ in range(samples):
        time.sleep(0.005)
        t0 = time.perf_counter()
        b_ours.sendall(b"x")
        b_ours.recv(1)
        trips.append(time.perf_counter() - t0)
    b_ours.sendall(b"q")
    stop.set()
    answering.join()
    spinner.join()
    for conn in (a_ours, a_theirs, b_ours, b_theirs):
        conn.close()
    p90 = sorted(trips)[int(0.9 * len(trips))]
    return statistics.median(trips) * 1e6, statistics.median(works) * 1e6, p90 * 1e6


def main() -> None:
    torch.set_num_threads(1)
    nap_s = float(sys.argv[1]) if len(sys.argv) > 1 else 50e-6
    if len(sys.argv) > 2:
        sys.setswitchinterval(float(sys.argv[2]))
    for mode in ("blocking", "polling", "napping", "c-spin") * 2:
        trip, busy, p90 = run(mode, nap_s)
        print(f"other thread {mode:8s}: round trip {trip:7.1f} (p90 {p90:7.1f}), work {busy:6.1f}")


if __name__ == "__main__":
    main()
