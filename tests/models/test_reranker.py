"""Stage 3 on a tiny random BERT: Eq. 10's shapes and order, pair truncation, export round trips, a short fit.

That a reranker export loads without Lightning or peft is checked in test_retriever.py, in the same subprocess
as the retriever (one interpreter start instead of two)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

from persrag_lightning.data.candidates import Candidate, CandidateBatch, FeedbackExample, collate_candidates
from persrag_lightning.models.reranker import PersonalizedReranker, RerankerSettings, cls_state

pytestmark = pytest.mark.usefixtures("one_thread")


CORPUS = [
    "the cat sat on the warm mat", "dogs chase cats in the park", "a recipe for lemon cake with sugar",
    "stock markets fell sharply on monday", "the team won the football final", "how to grow tomatoes at home",
    "a review of the new science fiction film", "quantum computers use qubits", "baking bread needs patience",
]
USERS = ["u0", "u1", "u2"]


def make_examples() -> list[FeedbackExample]:
    """Ragged candidate lists (5, 2, 4) sharing docs; labels are distinct so rankings are informative."""
    lists = [[0, 1, 2, 3, 4], [2, 5], [6, 7, 8, 0]]
    exs = []
    for i, rows in enumerate(lists):
        cands = tuple(Candidate(row=r, doc_id=f"d{r}", owner=USERS[r % 3], user_sim=0.5, first_stage=float(-j),
                                output="", label=float((r * 5 + i) % 7) / 6) for j, r in enumerate(rows))
        exs.append(FeedbackExample(f"e{i}", USERS[i], "input", f"query {i}: {CORPUS[rows[-1]]}", "y", cands))
    return exs


def make_batch(examples: list[FeedbackExample] | None = None) -> CandidateBatch:
    return collate_candidates(examples or make_examples(), {u: i for i, u in enumerate(USERS)}, CORPUS)


@pytest.fixture(scope="module")
def reranker(tiny_bert) -> PersonalizedReranker:
    torch.manual_seed(0)
    return PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()


def _linears(seq: nn.Sequential) -> list[tuple[int, int]]:
    return [(m.in_features, m.out_features) for m in seq if isinstance(m, nn.Linear)]


def test_head_shapes_follow_reference(tiny_bert, reranker):
    d = reranker.dim
    assert _linears(reranker.head) == [(2 * d, d), (d, d), (d, 1)]
    assert [type(m) for m in reranker.head] == [nn.Linear, nn.Tanh, nn.Linear, nn.Tanh, nn.Linear]
    assert (reranker.user_map.in_features, reranker.user_map.out_features) == (8, d)
    ablation = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, use_user=False)
    assert ablation.user_map is None
    assert _linears(ablation.head) == [(d, d), (d, 1)]
    assert [type(m) for m in ablation.head] == [nn.Linear, nn.Tanh, nn.Linear]


def test_score_is_mlp3_of_cls_then_user(reranker):
    """Eq. 10: MLP3(CONCAT(h, MLP2(e_u))), h first as the paper writes it; MLP2 output not normalised."""
    q, d = ["what cake to bake"], ["a recipe for lemon cake with sugar"]
    e_u = torch.randn(1, 8)
    with torch.no_grad():
        got = reranker.score_pairs(q, d, e_u)
        h = cls_state(reranker.encoder(**reranker.tokenize_pairs(q, d)).last_hidden_state)
        want = reranker.head(torch.cat([h, reranker.user_map(e_u)], dim=-1)).squeeze(-1)
        swapped = reranker.head(torch.cat([reranker.user_map(e_u), h], dim=-1)).squeeze(-1)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, swapped)
    with pytest.raises(ValueError, match="e_u"):
        reranker.score_pairs(q, d, None)


def test_query_and_doc_are_truncated_separately(tiny_bert):
    model = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, max_query_length=10, max_doc_length=12)
    long_q, long_d = " ".join(["alpha"] * 50), " ".join(["beta"] * 50)
    enc = model.tokenize_pairs([long_q, "short query"], [long_d, long_d])
    types = enc["token_type_ids"][0]
    assert enc["input_ids"].shape[1] == 1 + 10 + 1 + 12 + 1  # [CLS] q [SEP] d [SEP]
    assert int((types == 0).sum()) == 12 and int((types == 1).sum()) == 13
    # the short query keeps all its tokens and the doc still gets only its own 12
    assert int(enc["attention_mask"][1].sum()) == 1 + 2 + 1 + 12 + 1
    assert int(enc["token_type_ids"][1].sum()) == 13
    # the total cap trims the longer side first
    model.config = replace(model.config, max_length=20)
    enc = model.tokenize_pairs([long_q], [long_d])
    assert enc["input_ids"].shape[1] == 20


def test_forward_scatters_valid_pairs_and_leaves_padding_zero(reranker):
    batch = make_batch()
    e_u = torch.randn(len(batch), 8)
    with torch.no_grad():
        scores = reranker(batch, e_u)
        queries, docs, pos = batch.pair_texts()
        pairs = reranker.score_pairs(queries, docs, e_u[pos[:, 0]], batch_size=4)
    assert scores.shape == batch.mask.shape
    assert (scores[~batch.mask] == 0).all()
    torch.testing.assert_close(scores[pos[:, 0], pos[:, 1]], pairs, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("lora_r,use_user", [(0, True), (4, True), (0, False)])
def test_save_and_reload_reproduce_scores(tiny_bert, tmp_path, lora_r, use_user):
    from transformers import AutoModel

    torch.manual_seed(1)
    model = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, lora_r=lora_r, use_user=use_user).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    batch = make_batch()
    e_u = torch.randn(len(batch), 8)
    with torch.no_grad():
        before = model(batch, e_u)
    model.save_pretrained(tmp_path / "reranker")
    assert sorted(p.name for p in (tmp_path / "reranker").iterdir()) == ["config.json", "encoder",
                                                                         "user_heads.safetensors"]
    reloaded = PersonalizedReranker.from_pretrained(tmp_path / "reranker")
    assert not any("lora" in name for name in reloaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch, e_u), before, atol=1e-5, rtol=1e-5)
        # the encoder folder is plain transformers: same [CLS] state without our code or peft
        plain = AutoModel.from_pretrained(str(tmp_path / "reranker" / "encoder")).eval()
        tokens = model.tokenize_pairs(["a query"], ["a doc about cake"])
        torch.testing.assert_close(plain(**tokens).last_hidden_state[:, 0],
                                   model.encoder(**tokens).last_hidden_state[:, 0], atol=1e-5, rtol=1e-5)


# ---- the LightningModule --------------------------------------------------------------------------------------


def test_reranker_module_fit_lowers_kl_and_exports(tiny_bert, tmp_path):
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from persrag_lightning.modules.reranker import RerankerModule

    batch = make_batch()
    torch.manual_seed(3)
    table = torch.randn(len(USERS), 8)

    class Data(L.LightningDataModule):
        user_embeddings = table

        def train_dataloader(self):
            return torch.utils.data.DataLoader([batch], batch_size=1, collate_fn=lambda x: x[0])

        val_dataloader = train_dataloader

    data = Data()
    module = RerankerModule(RerankerSettings(encoder=tiny_bert), replace(RerankerModule().settings, lr=2e-3))
    assert module.settings.student_temperature == module.settings.teacher_temperature == 0.1
    module.attach_datamodule(data)

    def kl() -> float:
        module.eval()
        with torch.no_grad():
            return module.loss(module(batch), batch).item()

    before = kl()
    trainer = L.Trainer(max_epochs=8, accelerator="cpu", logger=CSVLogger(tmp_path, name="logs"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    after = kl()
    assert after < 0.7 * before, (before, after)
    header = next(tmp_path.glob("logs/version_*/metrics.csv")).read_text().splitlines()[0].split(",")
    assert {"train/kl", "val/kl", "val/ndcg@5", "val/recall@5", "val/ndcg@5_first_stage"} <= set(header)

    trainer.save_checkpoint(tmp_path / "m.ckpt")
    module.eval()
    with torch.no_grad():
        want = module(batch)
        restored = RerankerModule.load_from_checkpoint(tmp_path / "m.ckpt").eval()
        torch.testing.assert_close(restored(batch), want, atol=1e-5, rtol=1e-5)
        served = PersonalizedReranker.from_pretrained(module.export(tmp_path / "export", data))
        torch.testing.assert_close(served(batch, table[batch.users]), want, atol=1e-5, rtol=1e-5)


def test_a_batch_of_b_examples_is_the_official_b_steps_of_accumulation(tiny_bert):
    """The configs train on batches of 4 examples where the official code takes 4 single-example steps with
    gradient accumulation 4: the same gradient (the KL is the mean over examples), from one forward instead of 4."""
    from persrag_lightning.modules.losses import kl_to_llm_feedback

    torch.manual_seed(0)
    model = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).eval()  # eval: no dropout, same forward
    table = torch.randn(len(USERS), 8)
    examples = make_examples()

    def grads(batch: CandidateBatch, scale: float) -> list[torch.Tensor]:
        model.zero_grad()
        loss = kl_to_llm_feedback(model(batch, table[batch.users]), batch.labels, batch.mask, 0.1, 0.1) * scale
        loss.backward()
        return [p.grad.clone() for p in model.parameters() if p.requires_grad]

    together = grads(make_batch(examples), 1.0)
    accumulated = [sum(g) for g in zip(*(grads(make_batch([e]), 1 / len(examples)) for e in examples))]
    assert max((a - b).abs().max().item() for a, b in zip(together, accumulated)) < 1e-5
    assert max(g.abs().max().item() for g in together) > 1e-3  # a real gradient, not zeros on both sides


def test_pairs_are_encoded_in_length_chunks_and_returned_in_input_order(reranker):
    """score_pairs encodes rows_per_forward(device) pairs at a time by token length (less padding) — training and
    inference alike — and gives every pair the score it gets alone."""
    queries = [f"query {i}" for i in range(len(CORPUS))]
    e_u = torch.randn(len(CORPUS), 8)
    with torch.no_grad():
        alone = torch.stack([reranker.score_pairs([q], [d], e_u[i:i + 1])[0]
                             for i, (q, d) in enumerate(zip(queries, CORPUS))])
        for step in (2, 4, None):
            chunked = reranker.score_pairs(queries, CORPUS, e_u, batch_size=step)
            assert torch.allclose(chunked, alone, atol=1e-5), step
    lengths = reranker.tokenize_pairs(queries, CORPUS)["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 2  # the chunks really reorder pairs of different lengths


def test_rows_per_forward_depend_on_the_device_and_default_the_chunks(monkeypatch):
    """A CPU chunk stays small (padding costs more than calls there), a CUDA chunk is large (kernel launches cost
    more there: docs/training/gpu.md); other device types take the CPU's. encode_by_length uses the device's."""
    from persrag_lightning.models import common

    assert common.rows_per_forward("cpu") == common.ROWS_PER_FORWARD == 32
    assert common.rows_per_forward(torch.device("cuda", 0)) == 256
    assert common.rows_per_forward("meta") == common.ROWS_PER_FORWARD
    monkeypatch.setitem(common.ROWS_PER_FORWARD_BY_DEVICE, "cpu", 3)
    seen: list[int] = []
    inputs = {"attention_mask": torch.ones(7, 4, dtype=torch.long), "input_ids": torch.arange(28).view(7, 4)}
    out = common.encode_by_length(inputs, lambda rows, chunk: seen.append(len(rows)) or chunk["input_ids"][:, 0],
                                  torch.device("cpu"))
    assert seen == [3, 3, 1] and out.tolist() == [0, 4, 8, 12, 16, 20, 24]


def one_batch_data(batch: CandidateBatch, table: torch.Tensor):
    """A datamodule of one candidate batch over the user table `table`, for a student's short fit."""
    import lightning as L

    class Data(L.LightningDataModule):
        user_embeddings = table

        def train_dataloader(self):
            return torch.utils.data.DataLoader([batch], batch_size=1, collate_fn=lambda x: x[0])

    return Data()


