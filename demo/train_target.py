"""Train the demo target: a small Llama on the standard-library corpus.

    python demo/train_target.py --corpus /tmp/corpus --tokenizer DIR --out DIR [--device cuda]
    python demo/train_target.py ... --tiny          # a toy run on CPU: tests the code path

The corpus is small (about 3M tokens), so the run keeps the weights with the
best held-out loss, regularises with weight decay and residual dropout, and
stops at whichever comes first of --steps and --max-minutes (the learning-rate
schedule follows whichever is further along, so a time-capped run still
anneals). Progress: a tqdm bar, a loss table every --eval-every steps,
loss.csv and (with matplotlib) loss.png in --work. --resume continues from
the last checkpoint in --work.

The model is saved in bfloat16 (half the bytes; tandem and transformers cast
to the dtype they are asked for) with the tokenizer and a generation_config.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position: int = 2048
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"heads must divide hidden_size and kv heads must divide heads: {self}")


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 6000
    batch_size: int = 64
    seq_len: int = 512
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 200
    weight_decay: float = 0.1
    dropout: float = 0.1
    grad_clip: float = 1.0
    max_minutes: float | None = None
    eval_every: int = 250
    eval_windows: int = 128
    checkpoint_every: int = 1000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_windows", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if not 0 <= self.dropout < 1:
            raise ValueError("dropout must be in [0, 1)")


TINY_SHAPE = ModelShape(hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                        max_position=512)


def tokenize_corpus(jsonl: Path, tokenizer, cache: Path) -> torch.Tensor:
    """All documents as one stream of token ids, each document followed by EOS (cached)."""
    if cache.exists():
        return torch.load(cache)
    ids: list[int] = []
    with jsonl.open() as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    # The tokenizers backend directly: fast, and no warnings about documents
    # longer than the model's context (they are cut into windows later).
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(tokenizer.eos_token_id)
    stream = torch.tensor(ids, dtype=torch.int32)
    torch.save(stream, cache)
    return stream


def windows(stream: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    idx = starts[:, None] + torch.arange(length)[None]
    return stream[idx].long()


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each attention and MLP output before it joins the residual stream.

    Hooks, so the saved model is a plain LlamaForCausalLM (no dropout at eval).
    The corpus is small enough that an unregularised model overfits in minutes.
    """
    if p <= 0:
        return

    def drop(module, _inputs, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)


