"""Features go from the target to the draft without the gateway (issue 12).

A step with hold_features keeps the features at the target; the gateway tells
the draft how many rows there are. The draft subscribes to the target under a
sink name (SubscribeFeatures) and the gateway names that sink in its steps: the
target then pushes the rows as the step ends. Rows not pushed are held
(FeatureStore) and the draft reads them (ReadFeatures). The stores are bounded
and a read frees what it passed. End to end, a draft that takes its features
from the target drafts exactly as one fed by the gateway, and greedy output is
unchanged.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from draft_service.target_features import TargetFeatureReader
from draft_service.types import IngestItem
from gateway.clients import TargetClient
from tandem.feature_store import FeatureStore
from tandem.tensors import tensor_from_proto
from tandem.v1 import target_pb2, target_pb2_grpc
from target_service.feature_sinks import CommittedRows, FeatureSinks, split_features
from target_service.step_batch import StepResults
from target_service.types import SequenceStep
from target_service.wire import GrantStops
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


def test_a_steps_results_give_up_their_features_per_item_and_travel_without_them():
    results = StepResults(request_ids=("a", "b", "c"), num_accepted=np.zeros(3, np.int32),
                          accepted_nodes=np.zeros((3, 1), np.int32), new_tokens=np.zeros((3, 1), np.int32),
                          logprobs=np.zeros((3, 1), np.float32), num_committed=np.array([5, 9, 2]),
                          features=torch.cat((rows(3, 2), rows(8, 1))), feature_counts=np.array([2, 0, 1]))
    light, found = split_features(results)
    assert light.features is None and light.feature_counts is None
    assert [r.features for r in light.sequence_results()] == [None, None, None]
    assert [(b, rows_.request_id, rows_.start) for b, rows_ in found] == [(0, "a", 3), (2, "c", 1)]
    assert torch.equal(found[0][1].rows, rows(3, 2))  # positions 3, 4: the last two of 5 committed
    assert torch.equal(found[1][1].rows, rows(8, 1))


def test_a_reader_waits_for_rows_on_their_way_and_no_longer_than_it_said():
    store = FeatureStore(max_rows=100)
    store.hold("a", 0, rows(0, 2))
    assert store.wait_for("a", 2, timeout=0)  # already held
    writer = threading.Timer(0.05, lambda: store.hold("a", 2, rows(2, 3)))
    writer.start()
    t0 = time.monotonic()
    assert store.wait_for("a", 5, timeout=5)
    assert time.monotonic() - t0 < 2
    writer.join()
    t0 = time.monotonic()
    assert not store.wait_for("a", 9, timeout=0.05)
    assert not store.wait_for("nobody", 1, timeout=0.05)
    assert time.monotonic() - t0 < 2


def test_rows_are_pushed_only_to_a_live_subscriber_and_a_newer_one_replaces_it():
    sinks = FeatureSinks()
    pushed = [CommittedRows("a", 4, rows(4, 2))]  # one step's rows for the sink
    assert not sinks.push("s", pushed)  # nobody subscribed: the caller holds them
    first = sinks.subscribe("s")
    assert sinks.push("s", pushed)
    second = sinks.subscribe("s")  # the same reader, reconnected: the old stream ends
    assert first.closed and list(first) == [pushed]
    assert sinks.push("s", pushed) and not sinks.push("other", pushed)
    sinks.leave(first)  # the old stream's handler leaving does not drop the new subscription
    assert sinks.push("s", pushed)
    sinks.close_all()  # the target is stopping
    assert list(second) == [pushed, pushed] and not sinks.push("s", pushed)
    assert sinks.subscribe("late").closed


def test_a_subscription_that_delivers_directly_writes_on_the_pushing_thread_after_what_was_queued(caplog):
    """On a lane the step's thread writes its push itself (SubscribeFeatures): rows queued before that
    go first and in order, and a write that fails ends the subscription, so the caller holds the rows."""
    sinks = FeatureSinks()
    sub = sinks.subscribe("s")
    early = [[CommittedRows("a", 0, rows(0, 1))], [CommittedRows("a", 1, rows(1, 1))]]
    for batch in early:
        assert sinks.push("s", batch)
    written: list[tuple[list[CommittedRows], str]] = []
    sub.deliver_directly(lambda batch: written.append((batch, threading.current_thread().name)))
    late = [CommittedRows("a", 2, rows(2, 1))]
    pusher = threading.Thread(target=sinks.push, args=("s", late), name="step-thread")
    pusher.start()
    pusher.join()
    assert [batch for batch, _ in written] == [*early, late]
    assert written[-1][1] == "step-thread"

    def fail(batch):
        raise OSError("the reader is gone")

    sub._write = fail
    assert not sinks.push("s", late) and sub.closed and not sinks.subscribed("s")
    assert "held for a pull" in caplog.text
    assert list(sub) == []  # its handler's loop ends


def test_a_steps_features_are_pushed_once_its_reply_has_left_and_what_follows_it_never_raises(caplog):
    """The target keeps a step's rows for a sink with a live subscriber until _after_reply (the
    reply leaves first); rows for no sink, or a subscriber gone by then, are held for a pull; a
    metrics failure there is logged, not raised (on a stream it would become a second reply)."""
    from target_service.server import TargetServicer, _StepRun
    from target_service.step_batch import StepBatch
    from target_service.types import KvLoad

    class BrokenMetrics:
        held_feature_bytes = pushed_feature_bytes = type("Counter", (), {"inc": lambda self, n: None})()

        def record_batch(self, *args) -> None:
            raise RuntimeError("broken metrics")

    servicer = TargetServicer(Path("."), metrics=BrokenMetrics())
    sub = servicer.feature_sinks.subscribe("live")
    results = StepResults(request_ids=("a", "b", "c"), num_accepted=np.zeros(3, np.int32),
                          accepted_nodes=np.zeros((3, 1), np.int32), new_tokens=np.zeros((3, 1), np.int32),
                          logprobs=np.zeros((3, 1), np.float32), num_committed=np.array([5, 9, 2]),
                          features=torch.cat((rows(3, 2), rows(0, 9), rows(1, 1))),
                          feature_counts=np.array([2, 9, 1]))
    light, pushes = servicer._keep_features(results, ["live", None, "gone"])
    assert light.features is None and [(sink, r.request_id) for sink, r in pushes] == [("live", "a")]
    assert servicer.held_features.read("b", 0, 9)[1] is not None  # no sink: held before the reply
    assert servicer.held_features.read("c", 1, 2)[1] is not None  # a sink nobody subscribed to: held
    assert servicer.held_features.read("a", 3, 5)[1] is None  # not pushed yet, and not held
    servicer.feature_sinks.leave(sub)
    resubscribed = servicer.feature_sinks.subscribe("live")
    batch = StepBatch.from_items([SequenceStep.chain(rid, (1,)) for rid in ("a", "b", "c")])
    load = KvLoad(num_sequences=3, block_size=16, total_blocks=8, free_blocks=8)
    servicer._after_reply(_StepRun(batch, light, load, 0.001, pushes))
    resubscribed.close()
    assert [[r.request_id for r in batch] for batch in resubscribed] == [["a"]]  # one batch for the step
    assert "broken metrics" in caplog.text


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
        reader = TargetFeatureReader(target.address, subscribe=False)
        items = [IngestItem("held", 0, tuple(prompt), target_feature_rows=len(prompt)),
                 IngestItem("other", 0, (1, 2))]
        filled = reader.fill(items)
        assert filled[1] == items[1]
        assert filled[0].target_feature_rows == 0
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


def _wait(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@contextmanager
def _target_and_reader(tiny_llama, tmp_path) -> Iterator[tuple[Service, TargetFeatureReader]]:
    """A target service on the tiny model and a draft's feature reader subscribed to it. The target's
    stop ends the subscription (it must not hold the drain); the reader notices."""
    target = Service(["target", "--model", str(tiny_llama("gqa")), "--num-blocks", "64", "--block-size", "4"],
                     tmp_path, "target")
    reader = None
    try:
        target.wait_serving()
        reader = TargetFeatureReader(target.address)
        _wait(lambda: reader.live)
        yield target, reader
    finally:
        target.stop()
    _wait(lambda: not reader.live)
    reader.close()


def test_the_target_pushes_a_steps_features_to_the_sink_it_names_and_holds_the_rest(tiny_llama, tmp_path):
    with _target_and_reader(tiny_llama, tmp_path) as (target, reader):
        client = TargetClient(target.address)
        prompt = (5, 17, 3, 9, 33, 2)

        def chain(rid: str) -> SequenceStep:
            return SequenceStep.chain(rid, prompt, create=True, return_features=True)

        [inline], _, _ = client.step([chain("inline")], ())
        results, _, _ = client.step([chain("pushed"), chain("held")], (), hold_features=True,
                                    feature_sinks=[reader.sink, ""])
        assert [r.features for r in results] == [None, None]
        # The pushed rows reach the reader with no read; the others wait at the target.
        assert reader.pushed.wait_for("pushed", len(prompt), timeout=30)
        stub = target_pb2_grpc.TargetServiceStub(target.channel)
        found = stub.ReadFeatures(target_pb2.ReadFeaturesRequest(ranges=[
            target_pb2.FeatureRange(request_id="pushed", start_position=0, end_position=len(prompt))]))
        assert not found.rows[0].HasField("features")
        items = [IngestItem(rid, 0, prompt, target_feature_rows=len(prompt)) for rid in ("pushed", "held")]
        filled = reader.fill(items)
        for got in filled:
            assert got.target_feature_rows == 0 and torch.equal(got.features, inline.features)
        # A released request's pushed rows go with it.
        client.step([SequenceStep.chain("pushed", (results[0].tokens[-1],), return_features=True)], (),
                    hold_features=True, feature_sinks=[reader.sink])
        assert reader.pushed.wait_for("pushed", len(prompt) + 1, timeout=30)
        reader.release(["pushed"])
        assert reader.pushed.read("pushed", 0, len(prompt) + 1) == (0, None)
        client.close()


def test_pushed_rows_come_with_the_tokens_after_them_where_the_step_decided_them(tiny_llama, tmp_path):
    """A prompt chunk not marked as reaching the prompt's end pushes its rows with the prompt's tokens
    after them and none for its last row (its sample is nobody's); a decode step marked so pushes its
    sampled token. The subscriber hands them on (--catch-up-on-push) once they are stored."""
    with _target_and_reader(tiny_llama, tmp_path) as (target, reader):
        got = []
        reader.on_push = got.extend
        client = TargetClient(target.address)
        prompt = (5, 17, 3, 9, 33, 2)
        [first], _, _ = client.step([SequenceStep.chain("p", prompt, create=True, return_features=True)], (),
                                    hold_features=True, feature_sinks=[reader.sink])
        _wait(lambda: len(got) == 1)
        [chunk] = got
        assert (chunk.request_id, chunk.start_position, chunk.next_tokens) == ("p", 0, (*prompt[1:], -1))
        assert reader.pushed.wait_for("p", len(prompt), timeout=0)  # stored before it was handed on
        [decoded], _, _ = client.step([SequenceStep.chain("p", (first.tokens[-1],), return_features=True,
                                                          sample_is_output=True)], (),
                                      hold_features=True, feature_sinks=[reader.sink])
        _wait(lambda: len(got) == 2)
        assert (got[1].start_position, got[1].next_tokens) == (len(prompt), (decoded.tokens[-1],))
        assert got[1].rows.shape[0] == 1
        client.close()


def test_a_fed_grant_pushes_or_holds_each_steps_features_as_single_steps_return_them(tiny_llama, tmp_path):
    """Awake auto requests decode plainly in grants that still feed their drafts: the target pushes
    each granted step's rows to the sink the call names (or holds them for a pull) after that step's
    reply, and they are the rows the same steps return one call at a time (float32, CPU; within
    float32's tolerance, as the grant's batch holds two sequences)."""
    with _target_and_reader(tiny_llama, tmp_path) as (target, reader):
        client = TargetClient(target.address)
        prompt, steps = (5, 17, 3, 9, 33, 2), 5

        def prefill(rid: str) -> int:
            [first], _, _ = client.step([SequenceStep.chain(rid, prompt, create=True, return_features=True)], ())
            return first.tokens[-1]

        one_by_one, token = [], prefill("single")
        for _ in range(steps):
            [res], _, _ = client.step([SequenceStep.chain("single", (token,), return_features=True)], ())
            one_by_one.append(res.features)
            token = res.tokens[-1]
        expected = torch.cat(one_by_one)  # positions len(prompt)-1 .. len(prompt)+steps-2 fed, then committed

        stops = GrantStops(max_new_tokens=np.array([steps, steps], dtype=np.int32),
                           stop_token_ids=(frozenset(), frozenset()))
        first = {rid: prefill(rid) for rid in ("pushed", "held")}
        items = [SequenceStep.chain(rid, (first[rid],), return_features=True) for rid in ("pushed", "held")]
        replies = list(client.grant(items, (), steps, stops, hold_features=True, feature_sinks=[reader.sink, ""]))
        assert len(replies) == steps
        assert all(res.features is None for results, _, _ in replies for res in results)  # not in the replies
        start = len(prompt)
        assert reader.pushed.wait_for("pushed", start + steps, timeout=30)
        _, pushed = reader.pushed.read("pushed", start, start + steps)
        # A batch of two against steps of one: equal within float32's reordering, not bitwise.
        torch.testing.assert_close(pushed.float(), expected.float(), rtol=1e-4, atol=1e-5)
        [held] = reader.fill([IngestItem("held", start, (0,) * steps, target_feature_rows=steps)])
        assert torch.equal(held.features, pushed)  # the same prompt in the same steps
        client.close()


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    made = {}
    for name, reads, extra in (("inline", False, ()), ("from_target", True, ()),
                               ("caught_up_on_push", True, ("--catch-up-on-push",))):
        made[name] = Stack(tmp_path_factory.mktemp(name), DEMO / "target", [DEMO / "draft"], "--max-model-len",
                           "1024", "--no-profile",
                           target_args=("--num-blocks", "1024", "--block-size", "16", "--metrics-port", "0"),
                           draft_args=("--metrics-port", "0", *extra), drafts_read_target=reads)
    yield made
    for st in made.values():
        st.stop()


def test_a_draft_that_takes_its_features_from_the_target_drafts_as_one_the_gateway_feeds(stacks):
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
    assert per_step["from_target"] == pytest.approx(per_step["inline"], abs=0.15), per_step
    assert per_step["caught_up_on_push"] == pytest.approx(per_step["inline"], abs=0.15), per_step
    # With --catch-up-on-push the draft computed positions as the pushes came (most of a round's: the
    # gateway's call then found them done); without it, none.
    caught = {name: scrape(_metrics_url(stacks[name].drafts[0])).get("tandem_draft_push_catch_up_positions_total", 0)
              for name in ("from_target", "caught_up_on_push")}
    assert caught["from_target"] == 0 < caught["caught_up_on_push"], caught
    # The features went target -> draft, pushed as the steps ended: the target returned none to the
    # gateway, and held next to none for a read (the first steps may run before the subscription).
    from_target = stacks["from_target"]
    draft = scrape(_metrics_url(from_target.drafts[0]))
    assert draft["tandem_draft_feature_bytes_total"] > 0
    target = scrape(_metrics_url(from_target.target))
    inline_target = scrape(_metrics_url(stacks["inline"].target))
    assert target.get("tandem_target_feature_bytes_total", 0) == 0 < inline_target["tandem_target_feature_bytes_total"]
    pushed = target["tandem_target_pushed_feature_bytes_total"]
    assert pushed >= draft["tandem_draft_feature_bytes_total"] > 0
    assert target.get("tandem_target_held_feature_bytes_total", 0) < 0.05 * pushed
    rows = {source: draft.get(f'tandem_draft_target_feature_rows_total{{source="{source}"}}', 0)
            for source in ("pushed", "read", "absent")}
    assert rows["pushed"] > 0 and rows["read"] + rows["absent"] < 0.05 * rows["pushed"], rows
    # Both services on this host: the rows went through the draft's shared-memory ring, and the pushes
    # that name them on the target's step lane (the stack gives its services lanes).
    assert "through shared memory on its step lane" in from_target.drafts[0].log_path.read_text()


def _metrics_url(service: Service) -> str:
    for line in service.log_path.read_text().splitlines():
        if "metrics on http://" in line:
            return line.split("metrics on ", 1)[1].strip()
    raise AssertionError(f"{service.name} logged no metrics address")
