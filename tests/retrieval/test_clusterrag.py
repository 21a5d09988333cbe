"""ClusterRAG strategy (modes, degenerate users) and its prompt budget (Eq. 3 with carry-over), on tiny data."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared 2-core machine: faiss/BLAS must not spawn threads

import logging
import tempfile
from pathlib import Path

import faiss
import numpy as np
import pytest

from persrag_lightning.data.records import HistoryDoc, LampDataset, User
from persrag_lightning.llm.profile_budget import (
    BudgetSettings,
    allocate_budget,
    fit_profile,
    profile_budget,
    profile_length,
    query_length,
)
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.cluster_index import ClusterIndex, ClusterIndexSettings, ClusterIndexWarning
from persrag_lightning.retrieval.clusterrag import ClusterRAG, ClusterRAGSettings
from persrag_lightning.retrieval.cohort_settings import CohortSettings
from persrag_lightning.retrieval.cohorts import CohortWarning

faiss.omp_set_num_threads(1)

VOCAB = ["space", "rocket", "crime", "detective", "cooking", "recipe", "jazz", "piano", "opera"]


def words(text: str) -> int:
    """A whitespace tokenizer standing in for the LLM's: one token per word."""
    return len(text.split())


# ---- prompt budget (Eq. 3) ---------------------------------------------------------------------------------

def test_eq3_by_hand():
    # L_max = 512, γ = 0.55: ⌊0.55·512⌋ = ⌊281.6⌋ = 281
    assert profile_length(300) == 512 - 281 == 231  # a long query is capped at 281 tokens
    assert profile_length(100) == 412  # a short one keeps all its tokens
    assert profile_length(281) == 231 and profile_length(282) == 231
    assert profile_length(0) == 512
    # L_max = 200, γ = 0.55: 0.55·200 is 110.00000000000001 in floats; ⌊·⌋ must give 110, not 109 or 111
    assert query_length(500, 200, 0.55) == 110 and profile_length(500, 200, 0.55) == 90
    assert profile_length(50, 64, 0.1) == 64 - 6  # ⌊6.4⌋ = 6
    with pytest.raises(ValueError, match="gamma"):
        profile_length(10, 512, 1.5)


def test_profile_budget_counts_the_llms_tokens():
    # 4 "tokens" by the word counter (a character counter would say 19)
    assert profile_budget("what is this movie", words, BudgetSettings(20, 0.5)) == 16
    assert profile_budget("x " * 30, words, BudgetSettings(20, 0.5)) == 10  # capped at ⌊0.5·20⌋


def test_allocate_budget_carries_unused_tokens_forward():
    # 100 tokens over 3 items: share ⌊100/3⌋ = 33; item 1 needs 10 → 23 carried; item 2 may use 56, needs 50
    # → 6 carried; item 3 may use 39 (needs 80). The division's remainder (1) is not handed out (LaMP's code).
    assert allocate_budget(100, [10, 50, 80]) == [10, 50, 39]
    assert allocate_budget(90, [50, 10, 10]) == [30, 10, 10]  # no carry backwards to an earlier item
    assert allocate_budget(9, [5, 5, 5]) == [3, 3, 3]
    assert allocate_budget(-4, [5]) == [0]
    assert allocate_budget(10, []) == []


def test_fit_profile_truncates_query_then_items():
    query, items = fit_profile(["a b c", "d e f g h i j k l m n o p"], "q r s t", words, BudgetSettings(10, 0.3))
    # ⌊0.3·10⌋ = 3 query tokens; profile 10 − 3 = 7; share 3 each; the first item needs exactly 3
    assert query == "q r s"
    assert items == ["a b c", "d e f"]


def lamp2_doc(i: int, words_in_description: int) -> HistoryDoc:
    return HistoryDoc(f"d{i}", (2020, 1, 1), {"description": " ".join(f"w{i}x{j}" for j in range(words_in_description)),
                                             "tag": "comedy"})


