"""The pipeline's plan, printed before anything trains: the stages and the skipped exports, the rows, and the job's
minutes from the reader's rates measured here, against the budget of this CPU class; pipeline.json keeps it."""

from __future__ import annotations

import json

import pytest

from persrag_lightning.data.tasks import get_task
from persrag_lightning.pipeline import plan as plan_module
from persrag_lightning.pipeline import rates as rates_module
from persrag_lightning.pipeline.constants import (
    MIX_ITEMS_WORK,
    RETRIEVAL_PER_ANSWER,
    TRAINED_TEXTS,
    TRAINING_WORK,
)
from persrag_lightning.pipeline.rates import reader_rates
from persrag_lightning.presets import load_preset
from tests.commands.test_pipeline_recipe import AMX, AVX2_ONLY, machine, run_pipeline

RATES = {"answers": 2.0, "labels": 4.0}
ENCODER_TEXTS = 60.0  # the trained reader's encoder, texts/s
TRAINED = {f"trained_{kind}": ENCODER_TEXTS / n for kind, n in TRAINED_TEXTS.items()}


@pytest.fixture
def fixed_rates(monkeypatch):
    """The reader's rates as constants, so the minutes are arithmetic (the measurement has its own test)."""
    monkeypatch.setattr(rates_module, "reader_rates", lambda *a: RATES)
    monkeypatch.setattr(rates_module, "encoder_rate", lambda *a: ENCODER_TEXTS)


def test_the_plan_and_its_estimate_come_before_the_first_stage(monkeypatch, tmp_path, capsys, fixed_rates):
    machine(monkeypatch, AMX, onednn=True)
    run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"])
    out = capsys.readouterr().out.splitlines()
    first_stage = next(i for i, line in enumerate(out) if line.startswith("[pipeline] user_encoder: python"))
    estimate = next(i for i, line in enumerate(out) if line.startswith("[pipeline] estimate: about "))
    assert estimate < first_stage and out[estimate - 2].startswith("[pipeline] plan: train user_encoder, reader, reader_fold0, reader_fold1, retriever")
    # quick: 4 feedback stages x 3 x 2 candidates x 32 examples, labelled by the chosen reader; 300 dev questions x 6
    # configurations (2 orders, each gated and shut) and 300 test questions x 6 rows read by it; the LLM alone reads
    # the reader's dev choice (300),
    # the tuned generator's calibration (300) and its 3 rows (900); 9 stages of training at the quick size (the
    # main chain's stage 1, `judgments: profile`, trains nothing; the paper's does): the encoder stages' in encoder
    # texts, the generator's in LLM answers; the two fold readers of the cross-fitted feedback only where the trained
    # reader reads; the readers read every profile item twice (`mix_items`)
    reader = TRAINING_WORK["reader"] * MIX_ITEMS_WORK
    encoders = TRAINING_WORK["user_encoder"] + reader + 4 * TRAINING_WORK["feedback"]
    retrieval = RETRIEVAL_PER_ANSWER * (1800 + 1800 + 300 + 300 + 900)  # every row's questions, whoever reads
    llm_only = (300 + 300 + 900 + TRAINING_WORK["generator"]) / 2.0 + (encoders + retrieval) / ENCODER_TEXTS
    with_llm = (768 / 4.0 + (1800 + 1800) / 2.0 + llm_only) / 60
    with_trained = (768 / TRAINED["trained_labels"] + (1800 + 1800) / TRAINED["trained_answers"] + llm_only
                    + 2 * reader / ENCODER_TEXTS) / 60
    assert f"about {with_trained:.0f} min on this machine ({with_trained:.0f} if dev chooses the trained reader, " \
           f"{with_llm:.0f} if dev chooses the LLM)" in out[estimate]
    assert "budget on this CPU class: 20 min" in out[estimate]
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())["plan"]
    assert record["minutes"] == round(with_trained, 1) and record["labels"] == 768
    assert record["minutes_by_reader"] == {"trained": round(with_trained, 1), "llm": round(with_llm, 1)}
    assert record["answers"] == {"dev choice": 1800, "test table": 1800}
    assert record["llm_answers"] == {"tuned generator's rows": 900, "tuned generator's calibration": 300,
                                     "the reader's dev choice": 300}
    assert record["rates"] == {**RATES, "encoder_texts": ENCODER_TEXTS, **TRAINED}


