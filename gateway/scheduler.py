"""Building one step's plan: who runs, with which tokens, within the token and KV budgets.

The plan is a fresh object every step; nothing in it is written back onto a
Request. Decoding requests come first (one token each, plus their trees), then
prefill chunks, oldest first, within the per-step token budget. Admission of a
waiting request needs KV room for its first chunk on the target.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from draft_service.types import DraftBudget
from gateway.request import Phase, Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_step_tokens: int = 2048  # tokens (prefill chunks + decode nodes) per target step
    max_running: int = 256  # requests in the running batch
    block_size: int = 16
    reserve_blocks: int = 0  # blocks kept free for decode growth when admitting

    def __post_init__(self) -> None:
        if self.max_step_tokens < 1 or self.max_running < 1:
            raise ValueError("max_step_tokens and max_running must be >= 1")


@dataclass(frozen=True, eq=False)
class PlannedItem:
    request: Request
    tokens: tuple[int, ...]  # fixed chain (prefill chunk or the pending token)
    reaches_end: bool  # the chain ends at the request's last known token: its bonus token is new output

    @property
    def is_decode(self) -> bool:
        return self.reaches_end and len(self.tokens) == 1 and bool(self.request.output)


@dataclass(eq=False)
class StepPlan:
    items: list[PlannedItem] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    budgets: dict[str, DraftBudget] = field(default_factory=dict)  # filled by the policy
    # Per request given a tree, the drafted tokens the acceptance book expected it to accept, as the policy
    # priced it (filled by the policy; empty while the book holds too few trees: LoadGate.expected_weight).
    expected_accepted: dict[str, float] = field(default_factory=dict)
    # A replica captured a graph for a shape new to it while drafting this plan's trees: the
    # round took tens of milliseconds more than the next of its kind will (filled by the draft phase).
    draft_captured: bool = False
    # Prompt tokens a drafting replica took in (its queued ingests) ahead of this plan's draft call: a round
    # that waits on a prompt's catch-up pays for the prompt, not for its trees (see GatewayCore._draft).
    draft_prompt_tokens: int = 0
    # Decoding requests that could draft but whose drafts were still taking in their tokens (a joining prompt,
    # a woken request's gap), so that they decode plainly in this step (filled by the policy).
    drafts_behind: int = 0
    # Requests in the gateway (running or waiting) when this step was planned, held at the highest of the last
    # plans (policy.HeldLoad): the load the load gate judges. A step may carry fewer: while a burst's prompts
    # take their chunks, a step holds two of thirty-two.
    load: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(len(i.tokens) for i in self.items)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def plan_step(cfg: SchedulerConfig, running: list[Request], waiting: list[Request], free_blocks: int,
              tree_nodes: int) -> StepPlan:
    """running: admitted requests, oldest first; waiting: queue, oldest first.

    tree_nodes: the most drafted nodes a decoding request may add this step (its
    tree's depth bounds what can be committed, so it bounds the KV it may need).
    Linear in the number of requests: membership is by identity in sets, never by
    scanning lists.
    """
    plan = StepPlan()
    budget = cfg.max_step_tokens
    decode_ids = {id(req) for req in running if req.output and req.num_tokens - req.target_len == 1}

    def need(req: Request, new_tokens: int) -> int:
        return blocks_for(req.target_len + new_tokens, cfg.block_size) - blocks_for(req.target_len, cfg.block_size)

    # Decodes must fit; if they do not, preempt the newest running requests (recompute later).
    decode_need = sum(need(req, 1 + tree_nodes) for req in running if id(req) in decode_ids)
    preempted: set[int] = set()
    if decode_need > free_blocks:
        for victim in sorted(running, key=lambda req: req.arrival, reverse=True):
            if decode_need <= free_blocks:
                break
            if id(victim) in decode_ids:
                decode_need -= need(victim, 1 + tree_nodes)
            free_blocks += blocks_for(victim.target_len, cfg.block_size)
            preempted.add(id(victim))
            plan.preempted.append(victim)
    free_blocks -= decode_need
    for req in running:
        if id(req) in decode_ids and id(req) not in preempted:
            plan.items.append(PlannedItem(request=req, tokens=(req.output[-1],), reaches_end=True))
            budget -= 1
    # Prefill: requests part-way through first, then admissions.
    prefill = [req for req in running if id(req) not in decode_ids and id(req) not in preempted]
    admitting = 0
    for req in prefill + [w for w in waiting if w.phase == Phase.WAITING]:
        if budget <= 0:
            break
        queued = req.phase == Phase.WAITING
        if queued and len(running) + admitting >= cfg.max_running:
            break
        unsent = req.unsent
        chunk = min(len(unsent), budget)
        cost = need(req, chunk) + (cfg.reserve_blocks if queued else 0)
        if cost > free_blocks:
            if queued:
                break  # keep arrival order: no overtaking by smaller prompts
            continue
        free_blocks -= need(req, chunk)
        budget -= chunk
        plan.items.append(PlannedItem(request=req, tokens=tuple(unsent[:chunk]), reaches_end=chunk == len(unsent)))
        if queued:
            plan.admitted.append(req)
            admitting += 1
    return plan
