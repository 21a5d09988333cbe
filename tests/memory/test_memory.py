"""Memory bank (persrag_lightning/memory): per-user isolation, crash consistency, eviction, recall, extraction.

Unit tests use a hashed bag-of-words encoder and scripted LLMs, so they need no weights; one slow test uses the
real MiniLM."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from persrag_lightning.llm.base import LLM
from persrag_lightning.memory import (
    EvictionSettings,
    InvalidIdError,
    MemoryBank,
    MemorySettings,
    MemoryStore,
    RecallSettings,
    StoreSettings,
    Tags,
    UsageRow,
    UserExistsError,
    parse_extraction,
    rerank,
    select_evictions,
    user_filter,
)
from persrag_lightning.memory.extract import Extractor, build_prompt
from persrag_lightning.memory.records import Memory, MemoryCandidate
from persrag_lightning.memory.simulate import measure_recall, simulate_conversations
from persrag_lightning.memory.store import NewMemory

REPO = Path(__file__).resolve().parents[2]
EVIL = "x' OR '1'='1"


class HashEncoder:
    """Deterministic bag-of-words embedding (md5-hashed words), L2-normalised, returned as a torch tensor."""

    dim = 256

    def encode(self, texts: list[str]) -> torch.Tensor:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in re.findall(r"[a-z0-9]+", t.lower()):
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % self.dim] += 1.0
            if not out[i].any():
                out[i, 0] = 1.0
        return torch.from_numpy(out / np.linalg.norm(out, axis=1, keepdims=True))


class ScriptedLLM(LLM):
    """An LLM whose answer is a function of the prompt; records the prompts it saw."""

    backend = "scripted"

    def __init__(self, reply) -> None:
        super().__init__()
        self.reply = reply
        self.prompts: list[str] = []

    @property
    def name(self) -> str:
        return "scripted"

    def generate(self, prompts: list[str], max_new_tokens: int) -> list[str]:
        self.prompts.extend(prompts)
        return [self.reply(p) for p in prompts]

    def score(self, prompts: list[str], targets: list[str]) -> list[float]:
        raise NotImplementedError


def message_of(prompt: str) -> str:
    """The user message inside an extraction prompt."""
    return prompt.split("Latest user message:\n", 1)[1].rsplit("\nJSON:", 1)[0]


def identity_llm() -> ScriptedLLM:
    """Extraction = the message itself, no tags, in valid JSON (so no fallback is counted)."""
    return ScriptedLLM(lambda p: json.dumps({"memory": message_of(p)}))


class Clock:
    """A fake clock: each reading is one second after the previous, so 'oldest' is known exactly."""

    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def vec(dim: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).standard_normal(dim).astype(np.float32)
    return v / np.linalg.norm(v)


@pytest.fixture()
def store(tmp_path) -> MemoryStore:
    return MemoryStore(tmp_path / "bank", dim=8, clock=Clock())


def add(store: MemoryStore, user: str, texts: list[str], seed: int = 0) -> list[Memory]:
    return store.add_memories(user, [NewMemory(t, vec(store.dim, seed + i)) for i, t in enumerate(texts)])


# ---- per-user isolation ---------------------------------------------------------------------------------------

def test_injection_user_id_touches_only_its_own_rows(store):
    """A user id that would read `user_id = 'x' OR '1'='1'` if pasted into SQL must match only itself."""
    alice = add(store, "alice", ["alice likes tea", "alice lives in Oslo"], seed=0)
    add(store, "bob", ["bob plays chess"], seed=10)
    evil = add(store, EVIL, ["evil memory"], seed=20)
    store.add_turn("alice", "s1", "user", "hi")
    store.add_turn(EVIL, "s1", "user", "hello")

    assert [m.text for m in store.list_memories(EVIL)] == ["evil memory"]
    assert [t.text for t in store.turns(EVIL)] == ["hello"]
    assert store.count(EVIL) == 1
    assert [c.memory.user_id for c in store.search(EVIL, alice[0].vector, 20)] == [EVIL]
    assert store.mark_used(EVIL, [alice[0].id, evil[0].id]) == 1  # alice's id is not the evil user's row
    assert store.delete_memories(EVIL, [m.id for m in alice]) == 0
    assert store.delete_memories("alice", [EVIL]) == 0  # a quote-laden memory id matches nothing either
    assert store.delete_user(EVIL) == (1, 1)
    assert [m.usage_count for m in store.list_memories("alice")] == [0, 0]
    assert store.count("alice") == 2 and store.count("bob") == 1
    assert len(store.turns("alice")) == 1


def test_the_user_filter_is_a_typed_expression_with_doubled_quotes():
    assert user_filter(EVIL).to_sql() == "(user_id = 'x'' OR ''1''=''1')"


def test_every_table_access_in_the_store_goes_through_user_filter():
    """Static guard: each where/delete/update/count_rows call in store.py takes `user_filter(...)` (directly or
    via a name bound to it); a filter string written by hand anywhere would fail here."""
    import ast

    import persrag_lightning.memory.store as store_module

    tree = ast.parse(Path(store_module.__file__).read_text())
    bound = {t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", "") == "user_filter"
             for t in node.targets if isinstance(t, ast.Name)}

    def filtered(arg: ast.expr) -> bool:
        if isinstance(arg, ast.Call) and isinstance(arg.func, ast.Attribute) and arg.func.attr == "to_sql":
            arg = arg.func.value
        return (isinstance(arg, ast.Call) and getattr(arg.func, "id", "") == "user_filter") or (
            isinstance(arg, ast.Name) and arg.id in bound)

    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
             and n.func.attr in ("where", "delete", "update", "count_rows")]
    checked = 0
    for call in calls:
        args = list(call.args) + [k.value for k in call.keywords if k.arg == "where"]
        if call.func.attr == "count_rows" and not args:
            continue  # total row count (index threshold), no user data read
        assert args and filtered(args[0]), f"store.py line {call.lineno}: {ast.unparse(call)[:80]}"
        checked += 1
    assert checked >= 7


def test_quotes_and_backslashes_in_user_ids_round_trip(store):
    for user in ["o'brien", "a\\", "\\'", "ünïcödé 用户"]:
        add(store, user, [f"memory of {user}"])
    for user in ["o'brien", "a\\", "\\'", "ünïcödé 用户"]:
        assert [m.text for m in store.list_memories(user)] == [f"memory of {user}"]


@pytest.mark.parametrize("bad", ["", "a\x00b", "tab\there", "x" * 257, 42, None, "\ud800"])
def test_invalid_user_ids_are_rejected(store, bad):
    with pytest.raises((InvalidIdError, TypeError)):
        store.list_memories(bad)


def test_delete_user_removes_memories_and_turns_of_that_user_only(store):
    add(store, "alice", ["a1", "a2"])
    add(store, "bob", ["b1"])
    store.add_turn("alice", "s", "user", "q")
    store.add_turn("alice", "s", "assistant", "a")
    store.add_turn("bob", "s", "user", "q")
    assert store.delete_user("alice") == (2, 2)
    assert store.list_memories("alice") == [] and store.turns("alice") == []
    assert [m.text for m in store.list_memories("bob")] == ["b1"] and len(store.turns("bob")) == 1


def test_reopening_with_another_dimension_is_refused(tmp_path):
    MemoryStore(tmp_path / "b", dim=8)
    with pytest.raises(ValueError, match="8-d"):
        MemoryStore(tmp_path / "b", dim=16)


# ---- crash consistency ----------------------------------------------------------------------------------------

WRITER = """
import sys
import numpy as np
from persrag_lightning.memory.store import MemoryStore, NewMemory
store = MemoryStore(sys.argv[1], dim=8)
prefix = sys.argv[2]
batch = 0
while True:
    v = np.full(8, 0.35, dtype=np.float32)
    new = store.add_memories("u", [NewMemory(f"{prefix}b{batch}-r{j}", v) for j in range(5)])
    if batch == 0:
        print("ready", flush=True)
    if batch % 4 == 1:                                 # an update rewrites the batch's rows
        store.mark_used("u", [m.id for m in new])
    if batch % 4 == 3:                                 # and a whole earlier batch is deleted
        old = [m.id for m in store.list_memories("u") if m.text.startswith(f"{prefix}b{batch - 2}-")]
        store.delete_memories("u", old)
    batch += 1
