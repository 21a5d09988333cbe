"""`persrag serve`: endpoints, tokens and privacy, share: false, deletion, persistence across restarts, bad input,
concurrency on a real loopback server, and a server killed mid-write (tiny random models throughout)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fastapi.testclient import TestClient

from persrag_lightning.data.lamp import read_sharing
from persrag_lightning.memory import MemoryBank
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.serving.app import MAX_BODY_BYTES, create_app
from tests.conftest import REPO
from tests.helpers.serve_helpers import ADMIN, ThreadServer, free_port, open_service
from tests.serving.test_serving import run_dir  # noqa: F401  (the tiny exported run, module-scoped)

pytestmark = pytest.mark.usefixtures("one_thread")
ANSWERS = {"hobbies_lifestyle": "I climb on weekends.", "goals": "I want to run a marathon."}


def auth(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def history_like(service, source_user: str, prefix: str, n: int = 5) -> list[dict]:
    docs = service.pipeline.store.dataset.users[source_user].docs[:n]
    return [{"id": f"{prefix}-{i}", "date": f"2024-02-{i + 1:02d}", "fields": dict(d.fields)}
            for i, d in enumerate(docs)]


@pytest.fixture()
def service(run_dir, tiny_bert, tmp_path):  # noqa: F811
    return open_service(run_dir, tmp_path / "state", tiny_bert)


@pytest.fixture()
def client(service):
    return TestClient(create_app(service))


def sign_up(client, user_id, **extra) -> str:
    r = client.post("/v1/users", json={"user_id": user_id, "answers": ANSWERS, **extra})
    assert r.status_code == 201, r.text
    assert r.json()["user_id"] == user_id
    return r.json()["access_token"]


def test_sign_up_chat_memories_and_provenance(client, service):
    token = sign_up(client, "ada")
    assert client.get("/healthz").json()["status"] == "ok"
    assert len(client.get("/v1/users/ada/memories", headers=auth(token)).json()["memories"]) == 2
    r = client.post("/v1/chat/completions", headers=auth(token),
                    json={"model": "x", "messages": [{"role": "user", "content": "My dog is called Biscuit."}]})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["choices"][0]["message"]["role"] == "assistant"
    assert set(out["provenance"]) >= {"own_docs", "other_users_docs", "memories_used", "memory_stored"}
    r = client.post("/v1/chat/completions", headers=auth(token),
                    json={"messages": [{"role": "user", "content": "What is my dog called?"}]})
    used = r.json()["provenance"]["memories_used"]
    assert any("Biscuit" in m["text"] for m in used)
    memories = client.get("/v1/users/ada/memories", headers=auth(token)).json()["memories"]
    assert len(memories) == 4
    assert [t.role for t in service.bank.turns("ada")] == ["user", "assistant"] * 2  # both roles logged
    mid = next(m["id"] for m in memories if "Biscuit" in m["text"])
    assert client.delete(f"/v1/users/ada/memories/{mid}", headers=auth(token)).status_code == 204
    assert client.delete(f"/v1/users/ada/memories/{mid}", headers=auth(token)).status_code == 404
    assert len(client.get("/v1/users/ada/memories", headers=auth(token)).json()["memories"]) == 3


def test_a_chat_answered_by_the_llm_counts_its_usage_in_the_llms_tokens(run_dir, tiny_bert, tiny_llm,  # noqa: F811
                                                                         tmp_path):
    """OpenAI's `usage` in tokens of the LLM that answered: the prompt (before the chat template) and the answer,
    counted by its tokenizer, not in words."""
    service = open_service(run_dir, tmp_path / "state", tiny_bert, tiny_llm)
    client = TestClient(create_app(service))
    token = sign_up(client, "lin")
    chat = {"messages": [{"role": "user", "content": "Which running shoes suit a marathon?"}]}
    r = client.post("/v1/chat/completions", headers=auth(token), json=chat)
    assert r.status_code == 200, r.text
    answer, usage = r.json()["choices"][0]["message"]["content"], r.json()["usage"]
    assert usage["completion_tokens"] == service.pipeline.llm.count_tokens(answer)
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    # a tokenizer that counts characters: every count in `usage` follows it, none is a word count
    service.pipeline.llm.count_tokens = len
    usage = client.post("/v1/chat/completions", headers=auth(token), json=chat).json()["usage"]
    assert usage["prompt_tokens"] > len(chat["messages"][0]["content"]) > 6
    assert "Which running shoes suit a marathon?" in service.bank.turns("lin")[0].text


def test_chat_provenance_of_a_user_with_history_names_owners_and_similarity(client, service):
    exported = service.pipeline.store.corpus.user_ids[3]
    token = sign_up(client, "hist", history=history_like(service, exported, "h"))
    r = client.post("/v1/chat/completions", headers=auth(token),
                    json={"messages": [{"role": "user", "content": "description: a detective in a rainy city"}]})
    prov = r.json()["provenance"]
    docs = prov["own_docs"] + prov["other_users_docs"]
    assert len(docs) == 3 and prov["own_docs"]
    for d in prov["other_users_docs"]:
        assert d["owner"] != "hist" and -1.0 <= d["user_similarity"] <= 1.0001
        assert isinstance(d["retriever_score"], float) and isinstance(d["reranker_score"], float)


def test_every_endpoint_refuses_wrong_tokens_other_users_and_deleted_users(client, service):
    a, b = sign_up(client, "alice"), sign_up(client, "bob")
    mid = client.get("/v1/users/bob/memories", headers=auth(b)).json()["memories"][0]["id"]
    chat = {"messages": [{"role": "user", "content": "hello"}]}
    calls = [("GET", "/v1/users/bob/memories", None), ("DELETE", f"/v1/users/bob/memories/{mid}", None),
             ("DELETE", "/v1/users/bob", None), ("POST", "/v1/users/bob/history", {"history": []})]
    for method, path, body in calls:
        assert client.request(method, path, json=body).status_code == 401                       # no token
        assert client.request(method, path, json=body, headers=auth("nope")).status_code == 401  # wrong token
        r = client.request(method, path, json=body, headers=auth(a))                            # another user
        assert r.status_code == 403 and "another user" in r.json()["error"]["message"]
    assert client.post("/v1/chat/completions", json=chat).status_code == 401
    assert client.post("/v1/chat/completions", json=chat, headers=auth("nope")).status_code == 401
    assert client.post("/v1/chat/completions", json=chat, headers=auth(ADMIN)).status_code == 403
    assert len(client.get("/v1/users/bob/memories", headers=auth(b)).json()["memories"]) == 2  # untouched
    # the admin deletes another user; the deleted user's token is dead everywhere
    assert client.delete("/v1/users/bob", headers=auth(ADMIN)).json()["deleted"] is True
    for method, path, body in calls + [("POST", "/v1/chat/completions", chat)]:
        assert client.request(method, path, json=body, headers=auth(b)).status_code == 401
    assert client.get("/v1/users/bob/memories", headers=auth(ADMIN)).status_code == 404
    assert service.bank.list("bob") == [] and service.bank.turns("bob") == []
    # an exported user cannot be claimed without the admin token
    exported = service.pipeline.store.corpus.user_ids[0]
    r = client.post("/v1/users", json={"user_id": exported, "answers": ANSWERS})
    assert r.status_code == 409 and "admin" in r.json()["error"]["message"]
    r = client.post("/v1/users", json={"user_id": exported, "answers": ANSWERS}, headers=auth(ADMIN))
    assert r.status_code == 201


def test_share_false_is_never_a_neighbour_and_never_in_another_prompt(client, service):
    store = service.pipeline.store
    template = store.corpus.user_ids[4]
    secret = sign_up(client, "secret", share=False, history=history_like(service, template, "s", 6))
    sharer = sign_up(client, "twin", history=history_like(service, template, "t", 6))
    strategy = service.pipeline.strategy
    for u in [u for u in store.corpus.user_ids if u in store]:
        neighbours = [n for n, _ in strategy.similar_users(u)]
        assert "secret" not in neighbours or u == "secret"
    assert "twin" in [n for n, _ in strategy.similar_users("secret")] or len(strategy.similar_users("secret")) == 3
    for token, who in ((sharer, "twin"), (secret, "secret")):
        r = client.post("/v1/chat/completions", headers=auth(token),
                        json={"messages": [{"role": "user", "content": "description: " +
                                            store.dataset.users[template].docs[0].fields["description"]}]})
        owners = {d["owner"] for d in r.json()["provenance"]["other_users_docs"]}
        assert "secret" not in owners
        assert all(m["id"] in {x["id"] for x in client.get(f"/v1/users/{who}/memories", headers=auth(token))
                                .json()["memories"]} for m in r.json()["provenance"]["memories_used"])
    # the same rule in the retrieval every strategy, feedback build and evaluation shares
    queries = [Query(u, "description: a film", "description: a film") for u in store.corpus.user_ids[:6]]
    for docs in strategy.candidates(queries):
        assert all(d.owner != "secret" for d in docs)


def test_share_false_in_data_folders_and_docstores(run_dir, tmp_path):  # noqa: F811
    from persrag_lightning.data.docstore import read_docstore, write_docstore

    (tmp_path / "sharing.json").write_text(json.dumps({"u1": False, "u2": True}))
    assert read_sharing(tmp_path) == {"u1"}
    (tmp_path / "sharing.json").write_text(json.dumps({"u1": "no"}))
    with pytest.raises(Exception, match="sharing.json"):
        read_sharing(tmp_path)
    dataset = read_docstore(run_dir / "docstore")
    private = dataset.user_ids()[1]
    dataset.private.add(private)
    write_docstore(tmp_path / "ds", dataset)
    again = read_docstore(tmp_path / "ds")
    assert again.private == {private}
    store = DocStore(again)
    assert private not in store.visible.pool and private not in store.pool_users()
    cfrag = CFRAG(str(run_dir / "user_encoder"), str(run_dir / "retriever"), None, m=4, k_per_user=2,
                  cache_dir=str(tmp_path / "cache"))
    cfrag.prepare(store)
    for u in again.user_ids():
        sims = [n for n, _ in cfrag.similar_users(u)]
        assert len(sims) == 4 and (private not in sims or u == private)
    other = [Query(u, "description: a film") for u in again.user_ids() if u != private]
    assert all(d.owner != private for docs in cfrag.retrieve(other, 3) for d in docs)


def test_online_users_survive_a_restart_and_deletion_is_permanent(run_dir, tiny_bert, tmp_path):  # noqa: F811
    run_dir = copy_run(run_dir, tmp_path)  # deleting an exported user rewrites the run
    state = tmp_path / "state"
    service = open_service(run_dir, state, tiny_bert)
    client = TestClient(create_app(service))
    template = service.pipeline.store.corpus.user_ids[2]
    token = sign_up(client, "carol", share=False, history=history_like(service, template, "c", 5))
    gone = sign_up(client, "dave", history=history_like(service, template, "d", 4))
    exported = service.pipeline.store.corpus.user_ids[1]
    client.post("/v1/chat/completions", headers=auth(token),
                json={"messages": [{"role": "user", "content": "I am allergic to kiwi."}]})
    assert "dave" in {d.owner for d in service.pipeline.retrieve("carol", "description: a film", 3)}
    assert client.delete("/v1/users/dave", headers=auth(gone)).status_code == 200
    assert client.delete(f"/v1/users/{exported}", headers=auth(ADMIN)).status_code == 200
    before = service.pipeline.retrieve("carol", "description: a film", 3)
    assert "dave" not in {d.owner for d in before}
    del service, client

    again = open_service(run_dir, state, tiny_bert)  # a restart: same state folder
    client = TestClient(create_app(again))
    store = again.pipeline.store
    assert "carol" in store and not store.shares("carol") and len(store.corpus.rows_of("carol")) == 5
    assert [d.doc_id for d in again.pipeline.retrieve("carol", "description: a film", 3)] == [d.doc_id for d in before]
    assert "carol" in again.pipeline.strategy.user_index
    texts = [m["text"] for m in client.get("/v1/users/carol/memories", headers=auth(token)).json()["memories"]]
    assert any("kiwi" in t for t in texts)
    assert "dave" not in store and "dave" not in again.pipeline.strategy.user_index and again.bank.list("dave") == []
    assert exported not in store and exported not in again.pipeline.strategy.user_index
    assert client.get("/v1/users/dave/memories", headers=auth(gone)).status_code == 401
    assert not list((state / "users").glob("*.npz"))[1:]  # only carol's file is left
    # a new history replaces the old one and survives a restart too
    new = history_like(again, store.corpus.user_ids[5], "n", 3)
    assert client.post("/v1/users/carol/history", headers=auth(token), json={"history": new}).status_code == 200
    third = open_service(run_dir, state, tiny_bert)
    assert [third.pipeline.store.corpus.doc_ids[r] for r in third.pipeline.store.corpus.rows_of("carol")] == \
        ["n-0", "n-1", "n-2"]


def test_an_unfinished_sign_up_is_removed_at_start(run_dir, tiny_bert, tmp_path, monkeypatch):  # noqa: F811
    state = tmp_path / "state"
    service = open_service(run_dir, state, tiny_bert)
    template = service.pipeline.store.corpus.user_ids[2]

    def crash(*args) -> None:
        raise KeyboardInterrupt  # the process dies before the account line (the sign-up's commit point)

    monkeypatch.setattr(service, "_append_account", crash)
    with pytest.raises(KeyboardInterrupt):
        service.sign_up({"user_id": "eve", "answers": ANSWERS, "history": history_like(service, template, "e")}, None)
    assert list((state / "users").glob("*.npz")) and service.bank.list("eve")
    again = open_service(run_dir, state, tiny_bert)
    assert "eve" not in again.pipeline.store and again.bank.list("eve") == []
    assert not list((state / "users").glob("*.npz"))


BAD_BODIES = [
    (b"", "empty body"),
    (b"\xff\xfe{\"user_id\": 1}", "not valid UTF-8"),
    (b"{\"user_id\": \"x\",", "malformed JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"x" * (MAX_BODY_BYTES + 1), "limit"),
]


def test_bad_input_is_4xx_with_a_message_and_stores_nothing(client, service):
    token = sign_up(client, "frank")

    def counts():
        return len(service.bank.list("frank")), len(service.bank.turns("frank")), len(service.accounts)

    start = counts()
    for body, message in BAD_BODIES:
        for path, headers in (("/v1/users", {}), ("/v1/chat/completions", auth(token))):
            r = client.post(path, content=body, headers={**headers, "Content-Type": "application/json"})
            assert 400 <= r.status_code < 500 and message in r.json()["error"]["message"], (path, r.text)
    chats = [
        ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
        ({"messages": [{"role": "user", "content": "a" * 9000}]}, "more than the limit"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0]"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "last of `messages`"),
        ({"messages": [{"role": "user", "content": "hi"}], "session_id": ""}, "session_id"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "UTF-8"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
    ]
    for body, message in chats:
        r = client.post("/v1/chat/completions", headers=auth(token), json=body) if "\ud800" not in json.dumps(
            body, ensure_ascii=False) else client.post("/v1/chat/completions", headers={
                **auth(token), "Content-Type": "application/json"}, content=json.dumps(body).encode())
        assert 400 <= r.status_code < 500 and message in r.json()["error"]["message"], (body, r.text)
    signups = [
        ({"user_id": "", "answers": ANSWERS}, "user_id"),
        ({"user_id": "g\x00", "answers": ANSWERS}, "control characters"),
        ({"user_id": "g", "answers": {"nope": "x"}}, "unknown questionnaire"),
        ({"user_id": "g", "answers": {"goals": ""}}, "is empty"),
        ({"user_id": "g", "answers": {}}, "at least one"),
        ({"user_id": "g", "answers": {"goals": "y" * 9000}}, "more than the limit"),
        ({"user_id": "g", "answers": ANSWERS, "share": "no"}, "share"),
        ({"user_id": "g", "answers": ANSWERS, "history": [{"id": "1"}]}, "history[0]"),
        ({"user_id": "frank", "answers": ANSWERS}, "already exists"),
    ]
    for body, message in signups:
        r = client.post("/v1/users", json=body)
        assert 400 <= r.status_code < 500 and message in r.json()["error"]["message"], (body, r.text)
    assert client.get("/v1/users/nobody/memories", headers=auth(ADMIN)).status_code == 404
    assert client.delete("/v1/users/frank/memories/nope", headers=auth(token)).status_code == 404
    assert counts() == start and "g" not in service.accounts and service.bank.list("g") == []


def test_concurrent_clients_lose_and_duplicate_nothing(service):
    """N clients on loopback sign up and chat at once through uvicorn; every turn is stored exactly once."""
    n_clients, turns = 6, 4
    with ThreadServer(create_app(service)) as server:
        def one(i: int) -> list[str]:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                r = http.post("/v1/users", json={"user_id": f"c{i}", "answers": {"goals": f"goal of c{i}"}})
                assert r.status_code == 201, r.text
                token = r.json()["access_token"]
                stored = []
                for t in range(turns):
                    r = http.post("/v1/chat/completions", headers=auth(token), json={
                        "session_id": f"s{i}", "messages": [{"role": "user", "content": f"fact {t} of client {i}"}]})
                    assert r.status_code == 200, r.text
                    stored.append(r.json()["provenance"]["memory_stored"])
                return stored

        with ThreadPoolExecutor(n_clients) as pool:
            results = list(pool.map(one, range(n_clients)))
    for i, stored in enumerate(results):
        memories = service.bank.list(f"c{i}")
        assert sorted(m.text for m in memories) == sorted([f"goal of c{i}"] + [f"fact {t} of client {i}"
                                                                               for t in range(turns)])
        assert {m.id for m in memories} >= set(stored) and len({m.id for m in memories}) == len(memories)
        assert [t.role for t in service.bank.turns(f"c{i}")] == ["user", "assistant"] * turns


def test_killed_server_restarts_consistent(run_dir, tiny_bert, tmp_path):  # noqa: F811
    """SIGKILL while clients write; the restarted server reads whole rows only, and every acknowledged write."""
    state, port = tmp_path / "state", free_port()
    cmd = [sys.executable, "-m", "persrag_lightning.cli", "serve", "--run", str(run_dir), "--state", str(state),
           "--port", str(port), "--no-llm", "--extraction", "verbatim", "--encoder", tiny_bert, "--m", "3",
           "--k", "3"]
    env = {**os.environ, "PERSRAG_ADMIN_TOKEN": ADMIN, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}

    def start():
        proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                    return proc
            except httpx.HTTPError:
                time.sleep(0.3)
            if proc.poll() is not None:
                raise AssertionError(proc.stderr.read().decode()[-3000:])
        proc.kill()
        raise AssertionError("server did not start")

    proc = start()
    url = f"http://127.0.0.1:{port}"
    token = httpx.post(f"{url}/v1/users", json={"user_id": "kim", "answers": {"goals": "g"}}).json()["access_token"]
    acked: list[str] = []
    stop = threading.Event()

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                r = httpx.post(f"{url}/v1/chat/completions", headers=auth(token), timeout=30,
                               json={"messages": [{"role": "user", "content": f"note number {i}"}]})
                if r.status_code == 200:
                    acked.append(f"note number {i}")
            except httpx.HTTPError:
                return
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    while len(acked) < 3:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    stop.set()
    thread.join()
    proc = start()
    try:
        r = httpx.get(f"{url}/v1/users/kim/memories", headers=auth(token))
        assert r.status_code == 200
        texts = [m["text"] for m in r.json()["memories"]]
        assert set(acked) <= set(texts) and len(texts) == len(set(texts))
        assert all(t == "g" or t.startswith("note number ") for t in texts)
        r = httpx.post(f"{url}/v1/chat/completions", headers=auth(token),
                       json={"messages": [{"role": "user", "content": "after the crash"}]})
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    bank = MemoryBank(state / "memory", TextEncoder.from_pretrained(tiny_bert))
    assert all(m.vector.shape == (bank.store.dim,) for m in bank.list("kim"))


# ---- deletion rewrites the export, and cohorts in serving --------------------------------------------

def copy_run(run_dir, tmp_path):  # noqa: F811
    """A private copy of the module's run: these tests rewrite the export."""
    import shutil

    return shutil.copytree(run_dir, tmp_path / "run")


