"""`tandem serve`: its flags, its errors, and its supervision of child processes
(with stand-in services from tests/fake_services.py; the full stack is tested elsewhere)."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gateway import serve
from gateway.restarts import RestartPolicy
from tests.faults import wait_for
from tests.services import REPO

DESIGN_FLAGS = ["--model", "--draft", "--speculation", "--tp", "--device", "--dtype", "--host", "--port",
                "--grpc-port", "--draft-replicas", "--api-key", "--otlp-endpoint", "--max-model-len",
                "--max-queue", "--spec-steps", "--spec-topk", "--spec-draft-tokens"]


def test_help_lists_every_design_flag():
    out = subprocess.run([sys.executable, "-m", "tandem.cli", "serve", "--help"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in DESIGN_FLAGS:
        assert f"{flag} " in out.stdout, flag
    args = serve.build_parser().parse_args([])
    assert (args.speculation, args.tp, args.host, args.port, args.grpc_port, args.draft_replicas) == (
        "auto", 1, "127.0.0.1", 8000, 50051, 1)
    assert (args.spec_steps, args.spec_topk, args.spec_draft_tokens) == (5, 4, 8)


def test_otlp_endpoint_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert serve.build_parser().parse_args([]).otlp_endpoint == "http://collector:4317"


def test_missing_demo_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(serve, "DEMO_DIR", tmp_path / "demo")
    assert serve.main([]) == 2
    err = capsys.readouterr().err
    assert "demo models are not in this checkout" in err and str(tmp_path / "demo" / "target") in err
    assert "--model" in err


@pytest.fixture()
def dirs(tmp_path) -> tuple[Path, Path]:
    model, draft = tmp_path / "model", tmp_path / "draft"
    for d in (model, draft):
        d.mkdir()
        (d / "config.json").write_text("{}")
    return model, draft


def test_bad_flags_are_errors_before_anything_starts(dirs, tmp_path, capsys):
    model, draft = dirs
    assert serve.main(["--model", str(tmp_path / "nope")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert serve.main(["--model", str(model), "--draft", str(tmp_path / "nope")]) == 2
    assert serve.main(["--model", str(model), "--draft-replicas", "0"]) == 2
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert serve.main(["--model", str(model), "--port", str(port)]) == 2
        assert "already in use" in capsys.readouterr().err
    assert serve.main(["--model", str(model), "--target-args", "'unclosed"]) == 2
    assert "--target-args: cannot split" in capsys.readouterr().err


def listener_below_free_ports(low: int, high: int, count: int) -> socket.socket:
    """A listener on a port of [low, high) whose next `count` ports are free now. The span lies below the
    ephemeral range, so no other process's outgoing connection takes one of them meanwhile (a listener on
    an ephemeral port had the CI's other test worker take ports of its span between two calls, 2026-12-07)."""
    for _ in range(200):
        port = random.randrange(low, high - count)
        if all(serve.port_is_free("127.0.0.1", p) for p in range(port, port + count + 1)):
            busy = socket.socket()
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                busy.bind(("127.0.0.1", port))
            except OSError:  # taken since
                busy.close()
                continue
            busy.listen()
            return busy
    raise AssertionError(f"no {count + 1} free ports in a row in {low}-{high - 1}")


def test_child_ports_are_distinct_free_ports_taken_in_turn_from_the_span_below_the_ephemeral_range(monkeypatch):
    monkeypatch.setattr(serve, "_next_port", {})
    monkeypatch.delenv(serve.CHILD_PORTS_ENV, raising=False)
    low, high = serve.child_port_span()
    assert (low, high) == (serve.CHILD_PORTS_LOW, max(serve.ephemeral_low(), low + 1024))
    assert all(low <= port < high for port in serve.free_ports(4))
    # A worker's share: ports in turn, a listener's port passed over, and none twice until the span wraps.
    with listener_below_free_ports(low, high, 9) as busy:
        taken = busy.getsockname()[1]
        monkeypatch.setenv(serve.CHILD_PORTS_ENV, f"{taken}-{taken + 9}")
        first = serve.free_ports(3)
        second = serve.free_ports(3)
    assert taken not in first + second and len(set(first + second)) == 6
    assert all(taken < port <= taken + 9 for port in first + second)
    assert serve.free_ports(3)[0] not in first + second  # the cursor goes on from where it stopped
    monkeypatch.setenv(serve.CHILD_PORTS_ENV, f"{taken}-{taken + 2}")
    with pytest.raises(OSError, match="fewer than 4 free ports"):
        serve.free_ports(4)


