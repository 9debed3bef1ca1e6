"""guidellm and aiperf, as users run them, against the demo pair: a short streaming load each
(completions and chat; one run with speculation always, per-chunk usage and min_tokens) with
zero errors, and the usage and speculative statistics they read equal to what the server counted."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.bench_clients import ensure_bench_clients
from tests.stack import Stack

DEMO = Path(__file__).resolve().parent.parent / "demo"
REQUESTS = 4


@pytest.fixture(scope="module")
def clients() -> Path:
    return ensure_bench_clients()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    st = Stack(tmp_path_factory.mktemp("bench-demo"), DEMO / "target", [DEMO / "draft"], "--max-model-len", "1024",
               target_args=("--num-blocks", "512", "--block-size", "16"))
    yield st
    st.stop()


def served(st: Stack) -> dict[str, float]:
    """What the server counted so far: prompt and output tokens, verified trees and drafted tokens."""
    m = st.metrics()

    def total(prefix: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(prefix))

    return {"prompt": total("vllm:prompt_tokens_total"), "output": total("vllm:generation_tokens_total"),
            "spec_steps": total("vllm:spec_decode_num_drafts_total"),
            "accepted": total("vllm:spec_decode_num_accepted_tokens_total")}


def since(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def run(cmd: list[str], cwd: Path) -> None:
    env = {**os.environ, "HOME": str(cwd)}  # the clients' caches and settings stay in the test's folder
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, f"{cmd[0]} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"


def guidellm(clients: Path, st: Stack, tmp: Path, endpoint: str) -> dict:
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / "guidellm.json"
    run([str(clients / "guidellm"), "run",
         "--backend", f"kind=openai_http,target={st.url},request_format={endpoint}",
         "--profile", "kind=concurrent,streams=2", "--constraint", f"kind=max_requests,count={REQUESTS}",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={DEMO / 'target'}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"], tmp)
    return json.loads(out.read_text())["benchmarks"][0]["requests"]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_streams_with_zero_errors_and_reads_the_servers_usage(clients, demo, tmp_path, endpoint):
    # guidellm 0.8.1 now and then leaves one request of a max_requests run out of its report, though the
    # server served it in full: two CI runs on two busy workers (2026-12-03) read 3 successful, 0 errored,
    # 0 incomplete, nothing else kept, while the server had counted 4 x 32 prompt and 4 x 16 output tokens.
    # The cause is in guidellm and not found for certain (its max_requests constraint stops processing as the
    # last request is counted, a likely race). Such a run is repeated once, after checking that it had no
    # error and that the server served every request in full; every other check is made on a run that kept
    # all of them.
    for attempt in range(2):
        before = served(demo)
        requests = guidellm(clients, demo, tmp_path / f"run{attempt}", endpoint)
        counted = since(before, served(demo))
        assert len(requests["errored"]) == 0 and len(requests["incomplete"]) == 0
        ok = requests["successful"]
        kept = {kind: len(listed) for kind, listed in requests.items() if isinstance(listed, list)}
        shown = f"guidellm's requests by kind: {kept}; served since the start: {counted}"
        if len(ok) == REQUESTS or attempt == 1:
            break
        assert len(ok) == REQUESTS - 1 and counted["output"] == 16 * REQUESTS, shown
    assert len(ok) == REQUESTS, shown
    # It sent continuous usage stats on every stream (the field it was refused over), and read usage back.
    assert all(json.loads(r["request_args"])["body"]["stream_options"]["continuous_usage_stats"] for r in ok)
    assert sum(r["input_metrics"]["text_tokens"] for r in ok) == counted["prompt"]
    assert sum(r["output_metrics"]["text_tokens"] for r in ok) == counted["output"] == 16 * REQUESTS
    spec = [r["response_metrics"]["speculative_decoding"] for r in ok]
    assert sum(s["num_spec_steps"] for s in spec) == counted["spec_steps"]


def test_aiperf_with_per_chunk_usage_min_tokens_and_speculation_always(clients, demo, tmp_path):
    before = served(demo)
    out = tmp_path / "aiperf"
    run([str(clients / "aiperf"), "profile", "--model", "target", "--url", demo.url, "--endpoint-type", "chat",
         "--streaming", "--tokenizer", str(DEMO / "target"), "--request-count", str(REQUESTS), "--concurrency", "2",
         "--synthetic-input-tokens-mean", "32", "--output-tokens-mean", "16", "--per-chunk-usage",
         "--use-server-token-count", "--extra-inputs", "min_tokens:16", "--extra-inputs", "ignore_eos:true",
         "--extra-inputs", "speculation:always", "--output-artifact-dir", str(out), "--no-auto-plot",
         "--ui-type", "none"], tmp_path)
    counted = since(before, served(demo))
    report = json.loads((out / "profile_export_aiperf.json").read_text())
    assert not report["error_summary"] and report["request_count"]["avg"] == REQUESTS
    assert report["total_usage_prompt_tokens"]["avg"] == counted["prompt"]
    assert report["total_osl"]["avg"] == counted["output"] == 16 * REQUESTS
    # It read the speculative statistics in vLLM's shape, and they are the server's.
    assert report["total_spec_decode_steps"]["avg"] == counted["spec_steps"] > 0
    assert report["total_accepted_draft_tokens"]["avg"] == counted["accepted"]
