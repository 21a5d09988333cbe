"""The main job's recipe: precision by what the machine computes, the CFRAG configuration chosen on dev (never on
test) with the paper's chain kept as a row, progress lines in every stage, and the pipeline on a user's own folder."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch

from persrag_lightning import hardware
from persrag_lightning.models.corpus_embeddings import embedding_precision
from persrag_lightning.pipeline import command as pipeline
from persrag_lightning.pipeline import decisions
from persrag_lightning.pipeline.choice import CANDIDATES, GATES, chain_names, choose_on_dev
from persrag_lightning.pipeline.runs import EvaluationRun, StageRun, dev_evaluation
from persrag_lightning.presets import preset_names
from persrag_lightning.retrieval.strategies import set_reranker_runtime
from tests.conftest import cli_parse, evaluated_rows, fake_evaluate, fake_fit

AVX2_ONLY = frozenset({"avx", "avx2", "fma", "f16c"})
AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})


def machine(monkeypatch, flags: frozenset[str] | None, onednn: bool, cuda: bool = False,
            speedup: float = 6.3) -> None:
    """A CPU with `flags`, oneDNN's bf16 answer and a measured bf16 matmul `speedup` over float32 (AMX: ~6x)."""
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.setattr(hardware, "onednn_has_bf16", lambda: onednn)
    monkeypatch.setattr(hardware, "bf16_matmul_speedup", lambda: speedup)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: cuda)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)


def test_native_bf16_needs_the_instructions_not_only_onednns_word(monkeypatch) -> None:
    machine(monkeypatch, AMX, onednn=True)
    assert hardware.cpu_has_native_bf16() and hardware.auto_precision() == "bf16-mixed"
    # AVX-512 without BF16 (oneDNN would emulate) and AVX2-only: float32
    machine(monkeypatch, frozenset({"avx2", "avx512f"}), onednn=True)
    assert not hardware.cpu_has_native_bf16() and hardware.auto_precision() == "32-true"
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    assert not hardware.cpu_has_native_bf16()
    machine(monkeypatch, AMX, onednn=True)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # oneDNN's own cap makes the machine behave as an AVX2 one
    assert not hardware.cpu_has_native_bf16() and "oneDNN capped at AVX2" in hardware.describe_cpu()
    machine(monkeypatch, None, onednn=True)  # no x86 flags (another architecture): oneDNN's answer stands
    assert hardware.cpu_has_native_bf16()
    machine(monkeypatch, AVX2_ONLY, onednn=False, cuda=True)  # on a GPU it is the GPU's
    assert hardware.auto_precision() == "bf16-mixed" and hardware.bf16_verdict() == "yes (CUDA)"


def test_native_bf16_must_also_measure_faster(monkeypatch) -> None:
    """AVX512-BF16 without AMX: the instructions are there, but where a bfloat16 matmul measures slower than
    float32's (0.59-0.73x on a Xeon capped at AVX512_CORE_BF16) every stage, the reader and the labels stay float32."""
    no_amx = frozenset({"avx2", "avx512f", "avx512_bf16"})
    machine(monkeypatch, no_amx, onednn=True, speedup=0.77)
    assert hardware.cpu_bf16_instructions() and not hardware.cpu_has_native_bf16()
    assert hardware.auto_precision() == "32-true" and hardware.native_runtime("bf16_if_native") == "fp32"
    assert decisions.label_overrides("cpu_native", None) == {}
    assert decisions.precision_overrides("native") == {"trainer.precision": "32-true"}
    assert hardware.bf16_verdict() == "no (a bfloat16 matmul measures 0.77x float32's speed)"
    machine(monkeypatch, no_amx, onednn=True, speedup=2.0)  # where it pays (a CPU whose BF16 kernels are fast)
    assert hardware.cpu_has_native_bf16() and hardware.bf16_verdict().startswith("yes (")
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    assert hardware.bf16_verdict() == "no (no AVX512-BF16 or AMX in use: emulated)"


def test_bf16_matmul_speedup_is_measured_once_per_process_and_cap(monkeypatch) -> None:
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    first = hardware.bf16_matmul_speedup()
    assert first > 0 and hardware.bf16_matmul_speedup() == first  # remembered: stages of a run agree


def run_pipeline(monkeypatch, tmp_path, argv: list[str], dev_scores: dict[str, float] | None = None
                 ) -> tuple[list[StageRun], list[EvaluationRun]]:
    """pipeline.main with the stages and evaluations recorded, not run: what its pipeline.json says it ran, typed."""
    def evaluate(cfg):
        report = fake_evaluate()(cfg)
        for name, row in evaluated_rows(cfg):
            report.results[row]["accuracy"] = (dev_scores or {}).get(name, 0.1)
        return report

    monkeypatch.setattr(pipeline, "run_stage", fake_fit())
    monkeypatch.setattr(pipeline, "run_evaluation", evaluate)
    pipeline.main([*argv, "--export_root", str(tmp_path)])
    record = json.loads(max(tmp_path.glob("*/pipeline.json"), key=lambda p: p.stat().st_mtime_ns).read_text())
    return ([StageRun(**r) for r in record["stages"]],
            [EvaluationRun(**r) for r in record["evaluations"]])


