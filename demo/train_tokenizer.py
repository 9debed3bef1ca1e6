"""Train the demo's byte-level BPE tokenizer on the corpus's training files.

Byte-level so any text round-trips; a small vocabulary (4096) because the
embedding is a large share of a ~7M-parameter model. `<|endoftext|>` is both
the end-of-sequence token and the separator between documents. No chat
template: the gateway falls back to its plain template.

    python demo/train_tokenizer.py --corpus /tmp/corpus --out DIR [--vocab-size 4096]

Writes tokenizer.json and tokenizer_config.json so that
`transformers.AutoTokenizer.from_pretrained(DIR)` loads it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

EOS = "<|endoftext|>"
PAD = "<|pad|>"


def iter_texts(jsonl: Path) -> Iterator[str]:
    with jsonl.open() as f:
        for line in f:
            if line.strip():
                yield json.loads(line)["text"]


def train_tokenizer(texts: Iterator[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: code starts lines with keywords and indentation that
    # must survive a round trip exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save(tok, out: Path, model_max_length: int) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD, bos_token=None,
                                   unk_token=None, model_max_length=model_max_length,
                                   clean_up_tokenization_spaces=False)
    fast.save_pretrained(out)
    # transformers 5 records its new class name; the older alias loads in 4.x and 5.x alike.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True, help="directory written by demo/corpus.py")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--model-max-length", type=int, default=2048)
    ap.add_argument("--max-files", type=int, help="train on the first N files only (toy runs)")
    args = ap.parse_args(argv)
    if (args.out / "tokenizer.json").exists():
        print(f"tokenizer exists in {args.out}; skipping (delete it to retrain)")
        return 0
    t0 = time.time()
    texts = iter_texts(args.corpus / "train.jsonl")
    if args.max_files:
        texts = (t for i, t in zip(range(args.max_files), texts))
    tok = train_tokenizer(texts, args.vocab_size)
    args.out.mkdir(parents=True, exist_ok=True)
    save(tok, args.out, args.model_max_length)

    from transformers import AutoTokenizer

    check = AutoTokenizer.from_pretrained(args.out)
    sample = next(iter_texts(args.corpus / "heldout.jsonl"))[:2000]
    ids = check(sample)["input_ids"]
    assert check.decode(ids) == sample, "byte-level BPE must round-trip text exactly"
    print(f"vocab {len(check)} (eos {check.eos_token_id}); held-out sample: {len(sample)} chars -> "
          f"{len(ids)} tokens ({len(sample) / len(ids):.2f} chars/token); {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