def victim_of(store) -> tuple[str, list[str]]:
    """An exported user whose id is in no other id, and the texts of their docs that no other user has."""
    ids = [u for u in store.corpus.user_ids if u in store]
    for u in ids:
        if any(u in o for o in ids if o != u):
            continue
        others = {v for o in ids if o != u for d in store.dataset.users[o].docs for v in d.fields.values()}
        mine = [v for d in store.dataset.users[u].docs for v in d.fields.values()
                if v not in others and len(v) > 12 and '"' not in v and "\\" not in v]
        if mine:
            return u, mine
    raise AssertionError("no user with docs of their own")


def files_holding(roots, needles: list[str]) -> list[str]:
    """Every file under `roots` whose bytes contain one of `needles` (a grep over JSON, safetensors, faiss, npz
    and LanceDB's data, deletion and index files)."""
    hits = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            hits += [f"{path} ∋ {n[:30]!r}" for n in needles if n.encode() in data]
    return hits


def others_snapshot(run, cache, victim: str) -> dict:
    """What the deletion must not change: every other user's docstore line, user-table row and doc-table rows."""
    from safetensors.torch import load_file

    from persrag_lightning.data.corpus import Corpus
    from persrag_lightning.data.docstore import read_docstore

    dataset = read_docstore(run / "docstore")
    corpus = Corpus.from_dataset(dataset)
    ids = json.loads((run / "user_encoder" / "user_ids.json").read_text())
    table = load_file(str(run / "user_encoder" / "user_embeddings.safetensors"))["embeddings"]
    docs = load_file(str(run / "user_encoder" / "model.safetensors"))["doc_table.weight"]
    return {u: ([(d.doc_id, d.fields) for d in dataset.users[u].docs], table[ids.index(u)].tolist(),
                docs[corpus.rows_of(u) + 2].tolist())
            for u in dataset.user_ids() if u != victim}