def fit_and_reload(student, batch: CandidateBatch, table: torch.Tensor, tmp_path):
    """One epoch of a reranker module on `batch`, then its scores of the batch, its checkpoint reloaded and its
    export reloaded without Lightning: (scores, resumed module, served reranker)."""
    import lightning as L

    from persrag_lightning.modules.reranker import RerankerModule

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(student, datamodule=one_batch_data(batch, table))
    trainer.save_checkpoint(tmp_path / "student.ckpt")
    student.eval()
    with torch.no_grad():
        return (student(batch), RerankerModule.load_from_checkpoint(tmp_path / "student.ckpt").eval(),
                PersonalizedReranker.from_pretrained(student.export(tmp_path / "student")))


def test_a_distilled_student_starts_from_its_teachers_first_layers(tiny_bert, tmp_path):
    """init_from + num_layers: the student is the teacher's encoder cut to its first layers with the teacher's
    MLP2 and MLP3; all layers kept reproduce the teacher; checkpoint and export round trips keep the cut."""
    from persrag_lightning.models.reranker import keep_layers
    from persrag_lightning.modules.reranker import RerankerModule

    batch = make_batch()
    table = torch.randn(len(USERS), 8)
    torch.manual_seed(1)
    teacher_path = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8).save_pretrained(tmp_path / "teacher")
    teacher = PersonalizedReranker.from_pretrained(teacher_path)

    def student(**kw) -> RerankerModule:
        module = RerankerModule(RerankerSettings(**kw), init_from=str(teacher_path))
        module.attach_datamodule(one_batch_data(batch, table))
        return module.eval()

    with torch.no_grad():
        want = teacher(batch, table[batch.users])
        torch.testing.assert_close(student()(batch), want)          # every layer kept: the teacher itself
        cut = student(num_layers=1)
        assert len(cut.model.encoder.encoder.layer) == 1 and cut.model.config.num_layers == 1
        assert not torch.allclose(cut(batch), want)
        for name, p in teacher.state_dict().items():               # what is left is the teacher's
            if ".layer.1." not in name:
                torch.testing.assert_close(cut.model.state_dict()[name], p)
    got, resumed, served = fit_and_reload(cut, batch, table, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(resumed(batch), got)
        assert len(served.encoder.encoder.layer) == 1
        torch.testing.assert_close(served(batch, table[batch.users]), got)

    with pytest.raises(ValueError, match="lora_r: 0"):
        student(lora_r=4)
    with pytest.raises(ValueError, match="use_user=True"):
        student(use_user=False)
    with pytest.raises(ValueError, match="pairs are cut to"):
        student(max_query_length=16)
    with pytest.raises(ValueError, match=r"num_layers must be in \[1, 2\]"):
        keep_layers(teacher.encoder, 3)


def test_the_feedback_amount_comparison_reads_one_runs_rerankers_against_its_first_stage():
    """configs/evaluate_reranker_feedback.yaml: the same run's stage 1 and retriever in every CFRAG
    row; the quick reranker, the one trained on 256 feedback examples (the bundle its header's command exports) and
    none, against the first stage; test by default (dev is chosen on the command line)."""
    from tests.conftest import REPO, evaluate_config_rows

    cfg, run, rows = evaluate_config_rows("evaluate_reranker_feedback.yaml")
    rows = {name: row for name, row in rows.items() if "retriever" in row}  # the CFRAG rows
    path = REPO / "configs" / "evaluate_reranker_feedback.yaml"
    assert cfg.evaluation.init_args.split == "test" and cfg.evaluation.init_args.reference == "w/o reranker tuning"
    assert {r.user_encoder for r in rows.values()} == {f"{run}/user_encoder"}
    assert {r.retriever for r in rows.values()} == {f"{run}/retriever"}
    assert [r.reranker for r in rows.values()] == [f"{run}/reranker", f"{run}/reranker_f256", None]
    assert "--stage_name reranker_f256" in path.read_text() and "max_train_examples=256" in path.read_text()
