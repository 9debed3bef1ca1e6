"""The thread -> asyncio / blocking adapters: every delta arrives, early exits abort."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.streams import _POLL, AsyncDeltaStream, SubRequest, _LoopPost, iter_deltas, stream_deltas
from gateway.types import GenerationParams
from tandem.errors import ResourceExhausted
from tests.fake_engine import FakeEngine, expected_text, make_char_tokenizer


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = FakeEngine(make_char_tokenizer(tmp_path_factory.mktemp("tok")))
    yield e
    e.close()


@pytest.fixture(autouse=True)
def reset_engine(engine):
    yield
    engine.max_queue, engine.token_delay = 64, 0.0


def test_async_stream_delivers_everything_without_abort(engine):
    async def run():
        return [d async for d in stream_deltas(engine, "s-full", [5], GenerationParams(max_tokens=7))]

    deltas = asyncio.run(run())
    assert "".join(d.text for d in deltas) == expected_text(7)
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    assert "s-full" not in engine.aborted


def test_async_stream_aborts_when_the_consumer_stops_or_is_cancelled(engine):
    engine.token_delay = 0.02

    async def stop_early():
        agen = stream_deltas(engine, "s-early", [5], GenerationParams(max_tokens=100))
        async for _ in agen:
            break
        await agen.aclose()

    async def cancelled():
        async def consume():
            async for _ in stream_deltas(engine, "s-cancel", [5], GenerationParams(max_tokens=100)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(stop_early())
    asyncio.run(cancelled())
    assert {"s-early", "s-cancel"} <= set(engine.aborted) and engine.running == 0


def test_a_refused_submission_withdraws_the_others(engine):
    engine.max_queue = 2
    subs = [SubRequest(f"s-multi-{i}", [5], GenerationParams(max_tokens=50)) for i in range(3)]
    engine.token_delay = 0.05

    async def run():
        AsyncDeltaStream(engine, subs)

    with pytest.raises(ResourceExhausted):
        asyncio.run(run())
    assert {"s-multi-0", "s-multi-1"} <= set(engine.aborted) and engine.running == 0


def test_blocking_stream_full_early_close_and_cancel(engine):
    deltas = list(iter_deltas(engine, "b-full", [5], GenerationParams(max_tokens=5)))
    assert "".join(d.text for d in deltas) == expected_text(5) and "b-full" not in engine.aborted

    engine.token_delay = 0.02
    it = iter(iter_deltas(engine, "b-early", [5], GenerationParams(max_tokens=100)))
    next(it)
    it.close()
    assert "b-early" in engine.aborted

    stream = iter_deltas(engine, "b-cancel", [5], GenerationParams(max_tokens=100))
    it = iter(stream)
    next(it)
    stream.cancel()  # as a gRPC termination callback would, from another thread
    rest = list(it)  # wakes up and ends instead of waiting for deltas that never come
    assert len(rest) < 100 and "b-cancel" in engine.aborted and engine.running == 0


def test_a_quiet_stream_polls_from_its_first_get_and_stops_polling_when_closed(engine):
    """poll_s: get() returns None while nothing arrives (a caller checks on its client then);
    the timer starts with the first get, and close() leaves none behind."""
    engine.token_delay = 0.3  # one delta, then a pause far longer than the poll

    async def run():
        async with AsyncDeltaStream(engine, [SubRequest("s-poll", [5], GenerationParams(max_tokens=3))],
                                    poll_s=0.02) as stream:
            assert stream._poll_timer is None  # nobody has read yet
            got = []
            while not stream.done:
                got.append(await stream.get())
            timer = stream._poll_timer
        return got, timer

    got, timer = asyncio.run(run())
    deltas = [item[1] for item in got if item is not None]
    assert "".join(d.text for d in deltas) == expected_text(3)
    assert got.count(None) >= 3, "the quiet stream never returned for a poll"
    assert timer.cancelled()


def test_get_ready_takes_the_waiting_deltas_in_order_and_skips_a_poll_marker(engine):
    async def run():
        stream = AsyncDeltaStream(engine, [SubRequest("s-ready", [5], GenerationParams(max_tokens=6))], poll_s=5)
        async with stream:
            while engine.running:  # every delta queued before anything is read
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            queued = [stream._queue.get_nowait() for _ in range(stream._queue.qsize())]
            for item in [queued[0], _POLL, *queued[1:], _POLL]:  # poll markers among them: skipped
                stream._queue.put_nowait(item)
            first = await stream.get()
            rest = []
            while (item := stream.get_ready()) is not None:
                rest.append(item)
            return first, rest, stream.done

    first, rest, done = asyncio.run(run())
    deltas = [first[1], *(item[1] for item in rest)]
    assert "".join(d.text for d in deltas) == expected_text(6) and deltas[-1].finish_reason == "length"
    assert done


def test_items_posted_from_a_thread_before_the_loop_runs_arrive_in_order_with_one_wake_up():
    """The engine's thread emits a step's deltas stream by stream; the loop is woken once for all
    that arrive before it runs, and each queue gets its items in order."""
    async def run():
        loop = asyncio.get_running_loop()
        post = _LoopPost(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        wake_ups = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wake_ups.append(1), real(*a))[1]
        try:
            def emit():
                for step in range(4):
                    for i, q in enumerate(queues):
                        post.put(q, (i, step))
            thread = threading.Thread(target=emit)
            thread.start()
            thread.join()  # the loop has not run meanwhile: everything waits for one delivery
            got = []
            for q in queues:
                got.append([await q.get() for _ in range(4)])
        finally:
            del loop.call_soon_threadsafe
        return got, len(wake_ups)

    got, wake_ups = asyncio.run(run())
    assert got == [[(i, step) for step in range(4)] for i in range(3)]
    assert wake_ups == 1


def test_posting_to_a_closed_loop_raises_and_keeps_nothing():
    loop = asyncio.new_event_loop()
    post = _LoopPost(loop)
    loop.close()
    with pytest.raises(RuntimeError):
        post.put(asyncio.Queue(), 1)
    assert post._pending == []
