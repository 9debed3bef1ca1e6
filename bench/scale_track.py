"""Build the scale track: an 8B-shaped target with random weights, a random EAGLE-3 head, a record.

    python bench/scale_track.py --out /tmp/scale            # on a GPU: ~20 GB of weights drawn there

Writes, under --out:
  target/   config.json (Llama-3.1-8B shapes, plus "tandem_random_init": serve it with
            `tandem target --random-weights`), the demo tokenizer padded with filler tokens to
            the 128,256-token vocabulary, and model.safetensors holding only embed_tokens (the
            draft reads the target's embeddings; the target draws all its weights itself)
  draft/    an EAGLE-3 head of SpecForge's Llama-3.1-8B shape (32k draft vocabulary), random, with a
            large lm_head so it is confident (deep trees along its best path)
  record.jsonl  each held-out prompt's ids and the target's greedy continuation, for
            `tandem draft --force-record` (draft_service/forcing.py)

The target's weights are random with a planted next-token map (target_service/random_model.py,
RandomInit): its greedy output is a permutation walk with a margin bf16 rounding cannot flip,
so the record holds however the serving stack batches it. Every figure from this track is
labelled "scale track (8B-shaped random weights, forced acceptance)".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.draft_step import SHAPES, write_draft  # noqa: E402
from target_service.cuda_graphs import GraphConfig  # noqa: E402
from target_service.engine import TargetEngine  # noqa: E402
from target_service.parallel import EngineSpec, ParallelEngine  # noqa: E402
from target_service.random_model import (  # noqa: E402
    LLAMA_31_8B,
    LLAMA_31_70B,
    RandomInit,
    RandomWeights,
    random_llama_model,
)
from target_service.types import SequenceStep  # noqa: E402

DEMO_TOKENIZER = REPO / "demo" / "target"
HELDOUT = REPO / "demo" / "heldout_prompts.jsonl"
INIT = RandomInit(seed=0, embed_std=1.0, residual_out_std=0.002, planted_next_token=True)


def hf_config(cfg=LLAMA_31_8B, max_position: int = 16384) -> dict:
    r = cfg.rope
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": max_position, "tie_word_embeddings": False, "rope_theta": r.theta,
        "rope_scaling": {"rope_type": "llama3", "factor": r.factor, "low_freq_factor": r.low_freq_factor,
                         "high_freq_factor": r.high_freq_factor,
                         "original_max_position_embeddings": r.original_max_position},
        "bos_token_id": None, "eos_token_id": list(cfg.eos_token_ids), "torch_dtype": "bfloat16",
        "tandem_random_init": dataclasses.asdict(INIT),
    }


def write_padded_tokenizer(out: Path, vocab_size: int) -> None:
    """The demo BPE tokenizer with filler entries up to vocab_size, so every id the target
    can emit decodes (fillers are never produced by encoding: they have no merges)."""
    tok = json.loads((DEMO_TOKENIZER / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    used = set(vocab.values()) | {a["id"] for a in tok["added_tokens"]}
    # "Ġ" is the byte-level form of a space: fillers decode to " ~<id>".
    for i in range(vocab_size):
        if i not in used:
            vocab[f"Ġ~{i}"] = i
    (out / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(DEMO_TOKENIZER / "tokenizer_config.json", out / "tokenizer_config.json")


def record(engine: TargetEngine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of every prompt, decoded together."""
    seqs = {}
    for i, ids in enumerate(prompts):
        seqs[f"p{i}"] = list(ids) + engine.step([SequenceStep.chain(f"p{i}", ids, create=True)])[0].tokens
    for _ in range(max_tokens - 1):
        out = engine.step([SequenceStep.chain(r, [s[-1]]) for r, s in seqs.items()])
        for res in out:
            seqs[res.request_id].extend(res.tokens)
    engine.release(list(seqs))
    return list(seqs.values())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=HELDOUT, help="JSONL with a 'prompt' field per line")
    ap.add_argument("--max-tokens", type=int, default=320,
                    help="recorded tokens per prompt; more than the bench generates, since trees reach past it")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke run of this script)")
    ap.add_argument("--shape", choices=["8b", "70b"], default="8b",
                    help="Llama-3.1-8B shapes (default), or 70B (~141 GB of bf16: record it with --tp 8)")
    ap.add_argument("--tp", type=int, default=1,
                    help="record through a tensor-parallel target of this degree (tandem target's own code); "
                         "the model is the same at every degree")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    cfg, shape = (LLAMA_31_70B, SHAPES["70b"]) if args.shape == "70b" else (LLAMA_31_8B, SHAPES["8b"])
    if args.tiny:
        shape = SHAPES["tiny"]
        cfg = dataclasses.replace(cfg, vocab_size=shape["vocab"] * 16, hidden_size=shape["hidden"],
                                  intermediate_size=shape["inter"], num_layers=shape["layers"],
                                  num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                                  head_dim=shape["head_dim"])
        shape = dict(shape, vocab=cfg.vocab_size)
    target, draft = args.out / "target", args.out / "draft"
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(hf_config(cfg), indent=1))
    write_padded_tokenizer(target, cfg.vocab_size)
    t0 = time.perf_counter()
    # The draft reads the target's embeddings: drawn alone, as every rank of the target draws them.
    embed = RandomWeights(cfg, torch.device(args.device), torch.bfloat16, init=INIT).get(
        "model.embed_tokens.weight", (cfg.vocab_size, cfg.hidden_size))
    save_file({"model.embed_tokens.weight": embed.cpu()}, str(target / "model.safetensors"))
    del embed
    if not draft.exists():
        # Confident, like a head with high acceptance: its trees are deep along the best path,
        # which is the path forcing sets (a random head with a flat distribution grows bushy trees).
        write_draft(draft, shape, torch.bfloat16, args.device, lm_head_std=1.0)
    print(f"models written in {time.perf_counter() - t0:.1f} s", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(target)
    texts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = [list(tokenizer.encode(t)) for t in texts]
    num_blocks = len(prompts) * (512 + args.max_tokens) // 16 + 64
    if args.tp == 1:
        graphs = GraphConfig(max_batch=128, max_nodes=1) if args.device.startswith("cuda") else None
        model = random_llama_model(cfg, torch.bfloat16, args.device, init=INIT)
        engine = TargetEngine(model, num_blocks=num_blocks, block_size=16, max_model_len=4096, graphs=graphs)
        replays = lambda: engine.graphs.replays if engine.graphs else 0  # noqa: E731
    else:  # the served target's own tensor-parallel path, eager: the record needs only correctness
        engine = ParallelEngine(EngineSpec(model_dir=str(target), dtype="bfloat16", device=args.device,
                                           num_blocks=num_blocks, block_size=16, max_model_len=4096,
                                           random_weights=True, cuda_graphs=False), tp_size=args.tp)
        replays = lambda: 0  # noqa: E731
    t0 = time.perf_counter()
    try:
        seqs = record(engine, prompts, args.max_tokens)
    finally:
        if args.tp > 1:
            engine.shutdown()
    took = time.perf_counter() - t0
    with open(args.out / "record.jsonl", "w") as f:
        for s in seqs:
            f.write(json.dumps({"tokens": s}) + "\n")
    print(f"recorded {len(seqs)} continuations of {args.max_tokens} tokens in {took:.1f} s "
          f"({len(seqs) * args.max_tokens / took:.0f} tok/s at batch {len(seqs)}, tp {args.tp}, graph replays "
          f"{replays()}); sample: "
          f"{tokenizer.decode(seqs[0][len(prompts[0]):][:12])!r}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
