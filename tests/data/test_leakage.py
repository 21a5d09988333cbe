"""No path by which a query sees its own answer or a later profile (docs/data/history-rules.md).

The fixture is a LaMP-2 folder in which every user's questions carry different profiles, as the time-based split
does: the dev profile holds the train question's item (with its label), the test profile holds the dev question's
item, and user `a`'s test profile even holds that test question's own item. Every strategy and the feedback
builder are run on every split, and each retrieved doc is checked by id against the rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import visible_histories
from persrag_lightning.data.lamp import load_lamp
from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.feedback.builder import FeedbackBuilder
from persrag_lightning.feedback.settings import CandidateSettings, FeedbackSettings
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.user_encoder import UserEncoder, UserEncoderConfig
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.baselines import BM25, Dense, RandomDocs, Recency
from persrag_lightning.retrieval.cfrag import CFRAG
from persrag_lightning.retrieval.corpus_retriever import EncoderRetriever
from persrag_lightning.retrieval.pbr import PBRSettings, expand_query, user_anchor
from persrag_lightning.retrieval.pbr_strategy import PBRExpansion, PBRStrategy
from persrag_lightning.retrieval.strategies import strategy_config

USERS = ("a", "b", "c", "d")
PROMPT = "Which tag does this movie relate to among the following tags? tags: [...] description: "
WORDS = ("heist", "robot", "dragon", "detective", "pirate", "ghost", "alien", "knight")


def item(doc_id: str, day: int, text: str, tag: str) -> dict:
    return {"id": doc_id, "date": f"2010-01-{day:02d}", "description": text, "tag": tag}


def write_fixture(root: Path) -> Path:
    """train q1 ⊂ dev q2 (+ q1's item) ⊂ test q3 (+ q2's item; for `a` also q3's own item)."""
    questions = {"train": [], "dev": [], "test": []}
    golds = {"train": [], "dev": [], "test": []}
    for n, user in enumerate(USERS):
        base = [item(f"{user}-d{i}", 1 + i, f"a {WORDS[(n + i) % 8]} film number {i} of {user}",
                     LAMP2_LABELS[(n + i) % 5]) for i in range(6)]
        texts = {q: f"a {WORDS[n]} {WORDS[(n + 3) % 8]} film asked in {q} by {user}" for q in ("q1", "q2", "q3")}
        tags = {"q1": LAMP2_LABELS[7], "q2": LAMP2_LABELS[8], "q3": LAMP2_LABELS[9]}
        own = {q: item(f"{user}-{q}", 10 + i, texts[q], tags[q]) for i, q in enumerate(("q1", "q2", "q3"))}
        profiles = {"train": base, "dev": base + [own["q1"]], "test": base + [own["q1"], own["q2"]]}
        if user == "a":
            profiles["test"] = profiles["test"] + [own["q3"]]
        for split, q in (("train", "q1"), ("dev", "q2"), ("test", "q3")):
            questions[split].append({"id": f"{user}-{q}", "input": PROMPT + texts[q], "user_id": user,
                                     "profile": profiles[split]})
            golds[split].append({"id": f"{user}-{q}", "output": tags[q]})
    for split, records in questions.items():
        (root / f"{split}_questions.json").write_text(json.dumps(records))
        (root / f"{split}_outputs.json").write_text(json.dumps({"task": "LaMP_2", "golds": golds[split]}))
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_bert):
    root = write_fixture(tmp_path_factory.mktemp("leaky_lamp"))
    dataset = load_lamp(root, "LaMP-2")
    corpus = Corpus.from_dataset(dataset)
    cache = tmp_path_factory.mktemp("cache")
    build_corpus_embeddings(corpus, cache, encoder=tiny_bert, max_length=64)
    docs = load_corpus_embeddings(cache, corpus, encoder=tiny_bert, max_length=64)
    pools = visible_histories(dataset, corpus).pool
    torch.manual_seed(0)
    encoder = UserEncoder(UserEncoderConfig(dim=docs.shape[1], num_docs=len(corpus), text_encoder=tiny_bert,
                                            text_max_length=64), docs).eval()
    users = sorted(pools)
    encoder.index_users(users, torch.stack([docs[pools[u]].mean(0) for u in users]))
    encoder.save_pretrained(cache / "user_encoder")
    return dataset, corpus, str(cache), str(cache / "user_encoder")


def allowed(dataset, example_id: str) -> dict[str, set[str]]:
    """The rules, spelled out independently of data/histories.py: owner → doc ids the example may see."""
    examples = {e.example_id: e for es in dataset.examples.values() for e in es}
    ex = examples[example_id]
    out = {ex.user_id: set(ex.profile) - {example_id}}
    for user in USERS:
        if user != ex.user_id:
            out[user] = set(examples[f"{user}-q1"].profile)  # the earliest train/dev profile: train's
    return out


def check(dataset, example_id: str, docs) -> None:
    rules = allowed(dataset, example_id)
    for d in docs:
        assert d.doc_id != example_id, f"{example_id} retrieved its own item"
        assert d.doc_id in rules[d.owner], f"{example_id} retrieved {d.doc_id} of {d.owner}: not visible to it"