def test_prompt_builder_applies_eq3_in_the_llms_tokens():
    """build_prompt(profile_gamma=γ): the query keeps ⌊γ·L⌋ tokens (L = what the template's fixed text leaves of
    the LLM budget), the profile L − |q| split ⌊·/n⌋ per doc with carry-over (LaMP's rule, not the even split)."""
    import re

    from persrag_lightning.llm.prompts import TABLE4, _render, build_prompt, render_item

    def toks(text: str) -> int:  # the "LLM's tokenizer": words, with ':' and ';' splitting as well
        return len(re.findall(r"[^\s:;]+", text))

    query_words = 400
    raw = 'Which tag does this movie relate to among the following tags? Just answer with the tag name without ' \
          'further explanation. tags: [sci-fi, based on a book, comedy, action, twist ending, dystopia, dark ' \
          'comedy, classic, psychology, fantasy, romance, thought-provoking, social commentary, violence, true ' \
          'story] description: ' + " ".join(f"q{j}" for j in range(query_words))
    docs = [lamp2_doc(0, 3), lamp2_doc(1, 200), lamp2_doc(2, 200)]
    L_total = 302  # 61 fixed tokens, L = 241: ⌊0.55·241⌋ = 132 query tokens, 109 for the profile (mod 3 = 1)
    tp = TABLE4["LaMP-2"]
    fixed = toks(_render(tp, ["", "", ""], "", None))
    L = L_total - fixed  # L_max of Eq. 3 in this builder
    prompt = build_prompt("LaMP-2", raw, docs, toks, L_total, profile_gamma=0.55)
    assert toks(prompt) <= L_total
    query_line = prompt.split("\n")[-1]
    query = query_line.removeprefix('"description":').removesuffix('; "tag":')
    assert toks(query) == int(0.55 * L) == query_length(10_000, L, 0.55)
    # the profile: (L − ⌊0.55 L⌋) tokens, ⌊·/3⌋ each; the short first doc passes its unused share on
    budget = profile_length(10_000, L, 0.55)
    item_fixed = toks(render_item(tp, docs[0], body=""))
    granted = allocate_budget(budget, [item_fixed + 3, item_fixed + 200, item_fixed + 200])
    lines = prompt.split("\n")[1:4]
    assert [toks(x) for x in lines] == granted
    assert granted[1] > granted[2]  # the carried-over tokens go to the next doc only
    from persrag_lightning.llm.prompts import split_budget

    assert budget % 3 and sum(granted) == budget - 1 != sum(split_budget(budget, [6, 203, 203]))  # no remainder
    # CFRAG's builder over the same input gives another prompt (half the tokens to the query, even split)
    assert build_prompt("LaMP-2", raw, docs, toks, L_total) != prompt


def test_evaluate_builds_prompts_with_the_strategys_budget(monkeypatch):
    """Evaluation hands each strategy's γ to the one prompt builder: ClusterRAG rows Eq. 3, the others CFRAG's."""
    from persrag_lightning.evaluation import evaluate

    seen = []

    def spy(task, llm, inputs, docs, max_prompt_tokens, profile_gamma=None):
        seen.append(profile_gamma)
        return ["p"] * len(inputs)

    from persrag_lightning.reading import llm as llm_reading

    monkeypatch.setattr(llm_reading, "build_prompts", spy)  # the one builder, behind the LLM reader
    assert ClusterRAG(AxisEmbedder()).prompt_gamma == 0.55  # the seed's γ by default
    from persrag_lightning.retrieval.baselines import Recency

    assert Recency().prompt_gamma is None
    # run_strategy up to the prompt builder: the LLM is never reached (the reader's answers are stubbed)
    reader = llm_reading.LLMReader(llm_reading.LLMConfig(max_prompt_tokens=64, answer_mode="generate"), llm=object())
    monkeypatch.setattr(reader, "answer_prompts", lambda task, prompts, phase=None: ["comedy"] * len(prompts))
    ev = evaluate.Evaluation.__new__(evaluate.Evaluation)
    ev.task, ev.k = "LaMP-2", 2
    ev.reader_for = lambda strategy: reader
    ev.prompts, ev.out_dir = None, Path(tempfile.mkdtemp())
    ev.source = type("S", (), {"data_dir": Path("synth"), "cache_dir": ev.out_dir / "cache"})()
    store = make_store()
    from persrag_lightning.data.records import Example

    examples = [Example("e1", "s1", "description: space rocket", "space rocket", "comedy", "test")]
    monkeypatch.setattr(evaluate, "write_predictions", lambda *a, **k: None)
    cluster = ClusterRAG(AxisEmbedder(), ClusterRAGSettings("hybrid", CohortSettings(),
                                                            ClusterIndexSettings(method="hdbscan", top_b=4)),
                         cache_dir=ev.out_dir, prompt_gamma=0.7)
    ev.run_strategy(cluster, store, examples, None)
    ev.run_strategy(Recency(), store, examples, None)
    assert seen == [0.7, None]


# ---- the strategy ----------------------------------------------------------------------------------------

