"""Continuous batching of the chats' LLM replies (serving/continuous.py) and the service's first-come,
first-served model lock (serving/fair_lock.py): a prompt that arrives while replies are in flight joins them between
two tokens, and every reply equals the one the LLM gives that prompt alone, with its own token counts; an LLM that
cannot decode row by row gets the prompts queued together in one call; the lock serves its waiters in the order
they asked. No test asserts a time."""

from __future__ import annotations

import threading

import pytest

from persrag_lightning.llm.hf import HFLLM
from persrag_lightning.serving.batcher import REPLY_BATCHING, ReplyBatching
from persrag_lightning.serving.continuous import ContinuousReplies
from persrag_lightning.serving.fair_lock import FairLock
from tests.helpers.serve_helpers import ADMIN, open_service
from tests.serving.test_serving import run_dir  # noqa: F401  (the tiny exported run, module-scoped)

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ["a detective hunts a killer in a rainy city", "two friends open a bakery", "a ghost in an old house"]
BUDGET = 8


class PausingLock(FairLock):
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
    with pytest.raises(RuntimeError, match="closed"):
        replies.submit("too late")


def test_an_llm_that_cannot_decode_row_by_row_gets_whole_batches():
    class WholeBatchesOnly:
        backend = "llamacpp"

    calls: list[list[str]] = []

    def whole(prompts: list[str]) -> list[tuple[str, tuple[int, int]]]:
        calls.append(prompts)
        return [(p.upper(), (1, 1)) for p in prompts]

    replies = ContinuousReplies(WholeBatchesOnly, FairLock(), BUDGET, max_rows=4, whole_batches=whole)
    assert replies(PROMPTS[0]) == (PROMPTS[0].upper(), (1, 1))
    replies.close()
    assert calls == [[PROMPTS[0]]] and replies.stats.calls == 1 and replies.stats.steps == 0


def test_a_failing_prompt_fails_its_own_chat_only(llm):
    replies = ContinuousReplies(lambda: llm, FairLock(), BUDGET, max_rows=4, whole_batches=lambda prompts: [])
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
    users = service.pipeline.store.corpus.user_ids[:len(PROMPTS)]
    admin = service.authenticate(f"Bearer {ADMIN}")
    callers = [service.authenticate("Bearer " + service.sign_up({"user_id": u, "answers": {"goals": "g"}},
                                                                admin)["access_token"]) for u in users]
    turns: dict[int, object] = {}

    def chat(i: int) -> None:
        turns[i] = service.chat(callers[i], {"messages": [{"role": "user", "content": PROMPTS[i]}]})

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    llm = service.pipeline.llm
    for i in range(len(PROMPTS)):
        prompt = turns[i].prompt
        reply = service.pipeline.llm_config.chat(llm, [prompt])[0]
        assert turns[i].answer == reply and turns[i].usage == (llm.count_tokens(prompt), llm.count_tokens(reply))
    assert service.answerer.generation.stats.items == len(PROMPTS)
    service.close()


def test_the_fair_lock_serves_its_waiters_in_the_order_they_asked():
    lock, entered = FairLock(), []
    lock.acquire()
    threads = []
    for i in range(5):
        t = threading.Thread(target=lambda i=i: (lock.acquire(), entered.append(i), lock.release()))
        t.start()
        threads.append(t)
        while lock._next != i + 2:  # this thread holds its ticket before the next one starts
            threading.Event().wait(0.001)
    assert lock.locked() and entered == []
    lock.release()
    for t in threads:
        t.join(10)
    assert entered == [0, 1, 2, 3, 4] and not lock.locked()
    with pytest.raises(RuntimeError, match="unlocked"):
        lock.release()