"""


def test_writer_killed_mid_write_leaves_complete_rows_and_no_duplicates(tmp_path):
    """SIGKILL, at a few points in time, a process that adds (5 rows per commit), updates and deletes in a loop;
    reopened, every batch is all or nothing, nothing is duplicated, every row is complete."""
    path = tmp_path / "bank"
    MemoryStore(path, dim=8)  # create the tables before the race
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    for round_, delay in enumerate([0.05, 0.4, 0.9]):
        proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRITER), str(path), f"k{round_}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = proc.stdout.readline()
            assert line.strip() == b"ready", proc.stderr.read().decode()
            time.sleep(delay)  # where the kill lands, not a timing assertion
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait()
    rows = MemoryStore(path, dim=8).list_memories("u")
    texts = [m.text for m in rows]
    assert len(texts) == len(set(texts)), "duplicated rows"
    assert len({m.id for m in rows}) == len(rows)
    assert {t[:2] for t in texts} == {"k0", "k1", "k2"}
    batches: dict[str, list[Memory]] = {}
    for m in rows:
        batches.setdefault(m.text.split("-")[0], []).append(m)
    assert all(len(ms) == 5 for ms in batches.values()), "a batch was half-written"
    for m in rows:
        assert m.vector.shape == (8,) and np.allclose(m.vector, 0.35)
        assert m.usage_count in (0, 1) and m.source == "chat" and m.created_at > 0
    # each batch's update was one commit too: all five rows of a batch carry the same usage
    assert all(len({m.usage_count for m in ms}) == 1 for ms in batches.values())


# ---- eviction -------------------------------------------------------------------------------------------------

def rows(usages: list[int]) -> list[UsageRow]:
    """r0 is the oldest, r1 the next, ..."""
    return [UsageRow(f"r{i}", u, float(i)) for i, u in enumerate(usages)]


def survivors(usages: list[int], settings: EvictionSettings, key: str = "") -> list[str]:
    gone = set(select_evictions(rows(usages), settings, key))
    return [r.id for r in rows(usages) if r.id not in gone]


def test_eviction_within_capacity_removes_nothing():
    assert select_evictions(rows([0] * 10), EvictionSettings(capacity=10)) == []


def test_eviction_removes_the_oldest_of_the_rarely_used():
    # mean 6.55, std 4.01: rows with usage 0 (r0, r2, r9) are below mean - std; 20 % of 10 = 2 go, the oldest
    usages = [0, 9, 0, 9, 9, 9, 9, 9, 9, 0, 9]
    kept = survivors(usages, EvictionSettings(capacity=10))
    assert kept == ["r1", "r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10"]


def test_eviction_default_removes_at_random_among_all_rows_when_too_few_are_rarely_used():
    # the seed: "if the amount of values less than 1 std of the average is less than max_entries x 0.2, randomly
    # remove max_entries x 0.2 results" -- drawn from all rows, not topped up from the least used
    usages = [0, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]  # threshold 1.65: only r0 is below it; 30 % of 10 = 3 must go
    outcomes = [frozenset(select_evictions(rows(usages), EvictionSettings(capacity=10, fraction=0.3, seed=s), "a"))
                for s in range(20)]
    assert all(len(o) == 3 for o in outcomes)
    assert any({"r0", "r1", "r2"} != o for o in outcomes)  # not the least-used rule
    assert any(o & {f"r{i}" for i in range(3, 11)} for o in outcomes)  # well-used rows can go
    again = select_evictions(rows(usages), EvictionSettings(capacity=10, fraction=0.3, seed=3), "a")
    assert set(again) == outcomes[3]  # seeded per user
    with pytest.raises(ValueError, match="fallback"):
        EvictionSettings(fallback="oldest")  # type: ignore[arg-type]


def test_eviction_least_used_fallback_fills_from_the_least_used():
    # threshold 1.65: only r0 is below it; 30 % of 10 = 3 must go, so the two next least used (r1, r2) follow
    usages = [0, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]
    kept = survivors(usages, EvictionSettings(capacity=10, fraction=0.3, fallback="least_used"))
    assert kept == ["r3", "r4", "r5", "r6", "r7", "r8", "r9", "r10"]


def test_eviction_random_fill_is_seeded_and_only_among_the_least_used():
    usages = [0] + [1] * 6 + [5] * 5  # 12 rows, capacity 10 -> 2 go: r0, then one of the six 1-usage rows
    settings = EvictionSettings(capacity=10, seed=7, fallback="least_used")
    picks = [select_evictions(rows(usages), settings, "alice") for _ in range(2)]
    assert picks[0] == picks[1], "not reproducible"
    assert picks[0][0] == "r0" and picks[0][1] in {f"r{i}" for i in range(1, 7)}
    outcomes = {tuple(select_evictions(rows(usages), EvictionSettings(capacity=10, seed=s, fallback="least_used"),
                                       "alice")) for s in range(12)}
    assert len(outcomes) > 1, "the fill ignores the seed"


def test_eviction_removes_the_whole_overflow_after_a_bulk_insert():
    kept = survivors([0] * 15, EvictionSettings(capacity=10))  # 5 over capacity > 20 % of 10
    assert len(kept) == 10


def test_bank_evicts_per_user_by_id(tmp_path):
    """Capacity is per user: alice's eviction must not touch bob, and survivors are the expected rows."""
    settings = MemorySettings(eviction=EvictionSettings(capacity=4, fraction=0.5), recall=RecallSettings(k=1))
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), settings=settings, clock=Clock())
    for t in ["bob one", "bob two", "bob three", "bob four"]:
        bank.remember("bob", t, "s")
    for t in ["apple pie", "banana bread", "cherry tart", "date cake"]:
        bank.remember("alice", t, "s")
    for q in ["apple pie", "cherry tart", "date cake"]:  # top-1 recall raises these rows' usage
        bank.recall("alice", q)
    bank.remember("alice", "elderberry jam", "s")  # 5 > 4: two go
    # usages [1, 0, 1, 1, 0]: mean .6, std .49, threshold .11 -> below: banana bread, elderberry jam
    assert [m.text for m in bank.list("alice")] == ["apple pie", "cherry tart", "date cake"]
    assert [m.text for m in bank.list("bob")] == ["bob one", "bob two", "bob three", "bob four"]