def all_queries(dataset) -> list[Query]:
    return [Query(e.user_id, e.query, e.input, e.example_id) for es in dataset.examples.values() for e in es]


def test_fixture_has_the_leaks_it_guards_against(world):
    """Without the rules these docs would be reachable: a later question's item with its label, an own item."""
    dataset, corpus, _, _ = world
    every_doc = set(corpus.doc_ids)
    assert {"a-q1", "a-q2", "a-q3", "b-q2"} <= every_doc
    own = visible_histories(dataset, corpus).own
    assert "a-q3" not in {corpus.doc_ids[r] for r in own["a-q3"]} and len(own["a-q3"]) == 8


@pytest.mark.parametrize("make", [lambda c, b: RandomDocs(), lambda c, b: Recency(), lambda c, b: BM25(),
                                  lambda c, b: Dense(b, c, max_length=64)], ids=["random", "recency", "bm25", "dense"])
def test_own_history_baselines_see_only_the_question_profile(world, tiny_bert, make):
    dataset, corpus, cache, _ = world
    strategy = make(cache, tiny_bert)
    strategy.prepare(DocStore(dataset, corpus))
    queries = all_queries(dataset)
    for q, docs in zip(queries, strategy.retrieve(queries, 20)):  # k larger than any profile: everything visible
        check(dataset, q.example_id, docs)
        assert {d.doc_id for d in docs} == allowed(dataset, q.example_id)[q.user_id]


def test_pbr_strategy_sees_only_the_question_profile(world, tiny_bert, tmp_path):
    dataset, corpus, _, _ = world
    strategy = PBRStrategy(variant="PBR w/o P-PRF", settings=PBRSettings(theta=0.0), encoder=tiny_bert,
                           max_length=64, cache_dir=str(tmp_path))
    strategy.prepare(DocStore(dataset, corpus))
    queries = all_queries(dataset)
    for q, docs in zip(queries, strategy.retrieve(queries, 20)):
        check(dataset, q.example_id, docs)
        assert {d.doc_id for d in docs} == allowed(dataset, q.example_id)[q.user_id]


def test_cfrag_with_pbr_expansion_searches_q_star_within_the_rules(world, tiny_bert, tiny_llm, tmp_path):
    """`query_expansion: pbr`: the first stage searches q* = q + c (the anchor of the query's own profile, in the
    retriever's space) — checked against the seed's equations by hand — and P-PRF runs through the LLM cache."""
    dataset, corpus, cache, user_encoder = world
    store = DocStore(dataset, corpus)
    settings = PBRSettings(theta=0.0, utterance_tokens=8, reasoning_tokens=8)
    plain = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=3, cache_dir=cache)
    anchored = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=3, cache_dir=cache, query_expansion="pbr",
                     pbr=PBRExpansion("PBR w/o P-PRF", settings, cache_dir=str(tmp_path / "a")))
    full = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=3, cache_dir=cache, query_expansion="pbr",
                 pbr=PBRExpansion("PBR", settings, llm_model=tiny_llm, cache_dir=str(tmp_path / "f")))
    for s in (plain, anchored, full):
        s.prepare(store)
    queries = all_queries(dataset)
    q = queries[0]
    vector = plain.retriever.query_vectors([q.query])
    rows = store.rows(q.user_id, query=q)
    anchor, _ = user_anchor(plain.retriever.doc_vectors[torch.as_tensor(rows)].numpy(), settings)
    got = anchored.source.query_transform([q], vector)[0].numpy()
    assert got == pytest.approx(expand_query(vector[0].numpy(), anchor), abs=1e-5)
    assert full.source.query_transform([q], vector)[0].numpy() != pytest.approx(got, abs=1e-4)  # + w1 f + w2 r

    plain_ids = [[d.doc_id for d in c] for c in plain.candidates(queries)]
    moved = 0
    for strategy in (anchored, full):
        for q, cands, before in zip(queries, strategy.candidates(queries), plain_ids):
            check(dataset, q.example_id, cands)
            moved += [d.doc_id for d in cands] != before
    assert moved > 0  # q* changes what the first stage finds
    stats = full.source.query_transform.pbr.stats
    assert stats.llm_calls > 0 and stats.llm_hits > 0  # P-PRF answers through the cache: the second pass hit it


@pytest.mark.parametrize("users", ["encoder", "mean"])
def test_cfrag_candidates_and_final_docs_follow_the_rules(world, tiny_bert, users):
    dataset, corpus, cache, user_encoder = world
    strategy = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=20, users=users, cache_dir=cache)
    key = strategy_config(strategy)
    strategy.prepare(DocStore(dataset, corpus))
    assert strategy_config(strategy) == key  # retrieval caches are keyed before and read after prepare
    queries = all_queries(dataset)
    seen_others = 0
    for q, cands in zip(queries, strategy.candidates(queries)):
        check(dataset, q.example_id, cands)
        seen_others += sum(d.owner != q.user_id for d in cands)
    assert seen_others > 0  # the collaborative path was exercised
    for q, docs in zip(queries, strategy.retrieve(queries, 5)):
        check(dataset, q.example_id, docs)


