"""`tandem serve`: target, draft replicas and gateway as child processes on this machine.

Start-up order: the target and every draft replica start together (a draft
reads the target's embeddings from its directory, not from the running
target), each on an internal port on 127.0.0.1 that we pick free and keep for
it (a restarted child comes back at the same address, so the gateway finds it
again); once all report SERVING on gRPC health, the gateway starts on the
public --host/--port/--grpc-port and we wait for its /health to say 200.

With --tls-cert/--tls-key the gateway serves REST and gRPC over TLS; adding
--tls-ca turns on mutual TLS between the gateway and the services: they serve
the same certificate and require a client certificate signed by the CA, and
the gateway presents --tls-client-cert/--tls-client-key (default: the serving
pair, which must then allow client authentication too). This supervisor's own
readiness probes use the gateway's client certificate for the services; the
gateway's REST /health is probed without verifying its certificate (our own
child on this machine), and its gRPC health is not probed when it serves TLS
(the gateway flips it together with /health).

Children run in sessions of their own so that a terminal's Ctrl-C reaches
only this supervisor, which stops them in order: the gateway first (it
drains its running requests), then the drafts and the target. On Linux each
child also gets SIGTERM if the supervisor itself dies.

A child that exits once everything is running is reported (which, exit code,
last log lines) and started again with the same command line after a back-off
(gateway/restarts.py): the gateway waits for a restarted target (--target-wait)
and takes a restarted draft back. Past --max-restarts within --restart-window,
or for a child that dies while starting up, the rest are stopped and we exit
with status 1.
"""

from __future__ import annotations

import argparse
import http.client
import os
import random
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from gateway.restarts import DEFAULT_MAX_RESTARTS, DEFAULT_WINDOW_S, RestartPolicy
from tandem import telemetry
from tandem.cpu_quota import usable_cores
from tandem.cpu_wake import held_wake_latency
from tandem.host_threads import default_threads
from tandem.lane import SPIN_ENV
from tandem.tls import ClientTLS, ServerTLS

REPO = Path(__file__).resolve().parent.parent
# The bundled demo pair that `tandem serve` runs with no --model.
DEMO_DIR = REPO / "demo"
DEMO_TARGET_NAME = "target"
DEMO_DRAFT_NAME = "draft"
# How a child tandem service is started; tests swap in stand-ins.
TANDEM = [sys.executable, "-m", "tandem.cli"]
# The lanes' reads spin this long on a GPU host by default: 20 ms covers every wait of a round at one request
# (BENCHMARKS.md, the sixty-fourth session: the H100's round 0.8 ms shorter with it). Spinning threads take
# cores: where fewer than MIN_SPIN_CORES are usable (tandem/cpu_quota.py: a container's quota counts) reads block.
DEFAULT_LANE_SPIN_US = 20_000
MIN_SPIN_CORES = 8
MAX_LANE_SPIN_US = 1_000_000

