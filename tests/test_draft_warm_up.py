"""The gateway's start-up warm-up of a CUDA draft's graphs (gateway/profiling.py: warm_draft)."""

from __future__ import annotations

from types import SimpleNamespace

from draft_service.types import DraftBudget
from gateway.clients import DraftInfo
from gateway.policy import PolicyConfig
from gateway.profiling import CUT_BATCHES, PREFIX, WARM_BATCHES, depth_cuts, warm_draft
from target_service.types import KvLoad


class RecordingDraft:
    """A draft client that answers info and records every ingest, draft and release."""

    def __init__(self, device: str, free_blocks: int = 10_000, block_size: int = 16, feature_width: int = 12):
        self.device, self.free_blocks, self.block_size = device, free_blocks, block_size
        self.feature_width = feature_width
        self.known: dict[str, int] = {}  # tokens each request holds
        self.calls: list[tuple[DraftBudget, int]] = []  # growth calls: (budget, requests)
        self.catch_ups: list[int] = []  # calls that first took in tokens with features: their requests
        self.released: list[str] = []

    @property
    def ingested(self) -> list[str]:
        return list(self.known)

    def info(self) -> DraftInfo:
        load = KvLoad(0, self.block_size, self.free_blocks, self.free_blocks)
        return DraftInfo((1, 2, 3), 4096, 8, 8, 64, load, device=self.device, feature_width=self.feature_width)

    def ingest(self, items, catch_up=False):
        assert catch_up and all(len(it.tokens) == PREFIX and it.features is None for it in items)
        self.known.update({it.request_id: PREFIX for it in items})

    def draft(self, ingest, items):
        assert len({budget for _, budget, _ in items}) == 1
        for it in ingest:  # a verify's root and one token, the root's features with them
            assert it.start_position == self.known[it.request_id] - 1 and len(it.tokens) == 2
            assert tuple(it.features.shape) == (1, self.feature_width)
            self.known[it.request_id] += 1
        assert all(n == self.known[rid] for rid, _, n in items)
        if ingest:
            assert [it.request_id for it in ingest] == [rid for rid, _, _ in items]
            self.catch_ups.append(len(items))
        else:
            self.calls.append((items[0][1], len(items)))

    def release(self, request_ids):
        self.released += request_ids


def warm(client: RecordingDraft, cfg: PolicyConfig | None = None, max_batch: int = 256) -> int:
    return warm_draft(SimpleNamespace(client=client), cfg or PolicyConfig(), max_batch)


def test_a_cuda_draft_gets_a_call_for_each_option_at_each_bucket_the_profile_leaves_out_and_its_cuts_at_one_or_two():
    client = RecordingDraft("cuda")
    cfg = PolicyConfig()
    calls = warm(client, cfg)
    cuts = {(cut, b) for o in cfg.auto_options() for cut in depth_cuts(o) for b in CUT_BATCHES}
    assert calls == len(client.calls) + len(client.catch_ups) == (
        (len(cfg.auto_options()) + 1) * len(WARM_BATCHES) + len(cuts))
    assert set(client.calls) == {(o, b) for o in cfg.auto_options() for b in WARM_BATCHES} | cuts
    assert len(client.calls) == len(set(client.calls))  # each shape once
    assert client.catch_ups == list(WARM_BATCHES)  # the fixed-width catch-up's graph of each bucket
    assert sorted(client.released) == sorted(client.ingested) and len(client.ingested) == max(WARM_BATCHES)


def test_a_budgets_depth_cuts_are_its_shallower_trees_of_the_same_top_k_and_size():
    """As GatewayCore._budgets cuts a request's budget near its max_tokens: steps 1 .. steps - 1."""
    assert depth_cuts(DraftBudget(5, 4, 8)) == [DraftBudget(d, 4, 8) for d in (1, 2, 3, 4)]
    assert depth_cuts(DraftBudget(10, 1, 11))[-1] == DraftBudget(9, 1, 11)
    assert depth_cuts(DraftBudget(1, 1, 2)) == []


def test_a_draft_that_reports_no_feature_width_gets_no_catch_up_call():
    client = RecordingDraft("cuda", feature_width=0)
    warm(client)
    assert client.calls and not client.catch_ups


def test_a_cpu_draft_captures_nothing_and_is_not_called():
    client = RecordingDraft("cpu")
    assert warm(client) == 0 and not client.ingested and not client.calls


def test_the_warm_up_stays_within_the_running_batch_and_the_drafts_free_kv():
    client = RecordingDraft("cuda")
    warm(client, max_batch=20)
    assert {batch for _, batch in client.calls} == {1, 2, 8, 16}  # 1: depth cuts (CUT_BATCHES)
    lone = RecordingDraft("cuda")
    warm(lone, max_batch=1)  # one request at most: only the cuts' bucket of one
    assert {batch for _, batch in lone.calls} == {1} and not lone.catch_ups
    # 16-token blocks; the longest option (6/8/16) asks PREFIX + 5 catch-up tokens + 16 = 53 tokens: 4 blocks a
    # request.
    tight = RecordingDraft("cuda", free_blocks=4 * 9)
    warm(tight)
    assert {batch for _, batch in tight.calls} == {1, 2, 8}
    one = RecordingDraft("cuda", free_blocks=4)  # room for one request: the cuts at one
    warm(one)
    assert {batch for _, batch in one.calls} == {1}
    assert warm(RecordingDraft("cuda", free_blocks=3)) == 0


def test_only_what_the_mode_drafts_is_warmed():
    assert warm(RecordingDraft("cuda"), PolicyConfig(mode="never")) == 0
    client = RecordingDraft("cuda")
    warm(client, PolicyConfig(mode="always", steps=4, topk=2, draft_tokens=6))
    assert {budget for budget, _ in client.calls} == {DraftBudget(d, 2, 6) for d in (1, 2, 3, 4)}
