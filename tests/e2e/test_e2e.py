"""The main job end to end with the real embedded models (MiniLM, SmolLM2) on a small SynthLaMP: every stage,
the evaluation table, and serving from the exported bundles."""

from __future__ import annotations

import json

import pytest

from persrag_lightning.cli import main
from persrag_lightning.data.lamp import read_outputs
from persrag_lightning.data.tasks import LAMP2_LABELS
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.retrieval.strategies import file_name
from persrag_lightning.serving import CFRAGPipeline

RERANKED = "CFRAG (judgment profile, reranked)"  # the main chain's row (the presets' stage 1: judgments: profile)
STAGES = ("user_encoder", "reader", "retriever", "retriever_ropg", "reranker", "reranker_no_user",
          "reranker_distilled", "reranker_split_l5", "generator", "user_encoder_paper", "retriever_paper",
          "reranker_paper")


@pytest.mark.slow
def test_pipeline_smoke_with_real_models(in_tmp_cwd, capsys, recwarn):
    main(["pipeline", "--preset", "smoke"])
    run = in_tmp_cwd / "checkpoints" / "synthlamp-smoke"
    for stage in STAGES:
        assert (run / stage / "config.json").exists(), stage
    # as in the quick preset, the feedback stages validate nothing, so no dev question was labelled for them
    feedback = in_tmp_cwd / ".cache" / "persrag" / "feedback"
    assert list(feedback.rglob("train")) and not list(feedback.rglob("dev"))
    assert not [w for w in recwarn if "could not find the monitored key" in str(w.message)]  # they keep the last
    out = in_tmp_cwd / "runs" / "synthlamp-smoke" / "evaluate"
    metrics = json.loads((out / "metrics.json").read_text())
    names = set(metrics["results"])
    # the main chain's two orders are named by what they are (stage 1 reads judgments), not by an ablation
    reranked, first_stage = RERANKED, "CFRAG (judgment profile, first-stage order)"
    assert {reranked, "ROPG", "w/o user retrieval", "MEAN user emb.", first_stage,
            "CFRAG (distilled reranker)", "CFRAG (paper)", "CFRAG (paper) w/o reranker tuning"} <= names
    assert not {"CFRAG", "w/o reranker tuning"} & names
    # the recipe's order was chosen on dev between the two candidates, and that choice is the table's reference
    choice = json.loads((in_tmp_cwd / "runs" / "synthlamp-smoke" / "select-on-dev" / "metrics.json").read_text())
    assert choice["split"] == "dev" and set(choice["results"]) == {reranked, first_stage}
    assert metrics["reference"] in choice["results"]
    assert json.loads((run / "pipeline.json").read_text())["reference_row"] == metrics["reference"]
    assert metrics["split"] == "test" and metrics["answer_mode"] == "choose" and not metrics["skipped"]
    # the reader chosen on dev reads the test table (the LLM under the calibration the dev choice kept), and every
    # row stored its label scores
    record = json.loads((run / "pipeline.json").read_text())
    assert record["reader"] in ("trained", "llm") and record["reader_chosen_on_dev"] == record["reader"]
    chosen = record["calibration_chosen_on_dev"] if record["reader"] == "llm" else "none"
    assert chosen in ("none", "contextual", "pmi") and metrics["reading"]["calibration"] == chosen
    assert metrics["reader"] == "llm" if record["reader"] == "llm" else metrics["reader"].endswith("smoke/reader")
    assert (out / "predictions" / f"{file_name(reranked)}.labels.json").is_file()
    assert "majority label (train)" in names
    # every reported accuracy is the official metric of the written predictions against the test golds
    data_dir = next((in_tmp_cwd / ".cache" / "persrag" / "synthlamp").glob("LaMP-2-*"))
    golds = read_outputs(data_dir / "test_outputs.json", "LaMP-2")
    for name, row in metrics["results"].items():
        predictions = read_outputs(out / "predictions" / f"{file_name(name)}.json", "LaMP-2")
        assert len(predictions) == metrics["examples"] == 6 and set(predictions.values()) <= set(LAMP2_LABELS)
        correct = sum(predictions[i] == golds[i] for i in predictions)
        assert row["accuracy"] == pytest.approx(correct / len(predictions)), name
        low, high = metrics["intervals"][name]["accuracy"][1:]
        assert low <= row["accuracy"] <= high
    assert metrics["results"]["recency"]["own_docs"] == 1.0
    assert metrics["results"]["w/o user retrieval"]["own_docs"] == 1.0
    assert metrics["results"][reranked]["own_docs"] < 1.0  # the collaborative path reached the prompts
    # the tuned generator answers the same docs as the strategy it wraps (one retrieval, read from the cache)
    for name in ("zero_shot", "bm25", reranked):
        tuned = metrics["results"][f"{name} + tuned generator"]
        assert tuned.get("own_docs") == metrics["results"][name].get("own_docs"), name
    first = capsys.readouterr().out
    assert f"| {metrics['reference']} |" in first and "exported already, skipped" not in first

    main(["pipeline", "--preset", "smoke"])  # a second run skips every exported stage and cached evaluation
    assert capsys.readouterr().out.count("exported already, skipped") == len(STAGES)

    pipeline = CFRAGPipeline.from_pretrained(run, llm=LLMConfig(batch_size=4), m=3, k_per_user=2, k=3)
    user = pipeline.store.corpus.user_ids[0]
    out = pipeline.generate(user, "Which tag does this movie relate to among the following tags? Just answer with "
                                  "the tag name without further explanation. tags: [sci-fi, comedy] description: "
                                  "A crew of miners wakes a buried alien signal on a frozen moon.")
    assert out.docs and isinstance(out.answer, str) and "frozen moon" in out.prompt
    small = CFRAGPipeline.from_pretrained(run, m=3, k_per_user=2, k=3, reranker="reranker_distilled")
    assert len(small.strategy._reranker.encoder.encoder.layer) == 1 and len(small.retrieve(user, "a frozen moon")) == 3