def test_the_budget_follows_the_cpu_class(monkeypatch):
    machine(monkeypatch, AMX, onednn=True)
    assert rates_module.budget_minutes() == 20
    machine(monkeypatch, frozenset({"avx2", "avx512f", "avx512_bf16"}), onednn=True, speedup=2.1)
    assert rates_module.budget_minutes() == 30
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    assert rates_module.budget_minutes() == 45
    machine(monkeypatch, AVX2_ONLY, onednn=False, cuda=True)
    assert rates_module.budget_minutes() is None


def test_skipped_exports_are_named_and_generated_answers_get_no_estimate(monkeypatch, tmp_path, capsys, fixed_rates):
    (tmp_path / "synthlamp-paper" / "user_encoder").mkdir(parents=True)
    (tmp_path / "synthlamp-paper" / "user_encoder" / "config.json").write_text("{}")
    run_pipeline(monkeypatch, tmp_path, ["--preset", "paper"])
    out = capsys.readouterr().out
    assert "; already exported, so not trained again: user_encoder" in out and "[pipeline] plan: train retriever," in out
    assert "[pipeline] no time estimate: answers are generated" in out


def resolved_stages(argv: list[str], stages: list[str]) -> dict:
    """The stages of a pipeline call as it resolves them before anything trains: the objects the plan reads."""
    from persrag_lightning.pipeline import command as pipeline
    from persrag_lightning.pipeline.job import resolve_job

    opts, extra = pipeline.parse_args(argv)
    job = resolve_job(opts, extra, load_preset(opts.preset))
    return {stage: pipeline.LocalRunner().stage_config(job.stage_run(stage)) for stage in stages}


def test_a_smaller_preset_counts_smaller_stages(tmp_path):
    counts = {"train": 600, "dev": 300, "test": 300}
    quick = resolved_stages(["--preset", "quick"], ["user_encoder"])
    assert plan_module.training_work(quick, counts) == {"encoder": 0.0, "llm": 0.0, "fold_readers": 0.0}  # profile
    paired = resolved_stages(["--preset", "quick", "--judgments", "paired"], ["user_encoder"])
    assert plan_module.training_work(paired, counts) == {"encoder": TRAINING_WORK["user_encoder"], "llm": 0.0,
                                                         "fold_readers": 0.0}
    # the cross-fitted feedback's readers train only if dev chooses the trained reader: the LLM's estimate drops them
    readers = resolved_stages(["--preset", "quick"], ["reader", "reader_fold0", "reader_fold1"])
    work = plan_module.training_work(readers, counts)
    assert work["fold_readers"] == pytest.approx(2 / 3 * work["encoder"]) and work["fold_readers"] > 0
    assert work["encoder"] == pytest.approx(3 * TRAINING_WORK["reader"] * MIX_ITEMS_WORK)  # quick reads items twice
    (tmp_path / "single.yaml").write_text("base: quick\nreader:\n  data.init_args.mix_items: false\n")
    single = resolved_stages(["--preset", str(tmp_path / "single.yaml")], ["reader"])
    assert plan_module.training_work(single, counts)["encoder"] == pytest.approx(TRAINING_WORK["reader"])
    plan = plan_module.Plan(list(readers), [], None, work, readers=["trained", "llm"],
                            rates={"trained_labels": 1.0, "trained_answers": 1.0, "labels": 1.0, "answers": 1.0,
                                   "encoder_texts": 1.0})
    assert plan.minutes_for("trained") - plan.minutes_for("llm") == pytest.approx(work["fold_readers"] / 60)
    small = {"train": 48, "dev": 24, "test": 24}
    smoke = resolved_stages(["--preset", "smoke"], ["user_encoder", "retriever", "reranker", "generator"])
    trained = resolved_stages(["--preset", "smoke", "--judgments", "paired"], ["user_encoder"])
    assert plan_module.training_work(trained, small)["encoder"] == pytest.approx(
        TRAINING_WORK["user_encoder"] * 3 * 24 / (20 * 300))
    assert plan_module.training_work({"generator": smoke["generator"]}, small) == pytest.approx(
        {"encoder": 0.0, "llm": TRAINING_WORK["generator"] * 8 / 32, "fold_readers": 0.0})
    assert plan_module.feedback_prompts(smoke, 48) == 2 * 2 * 2 * 8
    # what runs is what counts: the config's own value where the preset says nothing (the paper preset's stage 1
    # trains cfrag_user_encoder.yaml's 30 epochs), and a user's own arguments, applied last
    paper = resolved_stages(["--preset", "paper"], ["user_encoder"])
    assert plan_module.training_work(paper, counts)["encoder"] == 1.5 * TRAINING_WORK["user_encoder"]
    mine = resolved_stages(["--preset", "smoke", "--data.init_args.candidates.m=3"], ["retriever"])
    assert plan_module.feedback_prompts(mine, 48) == 3 * 2 * 8


