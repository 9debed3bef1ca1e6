"""`tandem train-draft`: train an EAGLE-3 head for a Llama-family target.

    tandem train-draft --target DIR --data PATH [PATH ...] --out DIR [options]

Pipeline (each stage resumable; re-running skips what is done):
  1. data:   prompts from --data, continued by the target (greedy for
             --greedy-fraction of them, else sampled at --gen-temperature),
             saved in chunks under OUT/data/.
  2. vocab:  the --draft-vocab-size most frequent tokens of those sequences.
  3. train:  training-time test (--ttt-steps unrolled steps, weights
             --ttt-decay**k) against the target's distribution over the draft
             vocabulary; the target runs alongside to give features (inputs of
             its feature layers) and logits. Checkpoints in OUT/checkpoints/
             every --checkpoint-every steps; --resume continues from the latest.
  4. export: OUT/config.json and OUT/model.safetensors in SGLang's format,
             loadable by `tandem draft --model OUT --target-model DIR`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch

from draft_service.training import checkpoint
from draft_service.training.config import TrainConfig
from draft_service.training.data import sample_prompts, token_stream
from draft_service.training.export import export_draft
from draft_service.training.module import DraftShape, Eagle3TrainModel
from draft_service.training.target import TargetModel
from draft_service.training.ttt import acceptance_proxy, ttt_loss
from draft_service.training.vocab import coverage, draft_vocabulary

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _say(msg: str) -> None:
    print(f"[train-draft] {msg}", flush=True)


# --- stage 1: target-generated sequences ------------------------------------
def generate_sequences(cfg: TrainConfig, target: TargetModel, data: list[Path], tokenizer, out: Path) -> torch.Tensor:
    """[num_sequences, seq_len] token ids, from chunk files that are reused when their settings match."""
    from tqdm import tqdm

    data_dir = out / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    n_chunks = math.ceil(cfg.num_sequences / cfg.gen_batch_size)
    key = cfg.data_key()
    chunks: list[torch.Tensor | None] = []
    for i in range(n_chunks):
        path = data_dir / f"seqs_{i:05d}.pt"
        saved = torch.load(path) if path.exists() else None
        chunks.append(saved["tokens"] if saved is not None and saved["key"] == key else None)
    missing = [i for i, c in enumerate(chunks) if c is None]
    if missing:
        t0 = time.time()
        stream = token_stream(data, tokenizer, target.cfg.eos_token_ids[0] if target.cfg.eos_token_ids else None)
        _say(f"data: {len(stream):,} tokens of prompt text; generating {len(missing)} of {n_chunks} chunks "
             f"({cfg.prompt_len} prompt + {cfg.gen_len} generated tokens each)")
        for i in tqdm(missing, desc="generate", dynamic_ncols=True):
            n = min(cfg.gen_batch_size, cfg.num_sequences - i * cfg.gen_batch_size)
            cpu_gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + i)
            prompts = sample_prompts(stream, n, cfg.prompt_len, cpu_gen)
            greedy = torch.rand(n, generator=cpu_gen) < cfg.greedy_fraction
            temps = torch.where(greedy, 0.0, cfg.gen_temperature)
            dev_gen = torch.Generator(device=target.device).manual_seed(cfg.seed * 1_000_003 + i)
            with _autocast(target.device):
                seqs = target.generate(prompts.to(target.device), cfg.gen_len, temps, dev_gen).cpu()
            chunks[i] = seqs.to(torch.int32)
            torch.save({"key": key, "tokens": chunks[i], "greedy": greedy}, data_dir / f"seqs_{i:05d}.pt")
        _say(f"data: generated in {time.time() - t0:.1f} s")
    else:
        _say(f"data: reusing {n_chunks} chunks in {data_dir}")
    return torch.cat(chunks)


def _autocast(device: torch.device):
    # bfloat16 matmuls on a GPU; exact float32 on the CPU (tests compare against float32 references).
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


# --- stage 3: training ------------------------------------------------------
def batch_indices(step: int, n: int, batch_size: int, seed: int) -> torch.Tensor:
    """The sequences of a step: a fresh permutation every epoch, a function of (seed, step) only."""
    per_epoch = max(1, n // batch_size)
    epoch, i = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
    idx = order[i * batch_size:(i + 1) * batch_size]
    if len(idx) < batch_size:  # fewer sequences than a batch: repeat them
        idx = order.repeat(math.ceil(batch_size / n))[:batch_size]
    return idx


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    warmup = min(cfg.warmup, max(1, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    cos = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


@torch.no_grad()
def evaluate(model: Eagle3TrainModel, target: TargetModel, seqs: torch.Tensor, cfg: TrainConfig) -> dict:
    model.eval()
    acc = torch.zeros(cfg.ttt_steps, dtype=torch.float64)
    loss = torch.zeros(cfg.ttt_steps, dtype=torch.float64)
    rows = torch.zeros(cfg.ttt_steps, dtype=torch.float64)
    for chunk in seqs.split(cfg.batch_size):
        tokens = chunk.to(target.device).long()
        with _autocast(target.device):
            feats, logits = target.features_and_logits(tokens)
            r = ttt_loss(model, tokens, feats, logits, cfg.ttt_steps, cfg.ttt_decay)
        n = r.step_rows.double().cpu()
        acc += r.step_accuracy.double().cpu() * n
        loss += r.step_losses.double().cpu() * n
        rows += n
    model.train()
    rows = rows.clamp_min(1)
    acc, loss = (acc / rows).tolist(), (loss / rows).tolist()
    return {"acc": acc, "loss": loss, "tau_proxy": acceptance_proxy(acc)}


def build_model(cfg: TrainConfig, target: TargetModel, target_ids: torch.Tensor) -> Eagle3TrainModel:
    t = target.cfg
    heads = cfg.draft_heads or t.num_heads
    same_heads = heads == t.num_heads
    shape = DraftShape(
        hidden_size=t.hidden_size, num_heads=heads,
        num_kv_heads=cfg.draft_kv_heads or (t.num_kv_heads if same_heads else heads),
        head_dim=t.head_dim if same_heads else t.hidden_size // heads,
        intermediate_size=cfg.draft_intermediate_size or t.intermediate_size,
        draft_vocab_size=len(target_ids), target_vocab_size=t.vocab_size,
        num_feature_layers=len(target.feature_layers), rms_norm_eps=t.rms_norm_eps, max_position=t.max_position)
    torch.manual_seed(cfg.seed)
    model = Eagle3TrainModel(shape, target.embed_tokens.float(), target_ids)
    model.init_lm_head_from(target.lm_head)
    return model


def train(cfg: TrainConfig, target: TargetModel, model: Eagle3TrainModel, train_seqs: torch.Tensor,
          val_seqs: torch.Tensor, out: Path, resume: bool) -> tuple[bool, dict]:
    """Returns (finished, summary). finished is False when --stop-after cut the run short."""
    from tqdm import tqdm

    device = target.device
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, log, elapsed = 0, [], 0.0
    last = checkpoint.latest(out) if resume else None
    if resume and last is None:
        _say("--resume: no checkpoint yet; starting from step 0")
    if last is not None:
        state = checkpoint.load(last, device)
        if state["config"] != cfg.resume_key():
            diff = sorted(k for k in cfg.resume_key() if state["config"].get(k) != cfg.resume_key()[k])
            raise SystemExit(f"train-draft: {last} was made with different settings ({', '.join(diff)}); "
                             f"use another --out or the same settings")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, log, elapsed = state["step"], state["log"], state["elapsed"]
        _say(f"resumed from {last} at step {step}")
    if step >= cfg.steps:
        return True, {"steps": step, "log": log, "minutes": elapsed / 60}

    t0 = time.time() - elapsed
    max_s = cfg.max_minutes * 60 if cfg.max_minutes else None

    def progress() -> float:
        return max(step / cfg.steps, (time.time() - t0) / max_s if max_s else 0.0)

    def save_checkpoint() -> None:
        checkpoint.save(out, step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "log": log,
                                    "elapsed": time.time() - t0, "config": cfg.resume_key()})

    K = cfg.ttt_steps
    sums = torch.zeros(2 * K + 1, device=device)  # loss, acc[K], step loss[K] since the last log line
    since = 0
    bar = tqdm(total=cfg.steps, initial=step, desc="train-draft", dynamic_ncols=True, mininterval=1.0)
    bar.write(f"{'step':>7} {'loss':>7} {'acc@0':>6} {'acc@1':>6} {'acc@2':>6} {'acc@6':>6} {'tau~':>5} "
              f"{'lr':>8} {'min':>6}   (acc@k: top-1 agreement with the target at TTT step k)")
    model.train()
    stopped = False
    while progress() < 1.0:
        lr = lr_at(cfg, step, progress())
        for group in opt.param_groups:
            group["lr"] = lr
        tokens = train_seqs[batch_indices(step, len(train_seqs), cfg.batch_size, cfg.seed)].to(device).long()
        with _autocast(device):
            feats, logits = target.features_and_logits(tokens)
            r = ttt_loss(model, tokens, feats, logits, K, cfg.ttt_decay)
        opt.zero_grad(set_to_none=True)
        r.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        step += 1
        bar.update(1)
        sums += torch.cat([r.loss.detach()[None], r.step_accuracy, r.step_losses])
        since += 1
        finished = progress() >= 1.0
        if step % cfg.log_every == 0 or finished:
            m = (sums / since).tolist()
            acc = m[1:K + 1]
            row = {"step": step, "loss": m[0], "acc": acc, "step_loss": m[K + 1:], "lr": lr,
                   "minutes": (time.time() - t0) / 60}
            log.append(row)
            bar.set_postfix(loss=f"{m[0]:.3f}", acc0=f"{acc[0]:.2f}", accK=f"{acc[-1]:.2f}",
                            tau=f"{acceptance_proxy(acc):.2f}")
            sums.zero_()
            since = 0
        if step % cfg.eval_every == 0 or finished:
            ev = evaluate(model, target, val_seqs, cfg)
            log.append({"step": step, "val": ev})
            a = ev["acc"]
            last_train = next((x["loss"] for x in reversed(log) if "loss" in x), float("nan"))
            bar.write(f"{step:>7} {last_train:>7.3f} {a[0]:>6.3f} {a[min(1, K - 1)]:>6.3f} "
                      f"{a[min(2, K - 1)]:>6.3f} {a[min(6, K - 1)]:>6.3f} {ev['tau_proxy']:>5.2f} {lr:>8.2e} "
                      f"{(time.time() - t0) / 60:>6.2f}   (held-out sequences)")
        if step % cfg.checkpoint_every == 0 or finished:
            save_checkpoint()
        if cfg.stop_after is not None and step >= cfg.stop_after and not finished:
            save_checkpoint()
            stopped = True
            break
    bar.close()
    return not stopped, {"steps": step, "log": log, "minutes": (time.time() - t0) / 60}


def write_log_csv(log: list[dict], path: Path, K: int) -> None:
    head = ["step", "kind", "loss"] + [f"acc{k}" for k in range(K)] + ["tau_proxy", "lr", "minutes"]
    lines = [",".join(head)]
    for row in log:
        if "val" in row:
            v = row["val"]
            lines.append(",".join([str(row["step"]), "val", f"{sum(v['loss']) / K:.5f}",
                                   *(f"{a:.4f}" for a in v["acc"]), f"{v['tau_proxy']:.3f}", "", ""]))
        else:
            lines.append(",".join([str(row["step"]), "train", f"{row['loss']:.5f}",
                                   *(f"{a:.4f}" for a in row["acc"]), f"{acceptance_proxy(row['acc']):.3f}",
                                   f"{row['lr']:.3e}", f"{row['minutes']:.3f}"]))
    path.write_text("\n".join(lines) + "\n")


# --- command line -----------------------------------------------------------
def _parse(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    ap = argparse.ArgumentParser(prog="tandem train-draft", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="Hugging Face Llama-family target directory")
    ap.add_argument("--data", type=Path, nargs="+", required=True,
                    help=".jsonl files ({\"text\": ...} per line), text files, or directories of "
                         ".py/.txt/.md/.jsonl files")
    ap.add_argument("--out", type=Path, required=True, help="export here; work files in OUT/data, OUT/checkpoints")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--target-dtype", choices=list(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT/checkpoints")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        value = getattr(defaults, f.name)
        if f.name == "feature_layers":
            ap.add_argument(flag, help="comma-separated target layers whose INPUT residual stream is a feature "
                                       "(SGLang's convention; default: 2, L//2, L-3)")
        elif f.name == "export_dtype":
            ap.add_argument(flag, default=value, choices=list(DTYPES))
        else:
            kind = type(value) if value is not None else (float if f.name == "max_minutes" else int)
            ap.add_argument(flag, type=kind, default=value)
    args = ap.parse_args(argv)
    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    if values["feature_layers"] is not None:
        values["feature_layers"] = tuple(int(x) for x in values["feature_layers"].split(","))
    try:
        cfg = TrainConfig(**values)
    except ValueError as e:
        ap.error(str(e))
    return args, cfg


def run(args: argparse.Namespace, cfg: TrainConfig) -> int:
    from transformers import AutoTokenizer

    t_start = time.time()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    target_dtype = DTYPES[args.target_dtype] if args.target_dtype else (
        torch.bfloat16 if device.type == "cuda" else torch.float32)
    target = TargetModel(args.target, device, target_dtype, cfg.feature_layers)
    if cfg.seq_len > target.cfg.max_position:
        raise SystemExit(f"train-draft: --seq-len {cfg.seq_len} exceeds the target's "
                         f"max_position_embeddings ({target.cfg.max_position})")
    _say(f"target {args.target}: {target.cfg.num_layers} layers, hidden {target.cfg.hidden_size}, vocab "
         f"{target.cfg.vocab_size}; features = inputs of layers {list(target.feature_layers)}; device {device}")
    tokenizer = AutoTokenizer.from_pretrained(args.target)

    seqs = generate_sequences(cfg, target, args.data, tokenizer, out)
    n_val = max(1, int(len(seqs) * cfg.val_fraction)) if len(seqs) > 1 else 0
    train_seqs, val_seqs = seqs[:len(seqs) - n_val], seqs[len(seqs) - n_val:]
    if not n_val:
        val_seqs = train_seqs
    vocab_size = cfg.draft_vocab_size or min(32000, target.cfg.vocab_size)
    if vocab_size > target.cfg.vocab_size:
        raise SystemExit(f"train-draft: --draft-vocab-size {vocab_size} exceeds the target's vocabulary "
                         f"({target.cfg.vocab_size})")
    target_ids = draft_vocabulary(train_seqs, target.cfg.vocab_size, vocab_size)
    cover = coverage(seqs[:, cfg.prompt_len:], target_ids, target.cfg.vocab_size)
    _say(f"vocab: {vocab_size} of {target.cfg.vocab_size} target tokens cover {cover:.1%} of generated tokens; "
         f"{len(train_seqs)} training and {len(val_seqs)} held-out sequences")

    model = build_model(cfg, target, target_ids)
    n_params = sum(p.numel() for p in model.parameters())
    _say(f"draft: {n_params / 1e6:.2f}M trainable parameters, {asdict(model.shape)}")
    finished, summary = train(cfg, target, model, train_seqs, val_seqs, out, args.resume)
    write_log_csv(summary["log"], out / "train_log.csv", cfg.ttt_steps)
    if not finished:
        _say(f"stopped after step {summary['steps']} (--stop-after); --resume continues")
        return 0
    vals = [row["val"] for row in summary["log"] if "val" in row]
    extra = {"steps": summary["steps"], "train_minutes": round(summary["minutes"], 2),
             "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
             "draft_vocab_coverage": round(cover, 4), "sequences": len(seqs),
             "final_val": vals[-1] if vals else None, "config": {k: v for k, v in asdict(cfg).items()}}
    export_draft(model, target.cfg, target.feature_layers, out, DTYPES[cfg.export_dtype], extra)
    (out / "training_summary.json").write_text(json.dumps(extra, indent=2) + "\n")
    _say(f"exported {out}/config.json and model.safetensors; total {time.time() - t_start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args, cfg = _parse(list(sys.argv[1:] if argv is None else argv))
    return run(args, cfg)


if __name__ == "__main__":
    sys.exit(main())
