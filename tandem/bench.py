"""`tandem bench`: throughput against concurrency for the speculation modes.

Starts `tandem serve` (or uses a running gateway given by --url), sends the
held-out demo prompts as streaming greedy completions at each concurrency, for
each mode, and reports per mode and concurrency: total output tok/s, tok/s per
request, time to first token p50, inter-chunk latency p50/p99 and acceptance
length (tokens committed per verify step, bonus included). Writes a JSON file
and a PNG plot of the curves. Before the first level each mode runs every
concurrency once, short and not counted (--warmup): a server's first requests at
a concurrency pay one-time costs that would otherwise land in whichever mode
meets that concurrency first. With --rounds N each concurrency runs its modes N
times, interleaved (never, always, auto, never, ...), so that a server that
drifts during the sweep weighs on every mode alike; the tables then report each
round and the medians, and auto / max(never, always) per round and on the medians.
--length-spread draws each request's output length around --max-tokens (the same
lengths for every mode), so that a level's requests do not end in step, and
--steady also reports each level's tok/s over the span in which every client was
busy, which leaves out a level's ragged end (request_lengths, run_level).

Each level also reports the rate at which its requests decode (concurrency x a
request's tokens after the first over its time after the first token: what a
step's goodput compares with, prefill left out), the rate of its decode steps
alone as the gateway timed them at the level's batch bucket (steps that carry a
joining request's prompt chunk left out too), and, for `auto`, the policy's
audit over the level at that bucket: what its cost model predicted for trees
and for plain decoding, the same as delivered (with what the load gate charges
each arm for joining prompts at that load), and what the load gate measured
each arm's steps deliver, read from the gateway's /metrics before and after the
level.

The streams are read by tandem.sse_client, a connection per request, so that
the client is not what limits a level (see there: httpx's streaming took 2.5-3
times its CPU a chunk, and at 64 streams held the level to 62-63% of the
chunks the server would stream).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tandem.sse_client import post_events

REPO = Path(__file__).resolve().parent.parent
HELDOUT = REPO / "demo" / "heldout_prompts.jsonl"
MODES = ("never", "always", "auto")
AUDIT_TOLERANCE = 0.15  # issue 14's must-show 2: each arm's prediction within 15% of what its mode delivered


@dataclass
class RequestResult:
    seconds: float
    ttft: float
    gaps: list[float]  # between streamed chunks after the first
    tokens: int
    accepted: int
    verify_steps: int


@dataclass
class LevelResult:
    mode: str
    concurrency: int
    requests: int
    total_tok_s: float
    tok_s_per_request: float
    ttft_p50_s: float
    itl_p50_s: float
    itl_p99_s: float
    acceptance_length: float | None
    decode_tok_s: float = 0.0  # concurrency x mean of (tokens - 1) / (seconds - ttft): prefill left out
    # auto's audit over the level (read_level_sums): per arm ("trees", "plain", "configured_tree"), the mean
    # predicted, the measured and the predicted-as-delivered goodput in tok/s (level_audit; None where there were
    # none); None when /metrics was unread.
    audit: dict[str, dict[str, float | None]] | None = None
    # The level's decode steps alone, as the gateway timed them at the level's batch bucket (tokens they
    # committed over their seconds, any arm): the rate the audit's predictions are for, with the prompt
    # chunks of joining requests left out (decode_tok_s waits on them). None when /metrics was unread.
    decode_steps_tok_s: float | None = None
    # The same decode steps' mean: milliseconds and committed tokens a step (level_decode_step_shape), to set
    # beside the step the audit's predictions priced. None when /metrics was unread or older gateways' runs.
    decode_step_ms: float | None = None
    decode_step_tokens: float | None = None
    round: int = 1  # which of --rounds this level was, from 1
    # Wall-clock (UNIX) seconds when the level's first request went out and its last reply ended: the
    # window of the gateway's step log that is this level's (bench/step_log.py --levels).
    started_at: float | None = None
    ended_at: float | None = None
    # --steady: tokens a second over the level's first span, while every client still had a request in flight (from
    # the level's start to the first client that found no request left to send); None without --steady.
    steady_tok_s: float | None = None


def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def one_request(url: str, prompt: str, mode: str, max_tokens: int,
                      progress: list[tuple[float, int]] | None = None) -> RequestResult:
    """One streamed completion. progress: where given, the server is asked for its usage on every chunk and each
    chunk's (perf_counter time, completion tokens so far) is appended to it as it arrives."""
    options = {"include_usage": True, "continuous_usage_stats": progress is not None}
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "speculation": mode, "stream_options": options}
    t0 = time.perf_counter()
    first, last, gaps, usage, spec = None, None, [], {}, {}

    def on_data(data: bytes) -> None:
        nonlocal first, last, usage, spec
        if data == b"[DONE]":
            return
        chunk = json.loads(data)
        now = time.perf_counter()
        if chunk.get("choices"):
            if first is None:
                first = now
            elif last is not None:
                gaps.append(now - last)
            last = now
        if chunk.get("usage"):
            usage, spec = chunk["usage"], chunk.get("spec_stats") or {}
            if progress is not None:
                progress.append((now, usage.get("completion_tokens", 0)))

    await post_events(url, "/v1/completions", body, on_data)  # a status other than 200: HTTPStatusError
    end = time.perf_counter()
    return RequestResult(end - t0, (first or end) - t0, gaps, usage.get("completion_tokens", 0),
                         spec.get("accepted_tokens", 0), spec.get("verify_steps", 0))


