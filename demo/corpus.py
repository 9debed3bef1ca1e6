"""Build the demo corpus: the Python standard library's own source, tests excluded.

Every machine with Python has this corpus, so the demo pair can be rebuilt
anywhere. Files are split into train and held-out by a hash of their path
relative to the stdlib root (not by content or order), so the split is the
same on Python 3.11 and 3.12 even though their files differ.

Outputs, in --out:
  train.jsonl, heldout.jsonl   one {"path", "text"} per file
  stats.json                   file and character counts, Python version

The held-out *prompts* (function signatures and docstrings from held-out
files) are materialised once with --write-prompts into the committed
demo/heldout_prompts.jsonl, so evaluation does not depend on the machine's
Python. When building the training set, any file containing one of those
prompts verbatim is dropped too (a held-out file moved to another path in a
newer Python would otherwise leak into training).

    python demo/corpus.py --out /tmp/corpus [--prompts demo/heldout_prompts.jsonl]
    python demo/corpus.py --out /tmp/corpus --write-prompts demo/heldout_prompts.jsonl
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

# Path components that mark tests, third-party code, build data or generated tables.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
                           "lib-dynload", "pydoc_data", "ensurepip"})
MAX_FILE_CHARS = 300_000  # a few generated modules are huge tables of data, not code
HELDOUT_BUCKETS = 16  # 1 in 16 files is held out


@dataclass(frozen=True)
class SourceFile:
    path: str  # relative to the stdlib root, with forward slashes
    text: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """The split rule: a fixed hash of the relative path, stable across Python versions."""
    return hashlib.sha256(rel_path.encode()).digest()[0] % HELDOUT_BUCKETS == 0


def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIRS or p.startswith("config-") for p in parts[:-1]):
        return True
    name = parts[-1]
    return (name.startswith("test_") or name.endswith("_test.py") or name == "conftest.py"
            or name.startswith("_sysconfigdata"))


def _generated(text: str) -> bool:
    # Character-mapping codecs (encodings/cp1252.py ...) are tables written by gencodec.py.
    return "gencodec.py" in text[:2000]


def stdlib_files(root: Path | None = None) -> list[SourceFile]:
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if _excluded(rel):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are deliberately not UTF-8 (tokenizer test data)
        if not text.strip() or len(text) > MAX_FILE_CHARS or _generated(text):
            continue
        files.append(SourceFile(rel.as_posix(), text))
    return files


def split(files: list[SourceFile], heldout_prompts: list[str] = ()) -> tuple[list[SourceFile], list[SourceFile]]:
    train, heldout = [], []
    for f in files:
        if is_heldout(f.path):
            heldout.append(f)
        elif not any(p in f.text for p in heldout_prompts):
            train.append(f)
    return train, heldout


def function_prompts(f: SourceFile, min_chars: int = 120, max_chars: int = 700, per_file: int = 6) -> list[str]:
    """Prompts a code model should continue: a function's signature and docstring,
    or, for a function without one, its signature and first statement.

    The prompt ends at a line end inside the function, so the model's job is to
    write (the rest of) the body. Methods are dedented to start at column 0.
    """
    try:
        tree = ast.parse(f.text)
    except SyntaxError:
        return []
    lines = f.text.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or len(node.body) < 2:
            continue
        first = node.body[0]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        prompt = textwrap.dedent("".join(lines[start:first.end_lineno]))
        if min_chars <= len(prompt) <= max_chars:
            out.append(prompt)
    # Deterministic, spread over the file: sort by a hash of the text, keep a few.
    out.sort(key=lambda p: hashlib.sha256(p.encode()).hexdigest())
    return out[:per_file]


def heldout_prompts(heldout: list[SourceFile], limit: int = 128) -> list[dict]:
    rows = []
    for f in heldout:
        for p in function_prompts(f):
            rows.append({"path": f.path, "prompt": p})
    rows.sort(key=lambda r: hashlib.sha256((r["path"] + r["prompt"]).encode()).hexdigest())
    rows = sorted(rows[:limit], key=lambda r: (r["path"], r["prompt"]))
    return [{"id": i, **r} for i, r in enumerate(rows)]


def read_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="directory for train.jsonl, heldout.jsonl, stats.json")
    ap.add_argument("--prompts", type=Path, default=Path(__file__).with_name("heldout_prompts.jsonl"),
                    help="committed held-out prompts; training files containing one are dropped")
    ap.add_argument("--write-prompts", type=Path, help="(re)materialise the held-out prompts into this file")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--root", type=Path, help="stdlib root (default: this interpreter's)")
    args = ap.parse_args(argv)

    t0 = time.time()
    files = stdlib_files(args.root)
    _, heldout = split(files)
    if args.write_prompts:
        rows = heldout_prompts(heldout, args.num_prompts)
        _write_jsonl(args.write_prompts, rows)
        print(f"wrote {len(rows)} held-out prompts from {len({r['path'] for r in rows})} files "
              f"to {args.write_prompts}")
    prompts = read_prompts(args.prompts) if args.prompts.exists() else []
    train, heldout = split(files, prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(args.out / "train.jsonl", [{"path": f.path, "text": f.text} for f in train])
    _write_jsonl(args.out / "heldout.jsonl", [{"path": f.path, "text": f.text} for f in heldout])
    stats = {
        "python": sys.version.split()[0],
        "stdlib": str(args.root or stdlib_root()),
        "train_files": len(train), "train_chars": sum(len(f.text) for f in train),
        "heldout_files": len(heldout), "heldout_chars": sum(len(f.text) for f in heldout),
        "dropped_for_prompt_overlap": len(files) - len(train) - len(heldout),
    }
    (args.out / "stats.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats), f"({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