def test_the_split_reranker_stage_counts_its_questions_and_their_pairs_length(tmp_path):
    """A distilled stage scores every candidate pair of its train and dev questions: its work is the quick preset's
    scaled by both and by the data's (question, doc) pairs' length against SynthLaMP's, counted on the folder."""
    from persrag_lightning.data.lamp_format import questions_path
    from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp

    split = resolved_stages(["--preset", "quick-split"], ["reranker_split_l5"])
    quick = {"train": 600, "dev": 300, "test": 300}
    assert plan_module.training_work(split, quick)["encoder"] == pytest.approx(TRAINING_WORK["distilled"])
    assert plan_module.training_work(split, {"train": 300, "dev": 150, "test": 1}, 2.0)["encoder"] == pytest.approx(
        TRAINING_WORK["distilled"])
    short = generate_synth_lamp(tmp_path / "short", SynthConfig(num_users=24, seed=0))
    spec = get_task("LaMP-2")
    assert plan_module.pair_scale(None, spec) == 1.0
    assert plan_module.pair_scale(str(short), spec) == pytest.approx(1.0, abs=0.15)  # SynthLaMP: PAIR_TOKENS' data
    (tmp_path / "long").mkdir()
    for path in short.iterdir():
        questions = json.loads(path.read_text())
        if path == questions_path(short, path.name.split("_")[0]):
            for q in questions:  # every doc twice as long
                for item in q["profile"]:
                    item["description"] = f"{item['description']} {item['description']}"
        (tmp_path / "long" / path.name).write_text(json.dumps(questions))
    longer = plan_module.pair_scale(str(tmp_path / "long"), spec) / plan_module.pair_scale(str(short), spec)
    assert 1.3 < longer < 1.8  # the docs' half of a pair doubled, the questions' kept


@pytest.mark.slow
def test_the_readers_rates_are_measured_with_the_real_model():
    rates = reader_rates(get_task("LaMP-2").labels, "smollm2", "float32", 8)
    assert rates["answers"] > 0 and rates["labels"] > 0
    assert reader_rates(get_task("LaMP-2").labels, "smollm2", "float32", 8) is rates  # once per process


def test_each_precision_decision_is_stated_once_where_the_run_begins(monkeypatch, tmp_path, capsys, fixed_rates):
    """One policy (hardware.Precision, resolved by uses_bf16) for every kind of work: on an AVX2-only CPU every
    decision is float32, on an AMX CPU the quick preset's are bfloat16; pipeline.json keeps the same words."""
    from persrag_lightning.hardware import Precision, uses_bf16

    machine(monkeypatch, AVX2_ONLY, onednn=False)
    assert not any(uses_bf16(p) for p in Precision)
    run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--run_name", "avx2"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[pipeline] precision: "))
    assert line == ("[pipeline] precision: stage 1 32-true, feedback stages 32-true, generator 32-true, feedback "
                    "labels the configs' backend (exact), reader float32, rerankers fp32, corpus embeddings fp32")
    machine(monkeypatch, AMX, onednn=True)
    assert uses_bf16(Precision.CPU_NATIVE) and not uses_bf16(Precision.FLOAT32)
    run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--run_name", "amx"])
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("[pipeline] precision: "))
    assert line == ("[pipeline] precision: stage 1 bf16-mixed, feedback stages bf16-mixed, generator bf16-mixed, "
                    "feedback labels bfloat16, reader bfloat16, rerankers bf16, corpus embeddings bf16")
    record = json.loads((tmp_path / "amx" / "pipeline.json").read_text())["precision_decisions"]
    assert record["reader"] == "bfloat16" and record["stage 1"] == "bf16-mixed"
    machine(monkeypatch, AMX, onednn=True, cuda=True)  # cpu_native work stays float32 on a GPU machine
    assert uses_bf16(Precision.NATIVE) and not uses_bf16(Precision.CPU_NATIVE)