# Tokens per warm-up request: enough steps to meet a concurrency's batch shapes (on the H200's demo
# track `never`, run first, read 2,172-3,917 tok/s at 16-32 requests where `auto`, run last on the same
# server, read 6,969-8,242; the cause is not known, and a warm-up of single requests would not meet
# the shapes of 16 at once).
WARMUP_TOKENS = 16


def warmup_levels(modes: list[str], levels: list[int], per_slot: int,
                  max_tokens: int) -> list[tuple[str, int, int, int]]:
    """(mode, concurrency, requests, max_tokens) of the uncounted runs before the first level."""
    if per_slot < 1:
        return []
    return [(mode, conc, per_slot * conc, min(max_tokens, WARMUP_TOKENS)) for mode in modes for conc in levels]


def level_requests(concurrency: int, per_slot: int, per_level: int = 0, minimum: int = 4) -> int:
    """Requests in one level: `per_level` where given, else `per_slot` per client and at least `minimum`."""
    return per_level or max(minimum, per_slot * concurrency)


def request_lengths(requests: int, max_tokens: int, spread: float, seed: int) -> list[int]:
    """Each request's output tokens in a level: `max_tokens` for all where `spread` is 0, else drawn uniformly from
    (1 - spread) to (1 + spread) times `max_tokens` (at least 1), from `seed`: the same lengths for every mode and
    round of a level, so that the modes still do the same work.

    Why a spread: with every request the same length, a level's requests under `never` start and end together
    and the next ones' prompts go in a few steps of many prompts, while trees advance each request by what it
    accepts, so their requests end apart and the prompts join one or two a step beside trees. On an H100 (scale
    track, acceptance 0.8, 32 requests, 2026-12-06) prompt steps took 8% of `never`'s step time and 39% of
    `always`'s; in a probe of trees `auto`'s requests fell out of step too, and its plain steps then took the
    prompts one at a time (14.8% of its step time). Served traffic is not in step: a spread measures the modes
    the way they would meet it."""
    if spread <= 0:
        return [max_tokens] * requests
    draw = random.Random(seed)
    return [max(1, round(max_tokens * (1 + spread * (2 * draw.random() - 1)))) for _ in range(requests)]


def level_seed(concurrency: int, requests: int) -> int:
    """The seed of a level's lengths (request_lengths): its concurrency and size, the same in every round."""
    return concurrency * 100_003 + requests


def level_schedule(levels: list[int], modes: list[str], rounds: int) -> list[tuple[int, int, str]]:
    """(concurrency, round, mode) of the counted levels, in the order they run: at each concurrency the
    modes take turns, round after round, so that drift in the server lands on every mode alike."""
    return [(conc, round_number, mode) for conc in levels for round_number in range(1, rounds + 1)
            for mode in modes]


def _rounds_tok_s(rows: list[LevelResult], field: str = "total_tok_s") -> dict[tuple[str, int], list[float]]:
    """(mode, concurrency) -> the tok/s (`field`: total_tok_s or steady_tok_s) of each of its rounds that has it."""
    runs: dict[tuple[str, int], list[float]] = {}
    for row in rows:
        if (value := getattr(row, field)) is not None:
            runs.setdefault((row.mode, row.concurrency), []).append(value)
    return runs


def medians(rows: list[LevelResult], field: str = "total_tok_s") -> dict[tuple[str, int], float]:
    """(mode, concurrency) -> the median tok/s (`field`, as for _rounds_tok_s) over its rounds."""
    return {key: statistics.median(values) for key, values in _rounds_tok_s(rows, field).items()}


def steady_tokens(progress: list[list[tuple[float, int]]], until: float) -> int:
    """The completion tokens streamed up to `until` (perf_counter seconds), over every request's progress."""
    return sum(max((tokens for at, tokens in chunks if at <= until), default=0) for chunks in progress)


def round_spread(rows: list[LevelResult]) -> dict[tuple[str, int], float]:
    """(mode, concurrency) -> its slowest round's total tok/s over its fastest's (levels run in more
    than one round): how far one mode moves between rounds with nothing changed, the resolution that
    auto / max(never, always) is read at."""
    return {key: min(values) / max(values) for key, values in _rounds_tok_s(rows).items()
            if len(values) > 1 and max(values) > 0}