@pytest.mark.parametrize("preset", preset_names())
def test_a_cpu_without_native_bf16_gets_float32_in_every_stage_of_every_preset(monkeypatch, tmp_path, preset):
    from persrag_lightning.llm import hf_device

    machine(monkeypatch, AVX2_ONLY, onednn=False)
    fits, _ = run_pipeline(monkeypatch, tmp_path, ["--preset", preset])
    fixed = [r.stage for r in fits if r.overrides.get("trainer.precision", "").startswith("bf16")
             or "data.init_args.feedback.llm.options" in r.overrides]
    assert fits and not fixed  # neither a trainer precision nor the feedback labels' dtype
    # the evaluation's reader and rerankers ask for bf16_if_native, which resolves to float32 here, and the
    # corpus is embedded in float32
    assert hf_device.resolve_device_dtype("cpu", "bf16_if_native")[1] == torch.float32
    assert reranker_runtime_of("bf16_if_native") == "fp32" and embedding_precision() == "fp32"

    machine(monkeypatch, AMX, onednn=True)
    fits, _ = run_pipeline(monkeypatch, tmp_path, ["--preset", preset])
    bf16 = {r.stage for r in fits if r.overrides.get("trainer.precision") == "bf16-mixed"}
    labels_bf16 = {r.stage for r in fits if r.overrides.get("data.init_args.feedback.llm.options") == {"dtype": "bfloat16"}}
    if preset in ("quick", "full-feedback", "quick-split"):
        split = {"reranker_split_l5"} if preset == "quick-split" else set()
        assert bf16 == {"user_encoder", "user_encoder_paper", "retriever", "reranker", "retriever_paper",
                        "reranker_paper", "generator", *split}
        assert labels_bf16 == {"retriever", "reranker", "retriever_paper", "reranker_paper"}
    else:
        assert not bf16 and not labels_bf16  # smoke and paper keep the configs' float32 and exact labels
    assert hf_device.resolve_device_dtype("cpu", "bf16_if_native")[1] == torch.bfloat16
    assert reranker_runtime_of("bf16_if_native") == "bf16" and embedding_precision() == "bf16"


def by_purpose(evaluations: list[EvaluationRun]) -> dict[str, EvaluationRun]:
    """The job's evaluations by what they are for: "reader-trained", "reader-llm" (the reader's dev choice),
    "choice" (the configuration's), "generator" (its calibration's) and "test" (the table)."""
    short = {"dev choice: select-on-dev": "choice", "dev choice: select-on-dev/generator": "generator",
             "test table": "test"}
    return {short.get(r.purpose, r.purpose.removeprefix("dev choice: select-on-dev/")): r for r in evaluations}


def max_examples(run: EvaluationRun) -> int | None:
    """The evaluation's question count (None: every one)."""
    return run.overrides.get("evaluation.max_examples")


def test_the_quick_preset_says_up_front_what_float32_reading_costs(monkeypatch, tmp_path, capsys) -> None:
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    _, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"], {"CFRAG": 0.3})
    choice, test = by_purpose(evaluations)["choice"], by_purpose(evaluations)["test"]
    first = capsys.readouterr().out.splitlines()[:2]
    assert first[0].startswith("[pipeline] ") and "bfloat16 native: no" in first[0]
    assert first[1] == decisions.FLOAT32_READER_NOTE
    # the full protocol all the same: every test question, the dev choice on 300
    assert (max_examples(choice), max_examples(test)) == (300, None)
    for flags, cuda, preset in ((AMX, False, "quick"), (AVX2_ONLY, True, "quick"), (AVX2_ONLY, False, "smoke")):
        machine(monkeypatch, flags, onednn=flags == AMX, cuda=cuda)
        run_pipeline(monkeypatch, tmp_path / preset / str(cuda), ["--preset", preset], {"CFRAG": 0.3})
        assert decisions.FLOAT32_READER_NOTE not in capsys.readouterr().out


