"""Training text for the draft: where prompts come from.

Accepted --data paths (any mix, read in sorted order):
  - a .jsonl file: one JSON object a line with a "text" field (other fields ignored);
  - any other file: read whole as one document of UTF-8 text;
  - a directory: every .py, .txt, .md and .jsonl file below it, as above.
Documents are tokenized with the target's tokenizer and joined into one
stream, each followed by the EOS token; prompts are windows of that stream.
The draft then trains on the *target's* continuations of those prompts
(EAGLE-3 learns the target's behaviour, not the corpus's).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

TEXT_SUFFIXES = (".py", ".txt", ".md", ".jsonl")


def _files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    if path.is_file():
        return [path]
    raise FileNotFoundError(f"--data {path}: no such file or directory")


def iter_documents(paths: list[Path]) -> Iterator[str]:
    for path in paths:
        for f in _files(Path(path)):
            if f.suffix == ".jsonl":
                with f.open(encoding="utf-8") as fh:
                    for n, line in enumerate(fh, 1):
                        if not line.strip():
                            continue
                        row = json.loads(line)
                        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                            raise ValueError(f"{f}:{n}: expected an object with a \"text\" string")
                        yield row["text"]
            else:
                text = f.read_text(encoding="utf-8", errors="replace")
                if text.strip():
                    yield text


def token_stream(paths: list[Path], tokenizer, eos_id: int | None) -> torch.Tensor:
    """All documents as one int64 stream, each followed by EOS (when the tokenizer has one)."""
    texts = list(iter_documents(paths))
    if not texts:
        raise ValueError(f"no text found in --data {', '.join(map(str, paths))}")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encoded = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        encoded = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    ids: list[int] = []
    for enc in encoded:
        ids.extend(enc)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_prompts(stream: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """count windows of `length` tokens at seeded random offsets: [count, length]."""
    if len(stream) < length + 1:
        raise ValueError(f"the data holds {len(stream)} tokens, fewer than one prompt of {length}")
    starts = torch.randint(0, len(stream) - length, (count,), generator=generator)
    return stream[starts[:, None] + torch.arange(length)[None]]