# ---- recall ---------------------------------------------------------------------------------------------------

class TagTable:
    """Tag embeddings chosen by hand (unit vectors with given cosines to a reference)."""

    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table

    def __call__(self, tags):
        return np.stack([self.table[t] for t in tags]) if tags else np.zeros((0, 2), dtype=np.float32)


def unit_at(cos: float) -> np.ndarray:
    return np.array([cos, np.sqrt(1 - cos**2)], dtype=np.float32)


def memory(i: int, tags: Tags) -> Memory:
    return Memory(f"m{i}", "u", f"text {i}", tags, 0, float(i), float(i), "chat", np.zeros(2, dtype=np.float32))


def test_rerank_scores_rank_plus_tag_bonus_and_keeps_at_least_n_minus_2():
    embed = TagTable({"python": unit_at(1.0), "risk": np.array([0, 1], np.float32), "py": unit_at(0.76),
                      "snake": unit_at(0.74), "risky": np.array([0, 1], np.float32)})
    tags = [Tags(), Tags(topics=("snake",)), Tags(), Tags(topics=("py",), preferences=("risky",)),
            Tags(entities=("python",))]
    cands = [MemoryCandidate(memory(i, t), i, 0.1 * i) for i, t in enumerate(tags)]
    out = rerank(cands, ["python", "risk"], embed, RecallSettings(top_n=20, k=5))
    # scores: m0 20, m1 19 (cos .74 < .75, no bonus), m2 18, m3 17 + 2 = 19, m4 16 + 1 = 17 (< 18, dropped)
    assert [(r.memory.id, r.score) for r in out] == [("m0", 20), ("m1", 19), ("m3", 19), ("m2", 18)]
    assert [r.memory.id for r in rerank(cands, ["python", "risk"], embed, RecallSettings(k=2))] == ["m0", "m1"]


def test_rerank_counts_each_query_tag_once_by_its_best_match():
    """Three close row tags give +1, not +3; two row tags at cosine .5 each give nothing (no summing)."""
    embed = TagTable({"python": unit_at(1.0), "py": unit_at(0.9), "pyth": unit_at(0.8), "half": unit_at(0.5),
                      "halve": unit_at(0.5)})
    cands = [MemoryCandidate(memory(0, Tags(topics=("py", "pyth"), entities=("python",))), 3, 0.0),
             MemoryCandidate(memory(1, Tags(topics=("half", "halve"))), 4, 0.0)]
    out = rerank(cands, ["python"], embed, RecallSettings(top_n=20, score_margin=5))
    assert [(r.rank_score, r.tag_bonus, r.score) for r in out] == [(17, 1, 18), (16, 0, 16)]


