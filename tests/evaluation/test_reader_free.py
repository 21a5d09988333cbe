"""Reader-free rows (train majority, the user's own majority and median, the retrieved docs' vote), the share of
each row's most frequent answer, and the alarm on a row that answers one label whatever it reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from persrag_lightning.data.records import Example, HistoryDoc, LampDataset, User
from persrag_lightning.evaluation.reader_free import (
    MAJORITY,
    OWN_MAJORITY,
    OWN_MEDIAN,
    collapse_warnings,
    median_label,
    reader_free_rows,
    top_answer,
)
from persrag_lightning.retrieval.base import DocStore


def review(doc_id: str, day: int, score: str) -> HistoryDoc:
    return HistoryDoc(doc_id, (2020, 1, day), {"text": f"review {doc_id}", "score": score})


@pytest.fixture
def store() -> DocStore:
    """Two users, LaMP-3: u1 rated 5, 5, 1, 2 (majority 5, median 2) before its test question; u2 rated 3, 4.0
    (a score written as a number) and then its test question's own item, which no row may see."""
    u1 = [review("a1", 1, "5"), review("a2", 2, "5"), review("a3", 3, "1"), review("a4", 4, "2")]
    u2 = [review("b1", 1, "3"), review("b2", 2, "4.0"), review("t2", 3, "1")]
    train = [Example("tr1", "u1", "review: x", "x", "4", "train", ("a1",)),
             Example("tr2", "u2", "review: y", "y", "4", "train", ("b1",)),
             Example("tr3", "u2", "review: z", "z", "1", "train", ("b1",))]
    test = [Example("t1", "u1", "review: p", "p", "5", "test", ("a1", "a2", "a3", "a4")),
            Example("t2", "u2", "review: q", "q", "3", "test", ("b1", "b2", "t2"))]
    dataset = LampDataset("LaMP-3", {"u1": User("u1", u1), "u2": User("u2", u2)}, {"train": train, "test": test})
    return DocStore(dataset)


def test_reader_free_rows_by_hand(store: DocStore) -> None:
    examples = store.dataset.examples["test"]
    rows_of = {d: r for r, d in enumerate(store.corpus.doc_ids)}
    retrieved = {"bm25": [[store.doc(rows_of["a3"]), store.doc(rows_of["a4"]), store.doc(rows_of["b2"])],
                          [store.doc(rows_of["a1"])]]}
    train_golds = [e.target for e in store.dataset.examples["train"]]
    rows = reader_free_rows("LaMP-3", store, examples, train_golds, retrieved)
    assert rows[MAJORITY] == ["4", "4"]  # the train golds 4, 4, 1
    assert rows[OWN_MAJORITY] == ["5", "3"]  # u2: 3 and 4 tie -> the earlier label; t2 itself is never seen
    assert rows[OWN_MEDIAN] == ["2", "3"]  # sorted 1, 2, 5, 5 -> lower median 2; 3, 4 -> 3
    assert rows["bm25 docs' vote"] == ["2", "5"]  # median of 1, 2, 4; the one doc's 5
    lamp2 = reader_free_rows("LaMP-1", store, examples, ["[2]", "[2]", "[1]"], retrieved)
    assert list(lamp2) == [MAJORITY] and lamp2[MAJORITY] == ["[2]", "[2]"]  # no labels in LaMP-1's profiles
    assert reader_free_rows("LaMP-5", store, examples, [], retrieved) == {}


def test_median_and_top_answer() -> None:
    assert median_label(["5", "1", "4"], ("1", "2", "3", "4", "5")) == "4"
    assert median_label([], ("1",)) == ""
    assert top_answer(["1", "1", "3", "1"]) == ("1", 0.75) and top_answer([]) == ("", 0.0)


def test_the_alarm_names_a_constant_row_only() -> None:
    golds = ["5"] * 6 + ["4"] * 2 + ["1"] * 2  # the golds' own top share: 60 %
    rows = {"zero_shot": ["1"] * 10, "always five": ["5"] * 10, "CFRAG": ["5"] * 8 + ["4", "1"]}
    lines = collapse_warnings(rows, golds)
    assert len(lines) == 2 and lines[0].startswith("Warning: zero_shot answers '1' to 100%")
    assert "always five" in lines[1]  # 100 % > 60 % + 20 points
    assert not collapse_warnings({"CFRAG": ["5"] * 8 + ["4", "1"]}, golds)  # 80 %: not more than 80 %
    assert not collapse_warnings({"x": ["5"] * 10}, ["5"] * 9 + ["1"])  # the golds are that constant too


