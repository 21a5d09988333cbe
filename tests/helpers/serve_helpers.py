"""Helpers of the serving tests: a service over the tiny test run, and a real uvicorn server on loopback."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.serving.app import create_app
from persrag_lightning.serving.service import ChatService

ADMIN = "admin-secret-token"


def open_service(run_dir, state, tiny_bert, tiny_llm=None, cache=None, **pipeline_args) -> ChatService:
    llm = LLMConfig(model=tiny_llm, max_new_tokens=4, options={"device": "cpu"}) if tiny_llm else None
    service, _ = ChatService.open(run_dir, state, llm=llm, encoder=tiny_bert, admin_token=ADMIN,
                                  use_llm=tiny_llm is not None, extraction="verbatim", m=3, k_per_user=2, k=3,
                                  cache_dir=str(cache or (state.parent / "cache")), **pipeline_args)
    return service


def chat_at_once(service: ChatService, messages: list[str]) -> list:
    """Each message from its own exported user (signed up by the admin, so their docs are in the store), all
    sent at once from one thread each; the turns, in the messages' order."""
    admin = service.authenticate(f"Bearer {ADMIN}")
    users = service.pipeline.store.corpus.user_ids[:len(messages)]
    callers = [service.authenticate("Bearer " + service.sign_up({"user_id": u, "answers": {"goals": "g"}},
                                                                admin)["access_token"]) for u in users]
    turns: dict[int, object] = {}

    def chat(i: int) -> None:
        turns[i] = service.chat(callers[i], {"messages": [{"role": "user", "content": messages[i]}]})

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(messages))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return [turns[i] for i in range(len(messages))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadServer:
    """uvicorn serving an app in a thread on a free loopback port (the real HTTP stack, no subprocess)."""

    def __init__(self, app) -> None:
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def serve_app(service: ChatService):
    return create_app(service)