def round_over_best(rows: list[LevelResult], round_number: int, concurrencies: list[int],
                    field: str = "total_tok_s") -> str | None:
    """auto_over_best for one round's levels, on `field` (total_tok_s or steady_tok_s; levels without it left out)."""
    return auto_over_best({(r.mode, r.concurrency): value for r in rows
                           if r.round == round_number and (value := getattr(r, field)) is not None}, concurrencies)


def auto_over_best(tok_s: dict[tuple[str, int], float], concurrencies: list[int]) -> str | None:
    """"c=C: R, ..." with R = auto / max(never, always) from (mode, concurrency) -> tok/s; None where a
    mode is missing."""
    if not all((mode, conc) in tok_s for mode in MODES for conc in concurrencies):
        return None
    return ", ".join(f"c={conc}: {tok_s[('auto', conc)] / max(tok_s[('never', conc)], tok_s[('always', conc)]):.2f}"
                     for conc in concurrencies)


async def run_level(url: str, prompts: list[str], mode: str, concurrency: int, requests: int,
                    max_tokens: int, spread: float = 0.0, steady: bool = False) -> LevelResult:
    """One level: `requests` streams, `concurrency` at a time; spread: see request_lengths (seeded by the level's
    concurrency and size). steady: also measure the tok/s while every client is busy (LevelResult.steady_tok_s),
    from the usage the server reports on every chunk."""
    lengths = request_lengths(requests, max_tokens, spread, seed=level_seed(concurrency, requests))
    queue = list(range(requests))
    results: list[RequestResult] = []
    progress: list[list[tuple[float, int]]] = []
    drained_at: float | None = None  # when a client first found no request left: the busy span's end

    async def worker() -> None:
        nonlocal drained_at
        while queue:
            i = queue.pop()
            chunks: list[tuple[float, int]] | None = [] if steady else None
            if chunks is not None:
                progress.append(chunks)
            results.append(await one_request(url, prompts[i % len(prompts)], mode, lengths[i], chunks))
        if drained_at is None:
            drained_at = time.perf_counter()

    started_at, t0 = time.time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall, ended_at = time.perf_counter() - t0, time.time()
    steady_tok_s = None
    if steady and requests >= concurrency and drained_at is not None and drained_at > t0:
        steady_tok_s = steady_tokens(progress, drained_at) / (drained_at - t0)
    tokens = sum(r.tokens for r in results)
    verify = sum(r.verify_steps for r in results)
    decoding = [(r.tokens - 1) / (r.seconds - r.ttft) for r in results if r.tokens > 1 and r.seconds > r.ttft]
    return LevelResult(
        mode, concurrency, len(results), tokens / wall,
        statistics.mean(r.tokens / r.seconds for r in results),
        percentile([r.ttft for r in results], 0.5),
        percentile([g for r in results for g in r.gaps], 0.5),
        percentile([g for r in results for g in r.gaps], 0.99),
        (sum(r.accepted for r in results) + verify) / verify if verify else None,
        concurrency * statistics.mean(decoding) if decoding else 0.0, started_at=started_at, ended_at=ended_at,
        steady_tok_s=steady_tok_s)


# The gateway's running sums of auto's audit (gateway/metrics.py, _PolicyAudit), and of every mode's
# decode steps (GatewayMetrics.record_decode_step), each by arm and batch bucket.
PREDICTIONS = "tandem_policy_predictions_total"
PREDICTED = "tandem_policy_predicted_goodput_total"
COMMITTED = "tandem_policy_arm_committed_tokens_total"
SECONDS = "tandem_policy_arm_step_seconds_total"
PREDICTED_STEP_SECONDS = "tandem_policy_predicted_step_seconds_total"
PREDICTED_STEP_TOKENS = "tandem_policy_predicted_step_tokens_total"
DECODE_COMMITTED = "tandem_decode_step_committed_tokens_total"
DECODE_SECONDS = "tandem_decode_step_seconds_total"
DECODE_STEPS = "tandem_decode_steps_total"
# Not a sum: what the load gate charges each arm's committed tokens for joining prompts at this load, read
# as the level ends (PromptCharges.seconds_per_token).
PROMPT_CHARGE = "tandem_policy_load_prompt_seconds_per_token"
LEVEL_SUMS = (PREDICTIONS, PREDICTED, COMMITTED, SECONDS, PREDICTED_STEP_SECONDS, PREDICTED_STEP_TOKENS,
              DECODE_COMMITTED, DECODE_SECONDS, DECODE_STEPS, PROMPT_CHARGE)


