"""A user encoder that sees judgments (`judgments: label`), its export and serving, the community chance
level of stage 1's validation, and the pipeline's `--task` switch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from persrag_lightning.cli import main
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import FIRST_DOC_ID, MASK_ID, history_ids, pad_histories
from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.data.tasks import get_task
from persrag_lightning.metrics import community_chance
from persrag_lightning.models.user_encoder import UserEncoder, UserEncoderConfig, judgment_labels
from tests.conftest import REPO, fake_evaluate, fake_fit, tiny_serving_run

USERS = 24


def doc(i: int, **fields: str) -> HistoryDoc:
    return HistoryDoc(f"d{i}", (2024, 1, i + 1), fields)


# ---- the label embedding exists only where the task's history docs carry labels ------------------------------

def test_label_ids_follow_the_tasks_label_field() -> None:
    lamp3, lamp2 = get_task("LaMP-3"), get_task("LaMP-2")
    assert [lamp3.doc_label(doc(0, text="x", score=s)) for s in ("1", "5", "4.0", " 3 ", "7", "")] == [1, 5, 4, 3, 0, 0]
    assert lamp2.doc_label(doc(0, description="x", tag="comedy")) == lamp2.labels.index("comedy") + 1
    assert lamp2.doc_label(doc(0, description="x", tag="not a tag")) == 0
    for task in ("LaMP-1", "LaMP-4", "LaMP-5", "LaMP-7"):  # LaMP-1's profile holds papers, not citation choices
        assert get_task(task).label_field is None
        assert get_task(task).doc_label(doc(0, title="x", abstract="y", text="z")) == 0
        with pytest.raises(ValueError, match="no label field"):
            judgment_labels(task)
        with pytest.raises(ValueError, match="no label field"):
            UserEncoder(UserEncoderConfig(dim=8, num_docs=4, judgments="label", task=task))
    with pytest.raises(ValueError, match="needs the task"):
        UserEncoder(UserEncoderConfig(dim=8, num_docs=4, judgments="label"))
    with pytest.raises(ValueError, match="'none', 'label', 'paired' or 'profile'"):
        UserEncoder(UserEncoderConfig(dim=8, num_docs=4, judgments="score"))


def test_a_text_only_encoder_has_no_label_parameters_and_refuses_labels() -> None:
    encoder = UserEncoder(UserEncoderConfig(dim=8, num_docs=4, task="LaMP-3"))
    assert not encoder.uses_judgments and not hasattr(encoder, "label_table")
    assert not any("label" in k for k in encoder.state_dict())
    with pytest.raises(ValueError, match="judgments: none"):
        encoder.encode_embeddings(torch.randn(1, 2, 8), torch.zeros(1, 2, dtype=torch.bool),
                                  torch.ones(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="judgments: none"):
        encoder.doc_label_ids([doc(0, text="x", score="3")])


def test_the_label_enters_the_embedding_and_a_masked_doc_hides_it() -> None:
    torch.manual_seed(0)
    encoder = UserEncoder(UserEncoderConfig(dim=8, num_docs=4, dropout=0.0, judgments="label", task="LaMP-3"),
                          torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)).eval()
    ids = torch.tensor([[FIRST_DOC_ID, FIRST_DOC_ID + 1, MASK_ID]])
    encoder.set_doc_labels(torch.tensor([1, 5, 2, 3]))
    with torch.no_grad():
        before = encoder(ids)
        encoder.set_doc_labels(torch.tensor([1, 4, 2, 3]))  # the second doc's score changes: 5 -> 4
        after = encoder(ids)
        assert not torch.allclose(before, after)
        encoder.set_doc_labels(torch.tensor([1, 4, 2, 1]))  # only an unseen doc's label changes
        torch.testing.assert_close(encoder(ids), after)
        # the mask and pad rows always carry label 0, a zero vector: a masked doc hides its judgment
        assert encoder.doc_labels[MASK_ID] == 0 and encoder.label_table.weight[0].abs().sum() == 0
        # the doc-id path and the vector path (serving's new users) agree
        vectors = encoder.doc_table(ids)
        labels = encoder.doc_labels[ids]
        torch.testing.assert_close(encoder.encode_embeddings(vectors, ids == 0, labels), after)
        with pytest.raises(ValueError, match="judgments: label"):
            encoder.encode_embeddings(vectors, ids == 0)
    with pytest.raises(ValueError, match="do not match"):
        encoder.set_doc_labels(torch.tensor([1, 2]))


def test_paired_keeps_which_doc_got_which_label_through_mean_pooling(tmp_path) -> None:
    """Two users rate the same two docs (5, 1) and (1, 5): a sum (doc + label vector) has the same mean for both,
    `paired` (+ a label-specific map of the doc vector) does not; label 0 leaves the doc vector alone; the map's
    weights are saved in the export and reproduce the embeddings."""
    torch.manual_seed(0)
    docs = torch.nn.functional.normalize(torch.randn(1, 2, 8), dim=-1)
    ratings, swapped = torch.tensor([[5, 1]]), torch.tensor([[1, 5]])
    label = UserEncoder(UserEncoderConfig(dim=8, num_docs=4, judgments="label", task="LaMP-3"))
    torch.testing.assert_close(label.judged_inputs(docs, ratings).mean(1), label.judged_inputs(docs, swapped).mean(1))
    paired = UserEncoder(UserEncoderConfig(dim=8, num_docs=4, dropout=0.0, judgments="paired", task="LaMP-3"),
                         torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)).eval()
    difference = paired.judged_inputs(docs, ratings).mean(1) - paired.judged_inputs(docs, swapped).mean(1)
    assert difference.norm() > 0.1 * docs.norm()
    torch.testing.assert_close(paired.judged_inputs(docs, torch.zeros(1, 2, dtype=torch.long)), docs)
    # each label's map differs, and a doc's mapped vectors under two labels are near-orthogonal at init
    assert not torch.allclose(paired.label_maps[1], paired.label_maps[5])
    paired.set_doc_labels(torch.tensor([5, 1, 3, 0]))
    ids = torch.tensor([[FIRST_DOC_ID, FIRST_DOC_ID + 1, FIRST_DOC_ID + 3, MASK_ID]])
    with torch.no_grad():
        expected = paired(ids)
        paired.save_pretrained(tmp_path / "ue")
        reloaded = UserEncoder.from_pretrained(tmp_path / "ue")
        assert reloaded.config.judgments == "paired" and reloaded.uses_judgments
        torch.testing.assert_close(reloaded(ids), expected)
    # the gradient reaches only the maps of labels present (label 0, [mask] here, has no map in use)
    paired(ids).sum().backward()
    used = paired.label_maps.grad.flatten(1).abs().sum(1) > 0
    assert used.tolist() == [False, True, False, False, False, True]  # scores 1 and 5; the 4th doc has none
    # bf16-mixed (stage 1 on a CPU that computes bfloat16 natively): the maps compute in bf16, the sum stays
    # float32 (it once failed: index_put of a bf16 source into a float32 tensor)
    paired.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = paired(ids)
    mixed.float().sum().backward()
    torch.testing.assert_close(mixed.float(), expected, atol=0.05, rtol=0.05)
    assert paired.label_maps.grad.flatten(1).abs().sum(1).gt(0).tolist() == used.tolist()


def test_profile_is_the_mean_of_each_docs_label_map_and_trains_nothing() -> None:
    """`profile`: the user is the mean of A_l d over their docs (label 0 and [mask] add zero but count), with no
    transformer and no text mean; so the (5, 1) and (1, 5) users differ, and the same judgments in another order
    give the same user."""
    torch.manual_seed(0)
    table = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
    profile = UserEncoder(UserEncoderConfig(dim=8, num_docs=4, judgments="profile", task="LaMP-3"), table).eval()
    assert not profile.trains and profile.uses_judgments
    profile.set_doc_labels(torch.tensor([5, 1, 3, 0]))
    ids = torch.tensor([[FIRST_DOC_ID, FIRST_DOC_ID + 1, FIRST_DOC_ID + 3, MASK_ID]])
    maps = profile.label_maps.detach()
    expected = (table[0] @ maps[5] + table[1] @ maps[1]) / 4
    with torch.no_grad():
        torch.testing.assert_close(profile(ids)[0], expected)
        torch.testing.assert_close(profile(ids.flip(1)), profile(ids))
        swapped = profile.encode_embeddings(table[None, :2], torch.zeros(1, 2, dtype=torch.bool), torch.tensor([[1, 5]]))
        assert (swapped[0] - profile.encode_embeddings(table[None, :2], torch.zeros(1, 2, dtype=torch.bool),
                                                      torch.tensor([[5, 1]]))[0]).norm() > 0.1


def test_a_profile_stage_one_validates_and_exports_without_training(in_tmp_cwd, tiny_bert) -> None:
    main(fit_args(tiny_bert, "--model.init_args.config.judgments=profile", users=16))
    encoder = UserEncoder.from_pretrained(in_tmp_cwd / "checkpoints" / "j" / "user_encoder")
    assert encoder.config.judgments == "profile" and encoder.user_embeddings is not None
    csv = next((in_tmp_cwd / "runs" / "j" / "user_encoder" / "logs").glob("version_*/metrics.csv")).read_text()
    assert "val/community_p@5" in csv and "train/loss" not in csv
    source = LampSource("LaMP-3", None, SynthConfig(num_users=16), str(in_tmp_cwd / ".cache" / "persrag"))
    corpus = Corpus.from_dataset(source.load())
    ids = pad_histories([history_ids(corpus.user_rows(i, 100)) for i in range(len(corpus.user_ids))])
    # the exported doc table is the frozen text encoder's (nothing trained), and reproduces the users
    with torch.no_grad():
        torch.testing.assert_close(encoder(ids), encoder.user_embeddings, atol=1e-5, rtol=1e-5)


def test_community_chance_is_the_share_of_other_users_in_ones_community() -> None:
    communities = torch.tensor([0, 0, 0, 1, 1, 2])
    # users of community 0 see 2 of 5 others, of 1: 1 of 5, of 2: 0 of 5
    assert community_chance(communities) == pytest.approx((3 * 2 / 5 + 2 * 1 / 5 + 0) / 6)
    assert community_chance(torch.zeros(4, dtype=torch.long)) == pytest.approx(1.0)


# ---- stage 1 with judgments: fit, export, reload without Lightning, serving's add_user ---------------------------

def fit_args(encoder: str, *extra: str, task: str = "LaMP-3", users: int = USERS) -> list[str]:
    return ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "j", f"--data.init_args.encoder={encoder}",
            f"--data.init_args.task={task}", f"--data.init_args.synth.num_users={users}", "--trainer.max_epochs=2",
            "--trainer.accelerator=cpu", "--data.init_args.batch_size=8", "--trainer.enable_progress_bar=false",
            *extra]


@pytest.fixture(scope="module")
def label_run(tmp_path_factory, tiny_bert):
    """A `judgments: label` user encoder on SynthLaMP LaMP-3 (frozen doc table, so a new user with a training
    user's history gets that user's embedding), with untrained tiny retriever and reranker exports beside it."""
    root = tmp_path_factory.mktemp("judgments")
    args = fit_args(tiny_bert, "--model.init_args.config.judgments=label", "--model.init_args.training.freeze_doc_table=true")
    return root, tiny_serving_run(root, args, "j", tiny_bert)


def test_label_export_reloads_and_reproduces_embeddings_without_lightning(label_run) -> None:
    root, run = label_run
    encoder = UserEncoder.from_pretrained(run / "user_encoder")
    assert encoder.uses_judgments and encoder.config.task == "LaMP-3"
    source = LampSource("LaMP-3", None, SynthConfig(num_users=USERS), str(root / ".cache" / "persrag"))
    corpus = Corpus.from_dataset(source.load())
    spec = get_task("LaMP-3")
    # the export carries every corpus row's judgment
    assert encoder.doc_labels[FIRST_DOC_ID:].tolist() == [spec.doc_label(d) for d in corpus.docs]
    assert set(encoder.doc_labels[FIRST_DOC_ID:].tolist()) <= {1, 2, 3, 4, 5}
    ids = pad_histories([history_ids(corpus.user_rows(i, 100)) for i in range(len(corpus.user_ids))])
    with torch.no_grad():
        torch.testing.assert_close(encoder(ids), encoder.user_embeddings, atol=1e-5, rtol=1e-5)
    # label 0 (pad, mask, no label) stays the zero row through training
    assert encoder.label_table.weight[0].abs().sum() == 0
    # the same in a fresh interpreter that never imports Lightning
    script = textwrap.dedent(f"""
        import sys, torch
        from persrag_lightning.models.user_encoder import UserEncoder
        e = UserEncoder.from_pretrained({str(run / "user_encoder")!r})
        ids = torch.load({str(root / "ids.pt")!r})
        with torch.no_grad():
            torch.testing.assert_close(e(ids), e.user_embeddings, atol=1e-5, rtol=1e-5)
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "pytorch_lightning"))
        assert not leaked, leaked
    """)
    torch.save(ids, root / "ids.pt")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]


def test_add_user_embeds_the_new_users_judgments(label_run, tmp_path) -> None:
    from persrag_lightning.serving import CFRAGPipeline

    _, run = label_run
    pipe = CFRAGPipeline.from_pretrained(run, m=3, k_per_user=2, k=3, cache_dir=str(tmp_path / "cache"))
    ue = pipe.strategy.user_encoder
    source_user = pipe.store.corpus.user_ids[4]
    docs = pipe.store.dataset.users[source_user].docs
    same = [{"id": f"a{i}", "date": "2024-01-01", "fields": d.fields} for i, d in enumerate(docs)]
    flipped = [{"id": f"b{i}", "date": "2024-01-01",
                "fields": {**d.fields, "score": str(6 - int(d.fields["score"]))}} for i, d in enumerate(docs)]
    pipe.add_user("copy", same)
    pipe.add_user("flipped", flipped)
    e = {u: ue.user_embeddings[ue.user_ids.index(u)] for u in (source_user, "copy", "flipped")}
    # frozen doc table: the same docs with the same scores give the training user's own embedding ...
    torch.testing.assert_close(e["copy"], e[source_user], atol=1e-4, rtol=1e-4)
    # ... and other scores on the same texts another one (the judgments entered the embedding)
    assert (e["flipped"] - e["copy"]).norm() > 1e-3 * e["copy"].norm()
    assert pipe.strategy.similar_users("copy")[0][0] in {"copy", source_user}


def test_judgments_label_on_a_task_without_labels_is_one_line_exit_2(in_tmp_cwd, tiny_bert, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(tiny_bert, "--model.init_args.config.judgments=label", task="LaMP-5", users=8))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and "judgments" in err[-1] and "LaMP-5" in err[-1]


def test_validation_logs_community_precision_next_to_its_chance(in_tmp_cwd, tiny_bert) -> None:
    main(fit_args(tiny_bert, users=16))
    csv = next((in_tmp_cwd / "runs" / "j" / "user_encoder" / "logs").glob("version_*/metrics.csv"))
    rows = csv.read_text().splitlines()
    header = rows[0].split(",")
    assert "val/community_p@5" in header and "val/community_p@5_chance" in header
    chance = [float(r.split(",")[header.index("val/community_p@5_chance")]) for r in rows[1:]
              if r.split(",")[header.index("val/community_p@5_chance")]]
    assert chance and all(0 < c < 1 for c in chance) and len(set(chance)) == 1  # a property of the users only


# ---- the pipeline's --task switch ------------------------------------------------------------------------------

def pipeline_runs(monkeypatch, argv: list[str]):
    """pipeline.main with stand-ins for its fits and evaluations: (what each fit and evaluation was given, the
    stages and evaluations as pipeline.json keeps them)."""
    import json

    from persrag_lightning.pipeline import command as pipeline
    from persrag_lightning.pipeline import runs

    fits, evaluations = [], []
    monkeypatch.setattr(pipeline, "run_stage", fake_fit(fits))
    monkeypatch.setattr(pipeline, "run_evaluation", fake_evaluate(evaluations))
    root = argv[argv.index("--export_root") + 1]
    pipeline.main(argv)
    record = json.loads(max(Path(root).glob("*/pipeline.json"), key=lambda p: p.stat().st_mtime_ns).read_text())
    return fits, evaluations, [runs.StageRun(**r) for r in record["stages"]]


def test_pipeline_task_switch_runs_the_same_stages_on_another_task(monkeypatch, tmp_path) -> None:
    from persrag_lightning.pipeline import command as pipeline

    fits, evaluations, stages = pipeline_runs(
        monkeypatch, ["--preset", "quick", "--task", "LaMP-3", "--export_root", str(tmp_path)])
    assert len(fits) == 10 and all(cfg.fit.data.init_args.task == "LaMP-3" for cfg in fits)  # the fold readers too
    assert all(cfg.fit.run_name == "synthlamp-lamp3-quick" for cfg in fits)
    assert all(cfg.run_name == "synthlamp-lamp3-quick" for cfg in evaluations)
    for cfg in evaluations:  # the reader's and the configuration's choices on dev, then the table on test
        assert cfg.evaluation.init_args.task == "LaMP-3" and cfg.evaluation.init_args.llm.answer_mode == "choose"
    # the preset's stage 1 reads judgments (paired); its paper chain's does not; no other stage gets the setting
    assert [r.overrides["model.init_args.config.judgments"] for r in stages
            if "model.init_args.config.judgments" in r.overrides] == ["profile", "none"]
    assert [r.stage for r in stages if r.config == "cfrag_user_encoder.yaml"] == ["user_encoder", "user_encoder_paper"]
    # another --judgments reaches stage 1 only and names the run
    fits, evaluations, stages = pipeline_runs(monkeypatch, ["--preset", "quick", "--task", "LaMP-3", "--judgments",
                                                            "label", "--export_root", str(tmp_path)])
    assert stages[0].overrides["model.init_args.config.judgments"] == "label"
    assert fits[0].fit.model.init_args.config.judgments == "label"
    assert all(cfg.run_name == "synthlamp-lamp3-quick-label" for cfg in evaluations)
    fits, _, stages = pipeline_runs(monkeypatch, ["--preset", "quick", "--export_root", str(tmp_path)])
    assert not any(k.endswith(".task") for r in stages for k in r.overrides)  # the main job is unchanged
    assert fits[0].fit.run_name == "synthlamp-quick"
    _, evaluations, _ = pipeline_runs(monkeypatch, ["--preset", "quick", "--task", "LaMP-5", "--export_root",
                                                    str(tmp_path)])
    assert evaluations[-1].evaluation.init_args.llm.answer_mode == "generate"  # no labels to choose among
    with pytest.raises(SystemExit):
        pipeline.main(["--task", "LaMP-9"])


def test_full_feedback_preset_is_the_quick_protocol_with_the_papers_feedback(monkeypatch, tmp_path) -> None:
    """`--preset full-feedback` changes only the feedback stages: no m/k/example caps (the configs' m 6, k 5, every
    question), quick's gain labels; the user encoder, generator, evaluation and reported rows are quick's."""
    runs: dict[str, dict] = {}
    for preset in ("quick", "full-feedback"):
        fits, evaluations, stages = pipeline_runs(monkeypatch, ["--preset", preset, "--export_root", str(tmp_path)])
        assert all(cfg.fit.run_name == f"synthlamp-{preset}" for cfg in fits)
        assert all(cfg.run_name == f"synthlamp-{preset}" for cfg in evaluations)
        runs[preset] = {r.stage: {k: v for k, v in r.overrides.items() if k != "run_name"} for r in stages}
        runs[preset]["table"] = evaluations[-1].clone()  # the table on test (the dev choices write per run)
        runs[preset]["table"].run_name = None
        runs[preset]["fits"] = {r.stage: cfg.fit.data.init_args for r, cfg in zip(stages, fits)}
    quick, full = runs["quick"], runs["full-feedback"]
    assert quick.keys() == full.keys()
    for key in ("user_encoder", "generator", "table"):
        assert full[key] == quick[key]
    for stage in ("retriever", "reranker"):
        assert full[stage]["data.init_args.feedback.metric"] == quick[stage]["data.init_args.feedback.metric"] == "gain"
        assert not any(k.startswith(("data.init_args.candidates.m", "data.init_args.candidates.k",
                                     "data.init_args.splits.max_")) for k in full[stage])
        assert "data.init_args.splits.max_train_examples" in quick[stage]
        data = full["fits"][stage]
        assert (data.candidates.m, data.candidates.k, data.splits.max_train_examples) == (6, 5, None)


def test_the_full_feedback_comparison_config_reads_the_two_runs_the_pipeline_names(tmp_path) -> None:
    """configs/evaluate_full_feedback.yaml puts CFRAG of the quick run and of the full-feedback run in one table (paired
    tests across the runs), each row with its own run's bundles, named as `persrag pipeline` names the two runs."""
    from persrag_lightning.pipeline import command as pipeline
    from tests.conftest import evaluate_config_rows

    cfg, _, rows = evaluate_config_rows("evaluate_full_feedback.yaml")
    assert cfg.evaluation.init_args.split == "test" and cfg.evaluation.init_args.reference == "CFRAG (full feedback)"
    runs = {"quick": "checkpoints/synthlamp-quick", "full feedback": "checkpoints/synthlamp-full-feedback"}
    for label, run in runs.items():
        assert {b: rows[f"CFRAG ({label})"][b] for b in ("user_encoder", "retriever", "reranker")} == \
            {b: f"{run}/{b}" for b in ("user_encoder", "retriever", "reranker")}
        first_stage = rows[f"w/o reranker tuning ({label})"]
        assert first_stage.reranker is None and first_stage.retriever == f"{run}/retriever"
    assert rows["w/o user retrieval (full feedback)"].m == 1
    named: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "run_stage", lambda cfg: named.append(cfg.fit.run_name))
        mp.setattr(pipeline, "run_evaluation", fake_evaluate())
        for preset in ("quick", "full-feedback"):
            pipeline.main(["--preset", preset, "--export_root", str(tmp_path)])
    assert set(named) == {r.split("/")[1] for r in runs.values()}


