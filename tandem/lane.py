"""A same-host lane for the step streams: StepStream, DraftStream and the drafts' feature
subscription (SubscribeFeatures) on a Unix socket.

On one host the gateway's two streams (to the target, to each draft replica) may skip gRPC:
each message, serialized as gRPC would send it, goes behind a 5-byte header (kind, length)
on a Unix socket that the caller's own thread writes and reads, and one thread of the
service runs the stream's handler over it. A gRPC message passes through several Python
threads on each side; on the dev machine a verify step's round trip after 7 ms of work
took 416-645 us on a gRPC stream against 145-259 us here (`bench/grpc_stream_latency.py
--transports tcp,socket --sleep`; BENCHMARKS.md, "A same-host lane for the step streams").

The lane is found through gRPC: a service that opens one names its socket and a random
token in GetInfo (StepLane; the target also in a feature subscription's first message),
and a client's first frame must carry that token and the stream's name, so only a caller
that may call gRPC (its TLS and API key) gets in. Health, info, release and ingest stay
on gRPC, and a client that cannot reach the socket uses the gRPC stream instead.

Errors: a handler's context.abort(code, details) reaches the client as a LaneError, a
grpc.RpcError with that code, and ends the stream, as gRPC would end it.

Spinning reads: with TANDEM_LANE_SPIN_US=N in a service's environment (`tandem serve --lane-spin-us`
sets it for its children: 20,000 by default on a GPU serve with the cores for it), the stream reads (a
server's next call, a client's next reply) poll the socket for up to N microseconds before they block.
On the H100's host a polling receiver's round trip was 101-135 us against 241-301 blocking, and a thread
that had spun ran host ops 3-10x faster than one woken from a sleep (bench/host_wake.py); served, the
spin took a round at one request from 11.7 to 10.9 ms (BENCHMARKS.md, the sixty-fourth session). The
cost: a core per spinning thread. The spin runs in C without the GIL (tandem/spin_wait.py): polling from
Python took the GIL between polls, and another thread's twenty small torch ops then took twice as long
on the dev machine. TANDEM_LANE_SPIN_NATIVE=0 polls from Python all the same (to measure the
difference); where the C helper cannot be built (no `cc`), reads block. A spin only at a wait's end kept
nothing warm (bench/results/gpu_2026-12-07_session63/).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import Message

from tandem.v1 import common_pb2

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<BI")  # kind, payload length
MESSAGE, ERROR, HELLO, WELCOME = 1, 2, 3, 4
MAX_FRAME_BYTES = 512 * 1024 * 1024  # as the services' gRPC limit (tandem.grpc_host)
PROTOCOL = "tandem-lane/1"
HELLO_TIMEOUT_S = 10.0


class LaneError(grpc.RpcError):
    """A lane's failure as a gRPC status, so callers handle both transports alike."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class LaneRefused(OSError):
    """The socket is not there, or its service did not let this client in."""


SPIN_ENV = "TANDEM_LANE_SPIN_US"
NATIVE_SPIN_ENV = "TANDEM_LANE_SPIN_NATIVE"


