"""Issues 11-14's GPU goals read off a device call's results: each goal, its figure, met or not.

    python3 bench/goals.py DIR [DIR ...]

Looks under each DIR (recursively, with every archive in it unpacked where it lies, in a copy: a call's all.tgz and
each stage's results.tgz) for what the stages of bench/h200_hot_path.sh write: forward_after.json (stage `forward`),
engine_after.json (`engine`), stack_after/ (`stack`), draft_after*.json (`draft`), spec_scale*/ and spec_demo*/
(`spec`), auto_scale_*/ and auto_demo*/ (`auto`, `autodemo`), tpengine_tp1.json and tpengine_tp2.json (`tpengine`),
tp_stack_1/ and tp_stack_2/ (`tp`). Every figure names the card it ran on (the nearest gpu.txt above it, else the
JSON's device): the goals are an H200's, and an H100's figure settles none of them. Where a mode ran in several
rounds, the figures are the medians of its rounds, as the BENCHMARKS.md sections read them.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.auto_report import load_rows  # noqa: E402
from tandem.bench import LevelResult  # noqa: E402

# Issue 11, must-show 3
ENGINE_OVER_FORWARD = {1: 1.10, 64: 1.15}
ITL_OVER_FORWARD = 1.15
FORWARD_OVER_FLOOR = 1.25
# Issue 12, must-shows 2-4
DRAFT_MS = {(1, "5/4/8"): 1.5, (1, "3/1/4"): 1.0, (64, "5/4/8"): 6.0}
SCALE_SPEEDUP = 2.5
ROUND_OVER_PLAIN = 1.35
DEMO_SPEEDUP = 1.5
# Issue 13, must-show 3: TP=2 over TP=1 at batch 1 (at most), and at 64 (under: faster)
TP2_AT_ONE = 0.65
# Issue 14, must-show 1
AUTO_FLOOR = 0.97
AUTO_AT_CROSSING = 1.05


class Goal(NamedTuple):
    """One goal as measured: what it asks, the figure, whether it is met (None: only reported), the card."""

    issue: int
    what: str
    figure: str
    met: bool | None
    card: str

    def line(self) -> str:
        verdict = "reported" if self.met is None else "met" if self.met else "NOT met"
        return f"issue {self.issue}: {self.what}: {self.figure} [{verdict}; {self.card}]"


def card_of(start: Path, root: Path, fallback: str = "card unknown") -> str:
    """The GPU a result ran on: the first line of the nearest gpu.txt from the folder `start` up to the root."""
    for folder in [start, *start.parents]:
        gpu = folder / "gpu.txt"
        # `nvidia-smi -L` ("GPU 0: NVIDIA H200 (UUID: ...)") or the stages' CSV query ("NVIDIA H200, 1980 MHz, ...")
        names = [line for line in gpu.read_text().splitlines() if "NVIDIA" in line] if gpu.exists() else []
        if names:
            return names[0].split("(UUID")[0].split(",")[0].split(": ", 1)[-1].strip()
        if folder == root:
            break
    return fallback


def read_json(path: Path) -> dict | None:
    """A stage's JSON, or None (said on stderr) where it is cut short or not what the stage writes: a call that ran
    out of time leaves such files, and the other goals are still worth reading."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"skipped {path}: {exc}", file=sys.stderr)
        return None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        print(f"skipped {path}: no rows", file=sys.stderr)
        return None
    return data


def bench_rows(folder: Path) -> list[LevelResult]:
    """A serve's `tandem bench` levels (bench/auto_report.py's reading), or none (said on stderr) where a bench.json
    is cut short or from another bench."""
    try:
        return load_rows(folder)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"skipped {folder}: {exc}", file=sys.stderr)
        return []