GATEWAY_STOP_GRACE_S = 45.0  # the gateway drains running requests (its --drain-seconds, 30 by default)
SERVICE_STOP_GRACE_S = 15.0
POLL_S = 0.2
LOG_TAIL_LINES = 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem serve",
        description="Start a target service, draft replicas and the gateway as separate processes on this "
                    "machine, and stop them all on Ctrl-C or SIGTERM. With no --model, serves the bundled "
                    f"demo pair ({DEMO_DIR.name}/{DEMO_TARGET_NAME} and {DEMO_DIR.name}/{DEMO_DRAFT_NAME}).",
        epilog=f"The services listen on 127.0.0.1, on ports picked free from {CHILD_PORTS_LOW} up to the kernel's "
               f"ephemeral range; set {CHILD_PORTS_ENV}=LOW-HIGH to keep them within a range of your own.")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="Hugging Face Llama-family directory (config.json, safetensors, tokenizer files); "
                        "default: the bundled demo target")
    p.add_argument("--draft", metavar="DIR|none", default=None,
                   help="EAGLE-3 draft directory, or 'none' to serve without speculation (default: the demo "
                        "draft with the demo target; none with --model)")
    p.add_argument("--speculation", choices=["auto", "always", "never"], default="auto",
                   help="default speculation mode; requests may override it (default auto)")
    p.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel degree of the target "
                   "(default 1)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda when a GPU is visible, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weights and KV dtype (default float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--host", default="127.0.0.1", help="address of the REST and gRPC APIs (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="REST (OpenAI) port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC tandem.v1.Generation port (default 50051)")
    p.add_argument("--draft-replicas", type=int, default=1, metavar="N",
                   help="draft service processes; a request sticks to one (default 1)")
    p.add_argument("--draft-gpus", metavar="LIST", default=None,
                   help="with --device cuda: the GPUs (indices as this process sees them) the draft replicas run "
                        "on, in turn, e.g. 1 to give the draft a GPU of its own beside a --tp 1 target on GPU 0 "
                        "(default: every replica on the first GPU, beside the target's rank 0)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on the REST API and on gRPC Generation")
    p.add_argument("--protect-metrics", action="store_true", help="with --api-key, require the key on /metrics")
    p.add_argument("--max-request-bytes", type=int, metavar="N", default=None,
                   help="largest REST body or gRPC message the gateway accepts (default: the gateway's)")
    tls = p.add_argument_group("TLS")
    tls.add_argument("--tls-cert", metavar="PEM", default=None,
                     help="serve the REST and gRPC APIs over TLS with this certificate chain (with --tls-key)")
    tls.add_argument("--tls-key", metavar="PEM", default=None, help="the private key of --tls-cert")
    tls.add_argument("--tls-ca", metavar="PEM", default=None,
                     help="mutual TLS between the gateway and the target/drafts: the services serve --tls-cert "
                          "and accept only callers with a certificate signed by this CA")
    tls.add_argument("--tls-client-cert", metavar="PEM", default=None,
                     help="the gateway's certificate towards the services (default: --tls-cert)")
    tls.add_argument("--tls-client-key", metavar="PEM", default=None,
                     help="the private key of --tls-client-cert (default: --tls-key)")
    telemetry.add_otlp_argument(p)
    p.add_argument("--max-model-len", type=int, metavar="N", default=None,
                   help="longest prompt + output in tokens (default: the model's)")
    p.add_argument("--max-queue", type=int, metavar="N", default=None,
                   help="waiting requests before 429 (default: the gateway's)")
    p.add_argument("--spec-steps", type=int, default=5, help="tree depth for `always` (default 5)")
    p.add_argument("--spec-topk", type=int, default=4, help="children per node for `always` (default 4)")
    p.add_argument("--spec-draft-tokens", type=int, default=8,
                   help="tree size for `always`, root included (default 8)")
    p.add_argument("--kv-cache-gb", type=float, default=None, metavar="GB",
                   help="target KV cache per GPU/rank in GiB (default: the target's)")
    p.add_argument("--features-through-gateway", action="store_true",
                   help="feed the drafts the target's features through the gateway instead of letting them take "
                        "the features from the target (benchmarks: the path before ReadFeatures; by default the "
                        "target pushes them to the drafts, and --draft-args=--pull-features has the drafts read "
                        "them before each tree instead)")
    p.add_argument("--deterministic", action="store_true",
                   help="the target's batch-invariant mode: greedy output with speculation is bitwise the output "
                        "without it, on a GPU in bf16 too; slower (see tandem target --help)")
    p.add_argument("--target-args", metavar="ARGS", default="",
                   help="more arguments for each `tandem target` child, as one quoted string "
                        "(e.g. \"--no-cuda-graphs --num-blocks 4096\"; see tandem target --help)")
    p.add_argument("--draft-args", metavar="ARGS", default="",
                   help="more arguments for each `tandem draft` child, as one quoted string")
    p.add_argument("--gateway-args", metavar="ARGS", default="",
                   help="more arguments for the `tandem gateway` child, as one quoted string "
                        "(e.g. \"--grant-steps 1\"; see tandem gateway --help)")
    p.add_argument("--no-step-lane", action="store_true",
                   help="keep the gateway's step streams to the target and drafts on gRPC. By default the services "
                        "also serve them on Unix sockets in a private temporary directory (tandem/lane.py), which "
                        "skips gRPC's threads on each message of a round")
    p.add_argument("--lane-spin-us", type=int, metavar="US", default=None,
                   help="the step lanes' reads (each service's wait for its next call, the gateway's for each "
                        "reply, a draft's for the target's features; with --tp N, ranks 1..N-1's wait for rank 0's "
                        "next command) spin up to US microseconds before they block: "
                        "a thread woken from a sleep runs its next hop cold, and a round has five such waits. The "
                        "spin runs in C without the GIL (tandem/spin_wait.py) and takes a core per waiting thread "
                        "while it lasts (up to 2 + 3 per draft replica + N - 1 threads wait so; an idle serve spins "
                        "once, then blocks). 0 blocks at once. Default: "
                        f"{DEFAULT_LANE_SPIN_US} with --device cuda where {MIN_SPIN_CORES} + 3 per draft replica past "
                        "the first + N - 1 cores or more are usable (the CPU affinity, cut to a container's CPU "
                        f"quota), else 0; unless {SPIN_ENV} is set")
    p.add_argument("--cpu-wake-latency-us", type=int, metavar="US", default=None,
                   help="hold the host's CPU wake-up latency limit (Linux PM QoS, /dev/cpu_dma_latency) at US "
                        "microseconds while serving: cores stay out of deeper idle states, whose wake-ups flush "
                        "caches and slow every hop of a speculative round (tandem/cpu_wake.py). 0 keeps them "
                        "polling. For bare-metal hosts with deep idle states (a VM's are its hypervisor's: no "
                        "effect there). Costs power; needs root, else a warning and the host's setting. Default: "
                        "the host's setting")
    p.add_argument("--log-dir", metavar="DIR", default=None,
                   help="where each process writes its log (default: a new temporary directory)")
    p.add_argument("--startup-timeout", type=float, default=900.0, metavar="S",
                   help="seconds each stage may take to become ready (default 900)")
    p.add_argument("--max-restarts", type=int, default=DEFAULT_MAX_RESTARTS, metavar="N",
                   help="a child that dies once everything runs is started again (same command line, same "
                        "address) after a back-off of 1, 2, 4, ... s; after N restarts within --restart-window "
                        "the next death stops everything. 0: a dead child stops everything "
                        f"(default {DEFAULT_MAX_RESTARTS})")
    p.add_argument("--restart-window", type=float, default=DEFAULT_WINDOW_S, metavar="S",
                   help=f"seconds over which --max-restarts counts (default {DEFAULT_WINDOW_S:.0f})")
    return p


