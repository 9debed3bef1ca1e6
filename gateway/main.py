"""`tandem gateway`: the core, the REST API and the gRPC Generation service in one process."""

from __future__ import annotations

import argparse
import functools
import logging
import tempfile
import threading
from pathlib import Path

import uvicorn
from grpc_health.v1 import health_pb2

from gateway.clients import DraftClient, TargetClient, wait_healthy
from gateway.core import CoreConfig, GatewayCore
from gateway.discovery import parse_draft_source, wait_for_replicas
from gateway.draft_pool import feature_layers_match
from gateway.http_guards import DEFAULT_MAX_BODY_BYTES
from gateway.load_gate import HeldLoad, LoadGate
from gateway.policy import PolicyConfig
from gateway.scheduler import SchedulerConfig
from tandem import telemetry
from tandem.tls import add_client_tls_arguments, add_server_tls_arguments, client_tls_from_args, server_tls_from_args
from tandem.v1 import target_pb2

log = logging.getLogger("tandem.gateway")


DEFAULT_GRANT_STEPS = 8
DEFAULT_TARGET_WAIT_S = 60.0
# A gRPC health name that is SERVING for as long as the process runs (Kubernetes' liveness asks it):
# "" turns NOT_SERVING while the gateway waits for a lost target or drains, when restarting the
# gateway would only lose the requests it holds.
LIVENESS_SERVICE = "tandem.liveness"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tandem gateway",
        description="Serve the OpenAI-compatible REST API and gRPC tandem.v1.Generation over a target "
                    "service and draft replicas; decide every step how much each request speculates.")
    p.add_argument("--target", required=True, metavar="HOST:PORT", help="the target service")
    p.add_argument("--draft", default="", metavar="HOST:PORT[,HOST:PORT...]|dns:///NAME:PORT|file:///PATH",
                   help="draft replicas (a request sticks to one): a fixed list; or every address a DNS name "
                        "resolves to (a Kubernetes headless Service), resolved again periodically; or a file "
                        "with one HOST:PORT per line, read again periodically. Empty or 'none' for no "
                        "speculation")
    p.add_argument("--draft-resolve-interval", type=float, default=5.0, metavar="S",
                   help="with dns:/// or file://, seconds between resolutions: new replicas join, gone ones "
                        "are retired and their requests move (default 5)")
    p.add_argument("--draft-wait", type=float, default=300.0, metavar="S",
                   help="with dns:/// or file://, how long start-up waits for a first replica before serving "
                        "without speculation until one appears (default 300)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="directory with the tokenizer (default: fetched from the target)")
    p.add_argument("--served-model-name", default=None, help="name clients use in `model` "
                   "(default: the target's model directory name)")
    p.add_argument("--host", default="127.0.0.1", help="REST and gRPC address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="REST port (default 8000)")
    p.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (default 50051)")
    p.add_argument("--speculation", choices=["auto", "always", "never"], default="auto",
                   help="default speculation mode; requests may override it (default auto)")
    p.add_argument("--spec-steps", type=int, default=5, help="tree depth for `always` (default 5)")
    p.add_argument("--spec-topk", type=int, default=4, help="children per node for `always` (default 4)")
    p.add_argument("--spec-draft-tokens", type=int, default=8,
                   help="tree size for `always`, root included (default 8)")
    p.add_argument("--spec-option-margin", type=float, default=0.05, metavar="SHARE",
                   help="`auto` drafts a tree other than the configured one (a chain, a deeper chain, a wider "
                        "tree) only where its predicted goodput beats the configured tree's by this share; "
                        "0 = the best prediction wins; default 0.05 (measured on the H200: BENCHMARKS.md, "
                        "\"Common draws\")")
    p.add_argument("--spec-own-weight", default="2", metavar="TREES|auto",
                   help="`auto` mode prices each request's trees from its own acceptance blended with the "
                        "global figures, which weigh as this many of its trees (fewer: a request's own few trees "
                        "decide sooner); `auto`: estimated from how far ended requests' acceptance differed beyond "
                        "their trees' draws (alike requests: up to 32, so a few lucky or unlucky trees change "
                        "nothing; differing ones: down to 1); default 2")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on REST /v1/* and on gRPC tandem.v1.Generation "
                        "(metadata authorization); health and metrics stay open")
    p.add_argument("--protect-metrics", action="store_true",
                   help="with --api-key, require the key on /metrics too")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help="largest REST body or gRPC message accepted (413 / RESOURCE_EXHAUSTED above it; "
                        f"default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 429 (default 1024)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap on prompt + output tokens")
    p.add_argument("--max-step-tokens", type=int, default=2048,
                   help="tokens per target step: prefill chunks plus decode nodes (default 2048)")
    p.add_argument("--max-running", type=int, default=256, help="requests decoded together (default 256)")
    p.add_argument("--grant-steps", type=int, default=DEFAULT_GRANT_STEPS, metavar="K",
                   help="when a batch decodes plainly and feeds nothing to the draft (see --fed-grants), let the "
                        "target run up to K steps on its own, feeding its tokens forward (stops at max_tokens, EOS "
                        "and stop token ids; a new arrival, an abort or a stop string ends the grant after the step "
                        f"in flight). 1 = one call per step (default {DEFAULT_GRANT_STEPS})")
    p.add_argument("--fed-grants", action="store_true",
                   help="grant steps to awake `auto` requests too (those still feeding their drafts the target's "
                        "features while the policy declines trees): the target pushes each granted step's "
                        "features to the drafts, up to the policy's next choice. Off by default: not shown to "
                        "pay on the H200 (BENCHMARKS.md, \"Fed grants\")")
    p.add_argument("--gate-close-probe-steps", type=int, default=16, metavar="N",
                   help="where the load gate's first probe of trees at a load ends within its margin of plain "
                        "decoding, run N more tree steps and judge the probe on the mean of all its steps, not "
                        "on a decayed mean of its last few (a tree step's accepted tokens vary a lot). 0 = off; "
                        "default 16 (measured on the H200: BENCHMARKS.md, \"Common draws\")")
    p.add_argument("--gate-expected-weight", type=float, default=LoadGate.expected_weight, metavar="SEQS",
                   help="judge the tokens a tree step commits, a draw, as their measured mean pulled towards what "
                        "the acceptance book expected of the same trees, the expectation weighing as SEQS "
                        "sequences' tokens (six steps of one sequence weigh 6 / 22 at 16); the step's time is "
                        f"measured as it is. 0 = the measured tokens alone; default {LoadGate.expected_weight:g} "
                        "(on an H100 at one request and acceptance 0.6 the gate's first probes of trees read "
                        "139-159 tok/s on 6-8 steps where trees ran at 195-225: BENCHMARKS.md, \"The sixty-sixth "
                        "session\")")
    p.add_argument("--gate-min-batch", type=int, default=LoadGate.min_batch, metavar="N",
                   help="sequences from which the load gate measures speculation against plain decoding and "
                        "decides between them; below N the cost model's predictions alone decide. "
                        f"Default {LoadGate.min_batch} "
                        "(measured on an H100: BENCHMARKS.md, \"The fifty-ninth session's figures\")")
    p.add_argument("--gate-load-hold-plans", type=int, default=HeldLoad.plans, metavar="N",
                   help="judge each plan at the most requests the gateway held in the last N plans (made in the "
                        "last --gate-load-hold-seconds), so that a load that dips while requests end and their "
                        "successors come in keeps the verdict of the load it held. 1 = each plan at its own "
                        f"load; default {HeldLoad.plans}")
    p.add_argument("--gate-load-hold-seconds", type=float, default=HeldLoad.seconds, metavar="SECONDS",
                   help="how long a load that fell keeps the verdict of the load it held, at most (see "
                        "--gate-load-hold-plans): a wave of 64 requests ending together took 0.4-0.65 s to be "
                        f"replaced on an H100. Default {HeldLoad.seconds:g}")
    p.add_argument("--gate-load-quiet-hold-seconds", type=float, default=HeldLoad.quiet_seconds, metavar="SECONDS",
                   help="the same where no request joined in the last "
                        f"{HeldLoad.join_window:g} s: a load that falls as requests end with none to replace them "
                        "(a burst draining) is believed sooner. At most --gate-load-hold-seconds; default "
                        f"{HeldLoad.quiet_seconds:g}")
    p.add_argument("--target-wait", type=float, default=DEFAULT_TARGET_WAIT_S, metavar="SECONDS",
                   help="when the target becomes unreachable, the gateway reports NOT_SERVING (new requests get "
                        "503 / UNAVAILABLE), keeps the running requests and waits this long for the target to "
                        "return at the same address, then re-prefills them from their tokens and continues; "
                        "past it they end with 503 / UNAVAILABLE, and the gateway serves again once the target "
                        f"is back (default {DEFAULT_TARGET_WAIT_S:g})")
    p.add_argument("--no-profile", action="store_true", help="skip the start-up cost profile (tests)")
    p.add_argument("--profile-context", type=int, default=32, metavar="TOKENS",
                   help="under --speculation auto on a GPU draft, the context each throwaway request holds when "
                        "the start-up profile times every tree shape's round (a round's attention reads it): set "
                        "it near your traffic's typical prompt plus output. Default 32")
    p.add_argument("--no-step-lane", action="store_true",
                   help="keep the step streams to the target and drafts on gRPC even where a service offers a "
                        "same-host lane (its --step-lane; by default the gateway uses one it can reach)")
    telemetry.add_otlp_argument(p)
    p.add_argument("--drain-seconds", type=float, default=30.0,
                   help="on SIGTERM, how long running requests may finish before they are aborted")
    add_server_tls_arguments(p, client_ca_help=None)  # REST and gRPC; TLS to the services below
    add_client_tls_arguments(p)
    return p


def load_tokenizer(args: argparse.Namespace, target: TargetClient):
    from transformers import AutoTokenizer

    if args.model:
        return AutoTokenizer.from_pretrained(args.model)
    files = target.stub.GetTokenizer(target_pb2.GetTokenizerRequest(), timeout=60).files
    tmp = Path(tempfile.mkdtemp(prefix="tandem-tokenizer-"))
    for name, data in files.items():
        (tmp / Path(name).name).write_bytes(data)
    return AutoTokenizer.from_pretrained(tmp)


class _Server(uvicorn.Server):
    """uvicorn that drains the core before it stops on SIGTERM/SIGINT."""

    core: GatewayCore
    drain_seconds: float

    def handle_exit(self, sig, frame) -> None:
        if self.core.ready() or self.core.draining:
            if not self.core.draining:
                log.info("draining for up to %.0f s", self.drain_seconds)
                threading.Thread(target=self._drain_then_exit, daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _drain_then_exit(self) -> None:
        self.core.drain(self.drain_seconds)
        self.should_exit = True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from gateway.grpc_api import SERVICE_NAME, add_generation_service
    from gateway.openai_api import create_app
    from gateway.tracing import instrument_app, setup_tracing
    from tandem.gc_pauses import GcWatch
    from tandem.grpc_auth import ApiKeyInterceptor
    from tandem.grpc_host import ServiceHost

    try:
        public_tls = server_tls_from_args(args, with_client_ca=False)
        service_tls = client_tls_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.protect_metrics and not args.api_key:
        raise SystemExit("error: --protect-metrics needs --api-key")
    if args.max_request_bytes < 1:
        raise SystemExit("error: --max-request-bytes must be positive")
    if not args.target_wait >= 0:
        raise SystemExit("error: --target-wait must be >= 0 seconds")
    if args.gate_close_probe_steps < 0:
        raise SystemExit("error: --gate-close-probe-steps must be >= 0")
    if not args.gate_expected_weight >= 0:  # (a NaN fails it too)
        raise SystemExit("error: --gate-expected-weight must be >= 0")
    if args.gate_min_batch < 1:
        raise SystemExit("error: --gate-min-batch must be at least 1")
    if args.gate_load_hold_plans < 1:
        raise SystemExit("error: --gate-load-hold-plans must be at least 1")
    if not args.gate_load_hold_seconds >= 0:
        raise SystemExit("error: --gate-load-hold-seconds must be at least 0")
    if not args.gate_load_quiet_hold_seconds >= 0:
        raise SystemExit("error: --gate-load-quiet-hold-seconds must be at least 0")
    if args.profile_context < 1:
        raise SystemExit("error: --profile-context must be at least 1 token")
    try:
        from_spread = args.spec_own_weight == "auto"
        own_weight = PolicyConfig.own_weight if from_spread else float(args.spec_own_weight)  # auto: until estimated
    except ValueError:
        raise SystemExit(f"error: --spec-own-weight takes a number of trees or auto, got {args.spec_own_weight!r}") \
            from None
    try:
        policy = PolicyConfig(args.speculation, args.spec_steps, args.spec_topk, args.spec_draft_tokens,
                              option_margin=args.spec_option_margin, own_weight=own_weight,
                              own_weight_from_spread=from_spread)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None

    setup_tracing(args.otlp_endpoint)
    collections = GcWatch(log)
    collections.install()
    try:
        source = parse_draft_source(args.draft, args.draft_resolve_interval)
    except ValueError as exc:
        raise SystemExit(f"error: --draft: {exc}") from None
    target = TargetClient(args.target, tls=service_tls, use_lane=not args.no_step_lane)
    try:
        wait_healthy(target.channel, timeout=600)
        info = target.info()
        tokenizer = load_tokenizer(args, target)
    except Exception as exc:
        raise SystemExit(f"error: cannot reach the target at {args.target}: {exc}") from None
    if source.dynamic:
        log.info("looking for draft replicas at %s (up to %.0f s for a first one)", source.describe(), args.draft_wait)
    addresses = wait_for_replicas(source, args.draft_wait)
    if source.dynamic:
        log.info("draft replicas from %s: %s", source.describe(), ", ".join(addresses) or "none yet")
    make_draft_client = functools.partial(DraftClient, tls=service_tls, use_lane=not args.no_step_lane)
    drafts = [make_draft_client(a) for a in addresses]
    cfg = CoreConfig(
        policy=policy,
        scheduler=SchedulerConfig(args.max_step_tokens, args.max_running, info.load.block_size),
        max_queue=args.max_queue, max_model_len=args.max_model_len, profile=not args.no_profile,
        profile_context=args.profile_context,
        grant_steps=args.grant_steps, fed_grants=args.fed_grants, target_wait_s=args.target_wait,
        gate_close_probe_steps=args.gate_close_probe_steps, gate_expected_weight=args.gate_expected_weight,
        gate_min_batch=args.gate_min_batch,
        gate_load_hold_plans=args.gate_load_hold_plans, gate_load_hold_seconds=args.gate_load_hold_seconds,
        gate_load_quiet_hold_seconds=args.gate_load_quiet_hold_seconds)
    core = GatewayCore(target, drafts, tokenizer, cfg, args.served_model_name or info.model_name)
    core.pool.admission = feature_layers_match(lambda: core.feature_layers)
    core.pool.make_client = make_draft_client  # replicas found later connect the same way
    try:
        grpc_host = ServiceHost(
            args.host, args.grpc_port, [SERVICE_NAME],
            credentials=public_tls.grpc_credentials() if public_tls else None,
            interceptors=[ApiKeyInterceptor(args.api_key, [SERVICE_NAME])] if args.api_key else [],
            max_message_bytes=args.max_request_bytes)
    except OSError as exc:
        raise SystemExit(f"error: --grpc-port: {exc}") from None
    add_generation_service(grpc_host, core)
    grpc_host.start()
    grpc_host.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)

    def start_core() -> None:
        try:
            core.start()
            collections.ready()  # after the profile: its objects are frozen too
            if source.dynamic:
                core.pool.follow(source.resolve, source.interval_s)
            # gRPC health follows the core from now on: NOT_SERVING while the target is lost or draining.
            core.on_readiness = grpc_host.set_serving
            grpc_host.set_serving(core.ready())
            log.info("ready: REST %s://%s:%d, gRPC %s:%d%s, %d draft replica(s) from %s, speculation %s",
                     "https" if public_tls else "http", args.host, args.port, args.host, grpc_host.port,
                     " (TLS)" if public_tls else "", len(drafts), source.describe(), args.speculation)
        except Exception:
            log.exception("the gateway could not start")
            server.should_exit = True

    app = instrument_app(create_app(core, args.api_key, [core.model_name], protect_metrics=args.protect_metrics,
                                    max_body_bytes=args.max_request_bytes))  # continues a caller's traceparent
    # log_config=None: uvicorn's records go through tandem's one logging setup (JSON too).
    server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", log_config=None,
                                    timeout_graceful_shutdown=2, **(public_tls.uvicorn_kwargs() if public_tls else {})))
    server.core, server.drain_seconds = core, args.drain_seconds
    threading.Thread(target=start_core, daemon=True).start()
    server.run()
    grpc_host.stop(grace=2)
    core.shutdown()
    telemetry.shutdown_tracing()  # flush the spans still queued
    log.info("stopped")
    return 0