def medians(rows: list[LevelResult]) -> dict[tuple[str, int], LevelResult]:
    """Per (mode, concurrency), the round with the median total tok/s (the lower middle of an even count)."""
    by_level: dict[tuple[str, int], list[LevelResult]] = {}
    for row in rows:
        by_level.setdefault((row.mode, row.concurrency), []).append(row)
    return {key: sorted(runs, key=lambda row: row.total_tok_s)[(len(runs) - 1) // 2] for key, runs in by_level.items()}


def median_rate(rows: list[LevelResult], mode: str, concurrency: int) -> float | None:
    rates = [row.total_tok_s for row in rows if row.mode == mode and row.concurrency == concurrency]
    return statistics.median(rates) if rates else None


def forward_goals(root: Path) -> Iterator[Goal]:
    """Issue 11: the forward against its floor, the engine step against the forward, `never`'s inter-token p50
    against the forward."""
    for path in sorted(root.rglob("forward_after.json")):
        if (data := read_json(path)) is None:
            continue
        card = card_of(path.parent, root, str(data.get("device", "card unknown")))
        decode = {row["batch"]: row for row in data["rows"] if row.get("step") == "decode"}
        if 1 in decode:
            row = decode[1]
            ratio = row["graph_ms"] / row["mem_floor_ms"]
            yield Goal(11, f"the forward at batch 1 within {FORWARD_OVER_FLOOR}x of the HBM floor",
                       f"{row['graph_ms']:.2f} / {row['mem_floor_ms']:.2f} ms = {ratio:.2f}x",
                       ratio <= FORWARD_OVER_FLOOR, card)
        folder = path.parent
        engine = folder / "engine_after.json"
        if engine.exists() and (engine_data := read_json(engine)) is not None:
            plain = [row for row in engine_data["rows"]
                     if row.get("mode") == "graphs" and row.get("nodes") == 1 and "ms" in row]
            steps = {row["batch"]: row["ms"] for row in plain if "grant" not in row}  # a whole standalone step
            granted = {row["batch"]: row["ms"] for row in plain if "grant" in row}  # a step within a grant
            for batch, most in ENGINE_OVER_FORWARD.items():
                if batch in steps and batch in decode:
                    forward = decode[batch]["graph_ms"]
                    ratio = steps[batch] / forward
                    within = f"; within a grant {granted[batch] / forward:.2f}x" if batch in granted else ""
                    yield Goal(11, f"the engine step within {most}x of the forward at batch {batch}",
                               f"{steps[batch]:.2f} / {forward:.2f} ms = {ratio:.2f}x{within}",
                               ratio <= most, card)
        stack = folder / "stack_after"
        rows = bench_rows(stack) if stack.is_dir() else []
        for concurrency in (1, 64):
            itl = [row.itl_p50_s for row in rows if row.mode == "never" and row.concurrency == concurrency]
            if itl and concurrency in decode:
                ms = 1e3 * statistics.median(itl)
                ratio = ms / decode[concurrency]["graph_ms"]
                requests = f"{concurrency} request{'s' if concurrency != 1 else ''}"
                yield Goal(11, f"full-stack `never` inter-token p50 within {ITL_OVER_FORWARD}x of the forward at "
                           f"{requests}", f"{ms:.2f} / {decode[concurrency]['graph_ms']:.2f} ms = {ratio:.2f}x",
                           ratio <= ITL_OVER_FORWARD, card)
        if (rate := median_rate(rows, "never", 64)) is not None:
            yield Goal(11, "`never` throughput at 64 requests", f"{rate:,.1f} tok/s", None, card)


def draft_goals(root: Path) -> Iterator[Goal]:
    """Issue 12, must-show 2: one Draft call's median ms per batch and budget (bench/draft_step.py)."""
    for path in sorted(root.rglob("draft_after*.json")):
        if (data := read_json(path)) is None:
            continue
        card = card_of(path.parent, root, str(data.get("device", "card unknown")))
        by_batch = {row["batch"]: row["ms"] for row in data["rows"]}
        for (batch, budget), most in DRAFT_MS.items():
            ms = by_batch.get(batch, {}).get(budget)
            if ms is not None:
                where = path.relative_to(root)
                yield Goal(12, f"a {budget} Draft call at batch {batch} in at most {most} ms ({where})",
                           f"{ms:.2f} ms", ms <= most, card)


def spec_goals(root: Path) -> Iterator[Goal]:
    """Issue 12, must-shows 3 and 4: `always` over `never` at one request, a round over a plain step, and where
    `always` falls below `never`."""
    for folder in sorted(p for p in root.rglob("spec_*") if p.is_dir()):
        rows = bench_rows(folder)
        never, always = median_rate(rows, "never", 1), median_rate(rows, "always", 1)
        if never is None or always is None:
            continue
        card, name = card_of(folder, root), folder.relative_to(root)
        demo = folder.name.startswith("spec_demo")
        least = DEMO_SPEEDUP if demo else SCALE_SPEEDUP
        track = "demo track" if demo else "scale track"
        yield Goal(12, f"`always` / `never` at one request, {track} ({name}), at least {least}x",
                   f"{always:,.1f} / {never:,.1f} tok/s = {always / never:.2f}x", always / never >= least, card)
        if demo:
            continue
        levels = medians(rows)
        plain, trees = levels.get(("never", 1)), levels.get(("always", 1))
        if plain and trees and plain.decode_step_ms and trees.decode_step_ms:
            ratio = trees.decode_step_ms / plain.decode_step_ms
            yield Goal(12, f"a round at one request at most {ROUND_OVER_PLAIN}x a plain step ({name})",
                       f"{trees.decode_step_ms:.2f} / {plain.decode_step_ms:.2f} ms = {ratio:.2f}x",
                       ratio <= ROUND_OVER_PLAIN, card)
        concurrencies = sorted({row.concurrency for row in rows})
        below = [c for c in concurrencies
                 if (median_rate(rows, "always", c) or 0.0) < (median_rate(rows, "never", c) or 0.0)]
        yield Goal(12, f"where `always` falls below `never` ({name})",
                   f"from {below[0]} requests" if below else f"not up to {concurrencies[-1]} requests", None, card)


def auto_goals(root: Path) -> Iterator[Goal]:
    """Issue 14, must-show 1: auto / max(never, always) at every level, where the two modes cross, and auto
    against `never` at the highest level."""
    for folder in sorted(p for p in root.rglob("auto_*") if p.is_dir()):
        rows = bench_rows(folder)
        levels = sorted({row.concurrency for row in rows if row.mode == "auto"})
        if not levels:
            continue
        card, name = card_of(folder, root), folder.relative_to(root)
        shares, lead = {}, {}
        for c in levels:
            never, always, auto = (median_rate(rows, mode, c) for mode in ("never", "always", "auto"))
            if never is None or always is None or auto is None:
                continue
            shares[c] = auto / max(never, always)
            lead[c] = always > never
        if not shares:
            continue
        figures = ", ".join(f"{c}: {share:.2f}" for c, share in shares.items())
        yield Goal(14, f"auto / max(never, always) at least {AUTO_FLOOR} at every level ({name})", figures,
                   min(shares.values()) >= AUTO_FLOOR, card)
        done = list(shares)
        crossing = sorted({c for a, b in zip(done, done[1:], strict=False) if lead[a] != lead[b] for c in (a, b)})
        if crossing:
            yield Goal(14, f"at least {AUTO_AT_CROSSING} where `never` and `always` cross ({name})",
                       ", ".join(f"{c}: {shares[c]:.2f}" for c in crossing),
                       min(shares[c] for c in crossing) >= AUTO_AT_CROSSING, card)
        top = done[-1]
        never, auto = median_rate(rows, "never", top), median_rate(rows, "auto", top)
        yield Goal(14, f"auto at least {AUTO_FLOOR}x `never` at the highest level, {top} ({name})",
                   f"{auto:,.1f} / {never:,.1f} tok/s = {auto / never:.2f}x", auto / never >= AUTO_FLOOR, card)


def tp_goals(root: Path) -> Iterator[Goal]:
    """Issue 13, must-show 3: the engine step (bench/engine_step.py --tp) and the full stack's `never` inter-token
    p50 at TP=2 over TP=1, at batch 1 and at 64."""
    for one in sorted(root.rglob("tpengine_tp1.json")):
        two = one.with_name("tpengine_tp2.json")
        if not two.exists():
            continue
        card = card_of(two.parent, root)
        if (first := read_json(one)) is None or (second := read_json(two)) is None:
            continue
        steps = [{(row["batch"], "grant" in row): row["ms"] for row in data["rows"]
                  if row.get("mode") == "graphs" and row.get("nodes") == 1 and "ms" in row} for data in (first, second)]
        for (batch, granted), ms in sorted(steps[1].items()):
            base = steps[0].get((batch, granted))
            if batch not in (1, 64) or base is None:
                continue
            ratio, kind = ms / base, "a step within a grant" if granted else "a standalone step"
            most = TP2_AT_ONE if batch == 1 else 1.0
            yield Goal(13, f"TP=2 over TP=1, {kind} at batch {batch}, {'at most' if batch == 1 else 'under'} {most}",
                       f"{ms:.2f} / {base:.2f} ms = {ratio:.2f}x", ratio <= most if batch == 1 else ratio < most, card)
    for one in sorted(p for p in root.rglob("tp_stack_1") if p.is_dir()):
        two = one.with_name("tp_stack_2")
        rows = [bench_rows(folder) for folder in (one, two)] if two.is_dir() else []
        card = card_of(two, root)
        for concurrency in (1, 64) if rows else ():
            itl = [[row.itl_p50_s for row in runs if row.mode == "never" and row.concurrency == concurrency]
                   for runs in rows]
            if all(itl):
                base, ms = (1e3 * statistics.median(values) for values in itl)
                most = TP2_AT_ONE if concurrency == 1 else 1.0
                yield Goal(13, f"TP=2 over TP=1, `never` inter-token p50 at {concurrency} "
                           f"request{'s' if concurrency != 1 else ''}, {'at most' if concurrency == 1 else 'under'} "
                           f"{most}", f"{ms:.2f} / {base:.2f} ms = {ms / base:.2f}x",
                           ms / base <= most if concurrency == 1 else ms / base < most, card)
        if rows and all((median_rate(runs, "never", 64) is not None) for runs in rows):
            base, rate = (median_rate(runs, "never", 64) for runs in rows)
            yield Goal(13, "TP=2 over TP=1, `never` throughput at 64 requests", f"{rate:,.1f} / {base:,.1f} tok/s = "
                       f"{rate / base:.2f}x", None, card)


def goals(root: Path) -> list[Goal]:
    """Every goal found under `root`. A family whose files hold rows of another shape (another bench's, or an
    older one's) stops at that file, said on stderr; the others are still read."""
    found: list[Goal] = []
    for family in (forward_goals, draft_goals, spec_goals, tp_goals, auto_goals):
        try:
            for goal in family(root):
                found.append(goal)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            print(f"skipped the rest of {family.__name__} under {root}: {exc!r}", file=sys.stderr)
    return found


def unpacked_copy(root: Path, scratch: Path) -> Path:
    """`root` copied into `scratch` with every archive in it unpacked where it lies, then the archives those held,
    and so on: a device call's files (all.tgz, a results.tgz per stage) as the stages left them. The copy keeps the
    results folder as it is; an archive that cannot be read is skipped with a line on stderr."""
    copy = scratch / (root.resolve().name or "root")
    shutil.copytree(root, copy, symlinks=True)
    done: set[Path] = set()
    while todo := [path for path in sorted(copy.rglob("*")) if path.name.endswith((".tgz", ".tar.gz"))
                   and path.is_file() and path not in done]:
        for archive in todo:
            done.add(archive)
            try:
                with tarfile.open(archive) as tar:
                    tar.extractall(archive.parent, filter="data")  # no member outside the folder, no links out
            except (OSError, tarfile.TarError) as exc:
                print(f"skipped {archive.relative_to(copy)}: {exc}", file=sys.stderr)
    return copy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="device calls' result folders (their archives are read too)")
    args = ap.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing:
        ap.error(f"not a folder: {', '.join(missing)}")
    found = 0
    with tempfile.TemporaryDirectory(prefix="tandem-goals-") as scratch:
        for index, root in enumerate(args.dirs):
            print(f"== {root}")
            for goal in goals(unpacked_copy(root, Path(scratch) / str(index))):
                print(goal.line())
                found += 1
    if not found:
        print("no results of the forward, engine, stack, draft, spec, tpengine, tp, auto or autodemo stages found",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