def test_deleting_an_exported_user_rewrites_the_run_and_leaves_no_trace(run_dir, tiny_bert, tmp_path):  # noqa: F811
    from persrag_lightning.data.corpus import Corpus
    from persrag_lightning.data.docstore import read_docstore
    from persrag_lightning.models.corpus_embeddings import corpus_embedding_key

    run, state, cache = copy_run(run_dir, tmp_path), tmp_path / "state", tmp_path / "cache"
    service = open_service(run, state, tiny_bert, cache=cache)
    client = TestClient(create_app(service))
    victim, texts = victim_of(service.pipeline.store)
    before = others_snapshot(run, cache, victim)
    corpus = Corpus.from_dataset(read_docstore(run / "docstore"))
    token = client.post("/v1/users", json={"user_id": victim, "answers": {"goals": "I collect zebra-kiwi stamps."}},
                        headers=auth(ADMIN)).json()["access_token"]
    client.post("/v1/chat/completions", headers=auth(token),
                json={"messages": [{"role": "user", "content": "My locker code is quokka-7731."}]})
    friend = sign_up(client, "friend", history=history_like(service, victim, "f", 4))
    secrets_ = [victim, "zebra-kiwi", "quokka-7731", *texts]
    assert files_holding([run, state], secrets_)  # the grep finds them before
    assert client.delete(f"/v1/users/{victim}", headers=auth(ADMIN)).status_code == 200
    assert files_holding([run, state, cache], secrets_) == []
    assert not (state / "purge.json").exists() and not (state / "deleted.json").exists()
    assert not list(run.rglob("*.purge-new"))
    assert others_snapshot(run, cache, victim) == before  # other users unchanged, row for row
    assert client.post("/v1/chat/completions", headers=auth(token), json={
        "messages": [{"role": "user", "content": "hi"}]}).status_code == 401
    # the corpus-embedding cache of the old corpus is gone; the one of the new corpus holds only kept rows
    del service, client
    again = open_service(run, state, tiny_bert, cache=cache)
    store = again.pipeline.store
    assert victim not in store and victim not in again.pipeline.strategy.user_index
    assert victim not in again.pipeline.strategy.user_encoder.user_ids and victim not in again.accounts
    assert again.bank.list(victim) == [] and again.bank.turns(victim) == []
    exported = Corpus.from_dataset(read_docstore(run / "docstore"))
    assert victim not in exported and len(exported) == len(corpus) - len(corpus.rows_of(victim))
    folders = sorted(p.name for p in (cache / "embeddings").iterdir())
    r = again.pipeline.strategy.retriever
    assert folders == [corpus_embedding_key(exported, r.doc_encoder, r.max_length, r.pooling)]
    assert "friend" in store and again.pipeline.retrieve("friend", "description: a film", 3)
    assert all(d.owner != victim for d in again.pipeline.retrieve("friend", "description: a film", 3))
    assert TestClient(create_app(again)).get("/v1/users/friend/memories", headers=auth(friend)).status_code == 200
    assert files_holding([run, state, cache], secrets_) == []


