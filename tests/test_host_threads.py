"""How many OpenMP threads a service starts with: one on a GPU, a share of the cores on the CPU,
whatever OMP_NUM_THREADS says when it is set."""

from __future__ import annotations

import os

import torch

from gateway import serve
from tandem import host_threads


def test_a_gpu_service_gets_one_thread_and_a_cpu_service_a_third_of_the_cores():
    assert host_threads.default_threads("cuda", cpus=16) == 1
    assert host_threads.default_threads("cpu", cpus=16) == 5
    assert host_threads.default_threads("cpu", cpus=2) == 1  # never none


def test_the_cpu_default_counts_the_usable_cores(monkeypatch):
    monkeypatch.setattr(host_threads, "usable_cores", lambda: 6)  # e.g. a container's quota on a larger host
    assert host_threads.default_threads("cpu") == 2


def test_a_gpu_service_started_on_its_own_drops_to_one_thread(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert not host_threads.limit_for_gpu("cpu")
    assert calls == [] and "OMP_NUM_THREADS" not in os.environ
    assert host_threads.limit_for_gpu("cuda")
    assert calls == [1] and os.environ["OMP_NUM_THREADS"] == "1"  # the processes it starts inherit it


def test_an_explicit_omp_num_threads_wins_over_the_gpu_default(monkeypatch):
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert not host_threads.limit_for_gpu("cuda")
    assert calls == [] and os.environ["OMP_NUM_THREADS"] == "4"


def test_serve_starts_its_children_with_the_threads_of_their_device_unless_told(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(host_threads, "usable_cores", lambda: 16)  # a GPU host's cores: the two defaults differ
    gpu = serve.Child("target", ["--help"], tmp_path, threads=host_threads.default_threads("cuda"))
    cpu = serve.Child("draft0", ["--help"], tmp_path)
    try:
        assert gpu.environment()["OMP_NUM_THREADS"] == "1"
        assert cpu.environment()["OMP_NUM_THREADS"] == "5"
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert gpu.environment()["OMP_NUM_THREADS"] == "3"
    finally:
        gpu.kill()
        cpu.kill()