def spin_from_env() -> float:
    """Seconds a stream read polls before it blocks, from TANDEM_LANE_SPIN_US (0: block at once)."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return 0.0
    try:
        micros = float(raw)
    except ValueError:
        micros = -1.0
    if not 0 <= micros <= 1e6:
        log.warning("%s=%r is not a number of microseconds from 0 to 1000000; lane reads block", SPIN_ENV, raw)
        return 0.0
    return micros / 1e6


class SpinStats:
    """What this process's spinning reads did, for its metrics (tandem/service_metrics.py): reads whose data
    came within the spin, reads that blocked after it, and the seconds spent spinning (a core's time)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.caught = 0
        self.blocked = 0
        self.seconds = 0.0

    def record(self, caught: bool, seconds: float) -> None:
        with self._lock:
            if caught:
                self.caught += 1
            else:
                self.blocked += 1
            self.seconds += seconds

    def snapshot(self) -> tuple[int, int, float]:
        with self._lock:
            return self.caught, self.blocked, self.seconds


SPIN_STATS = SpinStats()


def new_token() -> str:
    return secrets.token_hex(16)


def spin_setup(spin_s: float | None = None) -> tuple[float, Callable[[int, float], int] | None]:
    """(what a read spins, the waiter it spins in) for a wanted spin of spin_s seconds (None: as
    TANDEM_LANE_SPIN_US says, spin_from_env): the C spin of
    tandem/spin_wait.py; with TANDEM_LANE_SPIN_NATIVE=0 polling from Python (None); where the C spin
    cannot be built, no spin at all (0: reads block), since polling from Python holds the GIL between polls
    and slows every other thread of the process (the module's docstring)."""
    if spin_s is None:
        spin_s = spin_from_env()
    if spin_s <= 0:
        return 0.0, None
    if os.environ.get(NATIVE_SPIN_ENV, "").strip() == "0":
        return spin_s, None
    from tandem.spin_wait import native_waiter

    waiter = native_waiter()
    if waiter is None:
        log.warning("lane reads block instead of spinning: the C spin is not available (%s=0 polls from Python)",
                    NATIVE_SPIN_ENV)
        return 0.0, None
    return spin_s, waiter


def _spin_read(conn: socket.socket, size: int, spin_s: float,
               waiter: Callable[[int, float], int] | None = None) -> bytes | None:
    """Up to `size` bytes, spinning for at most spin_s seconds (b"" at the end of the stream); None when
    nothing came (the caller then blocks). `waiter`: tandem/spin_wait.py's, which spins without the GIL;
    None polls from Python. Only for a blocking socket: one with a timeout would wait for readiness
    inside each poll."""
    start = time.perf_counter()
    if waiter is not None:
        ready = waiter(conn.fileno(), spin_s)
        SPIN_STATS.record(ready != 0, time.perf_counter() - start)
        if ready == 0:
            return None
        try:  # readable, or hung up (b""), or an error the read raises
            return conn.recv(size, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return None
    deadline = start + spin_s
    while True:
        try:
            data = conn.recv(size, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if (now := time.perf_counter()) >= deadline:
                SPIN_STATS.record(False, now - start)
                return None
            continue
        SPIN_STATS.record(True, time.perf_counter() - start)
        return data


def _read_exactly(conn: socket.socket, size: int, spin_s: float = 0.0,
                  waiter: Callable[[int, float], int] | None = None) -> bytes | None:
    """size bytes, or None at the end of the stream; spin_s: spin that long for the first bytes (with
    `waiter`, as _spin_read)."""
    if size == 0:
        return b""
    parts, got = [], 0
    if spin_s > 0 and conn.gettimeout() is None:
        first = _spin_read(conn, size, spin_s, waiter)
        if first == b"":
            return None
        if first is not None:
            parts.append(first)
            got = len(first)
    while got < size:
        chunk = conn.recv(min(size - got, 1 << 20))
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_frame(conn: socket.socket, limit: int = MAX_FRAME_BYTES, spin_s: float = 0.0,
               waiter: Callable[[int, float], int] | None = None) -> tuple[int, bytes] | None:
    """(kind, payload), or None when the peer closed (or shut down) the socket. spin_s: spin that
    long for the frame's start before blocking (the module's docstring), with `waiter` where given."""
    head = _read_exactly(conn, _HEADER.size, spin_s, waiter)
    if head is None:
        return None
    kind, size = _HEADER.unpack(head)
    if size > limit:
        raise LaneError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"a lane frame of {size} bytes is over the limit")
    payload = _read_exactly(conn, size)
    return None if payload is None else (kind, payload)


def write_frame(conn: socket.socket, kind: int, payload: bytes) -> None:
    header = _HEADER.pack(kind, len(payload))
    if len(payload) < 1 << 16:  # one write for a step's message; no copy of a large one (features)
        conn.sendall(header + payload)
    else:
        conn.sendall(header)
        conn.sendall(payload)


def _write_within(conn: socket.socket, data: bytes, timeout: float) -> None:
    """All of data on a blocking socket, or TimeoutError once the reader has taken nothing for
    `timeout` seconds (its buffer stayed full): a writer that must not wait on a stuck reader."""
    view, deadline = memoryview(data), time.monotonic() + timeout
    while view:
        try:
            view = view[conn.send(view, socket.MSG_DONTWAIT):]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [conn], [], left)[1]:
            raise TimeoutError(f"the lane's reader took nothing for {timeout:g} s")


def _error_payload(code: grpc.StatusCode, details: str) -> bytes:
    return f"{code.name}\n{details}".encode()


def _error_from(payload: bytes) -> LaneError:
    name, _, details = payload.decode(errors="replace").partition("\n")
    return LaneError(getattr(grpc.StatusCode, name, grpc.StatusCode.UNKNOWN), details)


# --- the service's end ------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaneMethod:
    """A streaming handler as gRPC calls it and its request type: (request iterator, context) ->
    replies, or with `unary` (one request, context) -> replies (a server stream)."""

    handler: Callable[[object, object], Iterator[Message]]
    request_type: type[Message]
    unary: bool = False


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _LaneContext:
    """What the stream handlers use of a grpc.ServicerContext: abort, and callbacks run once when the
    stream ends (the handler returned, or the client went away); and, beyond gRPC, send() (see
    direct_sender)."""

    def __init__(self, conn: socket.socket):
        self._conn = conn
        self._write_lock = threading.Lock()  # frames whole, whichever thread writes them
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False
        self._lock = threading.Lock()

    def write(self, kind: int, payload: bytes) -> None:
        with self._write_lock:
            write_frame(self._conn, kind, payload)

    def send(self, reply: Message, timeout: float) -> None:
        """Writes one reply now, on the caller's thread. Raises LaneError (UNAVAILABLE) when the
        stream has ended or the client took nothing for `timeout` seconds; the stream is then shut
        down, so its handler's callbacks run and the client sees it end."""
        payload = reply.SerializeToString()
        frame = _HEADER.pack(MESSAGE, len(payload)) + payload
        try:
            if self._ended:
                raise OSError("the stream has ended")
            with self._write_lock:
                _write_within(self._conn, frame, timeout)
        except OSError as exc:  # TimeoutError too
            try:
                self._conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            raise LaneError(grpc.StatusCode.UNAVAILABLE, f"lane stream broke: {exc}") from None

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Abort(code, details)

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if not self._ended:
                self._callbacks.append(callback)
                return True
        return False

    def is_active(self) -> bool:
        return not self._ended

    def end(self) -> None:
        with self._lock:
            callbacks, self._callbacks, self._ended = self._callbacks, [], True
        for callback in callbacks:
            try:
                callback()
            except Exception:
                log.exception("a lane stream's end callback failed")


class LaneServer:
    """Serves `methods` on a Unix socket at `path` (mode 0600) to clients that bring `token`:
    one thread per connection runs the named handler over the connection's frames."""

    def __init__(self, path: str | Path, methods: Mapping[str, LaneMethod], token: str | None = None,
                 spin_s: float | None = None):
        self.path = str(path)
        self.token = token or new_token()
        self.methods = dict(methods)
        # a stream's wait for its next call
        self.spin_s, self.waiter = spin_setup(spin_s)
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.path):  # a socket a stopped service left
            os.unlink(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.path)
        os.chmod(self.path, 0o600)
        listener.listen(16)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="lane-accept", daemon=True).start()

    def close_listener(self) -> None:
        """Take no new connection (a drain); the open ones go on."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        """No new connection, and the open ones end (their clients see the stream end)."""
        self.close_listener()
        with self._lock:
            connections, self._connections = list(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # closed: a drain or a stop
                return
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="lane-stream", daemon=True).start()

    def _welcome(self, conn: socket.socket) -> LaneMethod | None:
        # Before the token is checked a client gets little: a short hello, soon.
        conn.settimeout(HELLO_TIMEOUT_S)
        frame = read_frame(conn, limit=4096)
        conn.settimeout(None)
        if frame is None or frame[0] != HELLO:
            return None
        protocol, method, token = (frame[1].decode(errors="replace").split("\n") + ["", "", ""])[:3]
        if protocol != PROTOCOL or not hmac.compare_digest(token.encode(), self.token.encode()):
            write_frame(conn, ERROR, _error_payload(grpc.StatusCode.UNAUTHENTICATED, "wrong lane token"))
            return None
        if method not in self.methods:
            write_frame(conn, ERROR, _error_payload(grpc.StatusCode.UNIMPLEMENTED, f"no lane for {method!r}"))
            return None
        write_frame(conn, WELCOME, b"")
        return self.methods[method]

    def _serve(self, conn: socket.socket) -> None:
        try:
            method = self._welcome(conn)
            if method is not None:
                self._run(conn, method, self.spin_s, self.waiter)
        except (OSError, LaneError) as exc:  # the client went away mid-frame, or sent too much
            log.debug("lane stream ended: %s", exc)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    @staticmethod
    def _run(conn: socket.socket, method: LaneMethod, spin_s: float = 0.0,
             waiter: Callable[[int, float], int] | None = None) -> None:
        def requests() -> Iterator[Message]:
            while (frame := read_frame(conn, spin_s=spin_s, waiter=waiter)) is not None and frame[0] == MESSAGE:
                yield method.request_type.FromString(frame[1])

        context = _LaneContext(conn)
        if method.unary:
            request = next(requests(), None)
            if request is None:
                return
            # Nothing more is read on a server stream but its end: a watcher waits for it, so the
            # handler's callbacks learn that the client left while the handler waits for work.
            threading.Thread(target=lambda: (_drain(conn), context.end()), name="lane-watch", daemon=True).start()
            replies = method.handler(request, context)
        else:
            replies = method.handler(requests(), context)
        try:
            # Each reply is written before the handler resumes: what it does after a yield runs once the
            # reply has left, as under gRPC.
            for reply in replies:
                context.write(MESSAGE, reply.SerializeToString())
        except _Abort as abort:
            context.write(ERROR, _error_payload(abort.code, abort.details))
        except OSError:
            raise
        except Exception as exc:
            log.exception("lane stream handler failed")
            context.write(ERROR, _error_payload(grpc.StatusCode.INTERNAL, f"internal error: {exc}"))
        finally:
            replies.close()  # a client gone mid-stream: the handler's own clean-up runs now
            context.end()


def direct_sender(context) -> Callable[[Message, float], None] | None:
    """For a server stream served on a lane, a function that writes a reply at once from any
    thread (reply, timeout in seconds; LaneError when it cannot): a producer on another thread
    then need not hand each reply to the handler's thread and wait for it to hold the GIL. None
    under gRPC, whose replies leave only by the handler's yield."""
    return context.send if isinstance(context, _LaneContext) else None