def test_questions_caps_the_dev_choice_and_the_table_alike(monkeypatch, tmp_path, capsys) -> None:
    machine(monkeypatch, AMX, onednn=True)
    _, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--questions", "100"],
                                  {"CFRAG": 0.3})
    assert {max_examples(run) for run in evaluations} == {100}  # the reader's dev choice too
    assert "read the first 100 dev and test questions by id" in capsys.readouterr().out
    assert json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())["questions"] == 100
    # after the preset's own count, so it wins over smoke's 6
    _, evaluations = run_pipeline(monkeypatch, tmp_path / "smoke", ["--preset", "smoke", "--questions", "50"],
                                  {"CFRAG": 0.3})
    assert {max_examples(run) for run in evaluations} == {50}
    _, evaluations = run_pipeline(monkeypatch, tmp_path / "default", ["--preset", "smoke"], {"CFRAG": 0.3})
    assert {max_examples(run) for run in evaluations} == {6}
    with pytest.raises(SystemExit) as exit_:
        run_pipeline(monkeypatch, tmp_path / "none", ["--preset", "quick", "--questions", "0"])
    assert exit_.value.code == 2 and "--questions must be a positive number" in capsys.readouterr().err


def reranker_runtime_of(runtime: str) -> str:
    """The runtime `set_reranker_runtime` gives a reranking CFRAG row (one with the default fp32)."""
    from persrag_lightning.retrieval.cfrag import CFRAG

    row, own = CFRAG("u", reranker="r"), CFRAG("u", reranker="r", reranker_runtime="int8", name="own")
    set_reranker_runtime([row, own, CFRAG("u", name="first-stage order")], runtime)
    assert own.inference.reranker_runtime == "int8"  # a row that names its runtime keeps it
    return row.inference.reranker_runtime


def test_the_quick_preset_reranks_in_bf16_if_native_in_the_evaluations_and_the_generators_prompts(
        monkeypatch, tmp_path) -> None:
    machine(monkeypatch, AMX, onednn=True)
    fits, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"], {"CFRAG": 0.3})
    assert all(e.overrides["evaluation.reranker_runtime"] == "bf16_if_native" for e in evaluations)  # dev and test
    assert fits[-1].stage == "generator" and fits[-1].overrides["data.init_args.reranker_runtime"] == "bf16_if_native"
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["corpus_embeddings"] == "bf16" and record["evaluation_reranker"] == "bf16"
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"], {"CFRAG": 0.3})
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["corpus_embeddings"] == "fp32" and record["evaluation_reranker"] == "fp32"
    with pytest.raises(ValueError, match="reranker_runtime must be"):
        set_reranker_runtime([], "bf16_always")
    from persrag_lightning.evaluation.evaluate import Evaluation

    with pytest.raises(ValueError, match="reranker_runtime must be"):
        Evaluation(reranker_runtime="bf16_always", cache_dir=str(tmp_path))


def test_on_a_gpu_the_generator_takes_bf16_and_the_feedback_stages_stay_float32(monkeypatch, tmp_path) -> None:
    machine(monkeypatch, AVX2_ONLY, onednn=False, cuda=True)
    fits, _ = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"])
    precision = {r.stage: r.overrides.get("trainer.precision") for r in fits}
    assert precision["generator"] == "bf16-mixed"
    assert precision["retriever"] == precision["reranker"] == precision["user_encoder"] == "32-true"
    assert not any("data.init_args.feedback.llm.options" in r.overrides for r in fits)  # hf's `auto` is bf16 on a GPU


def test_labels_in_bf16_only_where_native_and_caches_key_the_dtype_that_runs(monkeypatch, tmp_path) -> None:
    """The quick preset's feedback labels: bfloat16 on a native CPU, none asked elsewhere (the configs' `backend:
    auto` then measures the fastest exact backend), and never under a backend without a dtype option; an LLM
    config's identity (the feedback cache's, prompt store's and evaluation's key) names the dtype that runs."""
    from persrag_lightning.llm.registry import LLMConfig

    machine(monkeypatch, AMX, onednn=True)
    assert decisions.label_overrides("cpu_native", None) == {"data.init_args.feedback.llm.options": {"dtype": "bfloat16"}}
    assert decisions.label_overrides("cpu_native", "llamacpp") == {} == decisions.label_overrides(None, None)
    with pytest.raises(ValueError, match="not a valid Precision"):
        decisions.label_overrides("always", None)
    native = LLMConfig(backend="hf", options={"dtype": "bf16_if_native"}).identity()["options"]
    assert native == LLMConfig(backend="hf", options={"dtype": "bfloat16"}).identity()["options"] == {
        "dtype": "bfloat16"}
    fits, _ = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--llm-backend", "llamacpp"])
    assert not any("data.init_args.feedback.llm.options" in r.overrides for r in fits)
    assert all(r.overrides["data.init_args.feedback.llm.backend"] == "llamacpp" for r in fits if r.stage.startswith(("ret", "rer")))
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    assert decisions.label_overrides("cpu_native", None) == {}
    # float32 is the exact default: named or resolved to, it keys as no option (earlier caches stay valid)
    plain = LLMConfig(backend="hf").identity()["options"]
    assert plain == {} == LLMConfig(backend="hf", options={"dtype": "bf16_if_native"}).identity()["options"]
    assert LLMConfig(backend="hf", options={"dtype": "float32"}).identity()["options"] == {}
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["feedback_labels"] == {}  # the llamacpp run above