def test_a_health_check_answered_in_no_http_of_its_own_is_not_ok():
    """serve's readiness check on a port where a gRPC server (HTTP/2) answers: not ready, no exception."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x05\x00\x00\x40\x00")  # a SETTINGS frame

        thread = threading.Thread(target=answer)
        thread.start()
        assert serve.http_ok(f"http://127.0.0.1:{server.getsockname()[1]}/health") is False
        thread.join(timeout=5)


def test_serve_gives_no_child_the_gateways_own_ports_though_they_are_free_until_it_starts(dirs, tmp_path):
    """The gateway starts last: until then its REST and gRPC ports are free, and the children's ports, taken from
    the same span, must pass over them. Here the span holds exactly the gateway's two and the six the children
    need."""
    model, draft = dirs
    low, high = serve.child_port_span()
    with listener_below_free_ports(low, high, 8) as busy:
        first = busy.getsockname()[1] + 1
    port, grpc_port = first, first + 1
    s = ServeProcess(tmp_path, ["--model", str(model), "--draft", str(draft), "--draft-replicas", "2",
                                "--port", str(port), "--grpc-port", str(grpc_port)],
                     **{serve.CHILD_PORTS_ENV: f"{first}-{first + 7}"})
    s.wait_ready()
    taken = [int((tmp_path / "logs" / f"{n}.port").read_text()) for n in ("target", "draft0", "draft1")]
    assert not {port, grpc_port} & set(taken)
    s.proc.send_signal(signal.SIGTERM)
    code, err = s.finish()
    assert code == 0, err


def test_a_bad_child_port_span_is_an_error_before_anything_starts(dirs, monkeypatch, capsys):
    model, _ = dirs
    for bad in ("20000", "x-y", "30000-20000", "80-90", "60000-70000"):
        monkeypatch.setenv(serve.CHILD_PORTS_ENV, bad)
        assert serve.main(["--model", str(model)]) == 2
        assert f"TANDEM_CHILD_PORTS={bad!r}: expected LOW-HIGH" in capsys.readouterr().err


def test_child_command_lines(dirs, tmp_path):
    model, draft = dirs
    args = serve.build_parser().parse_args([
        "--model", str(model), "--draft", str(draft), "--tp", "2", "--device", "cuda", "--dtype", "bfloat16",
        "--max-model-len", "4096", "--api-key", "k", "--max-queue", "7", "--speculation", "never",
        "--otlp-endpoint", "http://c:4317", "--host", "0.0.0.0", "--port", "9000", "--grpc-port", "9001"])
    plan = serve.Plan(model=model, draft=draft, device="cuda", log_dir=tmp_path)
    assert serve.target_command(args, plan, tmp_path / "t.port", 9100, 9200) == [
        "target", "--model", str(model), "--port", "9200", "--port-file", str(tmp_path / "t.port"), "--tp", "2",
        "--device", "cuda", "--dtype", "bfloat16", "--max-model-len", "4096", "--metrics-port", "9100",
        "--otlp-endpoint", "http://c:4317"]
    assert serve.draft_command(args, plan, tmp_path / "d.port", 9101, 9201) == [
        "draft", "--model", str(draft), "--target-model", str(model), "--port", "9201", "--port-file",
        str(tmp_path / "d.port"), "--device", "cuda", "--dtype", "bfloat16", "--metrics-port", "9101",
        "--otlp-endpoint", "http://c:4317"]
    assert serve.gateway_command(args, plan, "127.0.0.1:1", ["127.0.0.1:2", "127.0.0.1:3"]) == [
        "gateway", "--target", "127.0.0.1:1", "--draft", "127.0.0.1:2,127.0.0.1:3", "--model", str(model),
        "--host", "0.0.0.0", "--port", "9000", "--grpc-port", "9001", "--speculation", "never",
        "--spec-steps", "5", "--spec-topk", "4", "--spec-draft-tokens", "8", "--api-key", "k",
        "--max-queue", "7", "--max-model-len", "4096", "--otlp-endpoint", "http://c:4317"]
    assert "--draft" not in serve.gateway_command(args, plan, "127.0.0.1:1", [])
    # Extra child arguments are appended as the shell would split them.
    args = serve.build_parser().parse_args(["--model", str(model), "--target-args=--random-weights --num-blocks 9",
                                            "--draft-args", "--force-record 'a b.jsonl'"])
    assert serve.target_command(args, plan, tmp_path / "t.port")[-3:] == ["--random-weights", "--num-blocks", "9"]
    assert serve.draft_command(args, plan, tmp_path / "d.port")[-2:] == ["--force-record", "a b.jsonl"]
    # The batch-invariant mode is the target's.
    args = serve.build_parser().parse_args(["--model", str(model), "--deterministic"])
    assert serve.target_command(args, plan, tmp_path / "t.port")[-1] == "--deterministic"
    assert "--deterministic" not in serve.draft_command(args, plan, tmp_path / "d.port")
    # Each draft reads the target's held features from the target itself.
    assert serve.draft_command(args, plan, tmp_path / "d.port", target="127.0.0.1:9200")[-2:] == [
        "--target", "127.0.0.1:9200"]


def test_lane_reads_spin_by_default_only_on_a_gpu_host_with_cores_to_spare(dirs, monkeypatch, capsys):
    monkeypatch.delenv("TANDEM_LANE_SPIN_US", raising=False)
    assert serve.lane_spin_us(None, "cuda", cores=16) == serve.DEFAULT_LANE_SPIN_US > 0
    assert serve.lane_spin_us(None, "cuda", cores=serve.MIN_SPIN_CORES - 1) == 0
    # A TP target's other ranks spin too: a core each.
    assert serve.lane_spin_us(None, "cuda", cores=serve.MIN_SPIN_CORES, tp=2) == 0
    assert serve.lane_spin_us(None, "cuda", cores=serve.MIN_SPIN_CORES + 7, tp=8) == serve.DEFAULT_LANE_SPIN_US
    # So do each further draft replica's three waits.
    assert serve.lane_spin_us(None, "cuda", cores=serve.MIN_SPIN_CORES + 2, replicas=2) == 0
    assert serve.lane_spin_us(None, "cuda", cores=serve.MIN_SPIN_CORES + 6, replicas=3) == serve.DEFAULT_LANE_SPIN_US
    assert serve.lane_spin_us(None, "cpu", cores=64) == 0
    assert serve.lane_spin_us(700, "cpu", cores=2) == 700 and serve.lane_spin_us(0, "cuda", cores=64) == 0
    # The cores counted are the usable ones: a container's CPU quota of 4 on a 64-core host blocks.
    monkeypatch.setattr(serve, "usable_cores", lambda: 4)
    assert serve.lane_spin_us(None, "cuda") == 0
    monkeypatch.setattr(serve, "usable_cores", lambda: 16)
    assert serve.lane_spin_us(None, "cuda") == serve.DEFAULT_LANE_SPIN_US
    # Set in the environment, it is left for the children to inherit.
    monkeypatch.setenv("TANDEM_LANE_SPIN_US", "300")
    assert serve.lane_spin_us(None, "cuda", cores=64) is None
    assert serve.lane_spin_us(0, "cuda", cores=64) == 0
    model, _ = dirs
    for bad, why in ((["--lane-spin-us", "-1"], "from 0 to"), (["--lane-spin-us", "2000000"], "from 0 to"),
                     (["--lane-spin-us", "10", "--no-step-lane"], "does nothing with --no-step-lane")):
        assert serve.main(["--model", str(model), *bad]) == 2
        assert why in capsys.readouterr().err


def test_draft_replicas_take_the_listed_gpus_in_turn(dirs, monkeypatch, capsys):
    model, draft = dirs
    args = serve.build_parser().parse_args(["--model", str(model), "--draft", str(draft), "--device", "cuda",
                                            "--draft-gpus", "1,2"])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [serve.draft_env(args, i) for i in range(3)] == [
        {"CUDA_VISIBLE_DEVICES": "1"}, {"CUDA_VISIBLE_DEVICES": "2"}, {"CUDA_VISIBLE_DEVICES": "1"}]
    # Indices are as tandem serve sees the GPUs: within CUDA_VISIBLE_DEVICES when that is set.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert serve.draft_env(args, 0) == {"CUDA_VISIBLE_DEVICES": "5"}
    assert serve.draft_env(serve.build_parser().parse_args(["--model", str(model)]), 0) == {}
    for bad, why in ((["--draft-gpus", "1,x", "--device", "cuda"], "GPU indices"),
                     (["--draft-gpus", "-1", "--device", "cuda"], "GPU indices"),
                     (["--draft-gpus", "1", "--device", "cpu"], "needs --device cuda"),
                     (["--draft-gpus", "3", "--device", "cuda"], "only 3 GPUs are visible")):
        assert serve.main(["--model", str(model), *bad]) == 2
        assert why in capsys.readouterr().err


class ServeProcess:
    """`tandem serve` in a subprocess whose children are the stand-ins of tests/fake_services.py."""

    def __init__(self, tmp: Path, flags: list[str], **env: str):
        self.record = tmp / "record"
        self.record.mkdir()
        code = ("import sys; from gateway import serve; "
                f"serve.TANDEM = [sys.executable, {str(REPO / 'tests' / 'fake_services.py')!r}]; "
                "sys.exit(serve.main(sys.argv[1:]))")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code, *flags, "--log-dir", str(tmp / "logs"), "--device", "cpu"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), "FAKE_RECORD_DIR": str(self.record), **env})

    def read(self, name: str, what: str):
        return json.loads((self.record / f"{name}.{what}").read_text())

    def wait_ready(self, timeout: float = 30) -> str:
        deadline = time.time() + timeout
        lines = []
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Press Ctrl-C" in line:
                return "".join(lines)
        self.proc.kill()
        raise AssertionError(f"serve never got ready:\n{''.join(lines)}\n{self.proc.stderr.read()}")

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        _, err = self.proc.communicate(timeout=timeout)
        return self.proc.returncode, err


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie has exited but awaits its parent's wait; the supervisor has exited, so init reaps it.
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(")")[-1].split()[0] == "Z"


def test_serve_starts_everything_then_stops_it_in_order_on_sigterm(dirs, tmp_path):
    model, draft = dirs
    port, grpc_port = serve.free_ports(2)
    s = ServeProcess(tmp_path, ["--model", str(model), "--draft", str(draft), "--draft-replicas", "2",
                                "--port", str(port), "--grpc-port", str(grpc_port), "--api-key", "k",
                                "--speculation", "always", "--lane-spin-us", "500"])
    ready = s.wait_ready()
    assert f"http://127.0.0.1:{port}/v1" in ready and f"127.0.0.1:{grpc_port}" in ready
    names = ["target", "draft0", "draft1", "gateway"]
    argv = {n: s.read(n, "argv") for n in names}
    ports = {n: int((tmp_path / "logs" / f"{n}.port").read_text()) for n in names[:3]}
    assert argv["target"][:3] == ["target", "--model", str(model.resolve())]
    # serve picks each service's port (kept across restarts), not the service.
    assert all(argv[n][argv[n].index("--port") + 1] == str(ports[n]) for n in names[:3])
    # Each service gets a metrics port of its own, and serve says where.
    metrics = {n: int(argv[n][argv[n].index("--metrics-port") + 1]) for n in names[:3]}
    assert len(set(metrics.values())) == 3
    assert all(f"http://127.0.0.1:{metrics[n]}/metrics" in ready for n in names[:3])
    assert argv["draft1"][:5] == ["draft", "--model", str(draft.resolve()), "--target-model",
                                  str(model.resolve())]
    gw = argv["gateway"]
    assert gw[gw.index("--target") + 1] == f"127.0.0.1:{ports['target']}"
    assert gw[gw.index("--draft") + 1] == f"127.0.0.1:{ports['draft0']},127.0.0.1:{ports['draft1']}"
    assert gw[gw.index("--speculation") + 1] == "always" and gw[gw.index("--api-key") + 1] == "k"
    assert gw[gw.index("--port") + 1] == str(port) and gw[gw.index("--grpc-port") + 1] == str(grpc_port)
    # Every child's lane reads spin as the flag says, and the ready message says so.
    assert {n: s.read(n, "lane_spin") for n in names} == dict.fromkeys(names, "500")
    assert "reads spin up to 500 us, then block" in ready

    s.proc.send_signal(signal.SIGTERM)
    code, err = s.finish()
    assert code == 0, err
    assert "stopped" in err
    stopped = {n: s.read(n, "stopped") for n in names}
    # The gateway drains first; the services it calls stop only after it has exited.
    assert all(stopped[n] >= stopped["gateway"] + 0.25 for n in names[:3]), stopped
    assert all(_gone(s.read(n, "pid")) for n in names)


@pytest.mark.parametrize("env, who, code", [({"FAKE_DIE": "draft1"}, "draft1", 3),
                                            ({"FAKE_DIE_AT_START": "target"}, "target", 4),
                                            ({"FAKE_DIE": "gateway"}, "gateway", 3)])
def test_with_restarts_off_serve_reports_a_dead_child_and_stops_the_rest(dirs, tmp_path, env, who, code):
    model, draft = dirs
    port, grpc_port = serve.free_ports(2)
    s = ServeProcess(tmp_path, ["--model", str(model), "--draft", str(draft), "--draft-replicas", "2",
                                "--port", str(port), "--grpc-port", str(grpc_port), "--max-restarts", "0"],
                     **env)
    rc, err = s.finish()
    assert rc == 1, err
    assert f"{who} exited with code {code}" in err
    assert f"fake {who} " in err  # the tail of its log
    pids = [s.read(p.stem, "pid") for p in s.record.glob("*.pid")]
    assert pids and all(_gone(pid) for pid in pids)


def test_serve_restarts_a_killed_child_at_the_same_address_and_stops_all_past_the_limit(dirs, tmp_path):
    model, draft = dirs
    port, grpc_port = serve.free_ports(2)
    s = ServeProcess(tmp_path, ["--model", str(model), "--draft", str(draft), "--port", str(port),
                                "--grpc-port", str(grpc_port), "--max-restarts", "1"])
    s.wait_ready()
    first_pid, port_file = s.read("draft0", "pid"), tmp_path / "logs" / "draft0.port"
    port, argv = port_file.read_text(), s.read("draft0", "argv")
    port_file.unlink()
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: port_file.exists() and bool(port_file.read_text()), "draft0 to be started again", timeout=30)
    assert port_file.read_text() == port and s.read("draft0", "argv") == argv  # same address, same command
    second_pid = s.read("draft0", "pid")
    assert second_pid != first_pid and s.proc.poll() is None  # serve went on; nothing else was touched
    assert not (s.record / "target.stopped").exists()
    others = [s.read(n, "pid") for n in ("target", "gateway")]

    os.kill(second_pid, signal.SIGKILL)  # the limit is one restart: now everything stops
    code, err = s.finish()
    assert code == 1, err
    assert "draft0 was killed by SIGKILL" in err and "restarting draft0 in 1 s" in err
    assert "restarted 1 time(s) in the last 600 s (--max-restarts 1)" in err
    assert all(_gone(pid) for pid in others)


def test_a_port_file_an_earlier_serve_left_in_the_log_dir_is_not_taken_for_the_new_childs(tmp_path):
    stale = tmp_path / "target.port"
    stale.write_text("1")  # the port of a serve long gone
    child = serve.Child("target", ["--help"], tmp_path)  # a child that never writes a port file
    try:
        assert not stale.exists()
    finally:
        child.kill()


def test_restart_policy_backs_off_then_gives_up_within_its_window():
    policy = RestartPolicy(max_restarts=3, window_s=600)
    assert [policy.delay([0.0] * n, 10.0) for n in range(4)] == [1.0, 2.0, 4.0, None]
    assert policy.delay([0.0, 0.0, 0.0], 700.0) == 1.0  # restarts older than the window are forgotten
    assert RestartPolicy(max_restarts=0).delay([], 0.0) is None
    assert RestartPolicy(max_restarts=9, max_backoff_s=5).delay([0.0] * 8, 1.0) == 5.0
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError):
        RestartPolicy(window_s=0)