def _drain(conn: socket.socket) -> None:
    """Read and drop until the stream ends."""
    try:
        while read_frame(conn) is not None:
            pass
    except (OSError, LaneError):
        pass


# --- the caller's end ---------------------------------------------------------------------------------

class LaneStream:
    """The gateway's end of one stream on a lane, the interface of gateway.clients' gRPC stream:
    send(), reply() (raises StopIteration when the stream ended, LaneError on an error), and
    cancel() from any thread. Used by one thread at a time."""

    def __init__(self, path: str, token: str, method: str, reply_type: type[Message], connect_timeout: float = 2.0,
                 spin_s: float | None = None):
        self._reply_type = reply_type
        self._spin_s, self._waiter = spin_setup(spin_s)  # each reply's wait
        self._cancelled = False
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(connect_timeout)
            conn.connect(path)
            write_frame(conn, HELLO, f"{PROTOCOL}\n{method}\n{token}".encode())
            answer = read_frame(conn)
        except OSError as exc:
            conn.close()
            raise LaneRefused(f"lane {path}: {exc}") from None
        if answer is None or answer[0] != WELCOME:
            conn.close()
            why = _error_from(answer[1]).details() if answer is not None and answer[0] == ERROR else "closed"
            raise LaneRefused(f"lane {path}: {why}")
        conn.settimeout(None)
        self._conn = conn
        self._send_failed: LaneError | None = None

    def send(self, call: Message) -> None:
        """Never raises: as on a gRPC stream, a failure shows at the next reply()."""
        try:
            write_frame(self._conn, MESSAGE, call.SerializeToString())
        except OSError as exc:
            self._send_failed = self._send_failed or self._broken(exc)

    def reply(self) -> Message:
        if self._send_failed is not None:
            raise self._send_failed
        try:
            frame = read_frame(self._conn, spin_s=self._spin_s, waiter=self._waiter)
        except OSError as exc:
            raise self._broken(exc) from None
        if frame is None:
            if self._cancelled:
                raise LaneError(grpc.StatusCode.CANCELLED, "lane stream cancelled")
            raise StopIteration
        kind, payload = frame
        if kind == ERROR:
            raise _error_from(payload)
        return self._reply_type.FromString(payload)

    def __iter__(self) -> Iterator[Message]:
        """The replies until the stream ends (a server stream's, as a gRPC call iterates)."""
        while True:
            try:
                yield self.reply()
            except StopIteration:
                return

    def _broken(self, exc: OSError) -> LaneError:
        if self._cancelled:
            return LaneError(grpc.StatusCode.CANCELLED, "lane stream cancelled")
        return LaneError(grpc.StatusCode.UNAVAILABLE, f"lane stream broke: {exc}")

    def cancel(self) -> None:
        """Ends the stream from any thread; a reply() waiting raises CANCELLED."""
        self._cancelled = True
        try:
            self._conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        self.cancel()
        self._conn.close()


# --- wiring into a service ------------------------------------------------------------------------------

def add_lane_argument(parser, stream: str) -> None:
    parser.add_argument(
        "--step-lane", default=None, metavar="DIR",
        help=f"also serve {stream} on a same-host lane, a Unix socket in DIR (made if missing; mode 0600), which "
             "a gateway on this host then uses for that stream instead of gRPC (its path and a token new at each "
             "start are in GetInfo; everything else stays on gRPC). `tandem serve` sets it; default: none")


def lane_to_proto(lane: LaneServer | None) -> common_pb2.StepLane | None:
    """What GetInfo says of a service's lane (None: it has none)."""
    return None if lane is None else common_pb2.StepLane(path=lane.path, token=lane.token)


def start_lane(directory: str | Path, name: str, methods: Mapping[str, LaneMethod], host) -> LaneServer:
    """A started lane at DIRECTORY/NAME.sock for `methods`, taking no new connection once `host`
    (tandem.grpc_host.ServiceHost) drains; stop() it before the engine goes."""
    lane = LaneServer(Path(directory) / f"{name}.sock", methods)
    lane.start()
    host.on_draining.append(lane.close_listener)
    log.info("step lane on %s", lane.path)
    return lane
