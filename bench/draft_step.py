"""Cost of one draft call (catch-up of the last verify's tokens + tree growth) against batch and budget.

    python bench/draft_step.py                 # Llama-3.1-8B-shaped EAGLE-3 head, random weights, cuda bf16
    python bench/draft_step.py --tiny          # CPU smoke run of the same code
    python bench/draft_step.py --ab-fused 8    # without and with --fused-tree-levels, alternated in one process
    python bench/draft_step.py --phases        # also the mean ms a call spends in each of its parts

(with the package installed, `pip install -e .`, or PYTHONPATH set to the repo root).

Writes a random draft in SGLang's format (and a stand-in target directory holding
only config.json and embed_tokens) to a temporary folder, gives every request a
committed prefix, then times steady-state Draft calls: each ingests the tokens a
verify step committed (with features) and grows one tree per request. Figures
are from the "8B-shaped random weights" track (or "tiny random"). A benchmark,
not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from bench.call_clock import CallClock
from bench.served_pause import wait_as_served
from draft_service.device_tree import BatchTreeGrowth
from draft_service.engine import DraftEngine
from draft_service.model import Eagle3Draft
from draft_service.types import DraftBudget, DraftItem, IngestItem
from tandem.layers import DTYPES

SHAPES = {
    # Llama-3.1-8B target; the draft head as SpecForge trains it (32k draft vocabulary).
    "8b": dict(vocab=128256, hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, layers=32,
               draft_vocab=32000),
    # Llama-3.1-70B target and a head of its width (the TP=8 scale track).
    "70b": dict(vocab=128256, hidden=8192, heads=64, kv_heads=8, head_dim=128, inter=28672, layers=80,
                draft_vocab=32000),
    "tiny": dict(vocab=512, hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, layers=4, draft_vocab=128),
}


TRACKS = {"8b": "8B-shaped random weights", "tiny": "tiny random"}

# What --phases times, in the order a call runs them: the ingest checked and applied, the catch-up (on a GPU: packed
# and its graph launched; on a CPU: run), the growth's inputs staged and its graph launched, and the trees read back,
# which waits for the GPU. What a call spends outside them (its own checks, the block table, the trees' wrapping) is
# the call less their sum. On the H100 (seventieth session) a 5/4/8 call at batch 1 took 2.11 ms for 1.75 ms of device
# time, at batch 64 6.97 ms for 3.25: these say which host part of the call that is.
PHASES = ((DraftEngine, "_check_ingest"), (DraftEngine, "_apply"), (DraftEngine, "_catch_up"),
          (BatchTreeGrowth, "load"), (BatchTreeGrowth, "run"), (BatchTreeGrowth, "trees"), (DraftEngine, "draft"))


class RandomHead(NamedTuple):
    """A random draft head loaded for a benchmark, and where it runs."""

    model: Eagle3Draft
    device: str
    dtype: torch.dtype
    shape: str  # a key of SHAPES
    track: str  # how the figures name it


def add_head_arguments(ap: argparse.ArgumentParser) -> None:
    """--tiny, --device, --dtype: which random head a draft benchmark loads, and where (head_from_args)."""
    ap.add_argument("--tiny", action="store_true", help="tiny shapes on CPU")
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bfloat16 on cuda, else float32")


def head_device(args: argparse.Namespace) -> str:
    return args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")


def head_from_args(args: argparse.Namespace) -> RandomHead:
    """The random head add_head_arguments' flags ask for, written to a temporary folder and loaded."""
    device = head_device(args)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")]
    shape = "tiny" if args.tiny else "8b"
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, draft_dir = write_pair(Path(tmp), SHAPES[shape], dtype, device)
        model = Eagle3Draft(draft_dir, target_dir, dtype, device)
    return RandomHead(model, device, dtype, shape, TRACKS[shape])


