"""Peer baseline: Hugging Face transformers `generate` on the same GPU and model, concurrency 1.

    python bench/hf_baseline.py --scale-dir /tmp/tandem-scale --out hf.json   # scale track
    python bench/hf_baseline.py --demo --out hf_demo.json                      # demo target

Scale track: the 8B-shaped target with the same random weights tandem serves
(bench/scale_track.py; the planted next-token map included), loaded into
transformers' LlamaForCausalLM. Plain greedy generate, then assisted generation
with a one-layer assistant that shares the target's embeddings and lm_head, so
it predicts the target's permutation walk (its acceptance is near 1: the best
case for assisted generation). Demo track: plain greedy generate of demo/target
(its draft is an EAGLE-3 head, which transformers cannot use as an assistant).
Prints and writes output tokens per second per request, greedy, ignoring EOS.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tandem.model_config import load_llama_config  # noqa: E402
from target_service.random_model import RandomInit, random_llama_model  # noqa: E402


def hf_weights_from(model) -> dict[str, torch.Tensor]:
    """transformers' names for a tandem LlamaModel's tensors (fused qkv / gate_up split back)."""
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out = {"model.embed_tokens.weight": model.embed, "model.norm.weight": model.norm, "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        wq, wk, wv = layer["qkv"].split([q, kv, kv])
        gate, up = layer["gate_up"].chunk(2)
        out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": layer["o"],
                    p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": layer["down"], p + "input_layernorm.weight": layer["input_norm"],
                    p + "post_attention_layernorm.weight": layer["post_norm"]})
    return out


def timed_generate(model, ids: list[int], max_new_tokens: int, **kw) -> tuple[float, int]:
    x = torch.tensor([ids], device=model.device)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    y = model.generate(x, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, y.shape[1] - len(ids)


def run(name: str, model, prompts: list[list[int]], max_new_tokens: int, **kw) -> dict:
    timed_generate(model, prompts[0], 8, **kw)  # warm-up
    rates = []
    for ids in prompts:
        seconds, n = timed_generate(model, ids, max_new_tokens, **kw)
        rates.append(n / seconds)
    row = {"name": name, "tok_s_per_request": statistics.median(rates), "runs": len(rates)}
    print(f"{name:<44} {row['tok_s_per_request']:8.1f} tok/s (median of {len(rates)})", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale-dir", type=Path, default=Path("/tmp/tandem-scale"))
    ap.add_argument("--demo", action="store_true", help="the demo target instead of the scale track")
    ap.add_argument("--prompts", type=int, default=3, help="held-out prompts timed (default 3)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    texts = [json.loads(line)["prompt"] for line in (REPO / "demo" / "heldout_prompts.jsonl").read_text().splitlines()]
    rows = []
    torch.manual_seed(0)
    if args.demo:
        target_dir = REPO / "demo" / "target"
        model = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).cuda().eval()
        prompts = [AutoTokenizer.from_pretrained(target_dir).encode(t) for t in texts[: args.prompts]]
        rows.append(run("transformers generate, demo target (plain)", model, prompts, args.max_new_tokens))
        track = "demo track (bf16)"
    else:
        target_dir = args.scale_dir / "target"
        raw = json.loads((target_dir / "config.json").read_text())
        ours = random_llama_model(load_llama_config(target_dir), torch.bfloat16, "cuda",
                                  init=RandomInit.from_config_json(raw))
        hf_cfg = LlamaConfig(**{k: v for k, v in raw.items() if k != "tandem_random_init"})
        with torch.device("cuda"):
            model = LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
        missing, unexpected = model.load_state_dict(hf_weights_from(ours), strict=False)
        if unexpected or [m for m in missing if "rotary" not in m]:
            raise SystemExit(f"weights do not line up: missing {missing}, unexpected {unexpected}")
        del ours
        prompts = [AutoTokenizer.from_pretrained(target_dir).encode(t) for t in texts[: args.prompts]]
        rows.append(run("transformers generate (plain)", model, prompts, args.max_new_tokens))
        small = LlamaConfig(**{**hf_cfg.to_dict(), "num_hidden_layers": 1})
        with torch.device("cuda"):
            assistant = LlamaForCausalLM(small).to(torch.bfloat16).eval()
        assistant.model.embed_tokens.weight.data.copy_(model.model.embed_tokens.weight.data)
        assistant.lm_head.weight.data.copy_(model.lm_head.weight.data)
        rows.append(run("transformers generate, assisted (1-layer assistant)", model, prompts,
                        args.max_new_tokens, assistant_model=assistant))
        track = "scale track (8B-shaped random weights, bf16)"
    args.out.write_text(json.dumps({"track": track, "gpu": torch.cuda.get_device_name(),
                                    "max_new_tokens": args.max_new_tokens, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
