"""Concurrent chats batched into one retrieval call answer exactly what each answers alone (the same docs, in the
same order, with the same scores up to float rounding, and the same answer), over the tiny test run; a user the
store lacks gets no docs without failing the batch; with the LLM, their replies share one generation call. No test
asserts a time."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from persrag_lightning.serving.bank_encoder import BANK_BATCHING, BatchedEncoder
from persrag_lightning.serving.batcher import ANSWER_BATCHING, REPLY_BATCHING, Batching, ReplyBatching
from tests.helpers.serve_helpers import ADMIN, chat_at_once, open_service
from tests.serving.test_serving import run_dir  # noqa: F401  (the tiny exported run, module-scoped)

pytestmark = pytest.mark.usefixtures("one_thread")
MESSAGES = ["a detective hunts a killer in a rainy city", "a space ship lost near a dying star",
            "two friends open a bakery", "a knight and a dragon", "a heist in a casino", "a ghost in an old house"]


def same_docs(a, b) -> None:
    assert [d.row for d in a] == [d.row for d in b] and [d.owner for d in a] == [d.owner for d in b]
    for x, y in zip(a, b):
        assert x.retriever_score == pytest.approx(y.retriever_score, rel=1e-4, abs=1e-5)
        assert x.reranker_score == pytest.approx(y.reranker_score, rel=1e-4, abs=1e-5, nan_ok=True)
        assert x.user_sim == pytest.approx(y.user_sim, rel=1e-4, abs=1e-5)


@pytest.fixture()
def services(run_dir, tiny_bert, tmp_path):  # noqa: F811
    # batches of exactly 6: the worker waits (bounded) until all six chats are queued, so the test is deterministic
    batched = open_service(run_dir, tmp_path / "batched", tiny_bert,
                           batching=Batching(max_batch=len(MESSAGES), max_wait_ms=60_000))
    alone = open_service(run_dir, tmp_path / "alone", tiny_bert, batching=Batching(max_batch=1))
    yield batched, alone
    batched.close()
    alone.close()


def test_one_batched_call_retrieves_what_each_query_retrieves_alone(services):
    batched, alone = services
    users = batched.pipeline.store.corpus.user_ids[:len(MESSAGES)]
    asks = [*zip(users, MESSAGES), ("nobody-here", "a question of a user without docs")]
    together = batched._retrieve_many(asks)
    assert len(together) == len(asks) and together[-1] == []
    for ask, docs in zip(asks, together):
        same_docs(docs, alone.retrieval(ask))
    assert all(len(docs) == alone.pipeline.k == 3 for docs in together[:-1])  # persrag serve's --k


def test_concurrent_chats_are_batched_and_answer_as_one_by_one(services):
    batched, alone = services
    users = batched.pipeline.store.corpus.user_ids[:len(MESSAGES)]
    turns: dict[str, dict] = {}
    for name, service in (("batched", batched), ("alone", alone)):
        admin = service.authenticate(f"Bearer {ADMIN}")
        callers, out = [], turns.setdefault(name, {})
        for u in users:  # the admin claims the exported users: their docs are in the store
            token = service.sign_up({"user_id": u, "answers": {"goals": f"the goal of {u}"}}, admin)["access_token"]
            callers.append(service.authenticate(f"Bearer {token}"))

        def chat(i: int, service=service, callers=callers, out=out) -> None:
            out[users[i]] = service.chat(callers[i], {"messages": [{"role": "user", "content": MESSAGES[i]}]})

        if name == "batched":
            threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(users))]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
        else:
            for i in range(len(users)):
                chat(i)
    stats = batched.retrieval.stats
    assert (stats.calls, stats.items, stats.largest) == (1, len(users), len(users))
    assert alone.retrieval.stats.largest == 1
    for u in users:
        a, b = turns["batched"][u], turns["alone"][u]
        same_docs(a.docs, b.docs)
        assert a.docs and a.answer == b.answer and a.prompt == b.prompt


def test_concurrent_chats_share_one_llm_call_and_each_gets_its_own_reply(run_dir, tiny_bert, tiny_llm,  # noqa: F811
                                                                          tmp_path):
    """With the LLM, the replies of chats that arrive together are generated in one batched call; each request
    gets the reply to its own prompt (the same as that batched call gives it), with its own token counts."""
    chats = MESSAGES[:4]
    service = open_service(run_dir, tmp_path / "llm", tiny_bert, tiny_llm,
                           generation=Batching(max_batch=len(chats), max_wait_ms=60_000))
    turns = chat_at_once(service, chats)
    stats = service.answerer.generation.stats
    assert (stats.calls, stats.items, stats.largest) == (1, len(chats), len(chats))
    prompts = [turns[i].prompt for i in range(len(chats))]
    assert all(chats[i] in prompts[i] for i in range(len(chats)))
    llm = service.pipeline.llm
    replies = service.pipeline.llm_config.chat(llm, prompts)  # the same batch, in one call
    assert [turns[i].answer for i in range(len(chats))] == replies
    assert [turns[i].usage for i in range(len(chats))] == [(llm.count_tokens(p), llm.count_tokens(r))
                                                          for p, r in zip(prompts, replies)]
    service.close()


def test_serve_flags_reach_the_service_and_bad_bounds_are_refused(monkeypatch):
    from persrag_lightning.commands.serve import serve_command
    from persrag_lightning.serving import service

    seen = {}

    class Opened(Exception):
        pass

    def opened(*args, **kwargs):
        seen.update(kwargs)
        raise Opened

    monkeypatch.setattr(service.ChatService, "open", staticmethod(opened))
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--no_llm", "--max_batch", "4", "--max-wait-ms", "0"])
    assert seen["batching"] == Batching(max_batch=4, max_wait_ms=0.0) and seen["generation"] == REPLY_BATCHING
    assert seen["answering"] == ANSWER_BATCHING
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--answers_max_batch", "1", "--answers_max_wait_ms", "3"])
    assert seen["answering"] == Batching(max_batch=1, max_wait_ms=3.0) and seen["batching"] == Batching()
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--no_llm", "--llm_max_batch", "8", "--llm_max_wait_ms", "20"])
    assert seen["batching"] == Batching() and seen["generation"] == ReplyBatching(max_batch=8, max_wait_ms=20.0)
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--llm_batching", "batches"])
    assert seen["generation"] == dataclasses.replace(REPLY_BATCHING, continuous=False) and REPLY_BATCHING.continuous
    assert seen["llm"].options == {}  # the backend's own dtype
    assert not isinstance(seen["encoder"], BatchedEncoder) and BANK_BATCHING.max_batch == 1  # each chat's alone
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--bank_max_batch", "16"])
    assert seen["encoder"].batcher.batching == Batching(max_batch=16, max_wait_ms=0.0)
    with pytest.raises(Opened):
        serve_command(["--run", "r", "--llm_dtype", "bf16_if_native"])
    assert seen["llm"].options == {"dtype": "bf16_if_native"}
    with pytest.raises(SystemExit):  # only hf computes in a dtype it is given
        serve_command(["--run", "r", "--llm_backend", "llamacpp", "--llm_dtype", "bfloat16"])
    with pytest.raises(SystemExit):
        serve_command(["--run", "r", "--max_batch", "0"])
    with pytest.raises(SystemExit):
        serve_command(["--run", "r", "--llm_max_batch", "0"])
    with pytest.raises(SystemExit):
        serve_command(["--run", "r", "--answers_max_wait_ms", "-1"])
    with pytest.raises(SystemExit):
        serve_command(["--run", "r", "--bank_max_batch", "0"])
