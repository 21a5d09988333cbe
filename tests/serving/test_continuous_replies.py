"""Continuous batching of the chats' LLM replies (serving/continuous.py) and the service's model lock
(serving/model_lock.py): a prompt that arrives while replies are in flight joins them between two tokens, and every
reply equals the one the LLM gives that prompt alone, with its own token counts; an LLM that cannot decode row by row
gets the prompts queued together in one call; between two tokens the worker lets a thread waiting for the lock take
it first. No test asserts a time."""

from __future__ import annotations

import itertools
import threading

import pytest

from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.serving.batcher import REPLY_BATCHING, ReplyBatching
from persrag_lightning.serving.continuous import ContinuousReplies
from persrag_lightning.serving.model_lock import ModelLock
from tests.helpers.serve_helpers import chat_at_once, open_service
from tests.serving.test_serving import run_dir  # noqa: F401  (the tiny exported run, module-scoped)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a detective hunts a killer in a rainy city", "two friends open a bakery", "a ghost in an old house"]
BUDGET = 8


class PausingLock(ModelLock):
    """The model lock, stopping the worker at its `pause_at`-th acquisition until the test lets it go."""

    def __init__(self, pause_at: int) -> None:
        super().__init__()
        self.pause_at, self.count = pause_at, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def acquire(self) -> bool:
        self.count += 1
        if self.count == self.pause_at:
            self.reached.set()
            self.go.wait(60)
        return super().acquire()


@pytest.fixture(scope="module")
def llm(tiny_llm) -> HFLLM:
    return HFLLM(tiny_llm, device="cpu", dtype="float32")


def alone(llm: HFLLM, prompt: str) -> tuple[str, tuple[int, int]]:
    reply = llm.generate([prompt], BUDGET)[0]
    return reply, (llm.count_tokens(prompt), llm.count_tokens(reply))


def test_a_prompt_arriving_mid_reply_joins_it_and_each_reply_is_its_own(llm):
    # acquisitions: 1 the LLM's check, 2 the first prefill, 3 and 4 two tokens; the fifth waits for the test
    lock = PausingLock(pause_at=5)
    replies = ContinuousReplies(lambda: llm, lock, BUDGET, max_rows=4, whole_batches=lambda prompts: [])
    first = replies.submit(PROMPTS[0])
    assert lock.reached.wait(60)
    later = [replies.submit(p) for p in PROMPTS[1:]]  # queued while the first reply is two tokens in
    lock.go.set()
    got = [f.result(60) for f in (first, *later)]
    replies.close()
    assert got == [alone(llm, p) for p in PROMPTS]
    stats = replies.stats
    assert stats.items == 3 and stats.calls == 2 and stats.largest == 3
    assert stats.steps < 3 * (BUDGET - 1)  # the rows shared their steps
    assert stats.steps < stats.stepped_rows <= 3 * stats.steps  # two steps of one row, then up to three rows a step
    assert stats.prefill_s > 0 and stats.step_s > 0
    assert f"{stats.stepped_rows / stats.steps:.1f} rows a step" in stats.describe("replies")
    with pytest.raises(RuntimeError, match="closed"):
        replies.submit("too late")


def test_an_llm_that_cannot_decode_row_by_row_gets_whole_batches():
    class WholeBatchesOnly:
        backend = "llamacpp"

    calls: list[list[str]] = []

    def whole(prompts: list[str]) -> list[tuple[str, tuple[int, int]]]:
        calls.append(prompts)
        return [(p.upper(), (1, 1)) for p in prompts]

    replies = ContinuousReplies(WholeBatchesOnly, ModelLock(), BUDGET, max_rows=4, whole_batches=whole)
    assert replies(PROMPTS[0]) == (PROMPTS[0].upper(), (1, 1))
    replies.close()
    assert calls == [[PROMPTS[0]]] and replies.stats.calls == 1 and replies.stats.steps == 0


def test_a_failing_prompt_fails_its_own_chat_only(llm):
    replies = ContinuousReplies(lambda: llm, ModelLock(), BUDGET, max_rows=4, whole_batches=lambda prompts: [])
    bad = replies.submit(None)  # not text: its prefill fails
    good = replies.submit(PROMPTS[1])
    assert good.result(60) == alone(llm, PROMPTS[1])
    with pytest.raises((TypeError, ValueError)):  # the tokenizer refuses it; the error reaches this chat
        bad.result(60)
    replies.close()


def test_the_service_replies_continuously_by_default(run_dir, tiny_bert, tiny_llm, tmp_path):  # noqa: F811
    assert REPLY_BATCHING.continuous
    service = open_service(run_dir, tmp_path / "llm", tiny_bert, tiny_llm, generation=ReplyBatching(max_batch=4))
    assert isinstance(service.answerer.generation, ContinuousReplies)
    turns = chat_at_once(service, PROMPTS)
    llm = service.pipeline.llm
    for i in range(len(PROMPTS)):
        prompt = turns[i].prompt
        reply = service.pipeline.llm_config.chat(llm, [prompt])[0]
        assert turns[i].answer == reply and turns[i].usage == (llm.count_tokens(prompt), llm.count_tokens(reply))
    assert service.answerer.generation.stats.items == len(PROMPTS)
    service.close()


def test_between_two_tokens_a_thread_waiting_for_the_lock_takes_it_first(llm):
    """The worker holds the lock for one token at a time: a thread asking for it again and again gets it while the
    reply is still in flight, about a token apart (not only once the reply has ended)."""
    lock = ModelLock()
    replies = ContinuousReplies(lambda: llm, lock, 40, max_rows=4, whole_batches=lambda prompts: [])
    first = replies.submit(PROMPTS[0])
    while replies.stats.steps < 2:  # the reply is in flight
        threading.Event().wait(0.001)
    got_in = []
    for _ in range(5):
        with lock:
            got_in.append((first.done(), replies.stats.steps))
    assert first.result(60) == (llm.generate([PROMPTS[0]], 40)[0], first.result()[1])
    replies.close()
    assert not any(done for done, _ in got_in)
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(got_in)]
    assert max(gaps) <= 3, gaps  # one token apart; the step counter moves outside the lock, so it may lag by one


def test_the_model_lock_counts_its_waiters_and_lets_them_in():
    lock, entered = ModelLock(), threading.Event()
    lock.acquire()
    t = threading.Thread(target=lambda: (lock.acquire(), entered.set(), lock.release()))
    t.start()
    while lock.waiting != 1:
        threading.Event().wait(0.001)
    lock.release()
    lock.yield_to_waiters(at_most_s=10)
    # it returned only once the waiting thread holds the lock or has had it (a yield that returned at once would
    # mostly find the thread still waiting, the lock free)
    assert lock.waiting == 0 or lock.locked()
    t.join(10)
    assert entered.is_set() and lock.waiting == 0 and not lock.locked()
    with lock:
        assert lock.locked()
