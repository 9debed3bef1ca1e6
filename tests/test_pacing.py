"""--emulate-step-cost: parsing, the hold, and the services' clear errors for bad values."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tandem.pacing import StepPacing, pacing_from_args
from tests.services import REPO


def test_parse_and_seconds():
    p = StepPacing.parse("30,4")
    assert p == StepPacing(30.0, 4.0)
    assert p.seconds(10) == pytest.approx(0.070)
    assert pacing_from_args(None) is None and pacing_from_args("") is None


@pytest.mark.parametrize("text", ["30", "a,b", "1,2,3", "-1,2", "1,-2"])
def test_bad_values_are_refused(text):
    with pytest.raises(ValueError, match="emulate-step-cost"):
        StepPacing.parse(text)
    with pytest.raises(SystemExit, match="error: --emulate-step-cost"):
        pacing_from_args(text)


def test_hold_pads_a_short_call_and_never_shortens_a_long_one():
    p = StepPacing(40, 10)
    t0 = time.perf_counter()
    p.hold(t0, 2)  # 60 ms from t0
    assert time.perf_counter() - t0 >= 0.060
    t0 = time.perf_counter()
    p.hold(t0 - 1.0, 2)  # began a second ago: already longer than 60 ms
    assert time.perf_counter() - t0 < 0.050


@pytest.mark.parametrize("service", ["target", "draft"])
def test_services_reject_a_bad_value_before_loading(service):
    args = [sys.executable, "-m", "tandem.cli", service, "--model", str(REPO / "demo" / service), "--port", "0",
            "--emulate-step-cost", "fast"]
    if service == "draft":
        args += ["--target-model", str(REPO / "demo" / "target")]
    out = subprocess.run(args, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode != 0
    assert "error: --emulate-step-cost takes BASE_MS,PER_TOKEN_MS" in out.stderr
    assert "Traceback" not in out.stderr