def write_pair(root: Path, s: dict, dtype: torch.dtype, device: str) -> tuple[Path, Path]:
    target, draft = root / "target", root / "draft"
    target.mkdir()
    (target / "config.json").write_text(json.dumps(dict(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
        num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"], max_position_embeddings=8192, rms_norm_eps=1e-5)))
    embed = (torch.randn(s["vocab"], s["hidden"], device=device) * 0.02).to(dtype).cpu()
    save_file({"model.embed_tokens.weight": embed}, str(target / "model.safetensors"))
    write_draft(draft, s, dtype, device)
    return target, draft


def write_draft(draft: Path, s: dict, dtype: torch.dtype, device: str, seed: int = 0,
                lm_head_std: float = 0.02) -> Path:
    """A random EAGLE-3 head of shape `s` in SGLang's format (the target's files are not read here).
    A large lm_head_std makes it confident (top-1 log-prob near 0), so its trees grow deep
    along one path, as a well-trained head's do."""
    draft.mkdir(parents=True)
    H, D = s["hidden"], s["head_dim"]
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) * 0.02).to(dtype).cpu()

    hot = torch.randperm(s["vocab"], generator=torch.Generator().manual_seed(seed))[:s["draft_vocab"]].sort().values
    t2d = torch.zeros(s["vocab"], dtype=torch.bool)
    t2d[hot] = True
    p = "midlayer."
    save_file({
        "fc.weight": rnd(H, 3 * H), p + "input_layernorm.weight": torch.ones(H, dtype=dtype),
        p + "hidden_norm.weight": torch.ones(H, dtype=dtype),
        p + "post_attention_layernorm.weight": torch.ones(H, dtype=dtype), "norm.weight": torch.ones(H, dtype=dtype),
        p + "self_attn.q_proj.weight": rnd(s["heads"] * D, 2 * H),
        p + "self_attn.k_proj.weight": rnd(s["kv_heads"] * D, 2 * H),
        p + "self_attn.v_proj.weight": rnd(s["kv_heads"] * D, 2 * H),
        p + "self_attn.o_proj.weight": rnd(H, s["heads"] * D),
        p + "mlp.gate_proj.weight": rnd(s["inter"], H), p + "mlp.up_proj.weight": rnd(s["inter"], H),
        p + "mlp.down_proj.weight": rnd(H, s["inter"]),
        "lm_head.weight": rnd(s["draft_vocab"], H) * (lm_head_std / 0.02),
        "d2t": hot - torch.arange(s["draft_vocab"]), "t2d": t2d,
    }, str(draft / "model.safetensors"))
    (draft / "config.json").write_text(json.dumps(dict(
        architectures=["LlamaForCausalLMEagle3"], hidden_size=H, intermediate_size=s["inter"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=D, num_hidden_layers=1,
        vocab_size=s["vocab"], draft_vocab_size=s["draft_vocab"], max_position_embeddings=8192,
        rms_norm_eps=1e-5)))
    return draft


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def spread_depths(budget: DraftBudget, batch: int) -> list[DraftBudget]:
    """One budget a request, the depths cycling from the budget's down to 1 (request i: steps - i % steps), as
    the gateway shortens the trees of requests whose acceptance is poor."""
    return [DraftBudget(budget.steps - i % budget.steps, budget.topk, budget.num_draft_tokens) for i in range(batch)]


def time_calls(engine: DraftEngine, batch: int, prefix: int, budget: DraftBudget, accepted: int, iters: int,
               device: str, grow_only: bool = False, around: contextlib.AbstractContextManager | None = None,
               mixed_depths: bool = False, pause_s: float = 0.0) -> float:
    """Median seconds of a Draft call that first ingests `accepted` + 1 committed tokens per request
    (grow_only: ingests nothing, so the call is the tree growth alone). `around` is entered for the
    timed calls only (after the requests' prefixes were ingested): a profiler. mixed_depths: the
    requests' depths spread (spread_depths). pause_s: each call after that long a wait (served_pause)."""
    width, vocab = engine.model.cfg.feature_width, engine.model.cfg.target_vocab_size
    ids = [f"b{batch}-{i}" for i in range(batch)]
    budgets = spread_depths(budget, batch) if mixed_depths else [budget] * batch
    engine.ingest([IngestItem(r, 0, tuple(torch.randint(0, vocab, (prefix + 1,)).tolist()),
                              torch.randn(prefix, width, dtype=engine.model.dtype)) for r in ids], catch_up=True)
    times = []
    with around or contextlib.nullcontext():
        _calls(engine, ids, budgets, accepted, iters + 2, vocab, width, device, grow_only, times, pause_s)
    engine.release(ids)
    return statistics.median(times[2:])


def _calls(engine: DraftEngine, ids: list[str], budgets: list[DraftBudget], accepted: int, n: int, vocab: int,
           width: int, device: str, grow_only: bool, times: list[float], pause_s: float = 0.0) -> None:
    for _ in range(n):
        ingest = []
        for r in ids if not grow_only else ():
            start = len(engine.requests[r].tokens) - 1
            # Features as the service gets them: host tensors in the model's dtype (bf16 from the target).
            ingest.append(IngestItem(r, start, tuple(engine.requests[r].tokens[start:]) +
                                     tuple(torch.randint(0, vocab, (accepted + 1,)).tolist()),
                                     torch.randn(accepted + 1, width, dtype=engine.model.dtype)))
        wait_as_served(pause_s, device)
        sync(device)
        t0 = time.perf_counter()
        engine.draft([DraftItem(r, budget) for r, budget in zip(ids, budgets)], ingest)
        sync(device)
        times.append(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_head_arguments(ap)
    ap.add_argument("--batches", default="1,8,32,64", help="requests per call (default 1,8,32,64)")
    ap.add_argument("--budgets", default="1,1,2;3,1,4;5,4,8;6,8,32",
                    help="steps,topk,num_draft_tokens; separated (default 1,1,2;3,1,4;5,4,8;6,8,32)")
    ap.add_argument("--prefix", type=int, default=1024, help="committed tokens per request (default 1024)")
    ap.add_argument("--accepted", type=int, default=2, help="tokens accepted per verify step (default 2)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--grow-only", action="store_true", help="calls that ingest nothing: the tree growth alone")
    ap.add_argument("--mixed-depths", action="store_true",
                    help="the requests of a call at spread depths (request i: the budget's steps - i %% steps), as "
                         "the gateway shortens the trees of requests whose acceptance is poor")
    ap.add_argument("--fused-tree-levels", action=argparse.BooleanOptionalAction, default=True,
                    help="each growth level's bookkeeping in one Triton launch, as `tandem draft` does by default "
                         "(--no-fused-tree-levels: the torch ops)")
    ap.add_argument("--ab-fused", type=int, default=0, metavar="N",
                    help="time each shape without and with --fused-tree-levels, two engines on one model in one "
                         "process, alternated N times (--iters calls each time): between processes the same "
                         "setting's median moved by 10-20%% on the H200, as much as the effect")
    ap.add_argument("--pause-ms", default="0", metavar="MS,...",
                    help="wait this long before each timed call, the host asleep and the GPU busy, as a served "
                         "call comes after the target's verify (bench/served_pause.py); several (0,5,0,5): each "
                         "shape timed after each, in turn (default 0: back to back)")
    ap.add_argument("--out", type=Path, help="also write JSON")
    ap.add_argument("--phases", action="store_true",
                    help="also time each (batch, budget) again with the call's parts clocked: the mean ms a call "
                         "spends validating and applying its ingest, catching up, staging and launching the growth, "
                         "and reading the trees (which waits for the GPU)")
    ap.add_argument("--profile", type=Path, metavar="FILE",
                    help="also profile a few calls of the first batch and budget (torch.profiler) and write the "
                         "ops by device time and by host time to FILE")
    args = ap.parse_args(argv)
    prefix = min(args.prefix, 128) if args.tiny else args.prefix
    batches = [int(b) for b in args.batches.split(",")]
    budgets = [DraftBudget(*map(int, b.split(","))) for b in args.budgets.split(";")]
    model, device, dtype, shape, track = head_from_args(args)
    blocks = max(batches) * (prefix + 64 * (args.iters + 2) * (args.accepted + 1)) // 16 + 64
    if args.ab_fused:
        return ab_fused(model, blocks, batches, budgets, prefix, args, device, dtype, shape)
    if args.fused_tree_levels:
        warm_up_fused_levels(model, budgets)
    engine = DraftEngine(model, num_blocks=blocks, block_size=16, fused_levels=args.fused_tree_levels)
    fused = "; growth levels fused" if engine.fused_levels else ""
    mixed = "; depths spread (request i: steps - i % steps)" if args.mixed_depths else ""
    pauses = [float(p) for p in args.pause_ms.split(",")]
    waits = pauses != [0.0]  # a column of its own only where asked for
    mixed += "; the pause column: each call after that wait (ms)" if waits else ""
    print(f"track: {track}; {device} {str(dtype).removeprefix('torch.')}; prefix {prefix}; "
          f"{args.accepted + 1} tokens ingested per request per call{fused}{mixed}; median ms per Draft call")
    print(f"{'batch':>6} " + (f"{'pause':>6} " if waits else "")
          + " ".join(f"{f'{b.steps}/{b.topk}/{b.num_draft_tokens}':>10}" for b in budgets))
    rows = []
    for batch in batches:
        for pause in pauses:
            ms = [1000 * time_calls(engine, batch, prefix, b, args.accepted, args.iters, device, args.grow_only,
                                    mixed_depths=args.mixed_depths, pause_s=pause / 1e3) for b in budgets]
            rows.append({"batch": batch, "pause_ms": pause,
                         "ms": dict(zip([f"{b.steps}/{b.topk}/{b.num_draft_tokens}" for b in budgets], ms))})
            print(f"{batch:>6} " + (f"{pause:>6g} " if waits else "") + " ".join(f"{m:>10.2f}" for m in ms))
    if args.phases:
        phase_rows = print_phases(engine, batches, budgets, prefix, args, device)
        for row in rows:
            row["phases_ms"] = phase_rows.get(row["batch"], {})
    if args.out:
        args.out.write_text(json.dumps({"track": track, "device": device, "dtype": str(dtype), "prefix": prefix,
                                        "fused_levels": engine.fused_levels,
                                        "mixed_depths": args.mixed_depths, "rows": rows}, indent=2))
    if args.profile:
        profile_calls(engine, batches[0], prefix, budgets[0], args.accepted, device, args.grow_only, args.profile)
    return 0


@contextlib.contextmanager
def clocked(clock: CallClock):
    """PHASES timed by `clock` while inside."""
    for owner, name in PHASES:
        clock.wrap(owner, name)
    try:
        yield clock
    finally:
        clock.restore()


def phase_ms(engine: DraftEngine, batch: int, prefix: int, budget: DraftBudget, args: argparse.Namespace,
             device: str) -> dict[str, float]:
    """Mean ms a call spends in each of PHASES over the calls of one time_calls, and "rest": the call outside the
    other phases. main's table has already timed this shape, so its graphs are captured and every call is warm."""
    clock = CallClock()
    time_calls(engine, batch, prefix, budget, args.accepted, args.iters, device, args.grow_only,
               around=clocked(clock), mixed_depths=args.mixed_depths)
    calls = args.iters + 2  # time_calls' two warm-up calls are inside `around` too
    out = {name: 1000 * clock.seconds.get(name, 0.0) / calls for _, name in PHASES}
    out["rest"] = out["draft"] - sum(ms for name, ms in out.items() if name != "draft")
    return out


def print_phases(engine: DraftEngine, batches: list[int], budgets: list[DraftBudget], prefix: int,
                 args: argparse.Namespace, device: str) -> dict[int, dict[str, dict[str, float]]]:
    """The --phases table: per batch and budget, the mean ms of each part of a call (with the clocks' own cost in
    it, a few microseconds a part). Returns {batch: {budget: {phase: ms}}} for the JSON."""
    names = [name for _, name in PHASES if name != "draft"] + ["rest", "draft"]
    print("mean ms a call spends in each part (draft: the whole call; trees: waits for the GPU)")
    print(f"{'batch':>6} {'budget':>8} " + " ".join(f"{name:>13}" for name in names))
    out: dict[int, dict[str, dict[str, float]]] = {}
    for batch in batches:
        for budget in budgets:
            label = f"{budget.steps}/{budget.topk}/{budget.num_draft_tokens}"
            ms = phase_ms(engine, batch, prefix, budget, args, device)
            out.setdefault(batch, {})[label] = ms
            print(f"{batch:>6} {label:>8} " + " ".join(f"{ms[name]:>13.3f}" for name in names))
    return out


def warm_up_fused_levels(model: Eagle3Draft, budgets: list[DraftBudget]) -> None:
    """Compile the fused levels' kernels for these budgets before any call is timed (Triton attention only)."""
    if model.attention.name != "triton":
        return
    from draft_service.device_tree import GrowthShape
    from kernels.tree_level import warm_up
    warm_up(model.device, max(b.topk for b in budgets), max(GrowthShape(1, b).candidates for b in budgets))


def ab_fused(model: Eagle3Draft, blocks: int, batches: list[int], budgets: list[DraftBudget], prefix: int,
             args: argparse.Namespace, device: str, dtype: torch.dtype, shape: str) -> int:
    """Each (batch, budget) timed on an engine without fused levels and one with them, in turn, args.ab_fused
    times: what separates the two is the setting, not the process. Prints the median of each side's
    per-turn medians and their ratio."""
    if model.attention.name != "triton":
        print(f"--ab-fused: the fused levels need Triton attention; this model runs {model.attention.name}: "
              f"both sides would be the same code", file=sys.stderr)
    warm_up_fused_levels(model, budgets)
    engines = {fused: DraftEngine(model, num_blocks=blocks, block_size=16, fused_levels=fused)
               for fused in (False, True)}
    print(f"track: {TRACKS[shape]}; {device} "
          f"{str(dtype).removeprefix('torch.')}; prefix {prefix}; {args.accepted + 1} tokens ingested per request "
          f"per call; ms per Draft call, median of {args.ab_fused} turns (each the median of {args.iters} calls)")
    print(f"{'batch':>6} {'budget':>8} {'off':>8} {'on':>8} {'on/off':>7}  turns off / on")
    rows = []
    for batch in batches:
        for budget in budgets:
            turns: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.ab_fused):
                for fused, engine in engines.items():
                    turns[fused].append(1000 * time_calls(engine, batch, prefix, budget, args.accepted, args.iters,
                                                          device, args.grow_only))
            off, on = statistics.median(turns[False]), statistics.median(turns[True])
            name = f"{budget.steps}/{budget.topk}/{budget.num_draft_tokens}"
            rows.append({"batch": batch, "budget": name, "off_ms": off, "on_ms": on,
                         "off_turns": turns[False], "on_turns": turns[True]})
            spread = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(turns[False], turns[True]))
            print(f"{batch:>6} {name:>8} {off:>8.2f} {on:>8.2f} {on / off:>7.3f}  {spread}")
    if args.out:
        args.out.write_text(json.dumps({"track": shape, "device": device, "dtype": str(dtype), "prefix": prefix,
                                        "ab": "fused_levels", "rows": rows}, indent=2))
    return 0


def profile_calls(engine: DraftEngine, batch: int, prefix: int, budget: DraftBudget, accepted: int, device: str,
                  grow_only: bool, path: Path) -> None:
    """Where a Draft call's time goes, by op: device time (what the GPU ran) and host time (what
    launched it), over 5 calls after warm-up."""
    time_calls(engine, batch, prefix, budget, accepted, 2, device, grow_only)  # warm: graphs captured
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=activities)
    time_calls(engine, batch, prefix, budget, accepted, 3, device, grow_only, around=prof)
    ops = prof.key_averages()
    device_key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    # Kernels (and in-graph copies) are the rows with device time and no host time of their own.
    kernels = sum(e.count for e in ops if e.self_cpu_time_total == 0 and e.self_device_time_total > 0)
    device_ms = sum(e.self_device_time_total for e in ops) / 1000 / 5
    path.write_text(f"batch {batch}, budget {budget.steps}/{budget.topk}/{budget.num_draft_tokens}, 5 calls\n"
                    f"device kernels per call: {kernels / 5:.0f}; device time per call: {device_ms:.3f} ms\n\n"
                    f"by device time:\n{ops.table(sort_by=device_key, row_limit=60)}\n\n"
                    f"by host time:\n{ops.table(sort_by='self_cpu_time_total', row_limit=40)}\n")
    print(f"profile: {path}")


if __name__ == "__main__":
    raise SystemExit(main())
