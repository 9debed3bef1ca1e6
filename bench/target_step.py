"""Time the target's step on a random tiny Llama: one-node decode vs a 16-node tree.

    python bench/target_step.py [--hidden 256 --layers 4 --vocab 4096 --prefix 128 --device cpu] [--host-part]
    python bench/target_step.py --host-only [--rounds 5]

Prints mean and median milliseconds per step; with --host-part also the median of the
model's forward inside the step, and the rest (the step's host work: validating,
packing, deciding, committing). --host-only times the host work alone, far more
steadily than a difference of two noisy medians: after a warm-up the model's forward
returns the output it gave for the same input shape, so a step is everything but the
forward (the logits and KV it commits are stale; the timing does not read them). It
prints the median microseconds of each of --rounds rounds of --iters steps.
`PYTHONPATH=<other checkout>` times another tree's engine with this script. A
benchmark, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from target_service.engine import TargetEngine
from target_service.model import LlamaModel
from target_service.types import SequenceStep


def make_model(dir: Path, hidden: int, layers: int, vocab: int) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4 // 1,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(dir)
    return dir


def binary_tree(pending: int, nodes: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    tokens, parents = [pending], [-1]
    for i in range(1, nodes):
        tokens.append(i % 50 + 1)
        parents.append((i - 1) // 2)
    return tuple(tokens), tuple(parents)


class ForwardReplay:
    """While installed, LlamaModel.forward computes once per input shape and then returns that
    output again: what is left of a step is its host work."""

    def __init__(self) -> None:
        self._forward = LlamaModel.forward
        self._outputs: dict[tuple[int, ...], object] = {}

    def __enter__(self) -> ForwardReplay:
        outputs, forward = self._outputs, self._forward

        def replayed(model, tokens, *args, **kwargs):
            key = tuple(tokens.shape)
            if key not in outputs:
                outputs[key] = forward(model, tokens, *args, **kwargs)
            return outputs[key]

        LlamaModel.forward = replayed
        return self

    def __exit__(self, *exc) -> None:
        LlamaModel.forward = self._forward


class ForwardTimer:
    """Times every LlamaModel.forward call while installed (the forward inside each step)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._forward = LlamaModel.forward

    def __enter__(self) -> ForwardTimer:
        timer, forward = self, self._forward

        def timed(model, *args, **kwargs):
            t0 = time.perf_counter()
            out = forward(model, *args, **kwargs)
            timer.times.append((time.perf_counter() - t0) * 1e3)
            return out

        LlamaModel.forward = timed
        return self

    def __exit__(self, *exc) -> None:
        LlamaModel.forward = self._forward


def time_steps(engine: TargetEngine, make_item, iters: int, prefix: int) -> list[float]:
    """Milliseconds of each of `iters` steps of sequence "b"; it starts over from its prompt
    (untimed) before it would outgrow the model."""
    times = []
    for _ in range(iters):
        if engine.length("b") + 32 > engine.max_model_len:
            engine.release(["b"])
            prefill(engine, prefix)
        item = make_item()
        t0 = time.perf_counter()
        r = engine.step([item])[0]
        times.append((time.perf_counter() - t0) * 1e3)
        engine.last = r.tokens[-1]
    return times


def prefill(engine: TargetEngine, prefix: int) -> None:
    engine.step([SequenceStep.chain("b", list(range(1, prefix + 1)), create=True)])
    engine.last = 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--host-part", action="store_true", help="also time the forward inside each step")
    ap.add_argument("--host-only", action="store_true",
                    help="time the step without its forward (replayed per input shape): the host work alone")
    ap.add_argument("--rounds", type=int, default=5, help="--host-only: rounds of --iters steps")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = LlamaModel(make_model(Path(tmp), args.hidden, args.layers, args.vocab), device=args.device)
    params = sum(t.numel() for t in [model.embed, model.norm] + [w for layer in model.layers
                                                                   for w in layer.values() if w is not None])
    print(f"model: hidden {args.hidden}, layers {args.layers}, vocab {args.vocab}, "
          f"{params / 1e6:.1f}M params, prefix {args.prefix}, torch threads {torch.get_num_threads()}")
    for nodes in (1, 16):
        engine = TargetEngine(model, num_blocks=4096, block_size=16)
        prefill(engine, args.prefix)

        def item(nodes=nodes, engine=engine):
            if nodes == 1:
                return SequenceStep.chain("b", [engine.last])
            tokens, parents = binary_tree(engine.last, nodes)
            return SequenceStep("b", tokens, parents, num_fixed=1)

        time_steps(engine, item, 5, args.prefix)  # warm-up
        if args.host_only:
            with ForwardReplay():
                medians = [1e3 * statistics.median(time_steps(engine, item, args.iters, args.prefix))
                           for _ in range(args.rounds)]
            print(f"{nodes:>3}-node step without its forward: median {statistics.median(medians):6.1f} us "
                  f"(rounds: {', '.join(f'{m:.1f}' for m in medians)})")
            continue
        with ForwardTimer() if args.host_part else contextlib.nullcontext() as forward:
            t = time_steps(engine, item, args.iters, args.prefix)
        line = f"{nodes:>3}-node step: mean {statistics.mean(t):7.2f} ms  median {statistics.median(t):7.2f} ms"
        if forward is not None:
            f = statistics.median(forward.times)
            line += f"  forward {f:6.3f} ms  host part {statistics.median(t) - f:6.3f} ms"
        print(line)


if __name__ == "__main__":
    main()
