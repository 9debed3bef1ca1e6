"""tandem_kv_cache_usage_ratio follows the caches down when the gateway goes idle, instead of keeping
the last step's value (taken while the finished requests still held their KV)."""

from __future__ import annotations

import time

import httpx

TARGET = 'tandem_kv_cache_usage_ratio{service="target"}'
DRAFT = 'tandem_kv_cache_usage_ratio{service="draft"}'


def wait_for(read, want: float, timeout: float = 10.0) -> float:
    deadline = time.time() + timeout
    while (value := read()) != want and time.time() < deadline:
        time.sleep(0.1)
    return value


def test_after_requests_finish_the_kv_gauges_read_zero(byte_stack):
    body = {"prompt": "x = [1, 2, 3]\n" * 2, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
            "speculation": "always"}
    for _ in range(2):
        r = httpx.post(f"{byte_stack.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
    assert r.json()["spec_stats"]["verify_steps"] > 0  # the draft held KV too
    # The response can reach us just before the step that emitted it releases the KV: poll briefly.
    assert wait_for(lambda: byte_stack.metrics()[TARGET], 0.0) == 0.0  # from the target's Release reply
    assert wait_for(lambda: byte_stack.metrics()[DRAFT], 0.0) == 0.0  # from the draft, after its release