def test_quick_chooses_its_cfrag_on_dev_and_reports_every_candidate_on_test(monkeypatch, tmp_path) -> None:
    machine(monkeypatch, AMX, onednn=True)
    dev = {"CFRAG": 0.20, "w/o reranker tuning": 0.31}
    fits, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"], dev)
    # the stages that need no reader first (stage 1 and the reader), then, the trained reader chosen, the fold
    # readers of the cross-fitted feedback, then the feedback stages
    assert [r.stage for r in fits] == ["user_encoder", "reader", "user_encoder_paper", "reader_fold0", "reader_fold1",
                                       "retriever", "reranker", "retriever_paper", "reranker_paper", "generator"]
    judged = [r.overrides.get("model.init_args.config.judgments") for r in fits]
    assert judged == ["profile", None, "none", None, None, None, None, None, None, None]  # the paper's chain: its own
    folds = {r.stage: (r.overrides["data.init_args.holdout.folds"], r.overrides["data.init_args.holdout.fold"])
             for r in fits if r.stage.startswith("reader_fold")}
    assert folds == {"reader_fold0": (2, 0), "reader_fold1": (2, 1)}  # each holds out the fold it labels
    # the reader is chosen on dev on BM25's prompts (a tie here: the trained reader, listed first, stands) and
    # labels every feedback stage and reads every row of the table
    runs = by_purpose(evaluations)
    assert runs["reader-trained"].only == runs["reader-llm"].only == ["bm25"]
    assert runs["reader-trained"].overrides["evaluation.reader"] == "{run_dir}/reader"
    assert runs["reader-llm"].overrides["evaluation.reader"] == "llm"
    assert all(r.overrides["data.init_args.feedback.reader"] == "{run_dir}/reader_fold{fold}"
               and r.overrides["data.init_args.feedback.cross_fit"] == 2 for r in fits
               if r.stage.startswith(("retriever", "reranker")))
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["reader"] == record["reader_chosen_on_dev"] == "trained"
    # the configuration is chosen on dev, before the generator trains on the chosen CFRAG's prompts
    choice, test = runs["choice"], runs["test"]
    assert choice.overrides["evaluation.reader"] == test.overrides["evaluation.reader"] == "{run_dir}/reader"
    assert choice.overrides["evaluation.split"] == "dev" and test.overrides["evaluation.split"] == "test"
    # the candidates: the main chain's two orders (the stage-1 encoder was chosen on dev once, CANDIDATES), each
    # with the neighbour gate at 2 docs and shut (GATES: the quick preset's gate_on_dev)
    assert choice.only == [*dev, "CFRAG, ≤ 2 neighbour docs", "w/o reranker tuning, ≤ 2 neighbour docs",
                           "w/o user retrieval", "w/o user retrieval (first-stage order)"]
    assert fits[-1].overrides["data.init_args.strategy"] == "w/o reranker tuning"
    rows = test.only
    assert test.overrides["evaluation.reference"] == "w/o reranker tuning"
    assert test.overrides["evaluation.pairs"] == [["w/o reranker tuning + tuned generator",
                                                   "bm25 + tuned generator"]]  # the goal's third paired test
    # where neighbours help: the reference against the user's own docs, by the asker's history size
    assert test.overrides["evaluation.by_history"] == ["bm25", "w/o user retrieval (first-stage order)"]
    assert set(dev) <= set(rows)  # both candidates are reported
    assert "CFRAG (paper)" in rows  # the paper's exact CFRAG stays a row
    assert "CFRAG (paper) w/o reranker tuning" not in rows
    assert "w/o user retrieval (first-stage order)" in rows and "w/o user retrieval" not in rows
    assert "w/o reranker tuning + tuned generator" in rows and "CFRAG + tuned generator" not in rows
    assert {"zero_shot", "bm25", "zero_shot + tuned generator", "bm25 + tuned generator"} <= set(rows)
    # in the tables the candidates are configurations of CFRAG, named by what stage 1 reads and their order; the
    # chosen one is the reference, and its "+ tuned generator" row and the goal's paired test follow that name
    assert test.names == choice.names == {
        "CFRAG": "CFRAG (judgment profile, reranked)",
        "w/o reranker tuning": "CFRAG (judgment profile, first-stage order)",
        "CFRAG, ≤ 2 neighbour docs": "CFRAG (judgment profile, reranked, ≤ 2 neighbour docs)",
        "w/o reranker tuning, ≤ 2 neighbour docs": "CFRAG (judgment profile, first-stage order, ≤ 2 neighbour docs)",
        "CFRAG (split reranker)": "CFRAG (judgment profile, split reranker)",
        "CFRAG (split reranker), ≤ 2 neighbour docs": "CFRAG (judgment profile, split reranker, ≤ 2 neighbour docs)"}
    assert [r for _, r in evaluated_rows(test) if r.startswith("CFRAG (judgment profile")] == [
        "CFRAG (judgment profile, reranked)", "CFRAG (judgment profile, first-stage order)",
        "CFRAG (judgment profile, first-stage order) + tuned generator"]
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["reference_row"] == "CFRAG (judgment profile, first-stage order)"


