"""Memory and CFRAG + memory as strategies, and the simulated-conversation evaluation (tiny random models)."""

from __future__ import annotations

import json

import pytest

from persrag_lightning.cli import main
from persrag_lightning.data.docstore import read_docstore
from persrag_lightning.evaluation.memory_eval import MemoryEvalConfig, run_memory_evaluation
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.memory import MemoryBank
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.memory import CFRAGMemory, MemoryRecall
from tests.serving.test_serving import run_dir  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def test_memory_strategies_return_own_memories_with_provenance(run_dir, tiny_bert, tmp_path):  # noqa: F811
    store = DocStore(read_docstore(run_dir / "docstore"))
    a, b = store.corpus.user_ids[:2]
    bank = MemoryBank(tmp_path / "bank", TextEncoder.from_pretrained(tiny_bert))
    bank.remember(a, "My dog is called Biscuit.", "s")
    bank.remember(b, "My dog is called Luna.", "s")
    memory = MemoryRecall().attach(bank)
    memory.prepare(store)
    (docs,) = memory.retrieve([Query(a, "What is my dog called?")], 5)
    assert [d.text for d in docs] == ["My dog is called Biscuit."]
    assert docs[0].source == "memory" and docs[0].row == -1 and docs[0].owner == a
    cfrag = CFRAGMemory(str(run_dir / "user_encoder"), str(run_dir / "retriever"), str(run_dir / "reranker"), m=3,
                        k_per_user=2, memory_k=2, cache_dir=str(tmp_path / "cache")).attach(bank)
    cfrag.prepare(store)
    (docs,) = cfrag.retrieve([Query(b, "What is my dog called?")], 3)
    assert [d.source for d in docs] == ["memory", "doc", "doc", "doc"]
    assert docs[0].text == "My dog is called Luna." and all(d.row >= 0 for d in docs[1:])


def test_memory_evaluation_counts_recall_and_answers(run_dir, tiny_bert, tiny_llm, tmp_path):  # noqa: F811
    cfg = MemoryEvalConfig(run_dir=str(run_dir), users=3, facts_per_user=2, fillers_per_fact=2, k=5,
                           encoder=tiny_bert, llm=LLMConfig(model=tiny_llm, max_new_tokens=4,
                                                            options={"device": "cpu"}),
                           cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "out"))
    results = {r.name: r for r in run_memory_evaluation(cfg)}
    assert list(results) == ["zero_shot", "Memory", "CFRAG", "CFRAG + memory"]
    assert results["zero_shot"].recall_at_k is None and results["CFRAG"].recall_at_k is None
    for name in ("Memory", "CFRAG + memory"):
        r = results[name]
        assert r.questions == 6 and r.foreign_memories == 0 and 0.0 <= r.recall_at_k <= 1.0
    # verbatim memories, no tags + the seed's rule (keep rank score >= N - 2): of 6 memories per user (2 facts,
    # 4 fillers) the fact is recalled exactly when it is among the question's 3 nearest by cosine, though k = 5
    import numpy as np

    from persrag_lightning.memory.simulate import simulate_conversations

    encoder = TextEncoder.from_pretrained(tiny_bert)
    expected = []
    for conv in simulate_conversations(3, 2, 2, cfg.seed):
        texts = [" ".join(m.split()) for m in conv.messages]
        mem = encoder.encode(texts).numpy()
        for fact in conv.facts:
            q = encoder.encode([fact.question]).numpy()[0]
            top3 = np.argsort(-(mem @ q), kind="stable")[:3]
            expected.append(any(fact.value.lower() in texts[i].lower() for i in top3))
    assert results["Memory"].recall_at_k == pytest.approx(np.mean(expected))
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert [r["name"] for r in metrics["results"]] == list(results)
    assert metrics["recall_inputs"]["raw_fallback"] > 0 and metrics["extraction_fallbacks"] == 0
    assert f"| Memory | 6 | {np.mean(expected):.3f} |" in (tmp_path / "out" / "results.md").read_text()
    answers = [json.loads(line) for line in (tmp_path / "out" / "answers.jsonl").read_text().splitlines()]
    assert [a["strategy"] for a in answers] == [name for name in results for _ in range(6)]
    for name, r in results.items():  # each strategy's rate is its questions' hits
        hits = [a["hit"] for a in answers if a["strategy"] == name]
        assert r.answer_hits == pytest.approx(np.mean(hits))
    assert all(a["hit"] == (a["fact"].lower() in a["answer"].lower()) for a in answers)


def test_evaluate_dispatches_the_memory_config_and_names_a_missing_run(in_tmp_cwd, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", "--config", "evaluate_memory.yaml", "--evaluation.run_dir=checkpoints/nothing"])
    assert exc.value.code == 2 and "checkpoints/nothing/docstore" in capsys.readouterr().err