class ServeError(Exception):
    """Bad flags or environment: reported as 'error: ...' with exit status 2."""


@dataclass
class Plan:
    """Resolved inputs: what to run and where."""

    model: Path
    draft: Path | None
    device: str
    log_dir: Path
    lane_dir: Path | None = None  # the services' step lanes (sockets), None: gRPC only
    lane_spin_us: int | None = None  # what the children's lane reads spin (None: as the environment says)
    public_tls: ServerTLS | None = None  # the gateway's REST and gRPC
    service_tls: ServerTLS | None = None  # the target's and drafts' gRPC (mutual: client_ca is set)
    gateway_tls: ClientTLS | None = None  # the gateway's (and our probes') side towards the services


def _say(msg: str) -> None:
    print(f"tandem serve: {msg}", file=sys.stderr, flush=True)


def _default_device() -> str:
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve(args: argparse.Namespace) -> Plan:
    """Check the flags against the machine; raise ServeError with a message a user can act on."""
    if args.model is None:
        model, draft_default = DEMO_DIR / DEMO_TARGET_NAME, DEMO_DIR / DEMO_DRAFT_NAME
        missing = [p for p in (model, draft_default) if not p.is_dir()
                   and not (p == draft_default and args.draft is not None)]
        if missing:
            raise ServeError(
                "the bundled demo models are not in this checkout (missing "
                + ", ".join(str(p) for p in missing) + "). Build the demo pair first, or pass "
                "--model DIR [--draft DIR|none] to serve your own model.")
    else:
        model, draft_default = Path(args.model), None
    if not (model / "config.json").is_file():
        raise ServeError(f"--model {model}: no config.json there (expected a Hugging Face model directory)")
    if args.draft is None:
        draft = draft_default
    elif args.draft.lower() == "none":
        draft = None
    else:
        draft = Path(args.draft)
    if draft is not None and not (draft / "config.json").is_file():
        raise ServeError(f"--draft {draft}: no config.json there (expected an EAGLE-3 draft directory)")
    for flag, value in (("--tp", args.tp), ("--draft-replicas", args.draft_replicas)):
        if value < 1:
            raise ServeError(f"{flag} must be >= 1, got {value}")
    for flag, value in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not 1 <= value <= 65535:
            raise ServeError(f"{flag} must be a port number (1-65535), got {value}")
    if args.port == args.grpc_port:
        raise ServeError("--port and --grpc-port must differ")
    if args.lane_spin_us is not None and not 0 <= args.lane_spin_us <= MAX_LANE_SPIN_US:
        raise ServeError(f"--lane-spin-us must be from 0 to {MAX_LANE_SPIN_US}, got {args.lane_spin_us}")
    if args.lane_spin_us and args.no_step_lane:
        raise ServeError("--lane-spin-us spins the step lanes' reads: it does nothing with --no-step-lane")
    if args.cpu_wake_latency_us is not None and args.cpu_wake_latency_us < 0:
        raise ServeError(f"--cpu-wake-latency-us must be 0 or more, got {args.cpu_wake_latency_us}")
    if args.draft_gpus is not None:
        gpus = draft_gpus(args.draft_gpus)
        if (args.device or _default_device()) != "cuda":
            raise ServeError("--draft-gpus needs --device cuda")
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and max(gpus) >= len(visible.split(",")):
            raise ServeError(f"--draft-gpus {args.draft_gpus}: only {len(visible.split(','))} GPUs are visible "
                             f"(CUDA_VISIBLE_DEVICES={visible})")
    for flag, value in (("--target-args", args.target_args), ("--draft-args", args.draft_args),
                        ("--gateway-args", args.gateway_args)):
        try:
            shlex.split(value)
        except ValueError as exc:
            raise ServeError(f"{flag}: cannot split {value!r} into arguments ({exc})") from None
    for flag, value in (("--port", args.port), ("--grpc-port", args.grpc_port)):
        if not port_is_free(args.host, value):
            raise ServeError(f"{flag} {value}: {args.host}:{value} is already in use")
    try:
        child_port_span()
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    if args.protect_metrics and not args.api_key:
        raise ServeError("--protect-metrics needs --api-key")
    try:
        restart_policy(args)
    except ValueError as exc:
        raise ServeError(f"--max-restarts/--restart-window: {exc}") from None
    public_tls, service_tls, gateway_tls = resolve_tls(args)
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="tandem-serve-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    device = args.device or _default_device()
    return Plan(model=model.resolve(), draft=draft.resolve() if draft else None,
                device=device, log_dir=log_dir.resolve(), public_tls=public_tls,
                service_tls=service_tls, gateway_tls=gateway_tls,
                lane_spin_us=None if args.no_step_lane else lane_spin_us(
                    args.lane_spin_us, device, tp=args.tp, replicas=args.draft_replicas if draft else 0))