def level_bucket(concurrency: int) -> str:
    """The gateway's batch bucket (its `sequences` label, gateway.cost_model.bucket_range) that a level of
    this concurrency decodes in: 1, 2-3, 4-7, ... (Not imported from there: gateway.cost_model loads torch,
    4 s before `tandem bench` could say anything.)"""
    low = 1 << (max(concurrency, 1).bit_length() - 1)
    return f"{low}-{2 * low - 1}"


def read_level_sums(url: str, sequences: str) -> dict[tuple[str, str], float] | None:
    """The audit's and the decode steps' sums from the gateway's /metrics, per (sample name, arm), in one
    batch bucket; None where /metrics cannot be read (a gateway that guards it with its API key, say)."""
    try:
        response = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return level_sums(response.text, sequences)


def level_sums(exposition: str, sequences: str) -> dict[tuple[str, str], float]:
    """The audit's and the decode steps' sums in a Prometheus text exposition, per (sample name, arm), in
    the batch bucket `sequences` ("64-127"). A level's other buckets are its ramp-up and drain: summed with its own
    (2026-12-03, H200, 64 requests), they made the mean prediction a mix of a few plans at 64 requests
    (the gate had chosen plain decoding: one dormant plan in 16 predicts, and a grant is one plan) and
    every plan of the last few requests, and plain decoding read 0.33x `never`, where the 64-127 bucket
    alone read 1.08x what the gate measured over the whole serve."""
    sums: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name in LEVEL_SUMS and sample.labels.get("sequences") == sequences:
                key = (sample.name, sample.labels["arm"])
                sums[key] = sums.get(key, 0.0) + sample.value
    return sums


def level_audit(before: dict[tuple[str, str], float] | None, after: dict[tuple[str, str], float] | None
                ) -> dict[str, dict[str, float | None]] | None:
    """Per arm, the mean prediction over the level's steps, the goodput its measured steps delivered, and the
    prediction as delivered: with what the load gate charges that arm's tokens for joining prompts at this load
    as the level ends (the configured tree is charged as trees). The predictions are for decode steps, while
    `always` and `never` also wait on the prompt chunks of joining requests; the gate judges its arms with
    these charges, so the delivered figure is the one it acted on. 'step_ms' and 'step_tokens': the mean step
    the predictions priced, its milliseconds and the tokens it commits (None where there were no predictions, or
    the gateway predates them)."""
    if before is None or after is None:
        return None
    out = {}
    for arm in ("trees", "plain", "configured_tree"):  # the last: predicted only (what `always` would do)
        predictions, seconds = _grown(before, after, PREDICTIONS, arm), _grown(before, after, SECONDS, arm)
        predicted = _grown(before, after, PREDICTED, arm) / predictions if predictions > 0 else None
        step_seconds = _grown(before, after, PREDICTED_STEP_SECONDS, arm)
        priced = predictions > 0 and step_seconds > 0
        charge = after.get((PROMPT_CHARGE, "trees" if arm == "configured_tree" else arm))
        out[arm] = {"predicted": predicted,
                    "measured": _grown(before, after, COMMITTED, arm) / seconds if seconds > 0 else None,
                    "delivered": 1.0 / (1.0 / predicted + charge) if predicted and charge is not None else None,
                    "step_ms": 1e3 * step_seconds / predictions if priced else None,
                    "step_tokens": _grown(before, after, PREDICTED_STEP_TOKENS, arm) / predictions if priced else None}
    return out


def level_decode_steps(before: dict[tuple[str, str], float] | None, after: dict[tuple[str, str], float] | None
                       ) -> float | None:
    """The tok/s of the level's decode steps, both arms together (None: /metrics unread, or no such step)."""
    if before is None or after is None:
        return None
    committed, seconds = _decode_sums(before, after, DECODE_COMMITTED, DECODE_SECONDS)
    return committed / seconds if seconds > 0 else None


def level_decode_step_shape(before: dict[tuple[str, str], float] | None,
                            after: dict[tuple[str, str], float] | None) -> tuple[float, float] | None:
    """The level's mean decode step, both arms together: (milliseconds, committed tokens). None where /metrics was
    unread, no decode step was counted, or the gateway predates the count."""
    if before is None or after is None:
        return None
    steps, committed, seconds = _decode_sums(before, after, DECODE_STEPS, DECODE_COMMITTED, DECODE_SECONDS)
    return (1e3 * seconds / steps, committed / steps) if steps > 0 else None


def _decode_sums(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
                 *names: str) -> list[float]:
    """How much each of the decode steps' running sums `names` grew between two scrapes, both arms together."""
    return [sum(_grown(before, after, name, arm) for arm in ("trees", "plain")) for name in names]


def _grown(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float], name: str, arm: str) -> float:
    """How much a running sum grew between two scrapes (absent: 0)."""
    return after.get((name, arm), 0.0) - before.get((name, arm), 0.0)


