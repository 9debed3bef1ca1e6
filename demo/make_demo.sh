#!/usr/bin/env bash
# Build the bundled demo pair end to end: corpus -> tokenizer -> target -> draft data -> draft -> export.
#
#   demo/make_demo.sh                 # on a GPU host (about 9 minutes on one H200); writes demo/target, demo/draft
#   demo/make_demo.sh --tiny          # toy sizes on CPU into a temp dir: checks every code path in ~2 minutes
#   options: --work DIR (intermediate files, default demo/.work or /tmp/tandem-demo-tiny)
#            --dest DIR (where target/ and draft/ go, default demo/ or WORK/pair)
#            --device cuda|cpu (default: cuda when torch sees one)
#            --no-eval (skip the closing acceptance measurement)
#
# Every step is idempotent: it is skipped when its output exists, and the two
# training steps resume from their checkpoints, so re-running after an
# interruption continues. Logs: WORK/logs/*.log. Timings are printed per step.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python3}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true

TINY=0 WORK="" DEST="" DEVICE="" EVAL=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --work) WORK="$2"; shift ;;
    --dest) DEST="$2"; shift ;;
    --device) DEVICE="$2"; shift ;;
    --no-eval) EVAL=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "make_demo.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
if [[ $TINY == 1 ]]; then
  WORK="${WORK:-/tmp/tandem-demo-tiny}"; DEST="${DEST:-$WORK/pair}"; DEVICE="${DEVICE:-cpu}"
else
  WORK="${WORK:-$ROOT/demo/.work}"; DEST="${DEST:-$ROOT/demo}"
fi
DEVICE="${DEVICE:-$($PY -c 'import torch; print("cuda" if torch.cuda.is_available() else "cpu")')}"
mkdir -p "$WORK/logs" "$DEST"
T_ALL=$SECONDS

step() {  # step NAME COMMAND...: run with a log and a timing line
  local name="$1"; shift
  local t0=$SECONDS log="$WORK/logs/$name.log"
  echo "=== $name: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  echo "=== $name: done in $((SECONDS - t0)) s (total $((SECONDS - T_ALL)) s)" | tee -a "$log"
}

if [[ $TINY == 1 ]]; then
  TOK_ARGS=(--vocab-size 512 --max-files 60)
  TARGET_ARGS=(--tiny)
  DRAFT_ARGS=(--num-sequences 32 --gen-batch-size 16 --seq-len 48 --prompt-len 16 --steps 20 --batch-size 8
              --draft-vocab-size 256 --eval-every 10 --checkpoint-every 10 --lr 3e-3 --warmup 2)
  EVAL_ARGS=(--limit 4 --max-new-tokens 16 --trees 5/4/8)
else
  TOK_ARGS=(--vocab-size 4096)
  # Sized so the whole script fits one 10-minute command on an H200.
  # Target: ~7.3M parameters (hidden 256, 8 layers, 4 heads / 2 KV heads, tied embeddings);
  # 2000 steps of 64 x 512 tokens (~25 passes over the ~2.6M-token corpus), capped at 3.5 minutes.
  TARGET_ARGS=(--steps 2000 --batch-size 64 --seq-len 512 --lr 2e-3 --max-minutes 3.5)
  # Draft: 6144 continuations (64-token corpus prompt + 256 target tokens, half greedy);
  # 3000 TTT steps of 64 sequences, capped at 2.5 minutes.
  DRAFT_ARGS=(--num-sequences 6144 --gen-batch-size 512 --seq-len 320 --prompt-len 64 --steps 3000
              --batch-size 64 --lr 2e-3 --draft-vocab-size 3072 --eval-every 250 --checkpoint-every 500
              --max-minutes 2.5)
  EVAL_ARGS=(--max-new-tokens 96 --trees 5/4/8,3/1/4)
fi

[[ -f "$WORK/corpus/stats.json" ]] || step 1_corpus "$PY" "$ROOT/demo/corpus.py" --out "$WORK/corpus"
step 2_tokenizer "$PY" "$ROOT/demo/train_tokenizer.py" --corpus "$WORK/corpus" --out "$WORK/tokenizer" "${TOK_ARGS[@]}"
step 3_target "$PY" "$ROOT/demo/train_target.py" --corpus "$WORK/corpus" --tokenizer "$WORK/tokenizer" \
  --out "$WORK/target" --work "$WORK/target.work" --device "$DEVICE" --resume "${TARGET_ARGS[@]}"
if [[ ! -f "$WORK/draft/model.safetensors" ]]; then
  step 4_draft "$PY" -m draft_service.training.main --target "$WORK/target" --data "$WORK/corpus/train.jsonl" \
    --out "$WORK/draft" --device "$DEVICE" --resume "${DRAFT_ARGS[@]}"
fi

# The bundle: only what serving needs (training.json records how the target was made).
mkdir -p "$DEST/target" "$DEST/draft"
for f in config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json training.json; do
  cp "$WORK/target/$f" "$DEST/target/$f"
done
for f in config.json model.safetensors; do cp "$WORK/draft/$f" "$DEST/draft/$f"; done
cp "$WORK/target.work/loss.csv" "$WORK/draft/train_log.csv" "$WORK/logs/" 2>/dev/null || true
[[ -f "$WORK/target.work/loss.png" ]] && cp "$WORK/target.work/loss.png" "$WORK/logs/target_loss.png"
du -ab "$DEST/target" "$DEST/draft" | sort -k2
echo "demo pair: $(du -cb "$DEST"/target/* "$DEST"/draft/* | tail -1 | cut -f1) bytes in $DEST/{target,draft}"

# Acceptance on the held-out prompts (a report; the pair is complete without it).
if [[ $EVAL == 1 ]]; then
  step 5_eval "$PY" "$ROOT/demo/eval_acceptance.py" --target "$DEST/target" --draft "$DEST/draft" \
    --device "$DEVICE" --json "$WORK/logs/acceptance.json" "${EVAL_ARGS[@]}" \
    || echo "=== 5_eval failed (the pair is built; run demo/eval_acceptance.py by hand)"
fi

# A summary without progress bars (the logs hold everything).
echo "=== summary"
for f in "$WORK"/logs/[0-9]_*.log; do grep -h "done in" "$f" | tail -1; done
clean() { tr '\r' '\n' < "$1" | grep -v -E "it/s|s/it|^ *$"; }  # progress bars redraw with \r
[[ -f "$WORK/logs/3_target.log" ]] && clean "$WORK/logs/3_target.log" | grep -E "^ *(step|[0-9]+) |best held-out|^model:|^corpus:" | tail -16
[[ -f "$WORK/logs/4_draft.log" ]] && clean "$WORK/logs/4_draft.log" | grep -E "held-out sequences|^ *step |\[train-draft\] (vocab|draft|data: gen|exported)" | tail -16
[[ -f "$WORK/logs/5_eval.log" ]] && clean "$WORK/logs/5_eval.log" | grep -E "held-out prompts|accept len|^ +[0-9]+/[0-9]+/[0-9]+ " | tail -4
echo "=== all done in $((SECONDS - T_ALL)) s; logs in $WORK/logs"