def small_smoke_preset(folder) -> object:
    """A user's own preset file: the smoke preset (base: smoke) with three stages and two LLM rows."""
    path = folder / "smoke.yaml"  # the run is named after the file: <data>-smoke
    path.write_text("base: smoke\nstages: [user_encoder, retriever, reranker]\nrows: [bm25, CFRAG]\n"
                    "paper_chain: false\nselect_order_on_dev: false\n")
    return path


@pytest.mark.slow
def test_pipeline_on_a_users_own_lamp_folder(in_tmp_cwd):
    """`--data_dir`: the stages train on the folder and the table reports the folder's test split (not SynthLaMP)."""
    from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp

    folder = generate_synth_lamp(in_tmp_cwd / "my_lamp", SynthConfig(num_users=16, seed=7))
    main(["pipeline", "--preset", str(small_smoke_preset(in_tmp_cwd)), "--data_dir", str(folder)])
    run = in_tmp_cwd / "checkpoints" / "my_lamp-smoke"
    assert all((run / s / "config.json").exists() for s in ("user_encoder", "retriever", "reranker"))
    metrics = json.loads((in_tmp_cwd / "runs" / "my_lamp-smoke" / "evaluate" / "metrics.json").read_text())
    golds = read_outputs(folder / "test_outputs.json", "LaMP-2")
    predictions = read_outputs(in_tmp_cwd / "runs" / "my_lamp-smoke" / "evaluate" / "predictions" /
                               f"{file_name(RERANKED)}.json", "LaMP-2")
    assert set(metrics["results"]) == {"bm25", RERANKED, "majority label (train)", "user's own majority",
                                       "bm25 docs' vote", f"{RERANKED} docs' vote"} and metrics["split"] == "test"
    assert set(predictions) <= set(golds)  # the folder's own test questions were answered
    assert json.loads((run / "pipeline.json").read_text())["argv"][-1] == str(folder)


@pytest.mark.slow
def test_a_review_log_in_every_format_converts_and_trains_to_its_table(in_tmp_cwd):
    """`persrag data convert` on a log written as CSV, JSON Lines, JSON and Parquet (the same LaMP files from each),
    then `pipeline --preset smoke --task LaMP-3 --data_dir` on the result: the table reports the log's own latest
    reviews, with the reader-free rows beside the LLM's."""
    from tests.data.test_convert import lamp_bytes, review_log, write_log

    rows = review_log(in_tmp_cwd, num_users=16, seed=5)
    folders = []
    for suffix in (".csv", ".jsonl", ".json", ".parquet"):
        log = write_log(in_tmp_cwd / f"reviews{suffix}", rows)
        folders.append(in_tmp_cwd / f"my_reviews{suffix.replace('.', '_')}")
        main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewer", "--date", "time", "--text",
              "review", "--label", "stars", "--item", "asin", "--out", str(folders[-1])])
    assert all(lamp_bytes(f) == lamp_bytes(folders[0]) for f in folders[1:])
    main(["pipeline", "--preset", str(small_smoke_preset(in_tmp_cwd)), "--task", "LaMP-3", "--data_dir",
          str(folders[0])])
    evaluate = in_tmp_cwd / "runs" / f"{folders[0].name}-lamp3-smoke" / "evaluate"
    metrics = json.loads((evaluate / "metrics.json").read_text())
    assert metrics["split"] == "test" and {"bm25", RERANKED, "majority label (train)", "user's own median",
                                           f"{RERANKED} docs' vote"} <= set(metrics["results"])
    golds = read_outputs(folders[0] / "test_outputs.json", "LaMP-3")
    predictions = read_outputs(evaluate / "predictions" / f"{file_name(RERANKED)}.json", "LaMP-3")
    assert len(golds) == 16 and predictions and set(predictions) <= set(golds)  # the users' latest reviews