def test_recall_is_per_user_and_marks_usage(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), settings=MemorySettings(recall=RecallSettings(k=1)),
                      clock=Clock())
    bank.remember("alice", "my dog is called Biscuit", "s")
    bank.remember("alice", "I work as a nurse", "s")
    bank.remember("bob", "my dog is called Luna", "s")
    out = bank.recall("alice", "what is my dog called")
    assert out[0].memory.text == "my dog is called Biscuit"
    assert all(r.memory.user_id == "alice" for r in out)
    by_text = {m.text: m for m in bank.list("alice")}
    recalled = {r.memory.text for r in out}
    for text, m in by_text.items():
        assert m.usage_count == (1 if text in recalled else 0)
        assert (m.last_used_at > m.created_at) == (text in recalled)
    assert bank.list("bob")[0].usage_count == 0


def test_recall_of_an_unknown_user_is_empty(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder())
    bank.remember("alice", "alice fact", "s")
    assert bank.recall("nobody", "alice fact") == []


def test_chat_turn_extracts_once_recalls_before_storing_and_uses_the_query_tags(tmp_path):
    llm = ScriptedLLM(lambda p: json.dumps({"memory": message_of(p), "topics": ["pets"]}))
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=llm, clock=Clock())
    bank.remember("u", "my dog is called Biscuit", "s")
    calls = len(llm.prompts)
    turn = bank.remember_and_recall("u", "what is my dog called", "s")
    assert len(llm.prompts) == calls + 1  # one extraction serves recall and storage
    assert [(r.memory.text, r.tag_bonus) for r in turn.recalled] == [("my dog is called Biscuit", 1)]
    assert turn.memory is not None and turn.memory.text == "what is my dog called"
    assert len(bank.list("u")) == 2


