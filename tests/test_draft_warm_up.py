"""The gateway's start-up warm-up of a CUDA draft's graphs (gateway/profiling.py: warm_draft)."""

from __future__ import annotations

from types import SimpleNamespace

from draft_service.types import DraftBudget
from gateway.clients import DraftInfo
from gateway.policy import PolicyConfig
from gateway.profiling import PREFIX, WARM_BATCHES, warm_draft
from target_service.types import KvLoad


class RecordingDraft:
    """A draft client that answers info and records every ingest, draft and release."""

    def __init__(self, device: str, free_blocks: int = 10_000, block_size: int = 16):
        self.device, self.free_blocks, self.block_size = device, free_blocks, block_size
        self.ingested: list[str] = []
        self.calls: list[tuple[DraftBudget, int]] = []
        self.released: list[str] = []

    def info(self) -> DraftInfo:
        load = KvLoad(0, self.block_size, self.free_blocks, self.free_blocks)
        return DraftInfo((1, 2, 3), 4096, 8, 8, 64, load, device=self.device)

    def ingest(self, items, catch_up=False):
        assert catch_up and all(len(it.tokens) == PREFIX for it in items)
        self.ingested += [it.request_id for it in items]

    def draft(self, ingest, items):
        assert not ingest and len({budget for _, budget, _ in items}) == 1
        assert all(rid in self.ingested and n == PREFIX for rid, _, n in items)
        self.calls.append((items[0][1], len(items)))

    def release(self, request_ids):
        self.released += request_ids


def warm(client: RecordingDraft, cfg: PolicyConfig | None = None, max_batch: int = 256) -> int:
    return warm_draft(SimpleNamespace(client=client), cfg or PolicyConfig(), max_batch)


def test_a_cuda_draft_gets_a_call_for_each_option_at_each_bucket_the_profile_leaves_out():
    client = RecordingDraft("cuda")
    cfg = PolicyConfig()
    calls = warm(client, cfg)
    assert calls == len(client.calls) == len(cfg.auto_options()) * len(WARM_BATCHES)
    assert set(client.calls) == {(o, b) for o in cfg.auto_options() for b in WARM_BATCHES}
    assert sorted(client.released) == sorted(client.ingested) and len(client.ingested) == max(WARM_BATCHES)


def test_a_cpu_draft_captures_nothing_and_is_not_called():
    client = RecordingDraft("cpu")
    assert warm(client) == 0 and not client.ingested and not client.calls


def test_the_warm_up_stays_within_the_running_batch_and_the_drafts_free_kv():
    client = RecordingDraft("cuda")
    warm(client, max_batch=20)
    assert {batch for _, batch in client.calls} == {2, 8, 16}
    # 16-token blocks; the longest option (6/8/16) asks PREFIX + 16 = 48 tokens: 3 blocks a request.
    tight = RecordingDraft("cuda", free_blocks=3 * 9)
    warm(tight)
    assert {batch for _, batch in tight.calls} == {2, 8}
    assert warm(RecordingDraft("cuda", free_blocks=3)) == 0


def test_only_what_the_mode_drafts_is_warmed():
    assert warm(RecordingDraft("cuda"), PolicyConfig(mode="never")) == 0
    client = RecordingDraft("cuda")
    warm(client, PolicyConfig(mode="always", steps=4, topk=2, draft_tokens=6))
    assert {budget for budget, _ in client.calls} == {DraftBudget(4, 2, 6)}