def test_the_judgments_comparison_config_reads_the_three_runs_the_pipeline_names(tmp_path) -> None:
    """configs/evaluate_judgments.yaml compares the paper's text-only CFRAG (the default LaMP-3 run's *_paper chain)
    with its profile chain and the `--judgments label` and `--judgments paired` sibling runs, each row with its own
    chain's bundles, and names the runs as `persrag pipeline` does."""
    from persrag_lightning.pipeline import command as pipeline
    from tests.conftest import evaluate_config_rows

    cfg, _, rows = evaluate_config_rows("evaluate_judgments.yaml")
    assert cfg.evaluation.init_args.task == "LaMP-3" and cfg.evaluation.init_args.split == "test" and cfg.evaluation.init_args.reference == "CFRAG"
    for bundle in ("user_encoder", "retriever", "reranker"):
        assert rows["CFRAG"][bundle] == f"checkpoints/synthlamp-lamp3-quick/{bundle}_paper"
        assert rows["CFRAG (judgments label)"][bundle] == f"checkpoints/synthlamp-lamp3-quick-label/{bundle}"
        assert rows["CFRAG (judgments paired)"][bundle] == f"checkpoints/synthlamp-lamp3-quick-paired/{bundle}"
        assert rows["CFRAG (judgments profile)"][bundle] == f"checkpoints/synthlamp-lamp3-quick/{bundle}"
    tuned = {s.init_args.retrieval: s.init_args.generator for s in cfg.strategies if "generator" in s.init_args}
    assert tuned["CFRAG (judgments label)"] == "checkpoints/synthlamp-lamp3-quick-label/generator"
    assert tuned["CFRAG (judgments paired)"] == "checkpoints/synthlamp-lamp3-quick-paired/generator"
    named: list = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "run_stage", lambda cfg: named.append(cfg.fit.run_name))
        mp.setattr(pipeline, "run_evaluation", fake_evaluate())
        for judgments in ("profile", "label", "paired"):
            pipeline.main(["--preset", "quick", "--task", "LaMP-3", "--judgments", judgments,
                           "--export_root", str(tmp_path)])
    assert set(named) == {"synthlamp-lamp3-quick", "synthlamp-lamp3-quick-label", "synthlamp-lamp3-quick-paired"}