def lr_at(progress: float, s: TrainSettings, step: int) -> float:
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * cos)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, s: TrainSettings, device: torch.device, autocast) -> float:
    model.eval()
    n = min(s.eval_windows, max(1, (len(stream) - 1) // (s.seq_len + 1)))
    starts = torch.linspace(0, len(stream) - s.seq_len - 2, n).long()
    total = 0.0
    for chunk in starts.split(s.batch_size):
        x = windows(stream, chunk, s.seq_len + 1).to(device)
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        total += F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
    model.train()
    return total / (n * s.seq_len)


def save_plot(rows: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    ax.plot([r["step"] for r in rows], [r["heldout_loss"] for r in rows], label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def build_model(shape: ModelShape, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=shape.tie_embeddings,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02,
    )
    return LlamaForCausalLM(cfg)


def save_model(model, tokenizer, out: Path, meta: dict) -> None:
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    cfg_path = out / "tokenizer_config.json"  # see train_tokenizer.save: the alias loads everywhere
    tcfg = json.loads(cfg_path.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tcfg, indent=2) + "\n")
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     do_sample=False).save_pretrained(out)
    (out / "training.json").write_text(json.dumps(meta, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="directory written by demo/corpus.py")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="Hugging Face model directory to write")
    ap.add_argument("--work", type=Path, help="token caches, checkpoints, loss log (default: OUT.work)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="toy model and a few steps (CPU code-path check)")
    ap.add_argument("--resume", action="store_true")
    for f, v in asdict(TrainSettings()).items():
        ap.add_argument("--" + f.replace("_", "-"), type=type(v) if v is not None else float, default=None)
    args = ap.parse_args(argv)

    if (args.out / "model.safetensors").exists():
        print(f"target exists in {args.out}; skipping (delete it to retrain)")
        return 0
    base = TrainSettings(steps=40, batch_size=8, seq_len=64, warmup=5, eval_every=10, eval_windows=16,
                         checkpoint_every=20, lr=3e-3) if args.tiny else TrainSettings()
    s = TrainSettings(**{**asdict(base), **{k: v for k, v in vars(args).items()
                                            if k in asdict(base) and v is not None}})
    shape = TINY_SHAPE if args.tiny else ModelShape()
    work = args.work or args.out.with_name(args.out.name + ".work")
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    torch.manual_seed(s.seed)
    t_start = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    train = tokenize_corpus(args.corpus / "train.jsonl", tokenizer, work / "train_tokens.pt")
    heldout = tokenize_corpus(args.corpus / "heldout.jsonl", tokenizer, work / "heldout_tokens.pt")
    print(f"corpus: {len(train):,} training tokens, {len(heldout):,} held-out tokens "
          f"({time.time() - t_start:.1f} s)")

    model = build_model(shape, tokenizer).to(device)
    add_residual_dropout(model, s.dropout)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {asdict(shape)}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": s.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=s.lr, betas=(0.9, 0.95),
                            fused=device.type == "cuda")

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    step, rows, best, elapsed_before = 0, [], (float("inf"), None, 0), 0.0
    ckpt_path = work / "checkpoint.pt"
    if args.resume and ckpt_path.exists():
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step, rows, best, elapsed_before = ck["step"], ck["rows"], ck["best"], ck["elapsed"]
        torch.set_rng_state(ck["rng"])
        print(f"resumed at step {step}")
    gen = torch.Generator().manual_seed(s.seed + step)
    t0 = time.time() - elapsed_before
    max_s = s.max_minutes * 60 if s.max_minutes else None

    def progress() -> float:
        return max(step / s.steps, (time.time() - t0) / max_s if max_s else 0.0)

    bar = tqdm(total=s.steps, initial=step, desc="target", dynamic_ncols=True, mininterval=2.0)
    print(f"{'step':>6} {'tokens':>12} {'train':>8} {'held-out':>9} {'lr':>9} {'min':>6}")
    model.train()
    running = None
    while progress() < 1.0:
        lr = lr_at(progress(), s, step)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, len(train) - s.seq_len - 1, (s.batch_size,), generator=gen)
        x = windows(train, starts, s.seq_len + 1).to(device, non_blocking=True)
        with autocast():
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        if step % 10 == 0 or step == 1:  # .item() syncs the GPU; not every step
            running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
            bar.set_postfix(loss=f"{running:.3f}", lr=f"{lr:.1e}")
        done = progress() >= 1.0
        if step % s.eval_every == 0 or done:
            held = evaluate(model, heldout, s, device, autocast)
            rows.append({"step": step, "tokens": step * s.batch_size * s.seq_len, "train_loss": running,
                         "heldout_loss": held, "lr": lr, "minutes": (time.time() - t0) / 60})
            r = rows[-1]
            bar.write(f"{step:>6} {r['tokens']:>12,} {running:>8.3f} {held:>9.3f} {lr:>9.2e} {r['minutes']:>6.2f}")
            if held < best[0]:
                best = (held, {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}, step)
        if step % s.checkpoint_every == 0 and not done:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "rows": rows,
                        "best": best, "elapsed": time.time() - t0, "rng": torch.get_rng_state()}, ckpt_path)
    bar.close()
    train_minutes = (time.time() - t0) / 60

    with (work / "loss.csv").open("w") as f:
        f.write("step,tokens,train_loss,heldout_loss,lr,minutes\n")
        for r in rows:
            f.write(f"{r['step']},{r['tokens']},{r['train_loss']:.5f},{r['heldout_loss']:.5f},"
                    f"{r['lr']:.3e},{r['minutes']:.3f}\n")
    plotted = save_plot(rows, work / "loss.png")
    model.load_state_dict(best[1])
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {"parameters": n_params, "shape": asdict(shape), "settings": asdict(s), "steps_run": step,
            "best_step": best[2], "best_heldout_loss": best[0], "train_minutes": round(train_minutes, 2),
            "device": device_name, "torch": torch.__version__, "loss_curve": rows}
    save_model(model, tokenizer, args.out, meta)
    print(f"best held-out loss {best[0]:.3f} at step {best[2]} of {step}; trained {train_minutes:.1f} min on "
          f"{device_name}; saved {args.out} (loss.csv{', loss.png' if plotted else ''} in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
