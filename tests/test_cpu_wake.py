"""The CPU wake-up latency limit: written as the kernel reads it, held only for the block, and a
device that cannot be opened is said, not raised; `tandem serve` takes it as a flag."""

from __future__ import annotations

import os
import struct

import pytest

from gateway import serve
from tandem import cpu_wake


def test_the_limit_is_written_as_a_32_bit_integer_and_the_file_is_closed_after_the_block(tmp_path, monkeypatch):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    opened = []
    real_open = os.open
    monkeypatch.setattr(cpu_wake.os, "open", lambda *a: opened.append(real_open(*a)) or opened[-1])
    with cpu_wake.held_wake_latency(7, device) as held:
        assert held == "held at 7 us"
        assert struct.unpack("<i", device.read_bytes()) == (7,)
        os.fstat(opened[0])  # open while held
    with pytest.raises(OSError):
        os.fstat(opened[0])  # closed after: the kernel drops the request with the file


def test_a_device_that_cannot_be_opened_is_reported_not_raised(tmp_path):
    with cpu_wake.held_wake_latency(0, tmp_path / "missing") as held:
        assert held.startswith("not held: ") and "missing" in held


def test_no_limit_asked_touches_nothing(tmp_path):
    device = tmp_path / "cpu_dma_latency"
    with cpu_wake.held_wake_latency(None, device) as held:
        assert held == "not held"
    assert not device.exists()


def test_a_negative_limit_is_refused():
    with pytest.raises(ValueError, match="0 or more"), cpu_wake.held_wake_latency(-1):
        pass


def test_idle_states_are_read_in_state_order_and_unreadable_ones_skipped(tmp_path):
    for index, name, latency in ((10, "C6", "170"), (0, "POLL", "0"), (2, "C1E", "4"), (3, "broken", "x")):
        state = tmp_path / f"state{index}"
        state.mkdir()
        (state / "name").write_text(name + "\n")
        (state / "latency").write_text(latency + "\n")
    assert cpu_wake.idle_states(tmp_path) == [("POLL", 0), ("C1E", 4), ("C6", 170)]


def test_serve_refuses_a_negative_limit_before_anything_starts(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert serve.main(["--model", str(model), "--draft", "none", "--cpu-wake-latency-us", "-1"]) == 2
    assert "--cpu-wake-latency-us must be 0 or more" in capsys.readouterr().err


def test_serve_holds_the_limit_for_the_whole_run_and_says_so(tmp_path, monkeypatch, capsys):
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    seen = []

    def run(args, plan):
        seen.append(struct.unpack("<i", device.read_bytes()))
        return 0

    monkeypatch.setattr(serve, "run", run)
    monkeypatch.setattr(serve, "held_wake_latency", lambda us: cpu_wake.held_wake_latency(us, device))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert serve.main(["--model", str(model), "--draft", "none", "--cpu-wake-latency-us", "0"]) == 0
    assert seen == [(0,)]
    assert "CPU wake-up latency limit held at 0 us" in capsys.readouterr().err