class AxisEmbedder:
    """Bag of words over VOCAB (+ a small constant so no vector is zero): topics are orthogonal axes."""

    data_key = ""

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.full((len(texts), len(VOCAB)), 0.01, np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                if w in VOCAB:
                    out[i, VOCAB.index(w)] += 1
        return out

    def doc_vectors(self, store: DocStore) -> np.ndarray:
        return self.embed(store.corpus.texts)

    def query_vectors(self, texts: list[str]) -> np.ndarray:
        return self.embed(texts)


def make_store(extra: dict[str, list[str]] | None = None) -> DocStore:
    """Three cohorts of users (space, crime, cooking), with each user's docs spread over two topics."""
    texts = {
        "s1": ["space rocket launch", "jazz piano night", "space station"],
        "s2": ["rocket space engine", "space walk", "jazz club"],
        "s3": ["space rocket", "rocket fuel space"],
        "c1": ["crime detective story", "detective novel crime"],
        "c2": ["crime scene detective", "crime drama"],
        "k1": ["cooking recipe pasta", "recipe cooking bread"],
        "k2": ["cooking show recipe", "recipe book cooking"],
    }
    texts.update(extra or {})
    users = {u: User(u, [HistoryDoc(f"{u}-{i}", (2020, 1, i + 1), {"description": t, "tag": "comedy"})
                         for i, t in enumerate(docs)]) for u, docs in texts.items()}
    return DocStore(LampDataset("LaMP-2", users))


def strategy(tmp_path, mode: str = "hybrid", top_b: int = 4, **cohort_kwargs) -> ClusterRAG:
    settings = ClusterRAGSettings(mode, CohortSettings(**cohort_kwargs),
                                  ClusterIndexSettings(method="hdbscan", top_b=top_b))
    return ClusterRAG(AxisEmbedder(), settings, cache_dir=tmp_path)


def owners(docs) -> set[str]:
    return {d.owner for d in docs}


def test_name_per_mode(tmp_path):
    assert strategy(tmp_path, "collab").name == "ClusterRAG (collab)"
    with pytest.raises(ValueError, match="mode"):
        ClusterRAG(AxisEmbedder(), ClusterRAGSettings("both"))  # type: ignore[arg-type]


def test_user_mode_reads_only_own_docs(tmp_path):
    s = strategy(tmp_path, "user")
    s.prepare(make_store())
    docs = s.retrieve([Query("s1", "space rocket")], 5)[0]
    assert owners(docs) == {"s1"} and all(d.user_sim == 1.0 for d in docs)
    assert s.cohorts is None  # user-only retrieval needs no cohorts


def test_collab_mode_reads_only_the_top_k_neighbours(tmp_path):
    s = strategy(tmp_path, "collab", top_k_users=1)
    s.prepare(make_store())
    docs = s.retrieve([Query("s1", "space rocket")], 5)[0]
    nb = s.cohorts.neighbours("s1", 1)[0]
    assert nb.user_id in {"s2", "s3"}
    assert owners(docs) == {nb.user_id}
    assert all(d.user_sim == pytest.approx(nb.similarity) for d in docs)


def test_hybrid_mode_mixes_own_and_neighbour_docs(tmp_path):
    s = strategy(tmp_path, "hybrid", top_k_users=2)
    s.prepare(make_store())
    docs = s.retrieve([Query("c1", "crime detective")], 4)[0]
    assert owners(docs) == {"c1", "c2"}
    assert [d.retriever_score for d in docs] == sorted((d.retriever_score for d in docs), reverse=True)


def test_b_restricts_the_ranking_to_the_best_clusters(tmp_path):
    """s1 has space docs and a jazz doc: with B = 1 only the best cluster is searched, so k = 5 gives fewer."""
    one = strategy(tmp_path, "user", top_b=1)
    one.prepare(make_store())
    docs = one.retrieve([Query("s1", "space rocket")], 5)[0]
    assert docs and all("jazz" not in d.text for d in docs) and len(docs) < 3
    every = strategy(tmp_path, "user", top_b=4)
    every.prepare(make_store())
    assert len(every.retrieve([Query("s1", "space rocket")], 5)[0]) == 3


def test_small_top_cluster_gives_fewer_docs_by_default_and_k_with_next_cluster(tmp_path):
    """s1's best cluster holds fewer than its 3 docs (the jazz doc is elsewhere): the seed's rule returns fewer for
    k = 3 and counts the short query; `fill: next_cluster` takes the next clusters and returns 3."""
    fewer = strategy(tmp_path, "user", top_b=1)
    fewer.prepare(make_store())
    got = fewer.retrieve([Query("s1", "space rocket"), Query("k1", "cooking recipe")], 3)
    assert len(got[0]) < 3 and all("jazz" not in d.text for d in got[0]) and len(got[1]) <= 2  # k1 has 2 docs
    assert fewer.notes.queries == 2 and fewer.notes.short_queries == 2
    assert fewer.notes.docs_per_query == pytest.approx((len(got[0]) + len(got[1])) / 2)
    settings = ClusterRAGSettings("user", CohortSettings(),
                                  ClusterIndexSettings(method="hdbscan", top_b=1, fill="next_cluster"))
    filled = ClusterRAG(AxisEmbedder(), settings, cache_dir=tmp_path)
    filled.prepare(make_store())
    docs = filled.retrieve([Query("s1", "space rocket")], 3)[0]
    assert len(docs) == 3 and any("jazz" in d.text for d in docs)
    assert filled.notes.short_queries == 0 and filled.notes.docs_per_query == 3.0


@pytest.mark.parametrize("how", ["removed", "private"])
def test_collab_takes_the_next_neighbour_when_the_nearest_has_no_docs(tmp_path, how, caplog):
    s = strategy(tmp_path, "collab", top_k_users=1)
    store = make_store()
    s.prepare(store)
    first, second = [n.user_id for n in s.cohorts.neighbours("s1", 2)]
    if how == "removed":
        store.remove_user(first)
    else:
        store.set_share(first, False)
    with caplog.at_level(logging.WARNING):
        docs = s.retrieve([Query("s1", "space rocket")], 5)[0]
    assert docs and owners(docs) == {second}
    assert s.notes.skipped_neighbours == 1 and "next one" in caplog.text
    assert s.notes.no_neighbours == 0


def test_unknown_query_user_gets_no_docs_and_a_message(tmp_path, caplog):
    s = strategy(tmp_path, "hybrid")
    s.prepare(make_store())
    with caplog.at_level(logging.WARNING):
        got = s.retrieve([Query("ghost", "space", example_id="e7"), Query("ghost2", "space")], 3)
    assert got == [[], []]
    assert "'ghost'" in caplog.text and "'e7'" in caplog.text and "unknown" in caplog.text
    assert s.notes.unknown_users == 2


def test_user_without_docs(tmp_path, caplog):
    s = strategy(tmp_path, "hybrid")
    with caplog.at_level(logging.WARNING):
        s.prepare(make_store({"empty": []}))
    assert "no docs" in caplog.text and "'empty'" in caplog.text
    assert "empty" not in s.cohorts  # no MEAN vector
    assert s.retrieve([Query("empty", "space")], 3) == [[]]
    assert s.notes.users_without_docs == 1 and s.notes.no_vector == 1


def test_user_without_docs_gets_collab_docs_from_a_given_user_vector(tmp_path):
    """With trained user embeddings (CFRAG's) a cold-start user has a vector, hence neighbours."""
    store = make_store({"cold": []})
    emb = AxisEmbedder()
    ids = store.corpus.user_ids
    table = emb.doc_vectors(store)
    vectors = np.stack([table[store.rows(u)].mean(0) if len(store.rows(u)) else emb.embed(["crime detective"])[0]
                        for u in ids])
    settings = ClusterRAGSettings("collab", CohortSettings(user_vectors="encoder"), ClusterIndexSettings())
    s = ClusterRAG(emb, settings, cache_dir=tmp_path, user_vectors=(ids, vectors))
    s.prepare(store)
    assert owners(s.retrieve([Query("cold", "crime")], 3)[0]) <= {"c1", "c2"}
    with pytest.raises(ValueError, match="trained user embeddings"):
        ClusterRAG(emb, settings)


def test_all_users_in_noise_fall_back_to_user_only(tmp_path, caplog):
    """Every user on a topic of their own: no cohort; collab falls back to the user's own docs, said once."""
    users = {f"n{i}": [f"{VOCAB[i]} {VOCAB[i]}"] for i in range(4)}
    store = DocStore(LampDataset("LaMP-2", {u: User(u, [HistoryDoc(f"{u}-0", (2020, 1, 1),
                                                                    {"description": t[0], "tag": "comedy"})])
                                            for u, t in users.items()}))
    s = strategy(tmp_path, "collab")
    with pytest.warns(CohortWarning, match="all 4 users are noise"), pytest.warns(ClusterIndexWarning):
        s.prepare(store)
    with caplog.at_level(logging.WARNING):
        docs = s.retrieve([Query("n0", "space"), Query("n1", "rocket")], 2)
    assert [owners(d) for d in docs] == [{"n0"}, {"n1"}]
    assert s.notes.no_neighbours == 2 and caplog.text.count("no cohort neighbours") == 1


def test_cohort_of_one_has_no_neighbours_and_falls_back(tmp_path):
    store = make_store({"j1": ["jazz piano", "piano jazz"]})
    settings = ClusterRAGSettings("collab", CohortSettings(method="kmeans", n_clusters=4, noise="own"),
                                  ClusterIndexSettings())
    s = ClusterRAG(AxisEmbedder(), settings, cache_dir=tmp_path)
    with pytest.warns(CohortWarning, match="cohort"):
        s.prepare(store)
    assert s.cohorts.neighbours("j1") == []
    assert owners(s.retrieve([Query("j1", "jazz")], 2)[0]) == {"j1"}
    assert s.notes.no_neighbours == 1


def test_noise_user_under_own_policy_is_user_only_but_nearest_policy_gets_neighbours(tmp_path):
    extra = {"x1": ["opera", "opera opera"]}  # alone on a topic nobody else has
    own = strategy(tmp_path / "own", "collab", noise="own")
    own.prepare(make_store(extra))
    assert own.cohorts.is_noise("x1")
    assert owners(own.retrieve([Query("x1", "jazz")], 3)[0]) == {"x1"}
    near = strategy(tmp_path / "near", "collab")  # default: nearest cohort
    near.prepare(make_store(extra))
    got = owners(near.retrieve([Query("x1", "opera")], 3)[0])
    assert got and "x1" not in got
    assert got <= {near.cohorts.user_ids[r] for r in near.cohorts.members(near.cohorts.cohort_of("x1"))}


def test_b_larger_than_clusters_warns_at_prepare_not_crash(tmp_path):
    s = strategy(tmp_path, "user", top_b=99)
    with pytest.warns(ClusterIndexWarning, match="B=99"):
        s.prepare(make_store())
    assert len(s.retrieve([Query("s1", "space")], 3)[0]) == 3


def test_second_prepare_loads_the_index(tmp_path):
    a = strategy(tmp_path, "hybrid")
    a.prepare(make_store())
    before = ClusterIndex.builds
    b = strategy(tmp_path, "hybrid")
    b.prepare(make_store())
    assert ClusterIndex.builds == before and b.index.loaded
    b.prepare(make_store({"k3": ["cooking recipe soup"]}))  # changed data: rebuilt
    assert ClusterIndex.builds == before + 1


def test_add_user_joins_a_cohort_and_the_index_without_rebuild(tmp_path):
    store = make_store()
    s = strategy(tmp_path, "collab")
    s.prepare(store)
    before = ClusterIndex.builds
    new = User("k9", [HistoryDoc("k9-0", (2021, 1, 1), {"description": "cooking recipe cake", "tag": "comedy"})])
    rows = store.add_user(new)
    s.add_user("k9", AxisEmbedder().embed([store.text(int(r)) for r in rows]))
    assert ClusterIndex.builds == before
    assert owners(s.retrieve([Query("k9", "recipe")], 2)[0]) <= {"k1", "k2"}
    assert s.cohorts.cohort_of("k9") == s.cohorts.cohort_of("k1")
    assert {n.user_id for n in s.cohorts.neighbours("k1", 2)} == {"k2", "k9"}  # a neighbour for others too


def test_evaluate_config_has_the_three_modes_and_cfrag_on_cohorts():
    """configs/evaluate_cfrag.yaml instantiates the ClusterRAG rows (Eq. 3 budget) and `CFRAG (users: cluster)`."""
    from jsonargparse import ActionConfigFile, ArgumentParser

    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.presets import load_preset
    from persrag_lightning.retrieval.base import Strategy
    from persrag_lightning.retrieval.cfrag import CFRAG
    from tests.conftest import REPO

    parser = ArgumentParser()
    parser.add_argument("--config", action=ActionConfigFile)
    parser.add_argument("--run_name", type=str)
    parser.add_class_arguments(Evaluation, "evaluation")
    parser.add_argument("--strategies", type=list[Strategy])
    strategies = {s.name: s for s in parser.instantiate_classes(
        parser.parse_args(["--config", str(REPO / "configs" / "evaluate_cfrag.yaml")])).strategies}
    for mode in ("user", "collab", "hybrid"):
        s = strategies[f"ClusterRAG ({mode})"]
        assert isinstance(s, ClusterRAG) and s.settings.mode == mode and s.prompt_gamma == 0.55
        assert (s.settings.index.top_b, s.settings.cohorts.method, s.settings.cohorts.top_k_users) == (1, "hdbscan", 1)
    cfrag = strategies["CFRAG (users: cluster)"]
    assert isinstance(cfrag, CFRAG) and cfrag.users == "cluster" and cfrag.prompt_gamma is None
    assert strategies["CFRAG"].users == "encoder"  # the paper's default stays
    assert not any(n.startswith("ClusterRAG") for n in load_preset("quick").rows)