@pytest.mark.parametrize("crash", ["bank", "stage", "first_rename", "third_rename"])
def test_a_deletion_cut_short_is_finished_at_the_next_start(run_dir, tiny_bert, tmp_path, monkeypatch,  # noqa: F811
                                                          crash):
    """The process dies at a step of the deletion: before `commit` the export is the old one, whole; at the next
    start the deletion is finished (export, bank, account) before anything reads the run."""
    from persrag_lightning.data.docstore import read_docstore
    from persrag_lightning.serving import purge
    from persrag_lightning.serving.service import Caller

    run, state, cache = copy_run(run_dir, tmp_path), tmp_path / "state", tmp_path / "cache"
    service = open_service(run, state, tiny_bert, cache=cache)
    victim, texts = victim_of(service.pipeline.store)
    service.sign_up({"user_id": victim, "answers": {"goals": "I collect zebra-kiwi stamps."}}, Caller(None, True))
    calls = []

    def die(*args, **kwargs):
        raise KeyboardInterrupt  # the process is killed here

    if crash == "bank":
        monkeypatch.setattr(service.bank, "purge_user", die)
    elif crash == "stage":
        monkeypatch.setattr(purge, "stage", die)
    else:
        real = purge._replace
        limit = 0 if crash == "first_rename" else 2

        def rename(src, dst):
            if len(calls) >= limit:
                die()
            calls.append(dst)
            real(src, dst)

        monkeypatch.setattr(purge, "_replace", rename)
    with pytest.raises(KeyboardInterrupt):
        service.delete_user(Caller(None, admin=True), victim)
    assert (state / "purge.json").exists()
    if crash in ("bank", "stage", "first_rename"):  # nothing renamed yet: the old export, whole
        assert victim in read_docstore(run / "docstore").users
        assert victim in json.loads((run / "user_encoder" / "user_ids.json").read_text())
    monkeypatch.undo()
    del service
    again = open_service(run, state, tiny_bert, cache=cache)
    assert victim not in again.pipeline.store and victim not in again.accounts and again.bank.list(victim) == []
    assert victim not in read_docstore(run / "docstore").users
    assert files_holding([run, state, cache], [victim, "zebra-kiwi", *texts]) == []
    assert not (state / "purge.json").exists() and not list(run.rglob("*.purge-new"))


