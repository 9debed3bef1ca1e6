"""The garbage collector kept out of the step loop: the heap frozen once a service is ready, slow
full collections logged (tandem/gc_pauses.py)."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from tandem.gc_pauses import FREEZE_ENV, GcWatch

REPO = Path(__file__).resolve().parent.parent

# Run in a child: freezing the test process's heap would keep its garbage for good.
READY_IN_A_CHILD = """
import gc, json, logging
from tandem.gc_pauses import GcWatch
kept = [[i] for i in range(50_000)]  # what a service holds once loaded
watch = GcWatch(logging.getLogger("child"))
watch.install()
frozen = watch.ready()
print(json.dumps({"frozen": frozen, "freeze_count": gc.get_freeze_count(), "serving": watch.serving}))
"""


def _ready_in_a_child(freeze: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != FREEZE_ENV}
    if freeze is not None:
        env[FREEZE_ENV] = freeze
    out = subprocess.run([sys.executable, "-c", READY_IN_A_CHILD], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_a_ready_service_freezes_what_it_holds_out_of_later_collections():
    result = _ready_in_a_child(None)
    assert result["frozen"] and result["serving"]
    assert result["freeze_count"] >= 50_000  # the kept lists at least


def test_TANDEM_GC_FREEZE_0_leaves_the_heap_unfrozen_and_still_watches():
    result = _ready_in_a_child("0")
    assert not result["frozen"] and result["serving"]
    assert result["freeze_count"] == 0


def test_a_slow_full_collection_while_serving_is_logged_as_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(FREEZE_ENV, "0")  # no freeze in the test process
    watch = GcWatch(logging.getLogger("tandem.test_gc"), slow_s=0.0)  # every full collection counts as slow
    watch.install()
    try:
        gc.collect()  # before ready: timed, not warned about
        assert watch.full_collections == 1 and watch.slow_while_serving == 0
        with caplog.at_level(logging.WARNING, logger="tandem.test_gc"):
            watch.ready()
            gc.collect()
            gc.collect(1)  # a young collection: not watched
    finally:
        watch.uninstall()
    assert watch.full_collections == 2 and watch.slow_while_serving == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "full garbage collection took" in warnings[0]
    gc.collect()
    assert watch.full_collections == 2  # uninstalled: no longer called


def test_a_quick_full_collection_is_not_a_warning(monkeypatch, caplog):
    monkeypatch.setenv(FREEZE_ENV, "0")
    watch = GcWatch(logging.getLogger("tandem.test_gc"), slow_s=3600.0)
    watch.install()
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.test_gc"):
            watch.ready()
            gc.collect()
    finally:
        watch.uninstall()
    assert watch.full_collections == 1 and watch.slow_while_serving == 0
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]