class CountingEncoder(HashEncoder):
    """HashEncoder that records the texts of each call."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def encode(self, texts: list[str]) -> torch.Tensor:
        self.calls.append(list(texts))
        return super().encode(texts)


def test_chat_turn_embeds_its_text_once_and_gets_what_recall_and_store_each_embed(tmp_path):
    encoder = CountingEncoder()
    bank = MemoryBank(tmp_path / "bank", encoder, clock=Clock())
    apart = MemoryBank(tmp_path / "apart", HashEncoder(), clock=Clock())
    for b in (bank, apart):
        b.remember("u", "my dog is called Biscuit", "s")
    encoder.calls.clear()
    turn = bank.remember_and_recall("u", "what is my dog called", "s")
    assert encoder.calls == [["what is my dog called"]]  # verbatim: the recall's text is the memory's
    # the same rows as a recall followed by a store, each embedding its own text
    expected = apart.recall("u", "what is my dog called")
    assert [r.memory.text for r in turn.recalled] == [r.memory.text for r in expected]
    assert [m.text for m in bank.list("u")] == ["my dog is called Biscuit", "what is my dog called"]
    stored = bank.store.search("u", HashEncoder().encode(["what is my dog called"])[0].numpy(), 1)[0]
    assert stored.memory.text == "what is my dog called" and stored.distance == pytest.approx(0, abs=1e-6)
    encoder.calls.clear()
    bank.remember_and_recall("u", "my  cat   is Tom", "s")  # stored with its spaces collapsed: two texts
    assert encoder.calls == [["my  cat   is Tom", "my cat is Tom"]]


def test_recall_embeds_the_llms_summary_of_the_query_and_raw_is_a_setting(tmp_path):
    # the question shares no word with the memory it is about; the LLM's summary does ("dog")
    question = "and what was the name again"
    summary = "User asks about their dog Biscuit."

    def reply(prompt: str) -> str:
        message = message_of(prompt)
        return json.dumps({"memory": summary if message == question else message})

    def bank_with(recall_query: str) -> MemoryBank:
        settings = MemorySettings(recall=RecallSettings(k=1), recall_query=recall_query)
        bank = MemoryBank(tmp_path / recall_query, HashEncoder(), llm=ScriptedLLM(reply), settings=settings,
                          clock=Clock())
        for text in ["my dog is called Biscuit", "the name again of that film was Heat", "I work as a nurse"]:
            bank.remember("u", text, "s")
        return bank

    paper = bank_with("summary")
    assert [r.memory.text for r in paper.recall("u", question)] == ["my dog is called Biscuit"]
    assert paper.recall_inputs["summary"] == 1
    raw = bank_with("raw")
    assert [r.memory.text for r in raw.recall("u", question)] == ["the name again of that film was Heat"]
    assert raw.recall_inputs["raw"] == 1
    # an unusable LLM answer: the raw query is embedded, and counted as a fallback
    broken = MemoryBank(tmp_path / "broken", HashEncoder(), llm=ScriptedLLM(lambda p: "no json"),
                        settings=MemorySettings(recall=RecallSettings(k=1)), clock=Clock())
    broken.remember("u", "the name again of that film was Heat", "s")
    assert [r.memory.text for r in broken.recall("u", question)] == ["the name again of that film was Heat"]
    assert broken.recall_inputs["raw_fallback"] == 1
    with pytest.raises(ValueError, match="recall_query"):
        MemorySettings(recall_query="query")


def test_recall_where_the_tag_rerank_changes_the_order(tmp_path):
    # the vector search ranks the pasta memory first; the query's two tags match the other memory's tags, so
    # 19 + 2 beats 20 + 0 and the order flips; without tags the vector order stays
    def reply(prompt: str) -> str:
        message = message_of(prompt)
        tags = {"topics": ["dogs"], "preferences": ["walks"]} if "dog" in message else {"topics": ["food"]}
        return json.dumps({"memory": message, **tags})

    settings = MemorySettings(recall=RecallSettings(k=2), recall_query="raw")
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=ScriptedLLM(reply), settings=settings, clock=Clock())
    bank.remember("u", "I cook pasta every evening before long evening walks", "s")
    bank.remember("u", "my dog needs long walks", "s")
    query = "long evening walks in the evening"
    untagged = bank.recall("u", query, tags=Tags())
    assert [r.memory.text for r in untagged] == ["I cook pasta every evening before long evening walks",
                                                 "my dog needs long walks"]
    tagged = bank.recall("u", query, tags=Tags(topics=("dogs",), preferences=("walks",)))
    assert [(r.memory.text, r.score) for r in tagged] == [("my dog needs long walks", 21),
                                                          ("I cook pasta every evening before long evening walks", 20)]


def test_concurrent_writers_lose_and_duplicate_nothing(tmp_path):
    """Threads of a service writing for several users at once through one bank."""
    from concurrent.futures import ThreadPoolExecutor

    bank = MemoryBank(tmp_path / "bank", HashEncoder())

    def chat(user: str) -> None:
        for i in range(6):
            bank.remember(user, f"{user} fact {i}", "s")
            bank.recall(user, f"{user} fact")

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(chat, ["a", "b", "c"]))
    for user in ["a", "b", "c"]:
        assert sorted(m.text for m in bank.list(user)) == [f"{user} fact {i}" for i in range(6)]
        assert len(bank.turns(user)) == 6


@pytest.mark.parametrize("index_type", ["hnsw_sq", "ivf_flat"])
def test_vector_index_is_built_past_the_threshold_and_search_stays_per_user(tmp_path, index_type):
    store = MemoryStore(tmp_path / "bank", dim=16, settings=StoreSettings(index_min_rows=300, index_type=index_type))
    vs = np.stack([vec(16, i) for i in range(320)])
    store.add_memories("alice", [NewMemory(f"a{i}", vs[i]) for i in range(160)])
    assert not store.maybe_index() and not store.has_vector_index()  # 160 < 300: flat search
    store.add_memories("bob", [NewMemory(f"b{i}", vs[i]) for i in range(160, 320)])
    assert store.maybe_index() and store.has_vector_index()
    assert not store.maybe_index()  # once
    hits = store.search("bob", vs[200], 20)
    assert hits[0].memory.text == "b200" and {c.memory.user_id for c in hits} == {"bob"} and len(hits) == 20


def test_small_commits_are_compacted_every_optimize_every_commits(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), settings=MemorySettings(store=StoreSettings(optimize_every=4)))
    for i in range(3):  # 3 memories + 3 turns = 6 commits: compaction ran once, at the 4th
        bank.remember("u", f"fact {i}", "s")
    assert bank.store.memories.stats()["fragment_stats"]["num_fragments"] < 3
    assert len(bank.list("u")) == 3 and len(bank.turns("u")) == 3


@pytest.mark.filterwarnings("ignore:optimize\\(cleanup_older_than=0\\):UserWarning")  # LanceDB: 0 is for a sole writer
def test_a_compaction_removes_the_table_versions_older_than_keep_versions_s(tmp_path):
    def bank_keeping(keep) -> MemoryBank:
        store = StoreSettings(optimize_every=4, keep_versions_s=keep)
        return MemoryBank(tmp_path / str(keep), HashEncoder(), settings=MemorySettings(store=store))

    pruned, kept = bank_keeping(0), bank_keeping(None)
    for bank in (pruned, kept):
        for i in range(2):  # 2 memories + 2 turns = 4 commits: one compaction, after the last
            bank.remember("u", f"fact {i}", "s")
    assert len(pruned.store.memories.list_versions()) == 1  # the compaction's, every older one removed
    assert len(kept.store.memories.list_versions()) > 2
    assert [m.text for m in pruned.list("u")] == [m.text for m in kept.list("u")] == ["fact 0", "fact 1"]
    with pytest.raises(ValueError, match="keep_versions_s"):
        StoreSettings(keep_versions_s=-1)


def test_recalls_usage_marks_are_kept_and_written_together_in_one_commit_every_usage_every_recalls(tmp_path):
    """Reads in the process see each recall's marks at once; the table (another connection) sees them when
    `usage_every` recalls are kept, in one commit, with each row's own count and its last recall's time."""
    store = MemoryStore(tmp_path / "bank", dim=8, clock=Clock(), settings=StoreSettings(usage_every=3))
    other = MemoryStore(tmp_path / "bank", dim=8)  # another process's connection
    a, b = add(store, "alice", ["a", "b"])
    version = store.memories.version
    store.note_used("alice", [a.id, b.id])
    store.note_used("alice", [a.id])
    mine = {m.text: m for m in store.list_memories("alice")}
    assert (mine["a"].usage_count, mine["b"].usage_count) == (2, 1) and mine["a"].last_used_at > mine["b"].last_used_at
    assert [c.memory.usage_count for c in store.search("alice", a.vector, 1)] == [2]
    assert store.memories.version == version and {m.usage_count for m in other.list_memories("alice")} == {0}
    store.note_used("alice", [b.id])  # the third recall: all three written
    assert store.memories.version == version + 1
    theirs = {m.text: m for m in other.list_memories("alice")}
    assert {t: (m.usage_count, m.last_used_at) for t, m in theirs.items()} == {
        t: (m.usage_count, m.last_used_at) for t, m in {m.text: m for m in store.list_memories("alice")}.items()}
    assert (theirs["a"].usage_count, theirs["b"].usage_count) == (2, 2)
    assert store.write_usage() == 0 and store.memories.version == version + 1  # nothing kept: no commit
    at_once = MemoryStore(tmp_path / "bank", dim=8, settings=StoreSettings(usage_every=1))
    at_once.note_used("alice", [a.id])  # 1: each recall's own update
    assert store.memories.version == version + 2 and [m.usage_count for m in other.list_memories("alice", [a.id])] == [3]
    with pytest.raises(ValueError, match="usage_every"):
        StoreSettings(usage_every=0)


def test_a_usage_write_never_brings_back_a_row_deleted_while_its_marks_were_kept(tmp_path):
    store = MemoryStore(tmp_path / "bank", dim=8, clock=Clock(), settings=StoreSettings(usage_every=100))
    a, b = add(store, "alice", ["a", "b"])
    (c,) = add(store, "bob", ["c"], seed=7)
    store.note_used("alice", [a.id, b.id])
    store.note_used("bob", [c.id])
    MemoryStore(tmp_path / "bank", dim=8).delete_memories("alice", [a.id])  # another process deletes one
    assert store.write_usage() == 2
    assert [(m.text, m.usage_count) for m in store.list_memories("alice")] == [("b", 1)]
    assert [m.usage_count for m in store.list_memories("bob")] == [1]
    assert store.memories.count_rows() == 2
    store.note_used("bob", [c.id])
    store.delete_user("bob")  # the marks of a deleted user go with it
    assert store.write_usage() == 0 and store._usage._marks == {}


def test_a_compaction_and_the_banks_close_write_the_usage_marks_kept(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder(),
                      settings=MemorySettings(store=StoreSettings(usage_every=100, optimize_every=0)))
    bank.remember("u", "I like green tea", "s")
    other = MemoryStore(tmp_path / "bank", dim=HashEncoder.dim)
    bank.recall("u", "green tea")
    assert [m.usage_count for m in other.list_memories("u")] == [0]
    bank.store.optimize()
    assert [m.usage_count for m in other.list_memories("u")] == [1]
    bank.recall("u", "green tea")
    bank.close()
    assert [m.usage_count for m in other.list_memories("u")] == [2] == [m.usage_count for m in bank.list("u")]


def test_a_process_that_never_closes_its_bank_writes_the_usage_marks_it_kept_as_it_ends(tmp_path):
    """An evaluation's recalls: no close, no compaction, fewer recalls than `usage_every`."""
    store = MemoryStore(tmp_path / "bank", dim=8)
    (a,) = add(store, "alice", ["a"])
    script = ("import sys; from persrag_lightning.memory.store import MemoryStore\n"
              "store = MemoryStore(sys.argv[1], dim=8)\n"
              "store.note_used('alice', [sys.argv[2]]); store.note_used('alice', [sys.argv[2]])\n"
              "assert store.memories.version == int(sys.argv[3])\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bank"), a.id, str(store.memories.version)],
                          check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [m.usage_count for m in store.list_memories("alice")] == [2]


