"""The micro-batcher alone: batches bounded by max_batch, each request its own result, a bad request fails only
itself, max_batch 1 runs in the caller's thread, and a closed batcher answers what it queued. Deterministic: the
batched function is held on an event while requests queue up; no test asserts a time."""

from __future__ import annotations

import threading

import pytest

from persrag_lightning.serving.batcher import Batching, MicroBatcher


class Held:
    """A batched function that doubles its items, recording each batch; the first call waits for `release`."""

    def __init__(self, answer=lambda items: [2 * i for i in items]) -> None:
        self.answer = answer
        self.batches: list[list[int]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, items: list[int]) -> list[int]:
        self.batches.append(list(items))
        self.started.set()
        assert self.release.wait(30)
        if any(i < 0 for i in items):
            raise ValueError(f"negative item in {items}")
        return self.answer(items)


def test_queued_requests_share_bounded_batches_and_get_their_own_results():
    fn = Held()
    with MicroBatcher(fn, Batching(max_batch=3, max_wait_ms=0)) as batcher:
        first = batcher.submit(0)
        assert fn.started.wait(30)  # the worker is inside the first call: the rest queue up
        rest = [batcher.submit(i) for i in range(1, 6)]
        fn.release.set()
        assert first.result(30) == 0 and [f.result(30) for f in rest] == [2, 4, 6, 8, 10]
    assert fn.batches == [[0], [1, 2, 3], [4, 5]]
    assert batcher.stats.calls == 3 and batcher.stats.items == 6 and batcher.stats.largest == 3


def test_a_bad_request_fails_alone_never_its_batch_mates():
    fn = Held()
    with MicroBatcher(fn, Batching(max_batch=8, max_wait_ms=0)) as batcher:
        first = batcher.submit(1)
        assert fn.started.wait(30)
        good, bad, other = batcher.submit(2), batcher.submit(-1), batcher.submit(3)
        fn.release.set()
        assert first.result(30) == 2 and good.result(30) == 4 and other.result(30) == 6
        with pytest.raises(ValueError, match="negative"):
            bad.result(30)
    # the failed batch, then each of its items alone
    assert fn.batches == [[1], [2, -1, 3], [2], [-1], [3]]


def test_a_wrong_number_of_results_is_retried_item_by_item_never_mismatched():
    fn = Held(lambda items: [2 * i for i in items][:1])  # one result, whatever the batch
    with MicroBatcher(fn, Batching(max_batch=4, max_wait_ms=0)) as batcher:
        first = batcher.submit(1)
        assert fn.started.wait(30)
        a, b = batcher.submit(2), batcher.submit(3)
        fn.release.set()
        assert (first.result(30), a.result(30), b.result(30)) == (2, 4, 6)
    assert fn.batches == [[1], [2, 3], [2], [3]]


def test_max_batch_one_runs_in_the_callers_thread_without_a_worker():
    seen = []
    batcher = MicroBatcher(lambda items: seen.append(threading.current_thread()) or items, Batching(max_batch=1))
    assert batcher(5) == 5 and seen == [threading.current_thread()] and batcher._worker is None
    batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher(6)


def test_close_answers_what_is_queued_then_refuses_and_stops_the_worker():
    fn = Held()
    batcher = MicroBatcher(fn, Batching(max_batch=2, max_wait_ms=0))
    first = batcher.submit(1)
    assert fn.started.wait(30)
    queued = [batcher.submit(i) for i in (2, 3, 4)]
    closing = threading.Thread(target=batcher.close)
    closing.start()
    fn.release.set()
    closing.join(30)
    assert first.result(30) == 2 and [f.result(30) for f in queued] == [4, 6, 8]
    assert not batcher._worker.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit(5)
    batcher.close()  # idempotent


@pytest.mark.parametrize("args", [{"max_batch": 0}, {"max_wait_ms": -1.0}, {"max_wait_ms": float("nan")}])
def test_bounds_are_checked(args):
    with pytest.raises(ValueError):
        Batching(**args)
