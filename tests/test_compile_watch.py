"""CompileWatch: a Triton compile after the service said it serves is a logged warning with its time."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from kernels._triton import interpreting
from kernels.compile_watch import CompileWatch


def _compile(watch: CompileWatch, name: str, key: str) -> None:
    fn = SimpleNamespace(name=name)
    assert watch._before_compile(key=key, fn=fn, repr=name) is False  # never tells Triton to skip it
    assert watch._after_compile(key=key, fn=fn, repr=name) is False


def test_compiles_before_serving_are_counted_quietly_and_those_after_are_warnings(caplog):
    watch = CompileWatch(logging.getLogger("test.compiles"))
    with caplog.at_level(logging.DEBUG, logger="test.compiles"):
        _compile(watch, "_rms_norm_kernel", "k1")
        assert [r.levelno for r in caplog.records] == [logging.DEBUG]
        watch.mark_serving()
        _compile(watch, "_rope_kernel", "[('i32', 'D')]")
    assert watch.compiles == 2 and watch.compiles_while_serving == 1
    assert watch.seconds_while_serving >= 0.0
    warning = caplog.records[-1]
    assert warning.levelno == logging.WARNING
    assert "_rope_kernel while serving" in warning.getMessage() and "[('i32', 'D')]" in warning.getMessage()


@pytest.mark.skipif(not interpreting(), reason="on a GPU install() would hook this process's real compiles")
def test_under_the_interpreter_there_is_nothing_to_watch():
    assert CompileWatch(logging.getLogger("test.compiles")).install() is False