def test_an_evaluation_table_carries_the_reader_free_rows_and_label_scores(tmp_path: Path, tiny_llm: str) -> None:
    """`persrag evaluate` on a generated LaMP-3 set: reader-free rows beside the LLM's with intervals and p-values,
    each row's top-answer share, and every label's score stored beside the answers."""
    from persrag_lightning.data.synth import SynthConfig
    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.llm.registry import LLMConfig
    from persrag_lightning.reading.label_reading import LabelReading
    from persrag_lightning.retrieval.baselines import BM25, ZeroShot

    out = tmp_path / "eval"
    evaluation = Evaluation(task="LaMP-3", synth=SynthConfig(num_users=12, docs_per_user=(4, 8)),
                            cache_dir=str(tmp_path / "cache"), k=2, max_examples=6, out_dir=str(out),
                            llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}, answer_mode="choose",
                                          calibration="contextual"),
                            reference="bm25", n_resamples=50)
    summary = evaluation.run([ZeroShot(), BM25()])
    assert list(summary.results) == ["zero_shot", "bm25", MAJORITY, OWN_MAJORITY, OWN_MEDIAN, "bm25 docs' vote"]
    assert set(summary.comparisons) == {"zero_shot", MAJORITY, OWN_MAJORITY, OWN_MEDIAN, "bm25 docs' vote"}
    assert all(0 < r["top_answer_share"] <= 1 for r in summary.results.values())
    labels = json.loads((out / "predictions" / "bm25.labels.json").read_text())
    assert labels["calibration"] == "contextual" and labels["decision"] == "median"
    assert len(labels["terms"]["contextual"]) == len(labels["terms"]["pmi"]) == 5
    assert [r["answer"] for r in sorted(labels["rows"], key=lambda r: r["id"])] == [
        g["output"] for g in sorted(json.loads((out / "predictions" / "bm25.json").read_text())["golds"],
                                    key=lambda g: g["id"])]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["reading"] == {"calibration": "contextual", "decision": "median"}
    assert (out / "predictions" / "user_s_own_median.json").is_file()
    table = (out / "results.md").read_text()
    assert "choose (calibration contextual, decision median)" in table and "user's own median" in table
    assert ("Warning:" in table) == bool(metrics["warnings"])
    assert not [w for w in metrics["warnings"] if MAJORITY in w]  # constant by design: never a reader's alarm
    # the report hands the rows' readings back as objects, the same a cached re-run hands back (no LLM call)
    report = evaluation.evaluate([ZeroShot(), BM25()])
    assert set(report.readings) == {"zero_shot", "bm25"} and report.primary_metric == "mae"
    assert not report.greater_is_better and len(report.golds) == 6
    assert report.readings["bm25"] == LabelReading.from_json(labels)
    assert [r["gold"] for r in labels["rows"]] == list(report.golds)
    for entry in (out / "cache").glob("*.json"):  # an entry cached before entries kept the scores
        cached = json.loads(entry.read_text())
        entry.write_text(json.dumps({k: v for k, v in cached.items() if k != "labels"}))
    assert evaluation.evaluate([ZeroShot(), BM25()]).readings == report.readings  # read from beside the answers


def test_tuned_generator_rows_read_labels_under_their_own_calibration(tmp_path: Path) -> None:
    """`generator_calibration`: a "+ tuned generator" row's reader carries it, every other row keeps the
    evaluation's; a misspelt one fails at construction."""
    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.llm.registry import LLMConfig
    from persrag_lightning.retrieval.baselines import BM25
    from persrag_lightning.retrieval.tuned_generator import TunedGenerator

    bundle = tmp_path / "generator"
    bundle.mkdir()
    (bundle / "config.json").write_text("{}")
    evaluation = Evaluation(task="LaMP-2", cache_dir=str(tmp_path / "cache"), out_dir=str(tmp_path / "eval"),
                            llm=LLMConfig(answer_mode="choose", calibration="contextual"),
                            generator_calibration="none")
    tuned = evaluation.reader_for(TunedGenerator("bm25", str(bundle)))
    assert tuned.config.calibration == "none" and tuned.config.model == str(bundle)
    assert tuned.reading("LaMP-2") == {"calibration": "none", "decision": "argmax"}
    assert evaluation.reader_for(BM25()).reading("LaMP-2")["calibration"] == "contextual"
    assert evaluation.reader_for(TunedGenerator("bm25", str(bundle))) is tuned  # each generator opened once
    assert "tuned generator rows: calibration none" in evaluation.answer_mode
    with pytest.raises(ValueError, match="unknown calibration"):
        Evaluation(task="LaMP-2", cache_dir=str(tmp_path / "cache"), generator_calibration="platt")