def test_purge_removes_rows_from_lancedb_files_even_in_shared_fragments(tmp_path):
    """A LanceDB delete leaves the text in the data file (one fragment holds many users: below 10 % deleted rows,
    compaction does not rewrite it); purge_user leaves no byte of it, index files included, others intact."""
    import numpy as np

    from persrag_lightning.memory.store import MemoryStore, NewMemory, StoreSettings

    store = MemoryStore(tmp_path / "db", 8, StoreSettings(index_min_rows=40, rows_per_partition=20))
    rng = np.random.default_rng(0)
    items = {u: [NewMemory(f"{u} note {i}", rng.standard_normal(8)) for i in range(n)]
             for u, n in (("ann", 5), ("bea", 60), ("cid", 60))}  # ann: 4 % of the fragment
    for u, batch in items.items():
        store.add_memories(u, batch)
    store.optimize()  # one fragment with every user's rows
    assert store.maybe_index() or store.has_vector_index()
    store.add_memories("bea", [NewMemory("bea late note", rng.standard_normal(8))])
    store.add_turn("ann", "s", "user", "ann says hello")
    assert store.purge_user("ann") == (5, 1)
    assert files_holding([tmp_path / "db"], ["ann"]) == []
    assert len(store.list_memories("bea")) == 61 and len(store.list_memories("cid")) == 60
    assert store.search("cid", rng.standard_normal(8), 5) and store.purge_user("ann") == (0, 0)