def test_without_judgments_the_paper_chain_is_the_main_one(monkeypatch, tmp_path) -> None:
    machine(monkeypatch, AMX, onednn=True)
    fits, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--judgments", "none"],
                                     {"CFRAG": 0.3})
    assert not any("_paper" in r.stage for r in fits)
    assert all(r.overrides["run_name"] == "synthlamp-quick-none" for r in fits)
    runs = by_purpose(evaluations)
    assert runs["choice"].only == list({**CANDIDATES, **GATES})  # both orders, each gated and shut
    assert "evaluation.reference" not in runs["test"].overrides  # CFRAG is the config's reference already
    rows = runs["test"].only
    assert "CFRAG" in rows and not any("(paper" in r for r in rows)  # no row of a chain that was not trained
    assert runs["test"].names["CFRAG"] == "CFRAG (text only, reranked)"


def test_data_dir_reaches_every_stage_and_the_evaluation(monkeypatch, tmp_path) -> None:
    from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp

    folder = generate_synth_lamp(tmp_path / "my_lamp2", SynthConfig(num_users=12, seed=3))
    machine(monkeypatch, AVX2_ONLY, onednn=False)
    fits, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick", "--data_dir", str(folder)])
    assert all(r.overrides["data.init_args.data_dir"] == str(folder) for r in fits)
    assert all(e.overrides["evaluation.data_dir"] == str(folder) for e in evaluations)
    assert all(r.overrides["run_name"] == "my_lamp2-quick" for r in fits + evaluations)