def test_a_folders_own_label_set_reaches_the_reader_the_rows_and_the_metric(tmp_path: Path, tiny_llm: str) -> None:
    """An evaluation of a news log converted with `--task labels`: the reader chooses among the folder's labels,
    the reader-free rows answer them, and macro-F1 is taken over them."""
    from persrag_lightning.cli import main
    from persrag_lightning.data.tasks import get_task
    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.llm.registry import LLMConfig
    from persrag_lightning.metrics import lamp_metric
    from persrag_lightning.retrieval.baselines import BM25
    from persrag_lightning.retrieval.strategies import file_name
    from tests.helpers.logs import news_log

    log = tmp_path / "news.json"
    log.write_text("".join(json.dumps(r) + "\n" for r in news_log(num_authors=10)))
    main(["data", "convert", str(log), "--task", "labels", "--user", "authors", "--user_sep", ",", "--date", "date",
          "--text", "headline,short_description", "--label", "category", "--out", str(tmp_path / "news")])
    out = tmp_path / "eval"
    evaluation = Evaluation(task="labels", data_dir=str(tmp_path / "news"), cache_dir=str(tmp_path / "cache"), k=2,
                            max_examples=6, out_dir=str(out), reference="bm25", n_resamples=50,
                            llm=LLMConfig(model=tiny_llm, options={"device": "cpu"}, answer_mode="choose"))
    summary = evaluation.run([BM25()])
    labels = json.loads((tmp_path / "news" / "convert.json").read_text())["task"]["labels"]
    assert get_task("labels").labels == tuple(labels) and lamp_metric("labels").labels == tuple(labels)
    assert list(summary.results) == ["bm25", MAJORITY, OWN_MAJORITY, "bm25 docs' vote"]
    for name in summary.results:
        answers = json.loads((out / "predictions" / f"{file_name(name)}.json").read_text())["golds"]
        assert len(answers) == 6 and {a["output"] for a in answers} <= set(labels), name
    stored = json.loads((out / "predictions" / "bm25.labels.json").read_text())
    assert stored["labels"] == labels and "f1" in summary.results["bm25"]  # macro-F1 over the folder's labels


def test_the_expected_rating_of_a_reader_that_reads_correlates_and_of_one_that_does_not_is_absent() -> None:
    """expected_label_spearman: the expected rating under the reading's distribution against the gold (LaMP-3 only);
    a reader whose distribution is the same for every question gives no correlation to report."""
    import math

    from persrag_lightning.evaluation.reader_free import reading_diagnostics
    from persrag_lightning.reading.label_reading import LabelReading

    labels = ("1", "2", "3", "4", "5")

    def reading(rows: list[list[float]]) -> LabelReading:
        return LabelReading("LaMP-3", labels, [[math.log(p) for p in row] for row in rows], "none", "median",
                            {"none": None})

    golds = ["1", "3", "5", "4"]
    peaked = [[0.9 if label == g else 0.025 for label in labels] for g in golds]
    assert reading_diagnostics(reading(peaked), golds)["expected_label_spearman"] == pytest.approx(1.0)
    assert reading_diagnostics(reading([[0.2] * 5] * 4), golds) == {}  # one distribution for every question
    reversed_ = [[0.9 if label == str(6 - int(g)) else 0.025 for label in labels] for g in golds]
    assert reading_diagnostics(reading(reversed_), golds)["expected_label_spearman"] == pytest.approx(-1.0)
    lamp2 = LabelReading("LaMP-2", ("comedy", "action"), [[-0.1, -2.0]] * 3, "none", "argmax", {"none": None})
    assert reading_diagnostics(lamp2, ["comedy", "action", "comedy"]) == {}  # unordered labels: no expected value