def print_table(rows: list[LevelResult]) -> None:
    rounds = max((row.round for row in rows), default=1)
    for mode in dict.fromkeys(r.mode for r in rows):
        print(f"\n{mode}")
        print(f"{'conc':>5} {'round':>5} {'tok/s':>9} {'tok/s/req':>10} {'TTFT p50':>9} {'ITL p50':>8} "
              f"{'ITL p99':>8} {'accept':>7}")
        for r in rows:
            if r.mode == mode:
                acc = f"{r.acceptance_length:.2f}" if r.acceptance_length else "-"
                print(f"{r.concurrency:>5} {r.round:>5} {r.total_tok_s:9.1f} {r.tok_s_per_request:10.1f} "
                      f"{r.ttft_p50_s * 1e3:7.0f}ms {r.itl_p50_s * 1e3:6.1f}ms {r.itl_p99_s * 1e3:6.1f}ms {acc:>7}")
    concs = sorted({r.concurrency for r in rows})
    if rounds > 1:
        for round_number in range(1, rounds + 1):
            line = round_over_best(rows, round_number, concs)
            if line:
                print(f"\nround {round_number}, auto / max(never, always): {line}")
        spread = round_spread(rows)
        if spread:
            # On the H200 demo track (2026-12-05) `never`'s own rounds differed by up to 18% at one level:
            # an auto / max below 0.97 can be that spread and nothing of auto's.
            print("\neach mode's slowest round over its fastest: " + "; ".join(
                f"{mode} " + ", ".join(f"c={conc}: {spread[(mode, conc)]:.2f}" for conc in concs
                                       if (mode, conc) in spread)
                for mode in dict.fromkeys(r.mode for r in rows)))
        median_tok_s = medians(rows)
        print("\nmedian tok/s over the rounds: " + "; ".join(
            f"{mode} " + ", ".join(f"c={conc}: {median_tok_s[(mode, conc)]:.1f}" for conc in concs
                                   if (mode, conc) in median_tok_s)
            for mode in dict.fromkeys(r.mode for r in rows)))
    line = auto_over_best(medians(rows), concs)
    if line:
        print(f"\nauto / max(never, always){' on the medians' if rounds > 1 else ''}: {line}")
    print_steady(rows, concs, rounds)
    print_audit(rows)


def print_steady(rows: list[LevelResult], concs: list[int], rounds: int) -> None:
    """--steady: each level's tok/s while every client was busy, and auto / max(never, always) on it."""
    steady = medians(rows, "steady_tok_s")
    if not steady:
        return
    print("\nwhile every client was busy (--steady), median tok/s: " + "; ".join(
        f"{mode} " + ", ".join(f"c={conc}: {steady[(mode, conc)]:.1f}" for conc in concs if (mode, conc) in steady)
        for mode in dict.fromkeys(r.mode for r in rows)))
    for round_number in range(1, rounds + 1) if rounds > 1 else ():
        if line := round_over_best(rows, round_number, concs, "steady_tok_s"):
            print(f"while every client was busy, round {round_number}, auto / max(never, always): {line}")
    line = auto_over_best(steady, concs)
    if line:
        print(f"while every client was busy, auto / max(never, always){' on the medians' if rounds > 1 else ''}: "
              f"{line}")