@pytest.mark.slow
def test_a_news_log_with_its_own_labels_converts_and_trains_to_its_table(in_tmp_cwd):
    """`persrag data convert --task labels` on a news log (co-authors, articles without an author, 29 categories of
    its own), then `pipeline --preset smoke --data_dir` with the task read from the folder: the table answers the
    folder's labels, with the reader-free rows beside the LLM's."""
    from tests.helpers.logs import news_log

    log = in_tmp_cwd / "news.json"  # JSON Lines, named .json as such exports often are
    log.write_text("".join(json.dumps(r) + "\n" for r in news_log(num_authors=16, seed=2)))
    folder = in_tmp_cwd / "my_news"
    main(["data", "convert", str(log), "--task", "labels", "--user", "authors", "--user_sep", ",", "--date", "date",
          "--text", "headline,short_description", "--label", "category", "--item", "link", "--out", str(folder)])
    labels = set(json.loads((folder / "convert.json").read_text())["task"]["labels"])
    main(["pipeline", "--preset", str(small_smoke_preset(in_tmp_cwd)), "--data_dir", str(folder)])
    run = in_tmp_cwd / "checkpoints" / "my_news-labels-smoke"
    assert json.loads((run / "pipeline.json").read_text())["task"] == "labels"
    evaluate = in_tmp_cwd / "runs" / "my_news-labels-smoke" / "evaluate"
    metrics = json.loads((evaluate / "metrics.json").read_text())
    assert metrics["split"] == "test" and set(metrics["results"]) == {
        "bm25", RERANKED, "majority label (train)", "user's own majority", "bm25 docs' vote", f"{RERANKED} docs' vote"}
    golds = read_outputs(folder / "test_outputs.json", "labels")
    for name in metrics["results"]:
        predictions = read_outputs(evaluate / "predictions" / f"{file_name(name)}.json", "labels")
        assert predictions and set(predictions) <= set(golds) and set(predictions.values()) <= labels, name
    assert "labels" in (evaluate / "results.md").read_text()


@pytest.mark.slow
def test_the_shared_real_reviews_convert_and_the_main_job_reads_them_with_the_reader_chosen_on_dev(in_tmp_cwd):
    """Real users' reviews (../shared/data/real, Amazon's file as published) through `persrag data convert` and the
    main job at smoke scale: the reader stage trains, the reader is chosen on dev, it labels the feedback and reads
    the table, and the table carries the reader-free rows and the expected rating's correlation."""
    from tests.conftest import REPO

    log = REPO.parent / "shared" / "data" / "real" / "Magazine_Subscriptions_5.json"
    if not log.is_file():
        pytest.skip(f"{log} is not beside this checkout")
    folder = in_tmp_cwd / "magazines"
    main(["data", "convert", str(log), "--task", "LaMP-3", "--user", "reviewerID", "--date", "unixReviewTime",
          "--text", "reviewText", "--label", "overall", "--item", "asin", "--dedupe", "--out", str(folder)])
    preset = in_tmp_cwd / "reviews.yaml"
    preset.write_text("base: smoke\nstages: [user_encoder, reader, retriever, reranker]\nrows: [bm25, CFRAG]\n"
                      "paper_chain: false\nselect_order_on_dev: false\n")
    main(["pipeline", "--preset", str(preset), "--data_dir", str(folder)])
    run = in_tmp_cwd / "checkpoints" / "magazines-lamp3-reviews"
    record = json.loads((run / "pipeline.json").read_text())
    assert record["task"] == "LaMP-3" and (run / "reader" / "config.json").is_file()
    assert record["reader_chosen_on_dev"] in ("trained", "llm")
    labelled_by = [r["overrides"].get("data.init_args.feedback.reader") for r in record["stages"]
                   if r["stage"] in ("retriever", "reranker")]
    assert labelled_by == (["{run_dir}/reader"] * 2 if record["reader"] == "trained" else [None, None])
    metrics = json.loads((in_tmp_cwd / "runs" / "magazines-lamp3-reviews" / "evaluate" / "metrics.json").read_text())
    assert metrics["split"] == "test" and {"bm25", RERANKED, "user's own median", "majority label (train)",
                                           "bm25 docs' vote"} <= set(metrics["results"])
    for row in ("bm25", RERANKED):
        assert -1.0 <= metrics["results"][row]["expected_label_spearman"] <= 1.0
    golds = read_outputs(folder / "test_outputs.json", "LaMP-3")
    predictions = read_outputs(in_tmp_cwd / "runs" / "magazines-lamp3-reviews" / "evaluate" / "predictions" /
                               f"{file_name(RERANKED)}.json", "LaMP-3")
    assert len(predictions) == metrics["examples"] == 6 and set(predictions) <= set(golds)
    assert set(predictions.values()) <= {"1", "2", "3", "4", "5"}