def lane_spin_us(flag: int | None, device: str, cores: int | None = None, tp: int = 1,
                 replicas: int = 1) -> int | None:
    """What the children's lane reads spin, in microseconds: the flag's value; without it, none where the
    environment sets TANDEM_LANE_SPIN_US (the children inherit it), else the default on a GPU host with
    cores to spare (the model's own work runs on the host's cores on a CPU, and a spinning thread would
    take one from it): MIN_SPIN_CORES for a target and one draft replica, three more for each further
    replica (its stream, its feature subscription and the gateway's wait for it), and one more for each rank
    past the first of a --tp target, whose wait for rank 0's next command spins too
    (target_service/parallel.py)."""
    if flag is not None:
        return flag
    if os.environ.get(SPIN_ENV, "").strip():
        return None
    if cores is None:  # its affinity and its container's CPU quota, which spinning threads would exhaust
        cores = usable_cores()
    needed = MIN_SPIN_CORES + 3 * max(replicas - 1, 0) + tp - 1
    return DEFAULT_LANE_SPIN_US if device == "cuda" and cores >= needed else 0


def draft_gpus(text: str) -> list[int]:
    """--draft-gpus as indices: comma-separated integers >= 0 (ServeError otherwise)."""
    try:
        gpus = [int(part) for part in text.split(",")]
    except ValueError:
        gpus = []
    if not gpus or min(gpus) < 0:
        raise ServeError(f"--draft-gpus must list GPU indices >= 0, comma-separated, got {text!r}")
    return gpus


def draft_env(args: argparse.Namespace, replica: int) -> dict[str, str]:
    """Environment of draft replica `replica`: with --draft-gpus, only its GPU visible (as cuda:0)."""
    if args.draft_gpus is None:
        return {}
    gpus = draft_gpus(args.draft_gpus)
    gpu = gpus[replica % len(gpus)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": visible.split(",")[gpu].strip() if visible is not None else str(gpu)}


def resolve_tls(args: argparse.Namespace) -> tuple[ServerTLS | None, ServerTLS | None, ClientTLS | None]:
    """(the gateway's serving TLS, the services' mutual TLS, the gateway's client TLS) from the flags."""
    def path(value: str | None) -> Path | None:
        return Path(value).resolve() if value else None

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ServeError("--tls-cert and --tls-key go together")
    if args.tls_cert is None and (args.tls_ca or args.tls_client_cert or args.tls_client_key):
        raise ServeError("--tls-ca and --tls-client-cert/--tls-client-key need --tls-cert and --tls-key")
    if args.tls_ca is None and (args.tls_client_cert or args.tls_client_key):
        raise ServeError("--tls-client-cert/--tls-client-key need --tls-ca")
    if args.tls_cert is None:
        return None, None, None
    try:
        public = ServerTLS(cert=path(args.tls_cert), key=path(args.tls_key))
        if args.tls_ca is None:
            return public, None, None
        services = ServerTLS(cert=public.cert, key=public.key, client_ca=path(args.tls_ca))
        gateway = ClientTLS(ca=path(args.tls_ca), cert=path(args.tls_client_cert) or public.cert,
                            key=path(args.tls_client_key) or public.key)
    except ValueError as exc:
        raise ServeError(str(exc)) from None
    return public, services, gateway


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    return RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window)