# ---- extraction -----------------------------------------------------------------------------------------------

def test_parse_extraction_accepts_json_with_prose_fences_nested_tags_and_strings():
    answer = ('Sure! ```json\n{"memory": "The user prefers Python.", "tags": {"topics": "coding, tools", '
              '"entities": ["Python", "Python", ""], "preferences": ["python"]}}\n```')
    e = parse_extraction(answer, "I like python")
    assert e.parsed and e.memory == "The user prefers Python."
    assert e.tags == Tags(topics=("coding", "tools"), entities=("Python",), preferences=("python",))


def test_cut_off_answers_are_repaired_from_their_complete_strings():
    """SmolLM2-135M's usual answer: a tag repeated until max_new_tokens, so the JSON never closes."""
    answer = ('{"memory": "I prefer high-risk \\"bold\\" strategies.", "entities": ["stocks"], "topics": '
              '["High-Risk Investing", "High-Risk Investing", "High-Risk Inv')
    e = parse_extraction(answer, "msg")
    assert (e.parsed, e.repaired) == (True, True)
    assert e.memory == 'I prefer high-risk "bold" strategies.'
    assert e.tags == Tags(topics=("High-Risk Investing",), entities=("stocks",))
    extractor = Extractor(ScriptedLLM(lambda p: answer))
    extractor.extract("msg")
    assert (extractor.calls, extractor.fallbacks, extractor.repaired) == (1, 0, 1)


@pytest.mark.parametrize("answer", ["I cannot do that.", '{"memory": 3}', "[1, 2]", '{"memory": "unterminated'])
def test_unusable_answers_fall_back_to_the_message_and_are_counted(answer):
    extractor = Extractor(ScriptedLLM(lambda p: answer))
    e = extractor.extract("  I prefer   high risk strategies ")
    assert (e.memory, e.tags, e.parsed) == ("I prefer high risk strategies", Tags(), False)
    assert (extractor.calls, extractor.fallbacks) == (1, 1)


def test_extraction_is_constrained_to_its_json_schema_where_the_backend_can(tmp_path):
    from persrag_lightning.memory.extract import extraction_schema

    class SchemaLLM(ScriptedLLM):
        supports_json_schema = True

        def __init__(self, reply) -> None:
            super().__init__(reply)
            self.schemas: list = []

        def generate(self, prompts, max_new_tokens, json_schema=None):
            self.schemas.append(json_schema)
            return super().generate(prompts, max_new_tokens)

    llm = SchemaLLM(lambda p: json.dumps({"memory": message_of(p), "topics": ["x"]}))
    assert Extractor(llm, json_schema=True).extract("I like tea").parsed and llm.schemas == [extraction_schema()]
    schema = extraction_schema()
    assert schema["required"] == ["memory", "topics", "entities", "query_type", "intent", "preferences"]
    Extractor(llm).extract("I like tea")
    assert llm.schemas[-1] is None  # the default: the seed's free decoding, parsed afterwards
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=llm,
                      settings=MemorySettings(constrained_extraction=True))
    bank.remember("u", "I like tea", "s")
    assert llm.schemas[-1] == extraction_schema()
    plain = ScriptedLLM(lambda p: json.dumps({"memory": "m"}))  # no schema support: generate without it
    assert Extractor(plain, json_schema=True).extract("I like tea").memory == "m"


