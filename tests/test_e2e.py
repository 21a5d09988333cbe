"""The main job end to end with the real embedded models (MiniLM, SmolLM2) on a small SynthLaMP: every stage,
the evaluation table, and serving from the exported bundles."""

from __future__ import annotations

import json

import pytest

from persrag_lightning.cli import main
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.serving import CFRAGPipeline

STAGES = ("user_encoder", "retriever", "retriever_ropg", "reranker", "reranker_no_user")


@pytest.mark.slow
def test_pipeline_smoke_with_real_models(in_tmp_cwd, capsys):
    main(["pipeline", "--preset", "smoke"])
    run = in_tmp_cwd / "checkpoints" / "synthlamp-smoke"
    for stage in STAGES:
        assert (run / stage / "config.json").exists(), stage
    metrics = json.loads((in_tmp_cwd / "runs" / "synthlamp-smoke" / "evaluate" / "metrics.json").read_text())
    names = set(metrics["results"])
    assert {"CFRAG", "ROPG", "w/o user retrieval", "MEAN user emb.", "w/o reranker tuning"} <= names
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in metrics["results"].values())
    assert metrics["results"]["recency"]["own_docs"] == 1.0
    first = capsys.readouterr().out
    assert "| CFRAG |" in first and "exported already, skipped" not in first

    main(["pipeline", "--preset", "smoke"])  # a second run skips every exported stage and cached evaluation
    assert capsys.readouterr().out.count("exported already, skipped") == len(STAGES)

    pipeline = CFRAGPipeline.from_pretrained(run, llm=LLMConfig(batch_size=4), m=3, k_per_user=2, k=3)
    user = pipeline.store.corpus.user_ids[0]
    out = pipeline.generate(user, "Which tag does this movie relate to among the following tags? Just answer with "
                                  "the tag name without further explanation. tags: [sci-fi, comedy] description: "
                                  "A crew of miners wakes a buried alien signal on a frozen moon.")
    assert out.docs and isinstance(out.answer, str) and "frozen moon" in out.prompt
