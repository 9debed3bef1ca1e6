"""Features go from the target to the draft without the gateway (issue 12).

A step with hold_features keeps the features at the target (FeatureStore); the
gateway tells the draft how many rows the target holds; the draft reads them
itself (ReadFeatures). The store is bounded and a read frees what it passed.
End to end, a draft that reads from the target drafts exactly as one fed by
the gateway, and greedy output is unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_service.target_features import TargetFeatureReader
from draft_service.types import IngestItem
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.feature_store import FeatureStore
from target_service.step_batch import StepResults
from tests.services import Service
from tests.stack import Stack, scrape

DEMO = Path(__file__).resolve().parent.parent / "demo"
PROMPTS = [json.loads(line)["prompt"] for line in (DEMO / "heldout_prompts.jsonl").read_text().splitlines()][::9][:8]


def rows(start: int, n: int, width: int = 3) -> torch.Tensor:
    """Rows whose values say their position."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None].expand(n, width).clone()


# --- the target's store ----------------------------------------------------------------------


def test_a_read_returns_the_rows_held_in_its_range_and_frees_those_below_its_end():
    store = FeatureStore(max_rows=100)
    store.hold("a", 0, rows(0, 6))
    store.hold("a", 6, rows(6, 3))  # contiguous: appended
    start, got = store.read("a", 2, 5)
    assert start == 2 and torch.equal(got, rows(2, 3))
    assert store.rows == 4  # 5..8 left
    start, got = store.read("a", 0, 100)  # what was freed is gone; the rest comes back
    assert start == 5 and torch.equal(got, rows(5, 4))
    assert store.rows == 0 and store.read("a", 0, 9) == (0, None)


def test_rows_that_do_not_continue_the_held_ones_replace_them():
    store = FeatureStore(max_rows=100)
    store.hold("a", 0, rows(0, 4))
    store.hold("a", 2, rows(2, 2))  # a re-prefill after a target restart, say
    start, got = store.read("a", 0, 10)
    assert start == 2 and torch.equal(got, rows(2, 2))


def test_the_store_drops_the_sequences_written_longest_ago_when_full():
    store = FeatureStore(max_rows=10)
    store.hold("old", 0, rows(0, 6))
    store.hold("new", 0, rows(0, 6))
    assert store.rows == 6 and store.read("old", 0, 6) == (0, None)
    store.hold("new", 6, rows(6, 8))  # one sequence alone over the bound keeps its newest rows
    start, got = store.read("new", 0, 100)
    assert store.rows == 0 and start == 4 and torch.equal(got, rows(4, 10))
    store.hold("x", 0, rows(0, 2))
    store.release(["x", "unknown"])
    assert store.rows == 0


def test_a_steps_results_give_their_features_to_the_store_and_travel_without_them():
    store = FeatureStore(max_rows=100)
    results = StepResults(request_ids=("a", "b", "c"), num_accepted=np.zeros(3, np.int32),
                          accepted_nodes=np.zeros((3, 1), np.int32), new_tokens=np.zeros((3, 1), np.int32),
                          logprobs=np.zeros((3, 1), np.float32), num_committed=np.array([5, 9, 2]),
                          features=torch.cat((rows(3, 2), rows(8, 1))), feature_counts=np.array([2, 0, 1]))
    light = store.hold_results(results)
    assert light.features is None and light.feature_counts is None
    assert [r.features for r in light.sequence_results()] == [None, None, None]
    start, got = store.read("a", 0, 10)
    assert start == 3 and torch.equal(got, rows(3, 2))  # positions 3, 4: the last two of 5 committed
    assert store.read("b", 0, 10) == (0, None)
    start, got = store.read("c", 1, 2)
    assert start == 1 and torch.equal(got, rows(8, 1))


# --- the target service and the draft's reader --------------------------------------------------


def _chain(rid: str, tokens: list[int], create: bool = False) -> target_pb2.SequenceStep:
    return target_pb2.SequenceStep(request_id=rid, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                                   num_fixed=len(tokens), create=create, return_features=True)