def print_audit(rows: list[LevelResult]) -> None:
    """auto's audit per level, beside the decode rates the other modes delivered in the same round (where run)."""
    audited = [r for r in rows if r.mode == "auto" and r.audit is not None]
    if not audited:
        return
    decode = {(r.mode, r.concurrency, r.round): r.decode_tok_s for r in rows}
    steps = {(r.mode, r.concurrency, r.round): r.decode_steps_tok_s for r in rows}

    def cell(value: float | None) -> str:
        return f"{value:10.1f}" if value else f"{'-':>10}"

    def as_decoded(arm: dict[str, float | None], concurrency: int) -> float | None:
        """The prediction as a mode's decode rate shows it: what the load gate charges for joining prompts (the
        gap between 'delivered' and 'predicted') less a request's own prompt's share. The decode rate leaves out
        each request's time to first token, where its own prompt ran; only the others' prompts stall its
        decoding, (concurrency - 1) / concurrency of them. At one request no prompt stalls a decode, and the
        whole charge read `always` at 0.82-0.84 of its decode rate on the H200 (0.6, 2026-12-06) where the
        prediction alone read 0.92-0.97."""
        predicted, delivered = arm.get("predicted"), arm.get("delivered")  # 'delivered': absent in older runs
        if not predicted or not delivered:
            return delivered
        charge = 1.0 / delivered - 1.0 / predicted
        return 1.0 / (1.0 / predicted + charge * (concurrency - 1) / concurrency)

    def ratio(delivered: float | None, mode_rate: float | None) -> str:
        """Issue 14's must-show 2: the prediction as delivered within 15% of what the mode delivered."""
        if not delivered or not mode_rate:
            return f"{'-':>9}"
        value = delivered / mode_rate
        return f"{value:8.2f}{'*' if abs(value - 1) > AUDIT_TOLERANCE else ' '}"

    print("\nauto's audit, tok/s while decoding, at the level's batch bucket: the policy's mean prediction and the"
          "\ngate's measurement per arm,"
          "\nbeside the decode rate each mode delivered (concurrency x a request's rate after its first token)"
          "\nand its decode steps alone as the gateway timed them ('steps': no prompt chunk of a joining request,"
          "\nas the predictions assume); 'cfg pred': the configured tree for every auto request, as `always` drafts"
          "\nit (set it beside `always`); 'dlv': the prediction as delivered, with what the load gate charges the"
          "\narm for joining prompts at that load less a request's own prompt's share, 1 / concurrency (the decode"
          "\nrate leaves out the time to first token); set it beside the mode's decode rate; 'cfg/alw' and"
          f"\n'plain/nev': each 'dlv' over that mode's decode rate, '*' where they differ by over"
          f" {AUDIT_TOLERANCE:.0%}")
    print(f"{'conc':>5} {'round':>5} {'trees pred':>10} {'trees meas':>10} {'cfg pred':>10} {'cfg dlv':>10} "
          f"{'always':>10} {'steps':>10} {'plain pred':>10} {'plain dlv':>10} {'plain meas':>10} {'never':>10} "
          f"{'steps':>10} {'auto':>10} {'cfg/alw':>9} {'plain/nev':>9}")
    for r in audited:
        trees, plain = r.audit["trees"], r.audit["plain"]
        configured = r.audit.get("configured_tree", {})  # absent in runs before it existed
        level = (r.concurrency, r.round)
        configured_dlv, plain_dlv = as_decoded(configured, r.concurrency), as_decoded(plain, r.concurrency)
        print(f"{r.concurrency:>5} {r.round:>5} {cell(trees['predicted'])} {cell(trees['measured'])} "
              f"{cell(configured.get('predicted'))} {cell(configured_dlv)} "
              f"{cell(decode.get(('always', *level)))} {cell(steps.get(('always', *level)))} "
              f"{cell(plain['predicted'])} {cell(plain_dlv)} {cell(plain['measured'])} "
              f"{cell(decode.get(('never', *level)))} {cell(steps.get(('never', *level)))} {cell(r.decode_tok_s)} "
              f"{ratio(configured_dlv, decode.get(('always', *level)))} "
              f"{ratio(plain_dlv, decode.get(('never', *level)))}")
    print_predicted_steps(audited, rows)


def print_predicted_steps(audited: list[LevelResult], rows: list[LevelResult]) -> None:
    """The mean step each arm's predictions priced beside the decode steps of the mode that runs that arm: where a
    prediction missed, whether it priced the step's time or its tokens wrongly. Runs whose gateway did not export
    the predicted steps print nothing."""
    priced = [r for r in audited if any(arm.get("step_ms") for arm in r.audit.values())]
    if not priced:
        return
    shape = {(r.mode, r.concurrency, r.round): (r.decode_step_ms, r.decode_step_tokens) for r in rows}

    def cell(value: float | None, width: int = 8) -> str:
        return f"{value:{width}.2f}" if value else f"{'-':>{width}}"

    def ratio(predicted: float | None, measured: float | None) -> str:
        return f"{predicted / measured:6.2f}" if predicted and measured else f"{'-':>6}"

    print("\nthe step the predictions priced (mean ms and committed tokens a step, at the level's batch bucket) beside"
          "\nthe mode's decode steps: 'cfg' against `always`, 'plain' against `never`; '/': predicted over measured")
    print(f"{'conc':>5} {'round':>5} {'cfg ms':>8} {'alw ms':>8} {'/':>6} {'cfg tok':>8} {'alw tok':>8} {'/':>6} "
          f"{'plain ms':>8} {'nev ms':>8} {'/':>6} {'pln tok':>8} {'nev tok':>8} {'/':>6}")
    for r in priced:
        configured, plain = r.audit.get("configured_tree", {}), r.audit["plain"]
        always_ms, always_tokens = shape.get(("always", r.concurrency, r.round), (None, None))
        never_ms, never_tokens = shape.get(("never", r.concurrency, r.round), (None, None))
        print(f"{r.concurrency:>5} {r.round:>5} {cell(configured.get('step_ms'))} {cell(always_ms)} "
              f"{ratio(configured.get('step_ms'), always_ms)} {cell(configured.get('step_tokens'))} "
              f"{cell(always_tokens)} {ratio(configured.get('step_tokens'), always_tokens)} "
              f"{cell(plain.get('step_ms'))} {cell(never_ms)} {ratio(plain.get('step_ms'), never_ms)} "
              f"{cell(plain.get('step_tokens'))} {cell(never_tokens)} {ratio(plain.get('step_tokens'), never_tokens)}")


