"""kernels.l2_prefetch: what a prefetch asks for, that its kernel builds for Hopper, and that the target's
forward asks L2 for each GEMM's weight right after the GEMM before it (the GPU's timings are
bench/l2_prefetch_cost.py's and bench/step_cost.py --l2-prefetch-mb's)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.l2_prefetch import WeightPrefetch, prefetch_bytes
from kernels.tree_attention import StepLayout
from tandem.model_config import LlamaConfig
from tandem.tree import ancestor_mask
from target_service.random_model import random_llama_model

REPO = Path(__file__).resolve().parents[1]


def test_a_prefetch_asks_for_the_weights_first_bytes_up_to_the_cap_in_16_byte_units_or_for_nothing():
    weight = torch.zeros(64, 33, dtype=torch.bfloat16)  # 4,224 bytes
    assert prefetch_bytes(weight, 1 << 20) == 4224
    assert prefetch_bytes(weight, 1000) == 992  # the cap, rounded down to a multiple of 16
    assert prefetch_bytes(weight.t(), 1 << 20) == 0  # not one range of memory
    assert prefetch_bytes(weight.view(-1)[1:], 1 << 20) == 0  # 2 bytes past an aligned start


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="the prefetch runs on Hopper or later GPUs (the CPU builds it, above)")
def test_on_a_gpu_a_captured_forward_with_l2_prefetch_gives_the_logits_of_one_without():
    from tandem.graph_capture import capture_graphs

    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=False)
    model = random_llama_model(cfg, torch.bfloat16, "cuda", seed=3)
    layout = StepLayout((0,), (3,), (torch.zeros(0, dtype=torch.long),), (ancestor_mask([-1, 0, 0]),))
    tokens, positions = torch.tensor([1, 2, 3], device="cuda"), torch.tensor([0, 1, 1], device="cuda")
    rows = torch.arange(3, device="cuda")
    logits = {}

    def captured(name: str) -> torch.Tensor:
        kv = model.new_kv_cache(4, 4)
        # The metadata is built outside the graph, as the engine builds it (its copies to the device).
        meta = model.attention.plan(layout, block_size=4, num_q_heads=model.heads_local,
                                    num_kv_heads=model.kv_heads_local, device=model.device)

        def step() -> None:
            logits[name] = model.forward(tokens, positions, meta, kv, rows).logits

        graph = capture_graphs(step)[0]
        graph.replay()
        torch.cuda.synchronize()
        return logits[name].clone()

    without = captured("without")
    model.weight_prefetch = WeightPrefetch(torch.device("cuda"), 1 << 16, chunk_bytes=1 << 12)
    assert torch.equal(captured("with"), without)


# Builds the kernel for sm_90 and writes its PTX and cubin to the folder given (argv[1]).
BUILD = """
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from kernels.l2_prefetch import CHUNKS_PER_PROGRAM, _prefetch_l2_kernel

source = triton.compiler.ASTSource(
    fn=_prefetch_l2_kernel,
    signature={"Base": "*u8", "nbytes": "i64", "CHUNK": "constexpr", "PER_PROGRAM": "constexpr"},
    constexprs={"CHUNK": 1 << 16, "PER_PROGRAM": CHUNKS_PER_PROGRAM})
kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
out = Path(sys.argv[1])
(out / "prefetch.ptx").write_text(kernel.asm["ptx"])
(out / "prefetch.cubin").write_bytes(kernel.asm["cubin"])
"""


def test_the_prefetch_kernel_builds_for_hopper_into_bulk_l2_prefetches(tmp_path):
    """The CPU cannot run it; the build shows that ptxas takes its PTX for sm_90, and what it became. The build
    runs in a process of its own without TRITON_INTERPRET: the suite runs Triton interpreted (conftest), and
    in a worker where an interpreted kernel had run, the language's functions still bore the interpreter's
    builder and the real compile failed ('value' object has no attribute 'dtype'; a CI run on 2026-12-05)."""
    import triton

    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    build = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], capture_output=True, text=True, env=env,
                           cwd=REPO, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "cp.async.bulk.prefetch.L2.global" in (tmp_path / "prefetch.ptx").read_text()
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    sass = subprocess.run([str(nvdisasm), "-c", str(tmp_path / "prefetch.cubin")], capture_output=True, text=True,
                          check=True).stdout
    assert "UBLKPF.L2" in sass


def test_weight_prefetch_needs_a_cuda_device_and_a_positive_cap():
    with pytest.raises(ValueError, match="CUDA devices"):
        WeightPrefetch(torch.device("cpu"), 1 << 20)
    with pytest.raises(ValueError, match="at least 1 byte"):
        WeightPrefetch(torch.device("cuda"), 0)


class Recorder:
    """Stands in for WeightPrefetch and the model's linear layer: the order in which the forward enqueues
    GEMMs and prefetches, by weight."""

    def __init__(self, model):
        self.events: list[tuple[str, int]] = []
        self.linear = model.linear
        self.names = {id(model.lm_head): "lm_head"}
        for i, layer in enumerate(model.layers):
            self.names.update({id(layer[name]): f"{name}{i}" for name in ("qkv", "o", "gate_up", "down")})

    def gemm(self, x, weight, bias=None):
        self.events.append(("gemm", self.names[id(weight)]))
        return self.linear(x, weight, bias)

    def next(self, weight) -> None:
        self.events.append(("prefetch", self.names[id(weight)]))

    def join(self) -> None:
        self.events.append(("join", ""))


def test_the_forward_asks_for_each_gemms_weight_after_the_gemm_before_it_and_its_output_is_unchanged():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, max_position=64, tie_word_embeddings=False)
    model = random_llama_model(cfg, torch.float32, "cpu", seed=3, attention_backend="torch")
    layout = StepLayout((0,), (3,), (torch.zeros(0, dtype=torch.long),), (ancestor_mask([-1, 0, 0]),))
    args = (torch.tensor([1, 2, 3]), torch.tensor([0, 1, 1]), layout)
    plain = model.forward(*args, model.new_kv_cache(4, 4), torch.arange(3)).logits
    recorder = Recorder(model)
    model.linear, model.weight_prefetch = recorder.gemm, recorder
    prefetched = model.forward(*args, model.new_kv_cache(4, 4), torch.arange(3)).logits
    assert torch.equal(plain, prefetched)
    gemms = ["qkv0", "o0", "gate_up0", "down0", "qkv1", "o1", "gate_up1", "down1", "lm_head"]
    # Each weight's prefetch right after the GEMM before it is enqueued (the first before any), then the join.
    expected = [event for name in gemms for event in (("prefetch", name), ("gemm", name))] + [("join", "")]
    assert recorder.events == expected


def test_a_negative_prefetch_size_is_refused_before_anything_loads():
    from target_service.parallel import EngineSpec
    from target_service.server import main

    with pytest.raises(ValueError, match="--l2-prefetch-mb must be >= 0"):
        EngineSpec(model_dir="m", l2_prefetch_mb=-1)
    with pytest.raises(SystemExit, match="error: --l2-prefetch-mb must be >= 0"):
        main(["--model", "no-such-model", "--port", "0", "--l2-prefetch-mb", "-1"])