# Ports for the children are taken below the kernel's ephemeral range (where bind(0) and every outgoing
# connection get theirs), in turn from a random start: between our pick and the child's bind no client socket
# can take the port, and two supervisors (or two test workers) rarely look at the same one. TANDEM_CHILD_PORTS
# ("LOW-HIGH") narrows the span, for a firewall's allowed range or a test worker's share.
CHILD_PORTS_ENV = "TANDEM_CHILD_PORTS"
CHILD_PORTS_LOW = 20000
_next_port: dict[tuple[int, int], int] = {}  # span -> the port this process looks at next


def ephemeral_low(default: int = 32768) -> int:
    """The lowest port the kernel hands out on its own (Linux's ip_local_port_range; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def child_port_span() -> tuple[int, int]:
    """[low, high) of the ports free_ports hands out."""
    text = os.environ.get(CHILD_PORTS_ENV, "").strip()
    if text:
        low, sep, high = text.partition("-")
        try:
            span = (int(low), int(high) + 1)
        except ValueError:
            span = (0, 0)
        if not sep or not 1024 <= span[0] < span[1] <= 65536:
            raise ValueError(f"{CHILD_PORTS_ENV}={text!r}: expected LOW-HIGH, ports between 1024 and 65535")
        return span
    return CHILD_PORTS_LOW, max(ephemeral_low(), CHILD_PORTS_LOW + 1024)


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """n distinct ports free on 127.0.0.1 now, for the children's gRPC and metrics (see CHILD_PORTS_ENV), none
    of `avoid`: the ports the gateway binds, which stay free until it starts, after the other children."""
    low, high = span = child_port_span()
    size = high - low
    port = _next_port.get(span)
    if port is None:
        port = low + random.randrange(size)
    ports: list[int] = []
    for _ in range(size):
        if port not in avoid and port_is_free("127.0.0.1", port):
            ports.append(port)
            if len(ports) == n:
                break
        port = low + (port + 1 - low) % size
    _next_port[span] = low + (port + 1 - low) % size
    if len(ports) < n:
        raise OSError(f"fewer than {n} free ports in {low}-{high - 1} ({CHILD_PORTS_ENV})")
    return ports


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Servers set SO_REUSEADDR too: a port in TIME_WAIT is usable, one with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


# ---------------------------------------------------------------------------- child command lines

def _observability_flags(args: argparse.Namespace, metrics_port: int) -> list[str]:
    """What target and draft children share: their metrics port and the trace collector."""
    cmd = ["--metrics-port", str(metrics_port)] if metrics_port else []
    if args.otlp_endpoint:
        cmd += ["--otlp-endpoint", args.otlp_endpoint]
    return cmd


def _service_tls_flags(plan: Plan) -> list[str]:
    tls = plan.service_tls
    if tls is None:
        return []
    return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.client_ca)]


def _lane_flags(plan: Plan) -> list[str]:
    return ["--step-lane", str(plan.lane_dir)] if plan.lane_dir is not None else []


def target_command(args: argparse.Namespace, plan: Plan, port_file: Path, metrics_port: int = 0,
                   port: int = 0) -> list[str]:
    cmd = ["target", "--model", str(plan.model), "--port", str(port), "--port-file", str(port_file),
           "--tp", str(args.tp), "--device", plan.device]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_gb:
        cmd += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if args.deterministic:
        cmd.append("--deterministic")
    return (cmd + _lane_flags(plan) + _observability_flags(args, metrics_port) + _service_tls_flags(plan)
            + shlex.split(args.target_args))


def draft_command(args: argparse.Namespace, plan: Plan, port_file: Path, metrics_port: int = 0,
                  port: int = 0, target: str | None = None) -> list[str]:
    """target: the target's address, from which the draft takes its features (never via the gateway)."""
    assert plan.draft is not None
    cmd = ["draft", "--model", str(plan.draft), "--target-model", str(plan.model), "--port", str(port),
           "--port-file", str(port_file), "--device", plan.device]
    if target:
        cmd += ["--target", target]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return (cmd + _lane_flags(plan) + _observability_flags(args, metrics_port) + _service_tls_flags(plan)
            + shlex.split(args.draft_args))


