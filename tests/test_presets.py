"""Presets as declared data (configs/presets/*.yaml over `Preset`) and the stage graph (stages.py): typed fields,
a base a preset states its differences from, and one-line refusals that name the file and the key."""

from __future__ import annotations

import pytest

from persrag_lightning.cli import main
from persrag_lightning.hardware import Precision
from persrag_lightning.presets import load_preset, preset_names
from persrag_lightning.stages import PAPER_STAGES, STAGES, cli_overrides


def test_the_shipped_presets_read_as_typed_values():
    assert preset_names() == ["full-feedback", "paper", "quick", "quick-split", "smoke"]
    quick = load_preset("quick")
    assert quick.feedback["data.init_args.candidates.m"] == 3
    assert quick.feedback["data.init_args.feedback.metric"] == "gain"
    assert quick.precision.feedback is Precision.CPU_NATIVE and quick.precision.generator is Precision.NATIVE
    assert quick.judgments == "profile" and quick.paper_chain and quick.select_order_on_dev
    assert quick.readers == ["trained", "llm"] and quick.calibrations == ["none", "contextual", "pmi"]
    assert set(PAPER_STAGES) <= set(quick.stages) and "reader" in quick.stages
    assert cli_overrides(quick.evaluate) == ["--evaluation.llm.answer_mode=choose",
                                             '--evaluation.llm.options={"dtype": "bf16_if_native"}',
                                             "--evaluation.reranker_runtime=bf16_if_native"]
    paper = load_preset("paper")
    assert paper.stages is None and paper.rows is None and paper.judgments == "none" and not paper.paper_chain


def test_a_preset_with_a_base_states_only_its_differences():
    """full-feedback.yaml: quick's rows, stages and precision; its feedback keys set to null fall back to the stage
    configs' own values (no argument), its new key is added."""
    quick, full = load_preset("quick"), load_preset("full-feedback")
    assert (full.rows, full.stages, full.precision, full.evaluate) == (quick.rows, quick.stages, quick.precision,
                                                                        quick.evaluate)
    assert cli_overrides(full.feedback) == ["--data.init_args.feedback.metric=gain",
                                            "--data.init_args.feedback.cross_fit=2",
                                            "--data.init_args.feedback.llm.batch_size=64"]


def test_the_stage_graph_resolves_inputs_to_bundles_of_the_run():
    assert STAGES["reranker_paper"].arguments("checkpoints/run") == [
        "--stage_name=reranker_paper", "--data.init_args.candidates.user_encoder=checkpoints/run/user_encoder_paper",
        "--data.init_args.candidates.retriever=checkpoints/run/retriever_paper"]
    assert STAGES["retriever_ropg"].arguments() == ["--stage_name=retriever_ropg", "--model.init_args.config.alpha=0.0",
                                                    "--data.init_args.candidates.owners=self"]
    assert STAGES["retriever"].arguments() == [] and STAGES["generator"].kind == "generator"


REFUSED = [  # (the file's text, what the one line says)
    ("base: quick\npaper_chian: false\n", ("mine.yaml: paper_chian: Key 'paper_chian' not in 'Preset'. Did you mean: "
                                          "'paper_chain'?")),
    ("base: quick\nselect_order_on_dev: sometimes\n", ("mine.yaml: select_order_on_dev: Value 'sometimes' is not a "
                                                      "valid bool")),
    ("precision: {feedback: always}\n", "mine.yaml: precision.feedback: Invalid value 'always'"),
    ("base: quick\nstages: [user_encoder, retriver]\n", "mine.yaml: stages: unknown stage 'retriver'"),
    ("base: quick\nrows: [bm25, CFRAG (papers)]\n", ("mine.yaml: rows: 'CFRAG (papers)' is no strategy of "
                                                    "evaluate_cfrag.yaml")),
    ("base: quickest\n", "--preset: no preset 'quickest'; known: full-feedback, paper, quick, quick-split, smoke"),
    ("base: quick-split\nselect_order_on_dev: false\n", "mine.yaml: split_reranker: true needs select_order_on_dev"),
    ("base: quick-split\nstages: [user_encoder, retriever, reranker]\n",
     "mine.yaml: split_reranker: true needs the stage reranker_split_l5 in stages"),
]


@pytest.mark.parametrize("text, message", REFUSED, ids=["misspelt key", "wrong type", "wrong enum", "unknown stage",
                                                        "unknown row", "unknown base", "split without the dev choice",
                                                        "split without its stage"])
def test_a_bad_preset_is_refused_in_one_line_before_anything_trains(tmp_path, monkeypatch, capsys, text, message):
    from persrag_lightning.pipeline import command as pipeline

    monkeypatch.setattr(pipeline, "run_stage", lambda cfg: pytest.fail("trained before checking"))
    preset = tmp_path / "mine.yaml"
    preset.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        main(["pipeline", "--preset", str(preset), "--export_root", str(tmp_path)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_the_docs_example_preset_is_quick_with_its_stated_differences():
    quick, mine = load_preset("quick"), load_preset("configs/presets/examples/more-feedback.yaml")
    assert mine.user_encoder == {"trainer.max_epochs": 40}
    assert mine.feedback == {**quick.feedback, "data.init_args.candidates.m": 6, "data.init_args.candidates.k": 5}
    assert (mine.rows, mine.stages, mine.precision) == (quick.rows, quick.stages, quick.precision)