def test_the_draft_reads_from_the_target_the_features_a_step_would_have_returned(tiny_llama, tmp_path):
    target = Service(["target", "--model", str(tiny_llama("gqa")), "--num-blocks", "64", "--block-size", "4"],
                     tmp_path, "target")
    try:
        target.wait_serving()
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        prompt = [5, 17, 3, 9, 33, 2]
        returned = stub.Step(target_pb2.StepRequest(items=[_chain("inline", prompt, True)])).results[0]
        held = stub.Step(target_pb2.StepRequest(items=[_chain("held", prompt, True)], hold_features=True)).results[0]
        assert returned.HasField("features") and not held.HasField("features")
        reader = TargetFeatureReader(target.address)
        items = [IngestItem("held", 0, tuple(prompt), target_feature_rows=len(prompt)),
                 IngestItem("other", 0, (1, 2))]
        filled = reader.fill(items)
        assert filled[1] == items[1]
        assert filled[0].target_feature_rows == 0
        from tandem.tensors import tensor_from_proto
        assert torch.equal(filled[0].features, tensor_from_proto(returned.features))
        # The read freed them; a released sequence's rows go with it.
        assert reader.fill(items)[0].features is None
        stub.Step(target_pb2.StepRequest(items=[_chain("held", [returned.tokens[0]])], hold_features=True))
        stub.Release(target_pb2.ReleaseRequest(request_ids=["held"]))
        assert reader.fill([IngestItem("held", 6, (1,), target_feature_rows=1)])[0].features is None
        reader.close()
    finally:
        target.stop()
    # A target that is gone leaves the positions without features, and says so in the log.
    reader = TargetFeatureReader(target.address, timeout=2)
    got = reader.fill([IngestItem("held", 0, (1, 2), target_feature_rows=2)])
    assert got[0].features is None and got[0].target_feature_rows == 0
    reader.close()


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    made = {}
    for name, reads in (("inline", False), ("pulled", True)):
        made[name] = Stack(tmp_path_factory.mktemp(name), DEMO / "target", [DEMO / "draft"], "--max-model-len",
                           "1024", "--no-profile",
                           target_args=("--num-blocks", "1024", "--block-size", "16", "--metrics-port", "0"),
                           draft_args=("--metrics-port", "0"), drafts_read_target=reads)
    yield made
    for st in made.values():
        st.stop()


def test_a_draft_that_reads_the_target_drafts_as_one_the_gateway_feeds(stacks):
    """Greedy output unchanged, and acceptance as with features through the gateway (the rows
    are bitwise the same, above; which steps find the draft caught up is timing, so the
    totals are compared, not each step)."""
    totals = {name: [0, 0] for name in stacks}  # accepted tokens, verify steps
    for prompt in PROMPTS:
        plain = stacks["inline"].complete(prompt, max_tokens=32, temperature=0, speculation="never",
                                          ignore_eos=True)["choices"][0]["text"]
        for name, st in stacks.items():
            run = st.complete(prompt, max_tokens=32, temperature=0, speculation="always", ignore_eos=True)
            assert run["choices"][0]["text"] == plain, name
            totals[name][0] += run["spec_stats"]["accepted_tokens"]
            totals[name][1] += run["spec_stats"]["verify_steps"]
    per_step = {name: accepted / verify for name, (accepted, verify) in totals.items()}
    assert per_step["inline"] > 1.5  # the trained head, fed: not a vacuous comparison
    assert per_step["pulled"] == pytest.approx(per_step["inline"], abs=0.15), per_step
    # The features went target -> draft: the draft read them, the target returned none to the gateway.
    pulled = stacks["pulled"]
    draft = scrape(_metrics_url(pulled.drafts[0]))
    assert draft["tandem_draft_feature_read_seconds_count"] > 0 and draft["tandem_draft_feature_bytes_total"] > 0
    target = scrape(_metrics_url(pulled.target))
    inline_target = scrape(_metrics_url(stacks["inline"].target))
    assert target.get("tandem_target_feature_bytes_total", 0) == 0 < inline_target["tandem_target_feature_bytes_total"]
    assert target["tandem_target_held_feature_bytes_total"] >= draft["tandem_draft_feature_bytes_total"]


def _metrics_url(service: Service) -> str:
    for line in service.log_path.read_text().splitlines():
        if "metrics on http://" in line:
            return line.split("metrics on ", 1)[1].strip()
    raise AssertionError(f"{service.name} logged no metrics address")