def test_a_folder_without_the_reported_split_is_refused_in_one_line(monkeypatch, tmp_path, capsys) -> None:
    from persrag_lightning.cli import main
    from persrag_lightning.data.lamp import outputs_path
    from persrag_lightning.data.synth import SynthConfig, generate_synth_lamp

    folder = generate_synth_lamp(tmp_path / "no_test_golds", SynthConfig(num_users=12, seed=3))
    outputs_path(folder, "test").unlink()  # LaMP's public test golds are hidden
    monkeypatch.setattr(pipeline, "run_stage", lambda cfg: pytest.fail("trained before checking"))
    with pytest.raises(SystemExit) as exit_:
        main(["pipeline", "--preset", "quick", "--data_dir", str(folder), "--export_root", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "test_outputs.json: missing" in err[0]


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.layer(batch[0]).sum())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_progress_lines_cover_the_whole_fit_and_a_long_validation(capsys, tmp_path) -> None:
    from persrag_lightning.modules.progress_lines import ProgressLines

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = L.Trainer(max_epochs=2, enable_progress_bar=False, logger=False, enable_checkpointing=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
                        callbacks=[ProgressLines("generator", every=0.0)])
    trainer.fit(_Tiny(), data, data)
    err = capsys.readouterr().err
    train = [ln for ln in err.splitlines() if ln.startswith("[fit generator]")]
    assert train[0].startswith("[fit generator] 1/8 batches (12 %) (ETA ")  # one count over both epochs
    assert train[-1].startswith("[fit generator] 8/8 batches in ")
    assert "[validate generator] 2/4 batches (50 %) (ETA " in err
    trainer.validate(_Tiny(), data)
    assert capsys.readouterr().err.splitlines()[-1].startswith("[validate generator] 4/4 batches in ")


def labels(rows: list[list[float]], terms: dict):
    """A LaMP-3 row's label scores, as the evaluation reads them (every calibration's terms computed)."""
    from persrag_lightning.reading.label_reading import LabelReading

    return LabelReading("LaMP-3", ("1", "2", "3", "4", "5"), rows, "none", "median", terms)


def dev_report(results: dict[str, dict], readings: dict, golds: list[str]):
    """A LaMP-3 dev evaluation's report: MAE, lower is better, with the rows' readings."""
    from persrag_lightning.evaluation.base import EvaluationReport

    return EvaluationReport("mae", False, "", results, None, readings, tuple(golds))


def test_the_dev_choice_reads_each_calibration_and_refuses_identical_columns(monkeypatch, tmp_path, capsys):
    """LaMP-3: uncalibrated, both configurations answer "1" everywhere (identical columns: no choice, the earlier
    stands); calibrated against a prior for "1", the reranked order reads the reviews and wins on MAE. The scores
    are re-read from the report's readings: no file is read (the run folder stays empty)."""
    import math

    monkeypatch.chdir(tmp_path)
    golds = ["4", "5", "4", "2"]
    prior = {"none": None, "contextual": [math.log(0.8)] + [math.log(0.05)] * 4, "pmi": [0.0] * 5}
    near = {"4": [-0.3, -5, -4, -1.0, -3], "5": [-0.3, -5, -4, -3, -1.0], "2": [-0.3, -1.0, -4, -5, -5]}
    flat = [-0.3, -3.0, -3.0, -3.0, -3.0]
    report = dev_report({"CFRAG": {"mae": 3.0}, "w/o reranker tuning": {"mae": 3.0}},
                        {"CFRAG": labels([near[g] for g in golds], prior),
                         "w/o reranker tuning": labels([flat] * 4, prior)}, golds)
    run = dev_evaluation({}, list(CANDIDATES), "r", {})
    chosen = choose_on_dev(report, run, ["none", "contextual", "pmi"])
    said = capsys.readouterr().out
    assert "dev answers of w/o reranker tuning [calibration none] are identical to CFRAG [calibration none]'s" in said
    assert chosen[:2] == ("CFRAG", "contextual")
    assert chosen[2]["CFRAG [calibration contextual]"] == 0.0  # every review read right
    assert chosen[2]["CFRAG [calibration none]"] == chosen[2]["w/o reranker tuning [calibration none]"] == 2.75  # "1" to 4, 5, 4, 2
    # pmi with zero terms reads as none: the same answers, so it is no choice either
    assert "CFRAG [calibration pmi] are identical to CFRAG [calibration none]'s" in said
    assert not list(tmp_path.iterdir())
    # without calibrations, or for a row without scores, the evaluation's own numbers; ties keep the earlier
    assert choose_on_dev(report, run)[:2] == ("CFRAG", None)
    assert choose_on_dev(dev_report({"CFRAG": {"mae": 1.0}, "w/o reranker tuning": {"mae": 0.5}}, {}, golds),
                                  run, ["none"])[:2] == ("w/o reranker tuning", None)


def test_the_tuned_generator_gets_its_own_calibration_chosen_on_dev(monkeypatch, tmp_path, capsys) -> None:
    """With label scores in the dev reports, the generator's dev row is read under each calibration too, and the
    test table reads the base rows under theirs and the "+ tuned generator" rows under the generator's."""
    import math

    monkeypatch.chdir(tmp_path)
    machine(monkeypatch, AMX, onednn=True)
    golds = ["4", "2"]
    prior = {"none": None, "contextual": [math.log(0.8)] + [math.log(0.05)] * 4, "pmi": [0.0] * 5}
    reads = {"4": [-0.3, -5, -4, -1.0, -3], "2": [-0.3, -1.0, -4, -5, -5]}  # right once the prior is divided out

    def evaluate(cfg):  # dev: the base rows need calibrating, the tuned not
        rows = [row for _, row in evaluated_rows(cfg)]
        return dev_report({row: {"mae": 1.0} for row in rows},
                          {row: labels([reads[g] for g in golds] if "tuned" not in row
                                       else [[-5.0, -1.0, -5, -0.2, -5]] * 2, prior) for row in rows}, golds)

    monkeypatch.setattr(pipeline, "run_stage", fake_fit())
    monkeypatch.setattr(pipeline, "run_evaluation", evaluate)
    pipeline.main(["--preset", "quick", "--task", "LaMP-3", "--export_root", str(tmp_path)])
    record = json.loads((tmp_path / "synthlamp-lamp3-quick" / "pipeline.json").read_text())
    runs = by_purpose([EvaluationRun(**r) for r in record["evaluations"]])
    generator, test = runs["generator"], runs["test"]
    assert generator.only == ["CFRAG + tuned generator"] and generator.purpose.endswith("select-on-dev/generator")
    assert generator.overrides["evaluation.llm.calibration"] == "contextual"  # read on dev as the table reads
    assert test.overrides["evaluation.llm.calibration"] == "contextual"
    assert test.overrides["evaluation.generator_calibration"] == "none"  # "4", "4" under every calibration
    assert record["generator_calibration_chosen_on_dev"] == "none" and record["calibration_chosen_on_dev"] == "contextual"


def test_names_rename_rows_their_tuned_generators_and_the_tests_that_name_them() -> None:
    from persrag_lightning.evaluation.arguments import rename_strategies
    from persrag_lightning.evaluation.evaluate import Evaluation
    from persrag_lightning.retrieval.cfrag import CFRAG
    from persrag_lightning.retrieval.strategies import bind_strategies
    from persrag_lightning.retrieval.tuned_generator import TunedGenerator
    from persrag_lightning.utils import ConfigError

    def config():
        rows = [CFRAG("u", name="CFRAG"), CFRAG("u", name="w/o reranker tuning"), TunedGenerator("CFRAG"),
                TunedGenerator("w/o reranker tuning", name="mine")]
        bind_strategies(rows)
        return rows

    rows = config()
    names = {k: v for k, v in chain_names("paired").items() if k in CANDIDATES}  # the two orders
    made = rename_strategies(rows, names)
    assert [s.name for s in rows] == ["CFRAG (judgments, reranked)", "CFRAG (judgments, first-stage order)",
                                      "CFRAG (judgments, reranked) + tuned generator", "mine"]
    assert rows[2].retrieval is rows[0]  # bound by the old names, before the rename
    evaluation = Evaluation(reference="w/o reranker tuning", votes=["bm25", "CFRAG"],
                            pairs=[["CFRAG + tuned generator", "bm25 + tuned generator"]], by_history=["bm25", "CFRAG"])
    evaluation.rename(made)
    assert evaluation.by_history == ["bm25", "CFRAG (judgments, reranked)"]
    assert evaluation.reference == "CFRAG (judgments, first-stage order)"
    assert evaluation.votes == ["bm25", "CFRAG (judgments, reranked)"]
    assert evaluation.pairs == [["CFRAG (judgments, reranked) + tuned generator", "bm25 + tuned generator"]]
    with pytest.raises(ConfigError, match="already the name of another strategy"):
        rename_strategies(config(), {"CFRAG": "mine"})
    with pytest.raises(ConfigError, match=r"\['nope'\] name no strategy"):
        rename_strategies(config(), {"nope": "x"})


def test_the_reader_is_chosen_on_dev_and_an_llm_choice_keeps_the_llms_feedback(monkeypatch, tmp_path, capsys):
    """The LLM reads BM25's dev prompts better than the trained reader: it stays the reader of the feedback stages
    and of the table, and its calibrations are chosen with the configuration; a generation task trains no reader."""
    machine(monkeypatch, AMX, onednn=True)

    def evaluate(cfg):
        report = fake_evaluate()(cfg)
        for _, row in evaluated_rows(cfg):
            report.results[row]["accuracy"] = 0.2 if cfg.evaluation.init_args.reader == "{run_dir}/reader" else 0.4
        return report

    monkeypatch.setattr(pipeline, "run_stage", fake_fit())
    monkeypatch.setattr(pipeline, "run_evaluation", evaluate)
    pipeline.main(["--preset", "quick", "--export_root", str(tmp_path)])
    assert "reader chosen on dev (accuracy, bm25's prompts): llm — trained 0.200, llm 0.400" in capsys.readouterr().out
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["reader"] == "llm"
    assert not any("data.init_args.feedback.reader" in r["overrides"] for r in record["stages"])
    # the LLM trained on no question: the fold readers are not trained and nothing is cross-fitted
    assert not any(r["stage"].startswith("reader_fold") for r in record["stages"])
    assert all(r["overrides"]["data.init_args.feedback.cross_fit"] == 0 for r in record["stages"]
               if r["stage"].startswith(("retriever", "reranker")))
    runs = by_purpose([EvaluationRun(**r) for r in record["evaluations"]])
    assert "evaluation.reader" not in runs["choice"].overrides and "evaluation.reader" not in runs["test"].overrides
    fits, _ = run_pipeline(monkeypatch, tmp_path / "lamp5", ["--preset", "quick", "--task", "LaMP-5"])
    assert "reader" not in [r.stage for r in fits]  # the LLM writes titles; no reader to train or choose


def test_in_process_fits_and_evaluations_are_given_objects_their_printed_commands_resolve_to(
        monkeypatch, tmp_path, capsys) -> None:
    """Inside the pipeline's process no typed value goes through text: every fit and every evaluation is given
    the resolved configuration object (never a command line), and that object is what the printed command line
    resolves to through the CLI's own parser, so a user who runs the printed line gets the same stage."""
    from jsonargparse import Namespace

    from persrag_lightning.commands.evaluate import evaluate_args
    from persrag_lightning.evaluation.arguments import evaluate_parser

    machine(monkeypatch, AMX, onednn=True)
    fits, evaluations = [], []
    monkeypatch.setattr(pipeline, "run_stage", fake_fit(fits))
    monkeypatch.setattr(pipeline, "run_evaluation", fake_evaluate(evaluations))
    pipeline.main(["--preset", "quick", "--export_root", str(tmp_path), "--trainer.max_epochs=2"])
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    stages = [StageRun(**r) for r in record["stages"]]
    runs = [EvaluationRun(**r) for r in record["evaluations"]]
    assert len(fits) == len(stages) == 10 and len(evaluations) == len(runs) == 5
    assert all(isinstance(cfg, Namespace) for cfg in fits + evaluations)
    printed = [line for line in capsys.readouterr().out.splitlines() if ": python train.py fit " in line]
    for cfg, run, line in zip(fits, stages, printed):
        assert line == f"[pipeline] {run.stage}: python train.py {' '.join(run.argv())}"
        assert cfg == cli_parse(run.argv()), run.stage  # the CLI's own parse of the printed line
        assert cfg.fit.trainer.max_epochs == 2  # the user's own arguments reach every stage, last
    for cfg, run in zip(evaluations, runs):
        assert cfg == evaluate_parser().parse_args(evaluate_args(run.argv())), run.purpose


@pytest.mark.parametrize(("best", "order_row"), [("w/o reranker tuning, ≤ 2 neighbour docs",
                                                  "w/o user retrieval (first-stage order)"),
                                                 ("w/o user retrieval", "w/o user retrieval")])
def test_dev_may_narrow_or_shut_the_neighbour_gate_and_the_table_says_so(monkeypatch, tmp_path, best, order_row):
    """The gate is a dev choice like the order: where dev prefers at most 2 neighbours' docs, or none, that
    configuration is the reference and its own-docs chain is the table's "w/o user retrieval" row; shut, the
    reference is that row itself, named as it is."""
    machine(monkeypatch, AMX, onednn=True)
    dev = {"CFRAG": 0.20, "w/o reranker tuning": 0.31, best: 0.40}
    _, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick"], dev)
    test = by_purpose(evaluations)["test"]
    assert test.overrides["evaluation.reference"] == best
    assert best in test.only and order_row in test.only and "CFRAG" in test.only
    assert test.overrides["evaluation.pairs"] == [[f"{best} + tuned generator", "bm25 + tuned generator"]]
    # shut, the reference is its own chain without user retrieval: only bm25 is left to break down against
    assert test.overrides["evaluation.by_history"] == ["bm25", order_row] if best != order_row else ["bm25"]
    record = json.loads((tmp_path / "synthlamp-quick" / "pipeline.json").read_text())
    assert record["reference_row"] == test.names.get(best, best)


def test_the_split_preset_chooses_the_split_rerankers_order_on_dev_and_reports_the_exact_one(monkeypatch,
                                                                                             tmp_path) -> None:
    """quick-split: stage 3's reranker is distilled into the split reranker (no LLM, none of the feedback stages'
    keys), the reranked candidates of the dev choice are the split reranker's, the exact reranker stays a row, and
    the record names the split reranker's bundle for serving."""
    from persrag_lightning.pipeline.choice import report_rows
    from persrag_lightning.presets import load_preset
    from persrag_lightning.record import read_reference
    from persrag_lightning.stages import SPLIT_RERANKER

    machine(monkeypatch, AMX, onednn=True)
    fits, evaluations = run_pipeline(monkeypatch, tmp_path, ["--preset", "quick-split"],
                                     {"CFRAG (split reranker)": 0.5})
    stages = [r.stage for r in fits]
    assert stages.index(SPLIT_RERANKER) == stages.index("reranker") + 1
    split = fits[stages.index(SPLIT_RERANKER)]
    assert (split.config, split.overlays) == ("cfrag_reranker_distilled.yaml", ["overlays/reranker_split.yaml"])
    assert split.argv()[:5] == ["fit", "--config", "cfrag_reranker_distilled.yaml", "--config",
                                "overlays/reranker_split.yaml"]
    assert split.overrides["model.init_args.config.split_layer"] == 5
    assert split.overrides["trainer.max_epochs"] == 1 and split.overrides["trainer.precision"] == "bf16-mixed"
    assert not any(k.startswith(("data.init_args.feedback.", "data.init_args.candidates.")) for k in split.overrides)
    runs = by_purpose(evaluations)
    assert runs["choice"].only == ["CFRAG (split reranker)", "w/o reranker tuning",
                                   "CFRAG (split reranker), ≤ 2 neighbour docs",
                                   "w/o reranker tuning, ≤ 2 neighbour docs", "w/o user retrieval (split reranker)",
                                   "w/o user retrieval (first-stage order)"]
    test = runs["test"]
    assert test.overrides["evaluation.reference"] == "CFRAG (split reranker)"
    assert {"CFRAG", "w/o reranker tuning", "CFRAG (split reranker)", "w/o user retrieval (split reranker)",
            "CFRAG (split reranker) + tuned generator"} <= set(test.only)
    assert test.names["CFRAG (split reranker)"] == "CFRAG (judgment profile, split reranker)"
    assert fits[-1].overrides["data.init_args.strategy"] == "CFRAG (split reranker)"
    # the split reranker's order is a row whichever order dev chooses, beside stage 3's
    rows = report_rows(load_preset("quick-split"), "w/o reranker tuning", True)
    assert rows[2:5] == ["CFRAG", "CFRAG (split reranker)", "w/o reranker tuning"]
    reference = read_reference(tmp_path / "synthlamp-quick-split")
    assert reference.configuration.reranker == SPLIT_RERANKER
    assert reference.row == "CFRAG (judgment profile, split reranker)"