def test_prompt_carries_recent_turns_of_both_roles():
    llm = identity_llm()
    bank_turns = []
    extractor = Extractor(llm, history_turns=2)
    from persrag_lightning.memory.records import Turn

    for i, role in enumerate(["user", "assistant", "user"]):
        bank_turns.append(Turn(str(i), "s", "u", role, f"turn {i}", float(i)))
    extractor.extract("new message", bank_turns)
    assert llm.prompts == [build_prompt("new message", bank_turns[-2:])]
    assert "assistant: turn 1" in llm.prompts[0] and "turn 0" not in llm.prompts[0]


def test_remember_logs_turns_uses_session_history_and_skips_empty_memories(tmp_path):
    llm = ScriptedLLM(lambda p: json.dumps({"memory": "" if "weather" in message_of(p) else message_of(p),
                                            "topics": ["t"]}))
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=llm, clock=Clock())
    assert bank.remember("u", "what's the weather", "s1") is None  # nothing about the user: no memory
    bank.log_turn("u", "s1", "assistant", "sunny")
    m = bank.remember("u", "I love hiking", "s1")
    assert m is not None and m.text == "I love hiking" and m.tags.topics == ("t",)
    assert "assistant: sunny" in llm.prompts[-1] and "user: what's the weather" in llm.prompts[-1]
    assert [(t.role, t.text) for t in bank.turns("u", "s1")] == [
        ("user", "what's the weather"), ("assistant", "sunny"), ("user", "I love hiking")]
    assert [x.text for x in bank.list("u")] == ["I love hiking"]
    assert bank.fallbacks == 0


def test_the_turn_log_past_its_bound_is_trimmed_back_below_it_not_at_every_turn(tmp_path, monkeypatch):
    """Never more than max_turns_per_user turns; a trim brings the user back to trim_turns_to of it, so the turns
    after it pay no scan and no delete commit until the bound is passed again (1.0: a trim every turn)."""
    settings = MemorySettings(max_turns_per_user=10, trim_turns_to=0.5)
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), settings=settings, clock=Clock())
    deletes = []
    monkeypatch.setattr(bank.store.sessions, "delete", lambda *a, _f=bank.store.sessions.delete: deletes.append(a)
                        or _f(*a))
    sizes = []
    for i in range(22):
        bank.log_turn("u", "s", "assistant", f"turn {i}")
        sizes.append(len(bank.turns("u")))
    assert max(sizes) == 10 and sizes[10] == 5 and sizes[16] == 5 and len(deletes) == 2
    assert [t.text for t in bank.turns("u")][-1] == "turn 21" and len(bank.turns("u")) == 10
    every_turn = MemoryBank(tmp_path / "other", HashEncoder(), settings=MemorySettings(max_turns_per_user=10,
                                                                                      trim_turns_to=1.0))
    for i in range(12):
        every_turn.log_turn("u", "s", "assistant", f"turn {i}")
    assert [t.text for t in every_turn.turns("u")] == [f"turn {i}" for i in range(2, 12)]
    one = MemoryBank(tmp_path / "one", HashEncoder(), settings=MemorySettings(max_turns_per_user=1))
    for i in range(3):  # 0.9 of a bound of 1 rounds to none: the turn just logged still stays
        one.log_turn("u", "s", "assistant", f"turn {i}")
    assert [t.text for t in one.turns("u")] == ["turn 2"]
    with pytest.raises(ValueError, match="trim_turns_to"):
        MemorySettings(trim_turns_to=0)


@pytest.mark.parametrize("bad", ["", "   ", "x" * 9000, "bad \udcff surrogate"])
def test_bad_messages_are_rejected_and_nothing_is_stored(tmp_path, bad):
    bank = MemoryBank(tmp_path / "bank", HashEncoder())
    with pytest.raises(ValueError):
        bank.remember("u", bad, "s")
    assert bank.list("u") == [] and bank.turns("u") == []


def test_questionnaire_seeds_memories_tagged_by_category(tmp_path):
    llm = ScriptedLLM(lambda p: json.dumps({"memory": "The user " + message_of(p).lower(),
                                            "preferences": ["hands-on"]}))
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=llm, clock=Clock())
    with pytest.raises(ValueError, match="unknown questionnaire categories"):
        bank.add_user("u", {"favourite_colour": "blue"})
    stored = bank.add_user("u", {"goals": "Run a marathon.", "learning": "Learns best by building things.",
                                 "hobbies_lifestyle": "   "})
    assert [(m.text, m.tags.topics, m.source) for m in stored] == [
        ("The user learns best by building things.", ("learning",), "questionnaire"),
        ("The user run a marathon.", ("goals",), "questionnaire"),
    ]
    assert all(m.tags.preferences == ("hands-on",) for m in stored)
    assert "What are you learning" in llm.prompts[0]  # the question is the context of the answer
    with pytest.raises(UserExistsError):
        bank.add_user("u", {"goals": "again"})
    assert len(bank.list("u")) == 2