def test_plan_prints_the_decisions_and_the_estimate_then_exits_before_anything_trains(monkeypatch, tmp_path, capsys,
                                                                                      fixed_rates):
    """`--plan`: the machine, precision, the float32 GEMM path with its measured rates, the plan and the estimate
    against the class budget; no stage, no evaluation, no pipeline.json; exit code 0 through the CLI."""
    from persrag_lightning import cli, runtime
    from persrag_lightning.pipeline import command as pipeline
    from persrag_lightning.pipeline import decisions

    machine(monkeypatch, AVX2_ONLY, onednn=False)
    choice = runtime.GemmChoice(2, {"reader": {"torch": 90.0, "onednn": 113.0, "numpy": 126.0},
                                    "encoders": {"torch": 80.0}},
                                {"reader": "onednn", "encoders": "torch"}, {"openvino": "No module named 'openvino'"})
    monkeypatch.setattr("persrag_lightning.pipeline.decisions.gemm_choice", lambda: choice)

    def trained(*a, **k):
        raise AssertionError("--plan trained or evaluated something")

    monkeypatch.setattr(pipeline, "run_stage", trained)
    monkeypatch.setattr(pipeline, "run_evaluation", trained)
    cli.main(["pipeline", "--preset", "quick", "--plan", "--export_root", str(tmp_path)])  # returns: exit code 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[pipeline] ") and "bfloat16 native: no" in out[0]
    assert out[1] == decisions.FLOAT32_READER_NOTE and out[2].startswith("[pipeline] precision: stage 1 32-true")
    assert out[3] == "[pipeline] float32 GEMM path openvino: skipped (No module named 'openvino')"
    assert out[4] == ("[pipeline] float32 GEMM path for the reader: onednn (GFLOP/s on 2 threads: onednn 113, torch 90; "
                      "beside torch's threads, chosen only when named: numpy 126)")
    assert out[5] == "[pipeline] float32 GEMM path for the encoders: torch (GFLOP/s on 2 threads: torch 80)"
    assert out[6] == "[pipeline] PERSRAG_GEMM=reader:onednn,encoders:torch gives another run these paths without measuring"
    assert out[7].startswith("[pipeline] plan: train user_encoder, reader, reader_fold0, reader_fold1, retriever") and out[8].startswith("[pipeline] rows:")
    assert out[9].startswith("[pipeline] estimate: about ") and out[9].endswith("budget on this CPU class: 45 min")
    assert out[10].startswith("[pipeline] --plan: nothing trained") and len(out) == 11
    assert not list(tmp_path.rglob("pipeline.json"))


def test_pipeline_json_keeps_the_gemm_choice(monkeypatch, tmp_path, fixed_rates):
    from persrag_lightning import runtime

    machine(monkeypatch, AVX2_ONLY, onednn=False)
    monkeypatch.setenv(runtime.ENV, "onednn")
    run_pipeline(monkeypatch, tmp_path, ["--preset", "smoke"])
    record = json.loads((tmp_path / "synthlamp-smoke" / "pipeline.json").read_text())["gemm"]
    assert record["chosen"] == {"reader": "onednn", "encoders": "onednn"} and record["forced"] and record["pin"] == "onednn"


def test_the_plan_reads_resolved_objects_and_opens_no_file_of_configs():
    """The plan and the decisions read the stages and evaluations as the pipeline resolved them (the objects the
    fits and evaluations are then given), never a config file of their own: no YAML import, no file opened."""
    import ast
    from pathlib import Path

    from persrag_lightning.pipeline import decisions

    for module in (plan_module, rates_module, decisions):
        tree = ast.parse(Path(module.__file__).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {"yaml", "omegaconf"} & imported, module.__name__
        assert "resolve_config_path" not in ast.unparse(tree), module.__name__