def gateway_command(args: argparse.Namespace, plan: Plan, target: str, drafts: list[str]) -> list[str]:
    cmd = ["gateway", "--target", target]
    if drafts:
        cmd += ["--draft", ",".join(drafts)]
    cmd += ["--model", str(plan.model), "--host", args.host, "--port", str(args.port),
            "--grpc-port", str(args.grpc_port), "--speculation", args.speculation,
            "--spec-steps", str(args.spec_steps), "--spec-topk", str(args.spec_topk),
            "--spec-draft-tokens", str(args.spec_draft_tokens)]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    if args.max_queue is not None:
        cmd += ["--max-queue", str(args.max_queue)]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.otlp_endpoint:
        cmd += ["--otlp-endpoint", args.otlp_endpoint]
    if args.protect_metrics:
        cmd += ["--protect-metrics"]
    if args.max_request_bytes is not None:
        cmd += ["--max-request-bytes", str(args.max_request_bytes)]
    if plan.public_tls is not None:
        cmd += ["--tls-cert", str(plan.public_tls.cert), "--tls-key", str(plan.public_tls.key)]
    if plan.gateway_tls is not None:
        tls = plan.gateway_tls
        cmd += ["--tls-ca", str(tls.ca), "--tls-client-cert", str(tls.cert), "--tls-client-key", str(tls.key)]
    return cmd + shlex.split(args.gateway_args)


# ---------------------------------------------------------------------------- children

def _die_with_parent() -> Callable[[], None] | None:
    """A preexec_fn asking Linux to SIGTERM the child if this supervisor dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, not in the forked child
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, signal.SIGTERM)

    return preexec


class Child:
    """One service process, its log file, its stop sequence and its restarts."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, metrics_port: int = 0,
                 env: dict[str, str] | None = None, threads: int | None = None):
        self.name = name
        self.argv = list(argv)
        self.env = dict(env or {})  # set for this child on top of tandem serve's own environment
        self.threads = threads or default_threads("cpu")  # its OpenMP threads, unless OMP_NUM_THREADS is set
        self.log_path = log_dir / f"{name}.log"
        self.port_file = log_dir / f"{name}.port"
        self.address = ""
        self.metrics_port = metrics_port  # its Prometheus /metrics on 127.0.0.1 (0: none)
        self.restarts: list[float] = []  # monotonic times it was started again
        self.restart_at: float | None = None  # it died: when to start it again
        # A port file left in a reused --log-dir by an earlier serve would be read as this child's
        # address before the child writes its own: serve then waited on a dead port for the whole
        # --startup-timeout (seen with a benchmark's output directory used twice, 2026-12-03).
        self.port_file.unlink(missing_ok=True)
        self.proc = self._launch("wb")

    def environment(self) -> dict[str, str]:
        """The environment the child starts with: tandem serve's own, and what it sets for this child."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        # Three or more processes share this machine's cores: left alone, each would
        # start an OpenMP thread per core, and threads spinning against each other
        # make small CPU ops orders of magnitude slower (tandem/host_threads.py: one
        # thread on a GPU, a share of the cores on the CPU). An explicit setting wins.
        env.setdefault("OMP_NUM_THREADS", str(self.threads))
        env.update(self.env)
        return env

    def _launch(self, log_mode: str) -> subprocess.Popen:
        env = self.environment()
        with open(self.log_path, log_mode) as log:
            return subprocess.Popen([*TANDEM, *self.argv], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                    preexec_fn=_die_with_parent())

    def restart(self) -> None:
        """Start it again with the same command line (so the same address), its log appended to."""
        self.kill()  # whatever its process group left behind (a TP target's ranks)
        with open(self.log_path, "ab") as log:
            log.write(f"\n--- tandem serve: restarting {self.name} ---\n".encode())
        self.restarts.append(time.monotonic())
        self.restart_at = None
        self.proc = self._launch("ab")

    def exited(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the child's whole process group (a TP target's rank processes too)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join("    " + line for line in text.splitlines()[-lines:])

    def describe_exit(self) -> str:
        code = self.proc.returncode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        return f"{self.name} {how} (log: {self.log_path}); its last lines:\n{self.tail()}"


def grpc_serving(address: str, tls: ClientTLS | None = None) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.channels import open_channel

    with open_channel(address, tls) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                               timeout=2).status
        except grpc.RpcError:
            return False
    return status == health_pb2.HealthCheckResponse.SERVING


def http_ok(url: str) -> bool:
    # An https URL is our own child on this machine: whether it answers is all we ask, so its
    # certificate (which may name the public host, or chain to a CA we do not have) is not checked.
    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, http.client.HTTPException):  # the last: a server that speaks no HTTP/1
        return False


def _local(host: str) -> str:
    """Where to reach a server bound to `host` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