def test_feedback_candidates_follow_the_rules(world, tiny_bert, tiny_llm, tmp_path):
    dataset, corpus, cache, user_encoder = world
    builder = FeedbackBuilder(dataset, corpus, EncoderRetriever(tiny_bert, corpus, cache, 64),
                              CandidateSettings(user_encoder=str(user_encoder), retriever=tiny_bert, m=4, k=20),
                              FeedbackSettings(LLMConfig(model=tiny_llm, options={"device": "cpu"}), metric="loglik"),
                              tmp_path)
    for split in ("train", "dev"):
        builder.build(split)
        records = builder.load(split)
        assert len(records) == len(USERS)
        for rec in records:
            check(dataset, rec.example_id, rec.candidates)


def test_user_encoder_pools_hold_no_test_profile(world):
    dataset, corpus, _, _ = world
    pools = visible_histories(dataset, corpus).pool
    for user in USERS:
        ids = {corpus.doc_ids[r] for r in pools[user]}
        assert ids == {f"{user}-d{i}" for i in range(6)}


@pytest.mark.parametrize("users", ["encoder", "mean"])
def test_a_user_the_encoders_table_lacks_is_embedded_from_their_own_history(world, tiny_bert, tmp_path, users):
    """On a real log a user whose items are all in their own dev/test profiles has no collaborative pool, so stage 1
    trained no row for them (magazines: 12 of 202 test users): CFRAG embeds them with the trained encoder over their
    own visible history, finds their similar users with that vector, and keeps every history rule."""
    from persrag_lightning.models.user_encoder import UserEncoder

    dataset, corpus, cache, path = world
    encoder = UserEncoder.from_pretrained(path)
    lacking = encoder.user_ids[0]
    kept = encoder.user_ids[1:]
    encoder.index_users(kept, encoder.user_embeddings[1:])
    encoder.save_pretrained(tmp_path / "user_encoder")
    strategy = CFRAG(str(tmp_path / "user_encoder"), tiny_bert, None, m=4, k_per_user=20, users=users, cache_dir=cache)
    store = DocStore(dataset, corpus)
    strategy.prepare(store)
    queries = [q for q in all_queries(dataset) if q.user_id == lacking]
    assert queries and lacking not in strategy.user_row
    neighbours = strategy.similar_users(lacking)
    assert neighbours[0] == (lacking, 1.0) and len(neighbours) == 4 and len({u for u, _ in neighbours}) == 4
    rows = corpus.rows_of(lacking, encoder.config.max_history)
    docs = load_corpus_embeddings(cache, corpus, encoder=tiny_bert, max_length=64)
    expected = encoder.eval().encode_embeddings(docs[rows].float().unsqueeze(0), torch.zeros(1, len(rows), dtype=torch.bool))
    assert torch.allclose(strategy.e_u(lacking), expected.squeeze(0), atol=1e-5)
    for q, cands in zip(queries, strategy.candidates(queries)):
        check(dataset, q.example_id, cands)
        assert {d.owner for d in cands} > {lacking}  # its own docs and its neighbours'
    for q, docs_ in zip(queries, strategy.retrieve(queries, 5)):
        check(dataset, q.example_id, docs_)


@pytest.mark.parametrize("slots", [0, 1, 2])
def test_the_neighbour_gate_keeps_at_most_its_slots_of_neighbours_docs_in_the_chains_order(world, tiny_bert,
                                                                                            slots):
    """The gate (neighbour_slots) filters the chain's own order: the kept docs are that order's first ones, with
    the asker's own docs filling the slots neighbours may not take; it follows the rules like the ungated chain."""
    dataset, corpus, cache, user_encoder = world
    ungated = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=3, cache_dir=cache)
    gated = CFRAG(user_encoder, tiny_bert, None, m=4, k_per_user=3, cache_dir=cache, neighbour_slots=slots)
    assert strategy_config(gated) != strategy_config(ungated)
    store = DocStore(dataset, corpus)
    ungated.prepare(store)
    gated.prepare(store)
    queries = all_queries(dataset)
    full = ungated.retrieve(queries, 12)  # every candidate, in the chain's order
    cut = 0
    for q, docs, every in zip(queries, gated.retrieve(queries, 5), full):
        check(dataset, q.example_id, docs)
        theirs = [d for d in every if d.owner != q.user_id][:slots]
        want = [d for d in every if d.owner == q.user_id or d in theirs][:5]
        assert [d.row for d in docs] == [d.row for d in want]
        assert sum(d.owner != q.user_id for d in docs) <= slots
        cut += sum(d.owner != q.user_id for d in every[:5]) > slots
    assert cut > 0  # the gate shut slots the ungated chain gave neighbours
    with pytest.raises(ValueError, match="neighbour_slots"):
        CFRAG(user_encoder, tiny_bert, None, neighbour_slots=-1)