def plot(rows: list[LevelResult], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    median_tok_s = medians(rows)  # one point per (mode, concurrency), whatever the rounds
    for mode in dict.fromkeys(r.mode for r in rows):
        pts = sorted((conc, tok_s) for (each, conc), tok_s in median_tok_s.items() if each == mode)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    concs = sorted({r.concurrency for r in rows})
    ax.set_xticks(concs, [str(c) for c in concs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens / s (total)")
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=11)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_results(out: Path, meta: dict, rows: list[LevelResult], complete: bool) -> None:
    """bench.json: the sweep's settings and every level measured so far (`complete`: all of them)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    partial = path.with_suffix(".json.part")  # replaced in one rename: a reader never sees half a file
    partial.write_text(json.dumps({"meta": {**meta, "complete": complete},
                                   "results": [asdict(r) for r in rows]}, indent=1))
    partial.replace(path)


def served_model(url: str) -> str | None:
    """The model id the gateway serves (its /v1/models), for the record; None if it does not say."""
    try:
        data = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        return data[0]["id"] if data else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def start_serve(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    from gateway.serve import free_ports  # only where bench starts its own serve

    port, grpc_port = free_ports(2)  # taken together, so the two are never the same port
    cmd = [sys.executable, "-m", "tandem.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port)]
    for flag in ("model", "draft", "device", "dtype"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    for flag in ("target_args", "draft_args"):  # one argument each, as serve takes them
        if getattr(args, flag):
            cmd.append(f"--{flag.replace('_', '-')}={getattr(args, flag)}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    # The stack's logs go beside the results (OUT/logs: a file per service; OUT/serve.log: serve's own
    # lines): a pipe nobody reads fills up and then blocks the logging (and with it a step loop) mid-run.
    args.out.mkdir(parents=True, exist_ok=True)
    cmd += ["--log-dir", str(args.out / "logs")]
    log_path = args.out / "serve.log"
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log_file, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_bytes()[-2000:].decode(errors="replace")
            raise SystemExit(f"error: tandem serve exited (its log: {log_path}):\n{tail}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("error: tandem serve did not become ready")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench", description=__doc__.splitlines()[0] + (
        " Starts `tandem serve` on the demo pair unless --url is given."))
    p.add_argument("--url", default=None, help="a running gateway (default: start tandem serve)")
    p.add_argument("--model", default=None, help="target for the started stack (default: the demo pair)")
    p.add_argument("--draft", default=None, help="draft for the started stack")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--target-args", default="", metavar="ARGS",
                   help="more arguments for the started stack's target, as `tandem serve --target-args` takes "
                   "them (e.g. \"--emulate-step-cost 30,4\" for GPU-like step costs on a CPU)")
    p.add_argument("--draft-args", default="", metavar="ARGS",
                   help="more arguments for the started stack's draft (e.g. \"--emulate-step-cost 5,3\")")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated levels (default 1,2,4,8,16)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated (default never,always,auto)")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--length-spread", type=float, default=0.0, metavar="F",
                   help="draw each request's output tokens uniformly from (1 - F) to (1 + F) times --max-tokens, "
                   "the same lengths for every mode and round (default 0: every request --max-tokens). With one "
                   "length, `never`'s requests end together and the next prompts go in a few batched steps, while "
                   "trees end theirs apart; served traffic is not in step (on an H100 at 32 requests, prompt steps "
                   "took 8%% of `never`'s step time and 39%% of `always`'s)")
    p.add_argument("--steady", action="store_true",
                   help="also report each level's tok/s while every client had a request in flight (from the "
                   "level's start until a client first finds no request left), and auto / max(never, always) on "
                   "it: a level's end runs at a falling batch, more so with --length-spread, and weighs what each "
                   "mode does at lighter loads. The server is asked for its usage on every streamed chunk")
    p.add_argument("--requests-per-level", type=int, default=0,
                   help="requests per level (default: --requests-per-slot x concurrency, at least "
                   "--min-requests-per-level)")
    p.add_argument("--min-requests-per-level", type=int, default=4, metavar="N",
                   help="the fewest requests a level runs where --requests-per-level is not given (default 4). "
                   "Light levels are short: on the H200 scale track 4 requests of 128 tokens at one client took "
                   "about 2.5 s, and auto / max(never, always) moved between 0.88 and 1.15 from round to round "
                   "of one serve; a floor of 16 makes levels of 1-2 clients four times as long, the rest as they were")
    p.add_argument("--requests-per-slot", type=int, default=2, metavar="N",
                   help="requests per level per concurrent client (default 2). Short levels weigh a ragged end: "
                   "with trees, requests finish at different times and the last ones run at a small batch "
                   "(on the CPU's emulated track at 4 requests, auto / never read 0.91 with 2 per slot and 0.97 "
                   "with 8)")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="before the first level, each mode runs every concurrency C once with N x C requests of "
                   f"at most {WARMUP_TOKENS} tokens, not counted (default 1; 0: none): a server's first requests "
                   "at a concurrency pay one-time costs (kernel compiles, first graph replays) that would "
                   "otherwise land in whichever mode meets that concurrency first")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="run each concurrency's modes N times, interleaved (never, always, auto, never, ...), and "
                   "report each round and the medians (default 1). Between two serves on an H200 `never` alone "
                   "moved by up to 25%%: rounds in one serve put any drift on every mode alike")
    p.add_argument("--prompts", type=Path, default=HELDOUT, help="JSONL with a 'prompt' field per line")
    p.add_argument("--out", type=Path, default=Path("bench_out"),
                   help="folder for bench.json, bench.png and, for a started stack, its logs")
    p.add_argument("--title", default="tandem: throughput against concurrency (demo track)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from tqdm import tqdm

    try:
        levels = [int(c) for c in args.concurrency.split(",")]
        modes = [m.strip() for m in args.modes.split(",")]
    except ValueError:
        raise SystemExit("error: --concurrency takes comma-separated integers") from None
    if (not levels or min(levels) < 1 or any(m not in MODES for m in modes) or args.max_tokens < 1
            or args.warmup < 0 or args.requests_per_slot < 1 or args.requests_per_level < 0 or args.rounds < 1
            or args.min_requests_per_level < 1 or not 0.0 <= args.length_spread < 1.0):
        raise SystemExit("error: --concurrency needs positive integers, --modes a subset of never,always,auto, "
                         "--max-tokens a positive integer, --warmup 0 or more, --requests-per-slot at least 1, "
                         "--min-requests-per-level at least 1, --rounds at least 1, --length-spread from 0 to "
                         "below 1")
    if args.url and (args.target_args or args.draft_args or args.model or args.draft):
        raise SystemExit("error: --model, --draft, --target-args and --draft-args configure the stack bench "
                         "starts; with --url, configure the running stack instead")
    if not args.prompts.exists():
        raise SystemExit(f"error: {args.prompts} does not exist")
    prompts = [json.loads(line)["prompt"] for line in args.prompts.read_text().splitlines() if line.strip()]
    proc, url = (None, args.url) if args.url else start_serve(args)
    rows: list[LevelResult] = []
    started = args.url is None
    try:
        for mode, conc, requests, tokens in warmup_levels(modes, levels, args.warmup, args.max_tokens):
            asyncio.run(run_level(url, prompts, mode, conc, requests, tokens))
        meta = {"url": args.url or "started tandem serve", "served_model": served_model(url),
                "model": args.model or ("demo/target" if started else None),
                "draft": args.draft or ("demo/draft" if started else None), "max_tokens": args.max_tokens,
                "length_spread": args.length_spread, "steady": args.steady,
                "warmup": args.warmup, "rounds": args.rounds,
                "requests_per_slot": args.requests_per_slot,
                "requests_per_level": args.requests_per_level or None,
                "min_requests_per_level": args.min_requests_per_level, "date": time.strftime("%Y-%m-%d"),
                "track": ("demo" if not args.model else "custom") if started else None,
                "target_args": args.target_args, "draft_args": args.draft_args}
        schedule = level_schedule(levels, modes, args.rounds)
        with tqdm(total=len(schedule), desc="bench", unit="level") as bar:
            for conc, round_number, mode in schedule:
                n = level_requests(conc, args.requests_per_slot, args.requests_per_level, args.min_requests_per_level)
                bar.set_postfix(mode=mode, concurrency=conc, round=round_number)
                before = read_level_sums(url, level_bucket(conc))
                rows.append(asyncio.run(run_level(url, prompts, mode, conc, n, args.max_tokens,
                                                  args.length_spread, args.steady)))
                after = read_level_sums(url, level_bucket(conc))
                rows[-1].round = round_number
                rows[-1].decode_steps_tok_s = level_decode_steps(before, after)
                rows[-1].decode_step_ms, rows[-1].decode_step_tokens = level_decode_step_shape(before, after) or (
                    None, None)
                if mode == "auto":
                    rows[-1].audit = level_audit(before, after)
                # Every finished level is on disk at once: a sweep cut short (a deadline, Ctrl-C) keeps them.
                write_results(args.out, meta, rows, complete=False)
                bar.update()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    print_table(rows)
    write_results(args.out, meta, rows, complete=True)
    plot(rows, args.out / "bench.png", args.title)
    print(f"\nwrote {args.out / 'bench.json'} and {args.out / 'bench.png'}")
    return 0