class Stopped(Exception):
    """Ctrl-C or SIGTERM arrived."""


class Failed(Exception):
    """A child exited while it should be running, or a stage did not get ready in time."""


class Supervisor:
    def __init__(self, log_dir: Path, startup_timeout: float):
        self.log_dir = log_dir
        self.startup_timeout = startup_timeout
        self.children: list[Child] = []
        self.signals = 0

    def on_signal(self, signum, _frame) -> None:
        self.signals += 1
        if self.signals == 1:
            _say(f"received {signal.Signals(signum).name}, stopping (again to force)")
        else:
            _say("forcing stop")

    def start(self, name: str, argv: list[str], metrics_port: int = 0, env: dict[str, str] | None = None,
              threads: int | None = None) -> Child:
        child = Child(name, argv, self.log_dir, metrics_port, env, threads)
        self.children.append(child)
        return child

    def check(self) -> None:
        """Raise Stopped on a signal, Failed when any child has exited (while starting up)."""
        if self.signals:
            raise Stopped()
        for c in self.children:
            if c.exited() is not None:
                raise Failed(c.describe_exit())

    def wait_for(self, what: str, ready: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            self.check()
            if ready():
                return
            if time.monotonic() > deadline:
                raise Failed(f"{what} was not ready after {self.startup_timeout:.0f} s; its log is in "
                             f"{self.log_dir}")
            time.sleep(POLL_S)

    def wait_port(self, child: Child) -> None:
        def bound() -> bool:
            try:
                text = child.port_file.read_text().strip()
            except OSError:
                return False
            if text:
                child.address = f"127.0.0.1:{int(text)}"
            return bool(text)

        self.wait_for(f"{child.name} (binding a port)", bound)

    def monitor(self, policy: RestartPolicy) -> None:
        """Watch the running children: restart one that dies, within the policy's limit; raise
        Stopped on a signal, Failed when a child dies past the limit."""
        while True:
            if self.signals:
                raise Stopped()
            for child in self.children:
                self._tend(child, policy)
            time.sleep(POLL_S)

    def _tend(self, child: Child, policy: RestartPolicy) -> None:
        now = time.monotonic()
        if child.restart_at is not None:  # dead, waiting out its back-off
            if now >= child.restart_at:
                child.restart()
                _say(f"restarted {child.name}" + (f" on {child.address}" if child.address else ""))
            return
        if child.exited() is None:
            return
        delay = policy.delay(child.restarts, now)
        if delay is None:
            limit = (f"; it was restarted {policy.recent(child.restarts, now)} time(s) in the last "
                     f"{policy.window_s:.0f} s (--max-restarts {policy.max_restarts})" if policy.max_restarts else "")
            raise Failed(child.describe_exit() + limit)
        _say(child.describe_exit())
        _say(f"restarting {child.name} in {delay:.0f} s (restart "
             f"{policy.recent(child.restarts, now) + 1} of at most {policy.max_restarts} within "
             f"{policy.window_s:.0f} s)")
        child.restart_at = now + delay

    def stop_all(self) -> None:
        """Gateway first (it drains), then the services; SIGKILL whatever outlives its grace."""
        gateways = [c for c in self.children if c.name == "gateway"]
        others = [c for c in self.children if c.name != "gateway"]
        for group, grace in ((gateways, GATEWAY_STOP_GRACE_S), (others, SERVICE_STOP_GRACE_S)):
            for c in group:
                c.terminate()
            deadline = time.monotonic() + grace
            while (any(c.exited() is None for c in group) and time.monotonic() < deadline
                   and self.signals < 2):
                time.sleep(0.1)
            for c in group:
                if c.exited() is None:
                    _say(f"{c.name} did not stop in time; killing it")
                    c.kill()


def lane_reads(plan: Plan) -> str:
    """How the lanes' reads wait, for the ready message."""
    if plan.lane_dir is None:
        return ""
    spin = plan.lane_spin_us
    if spin is None:
        return f" (reads spin as {SPIN_ENV} says)"
    return f" (reads spin up to {spin} us, then block)" if spin else " (reads block)"


def run(args: argparse.Namespace, plan: Plan) -> int:
    if not args.no_step_lane:  # short (a socket's path has a limit of about 100 bytes) and private (0700)
        plan.lane_dir = Path(tempfile.mkdtemp(prefix="tandem-lane-"))
    sup = Supervisor(plan.log_dir, args.startup_timeout)
    previous = {s: signal.signal(s, sup.on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        _say(f"logs in {plan.log_dir}")
        _say(f"starting target: {plan.model} (device {plan.device}, tp {args.tp})")
        # Each service gets a gRPC port of its own, kept across restarts, and serves its own
        # Prometheus metrics on another (the gateway's are on REST /metrics).
        replicas = args.draft_replicas if plan.draft is not None else 0
        ports = iter(free_ports(2 * (1 + replicas), avoid={args.port, args.grpc_port}))
        port, metrics_port = next(ports), next(ports)
        threads = default_threads(plan.device)
        spin = {} if plan.lane_spin_us is None else {SPIN_ENV: str(plan.lane_spin_us)}
        target = sup.start("target", target_command(args, plan, plan.log_dir / "target.port", metrics_port, port),
                           metrics_port, spin, threads=threads)
        # Drafts take features from the target there (target_command sets no --host).
        target_address = None if args.features_through_gateway else f"127.0.0.1:{port}"
        drafts = []
        if plan.draft is not None:
            for i in range(replicas):
                name = f"draft{i}"
                _say(f"starting {name}: {plan.draft}")
                port, metrics_port = next(ports), next(ports)
                drafts.append(sup.start(name, draft_command(args, plan, plan.log_dir / f"{name}.port", metrics_port,
                                                            port, target_address), metrics_port,
                                        {**draft_env(args, i), **spin}, threads))
        else:
            _say("no draft: serving without speculation")
        for child in [target, *drafts]:
            sup.wait_port(child)
        for child in [target, *drafts]:
            sup.wait_for(f"{child.name} (loading)", lambda c=child: grpc_serving(c.address, plan.gateway_tls))
            _say(f"{child.name} ready on {child.address} ({time.monotonic() - started:.1f} s)")
        _say(f"starting gateway on {args.host}:{args.port} (REST) and {args.host}:{args.grpc_port} (gRPC)")
        sup.start("gateway", gateway_command(args, plan, target.address, [d.address for d in drafts]),
                  env=spin, threads=threads)
        local = _local(args.host)
        scheme = "https" if plan.public_tls else "http"
        sup.wait_for("gateway", lambda: http_ok(f"{scheme}://{local}:{args.port}/health")
                     and (plan.public_tls is not None or grpc_serving(f"{local}:{args.grpc_port}")))
        lines = [f"ready in {time.monotonic() - started:.1f} s",
                 f"  REST (OpenAI)  {scheme}://{local}:{args.port}/v1   (metrics: /metrics, health: /health)",
                 f"  gRPC           {local}:{args.grpc_port}   (tandem.v1.Generation"
                 f"{', TLS' if plan.public_tls else ''})",
                 f"  target         {target.address}   {plan.model}",
                 *[f"  {d.name:<13}  {d.address}   {plan.draft}" for d in drafts],
                 *[f"  {c.name + ' metrics':<13}  http://127.0.0.1:{c.metrics_port}/metrics"
                   for c in [target, *drafts]],
                 f"  speculation    {args.speculation}" + ("" if drafts else " (no draft: never)"),
                 f"  step lanes     {plan.lane_dir or 'off (gRPC)'}{lane_reads(plan)}",
                 f"  logs           {plan.log_dir}",
                 "Press Ctrl-C to stop."]
        print("tandem serve: " + "\n".join(lines), flush=True)
        sup.monitor(restart_policy(args))
    except Stopped:
        sup.stop_all()
        _say("stopped")
        return 0
    except Failed as exc:
        _say(f"error: {exc}")
        _say("stopping the other processes")
        sup.stop_all()
        return 1
    finally:
        sup.stop_all()  # a no-op when already stopped; never leave children behind on a bug
        for s, handler in previous.items():
            signal.signal(s, handler)
        if plan.lane_dir is not None:
            shutil.rmtree(plan.lane_dir, ignore_errors=True)
    return 0  # not reached: monitor() only returns by raising


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = resolve(args)
    except ServeError as exc:
        print(f"tandem serve: error: {exc}", file=sys.stderr)
        return 2
    with held_wake_latency(args.cpu_wake_latency_us) as held:  # for the whole serve; it lapses as we exit
        if args.cpu_wake_latency_us is not None:
            _say(f"CPU wake-up latency limit {held}" + ("" if held.startswith("held") else
                                                        " (serving with the host's setting)"))
        return run(args, plan)
