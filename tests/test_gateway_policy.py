"""Units of the gateway's decisions: speculation budgets, the load gate, step planning."""

from __future__ import annotations

from draft_service.types import DraftBudget
from gateway.policy import NO_SPEC, AcceptanceBook, Candidate, CostModel, LoadGate, PolicyConfig, choose_budgets
from gateway.request import Phase, Request
from gateway.scheduler import SchedulerConfig, plan_step
from gateway.types import GenerationParams
from tests.tiny_models import save_char_tokenizer

CFG = PolicyConfig()
GOOD = {o: (o.steps * 0.7, 10.0) for o in CFG.auto_options()}  # a request whose drafts are mostly accepted


def candidates(n: int, mode: str = "auto", stats=None) -> list[Candidate]:
    return [Candidate(f"r{i}", stats if stats is not None else GOOD, mode) for i in range(n)]


def gpu_like_costs() -> CostModel:
    # Large fixed cost per step, cheap extra tokens at small batch, compute-bound at large batch.
    return CostModel(target_base=4e-3, target_per_token=4e-5, target_per_seq=1e-6, draft_base=5e-4,
                     draft_per_level=2e-4, draft_per_expansion=2e-6)


def test_auto_speculates_when_quiet_and_not_when_busy():
    book = AcceptanceBook()
    quiet = choose_budgets(CFG, gpu_like_costs(), book, candidates(1), 0, 0)
    assert not quiet["r0"].empty
    busy = choose_budgets(CFG, gpu_like_costs(), book, candidates(512), 0, 0)
    assert all(b.empty for b in busy.values())


def test_auto_does_not_speculate_with_a_draft_that_is_never_right():
    bad = {o: (0.0, 50.0) for o in CFG.auto_options()}
    out = choose_budgets(CFG, gpu_like_costs(), AcceptanceBook(), candidates(1, stats=bad), 0, 0)
    assert out["r0"] == NO_SPEC


def test_never_and_always_ignore_the_cost_model():
    costs = gpu_like_costs()
    assert choose_budgets(CFG, costs, AcceptanceBook(), candidates(3, "never"), 0, 0) == {
        f"r{i}": NO_SPEC for i in range(3)}
    always = choose_budgets(CFG, costs, AcceptanceBook(), candidates(512, "always"), 0, 0)
    assert set(always.values()) == {DraftBudget(5, 4, 8)}


def test_load_gate_switches_speculation_off_on_evidence_and_probes_again():
    gate = LoadGate(stale_after=10, probe_steps=2)
    assert gate.allow_spec(1)  # light load: the gate never interferes
    seen = []
    for _ in range(40):
        spec = gate.allow_spec(32)
        seen.append(spec)
        gate.record(32, spec, committed=64 if spec else 32, seconds=0.2 if spec else 0.05)  # plain: 2x better
    assert seen[:2] == [True, True] and seen[2:4] == [False, False]  # each arm measured first
    later = seen[4:]
    assert later.count(False) > 25 and True in later  # plain wins, speculation is re-measured now and then
    after = []
    for _ in range(40):  # acceptance improved: speculation now pays at this load
        spec = gate.allow_spec(32)
        after.append(spec)
        gate.record(32, spec, committed=200 if spec else 32, seconds=0.1 if spec else 0.05)
    assert after[-20:].count(True) > 15


def make_request(rid: str, prompt_len: int, tokenizer) -> Request:
    return Request(rid, list(range(3, 3 + prompt_len)), GenerationParams(max_tokens=8), lambda d: None,
                   frozenset(), tokenizer, 512)


def test_plan_chunks_prefill_within_the_token_budget_and_preempts_when_kv_runs_out(tmp_path):
    from transformers import AutoTokenizer

    save_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    cfg = SchedulerConfig(max_step_tokens=32, block_size=4)
    long, short = make_request("long", 70, tok), make_request("short", 10, tok)
    plan = plan_step(cfg, [], [long, short], free_blocks=100, tree_nodes=0)
    assert [(i.request.request_id, len(i.tokens), i.reaches_end) for i in plan.items] == [("long", 32, False)]
    assert plan.admitted == [long]
    # Two decoding requests that no longer fit: the newest is preempted, the oldest keeps running.
    a, b = make_request("a", 8, tok), make_request("b", 8, tok)
    for r in (a, b):
        r.phase, r.target_len, r.target_created, r.output = Phase.RUNNING, 8, True, [5]
    plan = plan_step(cfg, [a, b], [], free_blocks=1, tree_nodes=4)
    assert plan.preempted == [b] and [i.request.request_id for i in plan.items] == ["a"]