def test_questionnaire_without_llm_stores_answers_verbatim(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder())
    stored = bank.add_user("u", {"interaction_style": "Be blunt.", "professional_background": "Nurse."})
    assert [(m.text, m.tags.topics) for m in stored] == [("Be blunt.", ("interaction_style",)),
                                                         ("Nurse.", ("professional_background",))]


def test_delete_memory_and_user_through_the_bank(tmp_path):
    bank = MemoryBank(tmp_path / "bank", HashEncoder())
    a = bank.remember("alice", "alice fact", "s")
    b = bank.remember("bob", "bob fact", "s")
    assert not bank.delete_memory("alice", b.id)  # bob's memory is not alice's to delete
    assert bank.delete_memory("alice", a.id) and bank.list("alice") == []
    assert bank.delete_user("bob") == (1, 1)
    assert bank.list("bob") == [] and bank.turns("bob") == []


# ---- simulation -----------------------------------------------------------------------------------------------

def test_simulated_conversations_are_seeded_and_plant_distinct_slots():
    a, b = simulate_conversations(5, seed=3), simulate_conversations(5, seed=3)
    assert a == b and a != simulate_conversations(5, seed=4)
    for conv in a:
        assert len({f.slot for f in conv.facts}) == 3
        assert all(f.statement in conv.messages for f in conv.facts)


def test_recall_at_k_over_simulated_conversations(tmp_path):
    convs = simulate_conversations(6, facts_per_user=3, seed=0)
    bank = MemoryBank(tmp_path / "bank", HashEncoder(), llm=identity_llm(), clock=Clock())
    report = measure_recall(bank, convs)
    assert report.questions == 18 and report.foreign == 0 and report.fallbacks == 0
    assert report.recall_at_k >= 0.9 and 0 < report.mrr <= report.recall_at_k


@pytest.mark.slow
def test_real_minilm_recalls_a_paraphrased_fact(tmp_path):
    from persrag_lightning.models.text_encoder import TextEncoder

    bank = MemoryBank(tmp_path / "bank", TextEncoder.from_pretrained("minilm"))
    for text in ["I prefer high risk investment strategies.", "I use Python, Vue and Flask.",
                 "I learn best by building things.", "My sister lives in Lyon."]:
        bank.remember("u", text, "s")
    out = bank.recall("u", "How should I invest my savings?")
    assert out[0].memory.text == "I prefer high risk investment strategies."


# ---- row counts kept between commits --------------------------------------------------------------------------

def test_kept_row_counts_follow_every_write_without_counting_again(store, monkeypatch):
    """Eviction's and the turn trim's counts move with the store's own commits: after each write they equal a
    fresh count_rows of the table, and no write made the store count again."""
    def fresh(table, user: str) -> int:
        return table.count_rows(user_filter(user).to_sql())

    add(store, "alice", ["a1", "a2"])
    add(store, "bob", ["b1"])
    store.add_turn("alice", "s", "user", "q")
    assert store.count("alice") == 2 and store.count("bob") == 1 and store.trim_turns("alice", keep=5) == 0
    counted = []
    for table in (store.memories, store.sessions):
        monkeypatch.setattr(table, "count_rows", lambda *a, _f=table.count_rows, **k: counted.append(a) or _f(*a, **k))
    first = add(store, "alice", ["a3", "a4", "a5"], seed=5)
    store.mark_used("alice", [first[0].id])
    store.delete_memories("alice", [first[1].id])
    for i in range(4):
        store.add_turn("alice", "s", "assistant", f"answer {i}")
    assert store.trim_turns("alice", keep=3) == 2
    store.add_turn("bob", "s", "user", "q")
    assert store.count("alice") == 4 and store.count("bob") == 1
    assert store.trim_turns("alice", keep=3) == 0
    assert counted == []  # every count above was the kept one
    assert store.count("alice") == fresh(store.memories, "alice") == 4
    assert len(store.turns("alice")) == fresh(store.sessions, "alice") == 3
    assert store.delete_user("alice") == (4, 3) and store.count("alice") == 0


def test_a_commit_by_another_writer_makes_the_kept_counts_be_read_again(tmp_path):
    first = MemoryStore(tmp_path / "bank", dim=8, clock=Clock())
    add(first, "u", ["m1"])
    assert first.count("u") == 1
    other = MemoryStore(tmp_path / "bank", dim=8, clock=Clock())  # another process's connection
    add(other, "u", ["m2", "m3"], seed=3)
    assert first.count("u") == 3
    add(first, "u", ["m4"], seed=9)  # two commits since the kept count: read again, not moved by one
    assert first.count("u") == 4 and other.count("u") == 4


def test_counts_read_again_come_from_one_scan_of_every_user(store, monkeypatch):
    """After a version the store did not make itself (its compaction), every user's count is read in one scan of
    the user column, not one count_rows per user, and no user's id reaches SQL (a hostile id counts its own)."""
    add(store, "alice", ["a1", "a2"])
    add(store, EVIL, ["e1"], seed=3)
    store.add_turn("alice", "s", "user", "q")
    assert store.count("alice") == 2
    store.optimize()  # new versions: the kept counts are dropped
    scans, counted = [], []
    for kept in (store._memory_counts, store._turn_counts):
        monkeypatch.setattr(kept, "_count_all", lambda _f=kept._count_all: scans.append(1) or _f())
    for table in (store.memories, store.sessions):
        monkeypatch.setattr(table, "count_rows", lambda *a, **k: counted.append(a))
    assert (store.count("alice"), store.count(EVIL), store.count("nobody")) == (2, 1, 0)
    assert store.trim_turns("alice", keep=5) == 0 and store.trim_turns(EVIL, keep=5) == 0
    assert len(scans) == 2 and counted == []  # one scan per table for every user asked