def cohort_export(run, tiny_bert, cache, n_clusters: int = 3):
    """`persrag cluster` on the run's data (k-means, MEAN vectors of the run's text encoder)."""
    from persrag_lightning.cli import main
    from tests.serving.test_serving import USERS

    main(["cluster", "--run_name", run.name, "--export_root", str(run.parent), "--num_users", str(USERS),
          "--cache_dir", str(cache), "--encoder", tiny_bert, "--method", "kmeans", "--n_clusters", str(n_clusters)])
    return run / "clusters"


def test_serving_reads_the_cohort_export_and_new_users_join_the_nearest_cohort(run_dir, tiny_bert, tmp_path,  # noqa: F811
                                                                               monkeypatch):
    from persrag_lightning.retrieval.cohorts import CohortModel
    from persrag_lightning.serving import CFRAGPipeline

    run, state, cache = copy_run(run_dir, tmp_path), tmp_path / "state", tmp_path / "cache"
    with pytest.raises(FileNotFoundError, match="persrag cluster"):
        CFRAGPipeline.from_pretrained(run, users="cluster", cache_dir=str(cache))
    export = cohort_export(run, tiny_bert, cache)
    exported = CohortModel.load(export)

    def no_fit(*args, **kwargs):
        raise AssertionError("serving re-clustered the users")

    monkeypatch.setattr(CohortModel, "fit", no_fit)
    service = open_service(run, state, tiny_bert, cache=cache, users="cluster")
    pipe = service.pipeline
    assert pipe.cohorts.user_ids == exported.user_ids and pipe.strategy.user_index is None
    for u in pipe.store.corpus.user_ids[:5]:  # CFRAG's `users: cluster`: the user, then its cohort's nearest
        expected = [(u, 1.0)] + [(n.user_id, n.similarity) for n in exported.neighbours(u, 2)]
        assert pipe.strategy.similar_users(u) == expected
    # a new user: the nearest centroid of its MEAN vector (the export's encoder), kept across a restart
    template = pipe.store.corpus.user_ids[6]
    history = history_like(service, template, "n", 6)
    _, _, vectors = pipe.encode_user("newbie", history)
    want = exported.assign(vectors[1].numpy())
    client = TestClient(create_app(service))
    sign_up(client, "newbie", history=history)
    assert pipe.cohorts.cohort_of("newbie") == want.cohort
    assert all(pipe.cohorts.cohort_of(n) == want.cohort for n, _ in pipe.strategy.similar_users("newbie")[1:])
    assert {d.owner for d in pipe.retrieve("newbie", "description: a film", 3)} <= \
        {n for n, _ in pipe.strategy.similar_users("newbie")}
    victim = next(u for u in exported.user_ids if exported.cohort_of(u) == exported.cohort_of(template)
                  and u != template)
    assert client.delete(f"/v1/users/{victim}", headers=auth(ADMIN)).status_code == 200
    assert victim not in pipe.cohorts and victim not in CohortModel.load(export)
    assert victim not in (export / "assignments.tsv").read_text()
    del service, client, pipe
    again = open_service(run, state, tiny_bert, cache=cache, users="cluster")
    assert again.pipeline.cohorts.cohort_of("newbie") == want.cohort and victim not in again.pipeline.cohorts
    assert all(victim not in [n for n, _ in again.pipeline.strategy.similar_users(u)]
               for u in again.pipeline.store.corpus.user_ids if u in again.pipeline.store)


def test_a_cohort_export_of_another_encoder_is_refused(run_dir, tiny_bert, tmp_path):  # noqa: F811
    from persrag_lightning.retrieval.cohorts import CohortModel
    from persrag_lightning.serving import CFRAGPipeline
    from persrag_lightning.utils import ConfigError

    run, cache = copy_run(run_dir, tmp_path), tmp_path / "cache"
    export = cohort_export(run, tiny_bert, cache)
    model = CohortModel.load(export)
    model.encoder = "minilm"
    model.save(export)
    with pytest.raises(ConfigError, match="persrag cluster --encoder"):
        CFRAGPipeline.from_pretrained(run, users="cluster", cache_dir=str(cache), m=3, k_per_user=2)
