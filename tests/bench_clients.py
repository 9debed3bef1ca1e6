"""The benchmark clients users run against OpenAI-compatible servers, installed for the tests.

guidellm and aiperf pull in dependencies tandem does not need (and pins of their
own), so they live in a virtual environment of their own, made once per machine
under ~/.cache (or $TANDEM_BENCH_CLIENTS_VENV) and reused while its versions match.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PACKAGES = ("guidellm==0.8.1", "aiperf==0.13.0")
TORCH = "torch==2.13.0"  # guidellm needs torch: the CPU build CI installs for tandem too


def venv_dir() -> Path:
    given = os.environ.get("TANDEM_BENCH_CLIENTS_VENV")
    if given:
        return Path(given)
    return Path.home() / ".cache" / "tandem" / ("bench-clients-" + "-".join(p.replace("==", "") for p in PACKAGES))


def ensure_bench_clients(timeout: float = 900) -> Path:
    """The bin/ folder holding `guidellm` and `aiperf` (installed now if missing)."""
    venv = venv_dir()
    marker = venv / "tandem-installed.txt"
    wanted = "\n".join((TORCH, *PACKAGES))
    if marker.is_file() and marker.read_text() == wanted:
        return venv / "bin"
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, TORCH], check=True, timeout=timeout)  # first, so no other torch build is chosen
    subprocess.run([*pip, *PACKAGES], check=True, timeout=timeout)
    marker.write_text(wanted)
    return venv / "bin"
