"""Stage 2 on a tiny random BERT: the KL loss to LLM feedback, Eq. 5, export round trips, and a short fit."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
import torch.nn.functional as F

from persrag_lightning.data.candidates import Candidate, CandidateBatch, FeedbackExample, collate_candidates
from persrag_lightning.models.retriever import PersonalizedRetriever, RetrieverSettings, doc_encoder_path
from persrag_lightning.modules.losses import kl_to_llm_feedback
from persrag_lightning.modules.optim import DistillationSettings

pytestmark = pytest.mark.usefixtures("one_thread")


CORPUS = [
    "the cat sat on the warm mat", "dogs chase cats in the park", "a recipe for lemon cake with sugar",
    "stock markets fell sharply on monday", "the team won the football final", "how to grow tomatoes at home",
    "a review of the new science fiction film", "quantum computers use qubits", "baking bread needs patience",
    "the election results surprised everyone", "running shoes for a marathon", "the museum opened a new wing",
]
USERS = ["u0", "u1", "u2", "u3"]
USER_ROW = {u: i for i, u in enumerate(USERS)}


def examples() -> list[FeedbackExample]:
    """Ragged candidate lists (5, 3, 1 and 4 candidates) that share docs across examples, as real feedback does."""
    lists = [[0, 1, 2, 3, 4], [2, 3, 5], [6], [0, 4, 7, 8]]
    out = []
    for i, rows in enumerate(lists):
        cands = tuple(Candidate(row=r, doc_id=f"d{r}", owner=USERS[r % 4], user_sim=1.0 - 0.1 * j,
                                first_stage=float(len(rows) - j), output="", label=float((r * 7 + i) % 5) / 4)
                      for j, r in enumerate(rows))
        out.append(FeedbackExample(f"e{i}", USERS[i], "input", f"query {i} about {CORPUS[rows[0]]}", "y", cands))
    return out


def make_batch() -> CandidateBatch:
    return collate_candidates(examples(), USER_ROW, CORPUS)


# ---- KL to LLM feedback (Eq. 6–8) -------------------------------------------------------------------------------

RAGGED_MASK = torch.tensor([[True] * 5, [True] * 3 + [False] * 2, [True] + [False] * 4])


def _row_kl(scores: list[float], labels: list[float], t_s: float, t_t: float) -> float:
    """KL(p_LLM ‖ p_model) of one candidate list, written out."""
    zs = [math.exp(s / t_s) for s in scores]
    zt = [math.exp(y / t_t) for y in labels]
    ps = [z / sum(zs) for z in zs]
    pt = [z / sum(zt) for z in zt]
    return sum(p * math.log(p / q) for p, q in zip(pt, ps))


def test_kl_on_ragged_lists_is_finite_with_finite_gradients():
    torch.manual_seed(0)
    scores = torch.randn(3, 5, requires_grad=True)
    loss = kl_to_llm_feedback(scores, torch.rand(3, 5), RAGGED_MASK, 0.1, 0.1)
    loss.backward()
    assert torch.isfinite(loss) and loss > 0
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[~RAGGED_MASK] == 0).all()
    assert (scores.grad[2] == 0).all()  # one valid candidate: no ranking signal


def test_kl_matches_hand_computation_and_skips_single_candidate_rows():
    torch.manual_seed(1)
    scores, labels = torch.randn(3, 5), torch.rand(3, 5)
    t_s, t_t = 0.7, 0.3
    loss = kl_to_llm_feedback(scores, labels, RAGGED_MASK, t_s, t_t)
    row1 = _row_kl(scores[1, :3].tolist(), labels[1, :3].tolist(), t_s, t_t)
    row0 = _row_kl(scores[0].tolist(), labels[0].tolist(), t_s, t_t)
    assert kl_to_llm_feedback(scores[1:2], labels[1:2], RAGGED_MASK[1:2], t_s, t_t).item() == pytest.approx(row1,
                                                                                                          rel=1e-5)
    assert loss.item() == pytest.approx((row0 + row1) / 2, rel=1e-5)  # row 2 (one candidate) is not averaged in
    # the official direction: torch's kl_div(log p_model, p_LLM) on a full row
    ref = F.kl_div(F.log_softmax(scores[:1] / t_s, -1), F.softmax(labels[:1] / t_t, -1), reduction="batchmean")
    assert kl_to_llm_feedback(scores[:1], labels[:1], RAGGED_MASK[:1], t_s, t_t).item() == pytest.approx(ref.item(),
                                                                                                       rel=1e-5)


def test_kl_is_zero_when_distributions_match():
    labels = torch.rand(3, 5)
    assert kl_to_llm_feedback(labels.clone(), labels, RAGGED_MASK, 1.0, 1.0).item() == pytest.approx(0, abs=1e-6)
    # same distribution through different temperatures (and a shift, which softmax ignores)
    scores = labels * 0.5 / 0.1 + 3.0
    assert kl_to_llm_feedback(scores, labels, RAGGED_MASK, 0.5, 0.1).item() == pytest.approx(0, abs=1e-5)


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), float("-inf"), 1e30, -1e30])
def test_kl_ignores_what_padded_slots_hold(garbage):
    torch.manual_seed(2)
    base, labels = torch.randn(3, 5), torch.rand(3, 5)
    clean = base.clone().requires_grad_(True)
    dirty_values = base.clone()
    dirty_values[~RAGGED_MASK] = garbage
    dirty = dirty_values.requires_grad_(True)
    dirty_labels = labels.clone()
    dirty_labels[~RAGGED_MASK] = garbage
    a = kl_to_llm_feedback(clean, labels, RAGGED_MASK, 0.1, 0.1)
    b = kl_to_llm_feedback(dirty, dirty_labels, RAGGED_MASK, 0.1, 0.1)
    a.backward()
    b.backward()
    assert torch.isfinite(b)
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(clean.grad, dirty.grad)


def test_kl_without_any_ranking_row_is_zero_and_differentiable():
    scores = torch.randn(2, 3, requires_grad=True)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    loss = kl_to_llm_feedback(scores, torch.rand(2, 3), mask)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(scores.grad).all()


# ---- the retriever ------------------------------------------------------------------------------------------


def test_eq5_score_matches_manual_computation(tiny_bert):
    torch.manual_seed(3)
    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, alpha=0.3)
    q, docs, u = torch.randn(2, 6), torch.randn(2, 4, 6), torch.randn(2, 6)
    got = model.score(q, docs, u)
    for b in range(2):
        for c in range(4):
            want = 0.7 * F.cosine_similarity(q[b], docs[b, c], dim=0) + 0.3 * F.cosine_similarity(u[b], docs[b, c], 0)
            assert got[b, c].item() == pytest.approx(want.item(), abs=1e-6)
    eq3 = model.score(q, docs, None)
    assert eq3[1, 2].item() == pytest.approx(F.cosine_similarity(q[1], docs[1, 2], dim=0).item(), abs=1e-6)


def test_one_query_scorer_gives_scores_bit_for_bit_equal_to_eq5_per_doc_set(tiny_bert):
    torch.manual_seed(5)
    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, alpha=0.3)
    q, u = torch.randn(6), torch.randn(1, 6)
    for with_user in (u, None):
        score = model.query_scorer(q, with_user)
        for size in (1, 3, 17):  # each user's doc set in turn, as the candidate source scores them
            docs = torch.randn(size, 6)
            assert torch.equal(score(docs), model.score(q.unsqueeze(0), docs.unsqueeze(0), with_user)[0])


@pytest.fixture(scope="module")
def retriever(tiny_bert) -> PersonalizedRetriever:
    torch.manual_seed(4)
    return PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64).eval()


def test_forward_encodes_each_shared_doc_once_and_matches_inference(retriever, monkeypatch):
    batch = make_batch()
    e_u = torch.randn(len(batch), 8)
    seen: list[int] = []
    tokenize = retriever.doc_encoder.tokenize
    monkeypatch.setattr(retriever.doc_encoder, "tokenize", lambda texts: (seen.append(len(texts)), tokenize(texts))[1])
    with torch.no_grad():
        scores = retriever(batch, e_u)
    assert seen[-1] == len(batch.docs) < int(batch.mask.sum())  # shared docs embedded once, queries apart
    q = retriever.encode_queries(batch.queries)
    docs = retriever.encode_docs(batch.docs)[batch.doc_index.clamp(min=0)]
    expected = retriever.score(q, docs, retriever.user_vectors(e_u))
    torch.testing.assert_close(scores[batch.mask], expected[batch.mask], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(scores).all()


def _perturb(model: torch.nn.Module) -> None:
    """LoRA B starts at zero (a no-op adapter); give it and the heads random values so the round trip means
    something."""
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name or "user_map" in name or "head" in name:
                p.normal_(0, 0.5)


@pytest.mark.parametrize("lora_r,shared", [(0, True), (4, True), (4, False)])
def test_save_and_reload_reproduce_scores(tiny_bert, tmp_path, lora_r, shared):
    from transformers import AutoModel

    torch.manual_seed(6)
    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, lora_r=lora_r,
                                               shared_encoder=shared, user_map_layers=1 if shared else 2).eval()
    _perturb(model)
    batch = make_batch()
    e_u = torch.randn(len(batch), 8)
    with torch.no_grad():
        before = model(batch, e_u)
    model.save_pretrained(tmp_path / "retriever")
    assert sorted(p.name for p in (tmp_path / "retriever").iterdir()) == sorted(
        ["config.json", "encoder", "user_heads.safetensors", *([] if shared else ["doc_encoder"])])
    assert not list(tmp_path.glob(".retriever*"))  # no temp folder left behind

    reloaded = PersonalizedRetriever.from_pretrained(tmp_path / "retriever")
    assert not any("lora" in name for name in reloaded.state_dict())  # merged: serving needs no peft
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch, e_u), before, atol=1e-5, rtol=1e-5)

    # the doc encoder folder is a plain transformers model (mean pooling, L2-normalised)
    folder = doc_encoder_path(tmp_path / "retriever")
    assert folder.name == ("encoder" if shared else "doc_encoder")
    plain = AutoModel.from_pretrained(str(folder)).eval()
    tokens = reloaded.doc_encoder.tokenize(batch.docs)
    with torch.no_grad():
        hidden = plain(**tokens).last_hidden_state
    mask = tokens["attention_mask"].unsqueeze(-1).float()
    vectors = F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(vectors, model.encode_docs(batch.docs), atol=1e-5, rtol=1e-5)


def test_exports_load_without_lightning_nor_peft(tiny_bert, tmp_path):
    """A fresh interpreter imports only models.retriever (then models.reranker) and reproduces LoRA-trained scores."""
    from persrag_lightning.models.reranker import PersonalizedReranker

    torch.manual_seed(7)
    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, lora_r=2).eval()
    reranker = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, lora_r=2).eval()
    _perturb(model)
    _perturb(reranker)
    model.save_pretrained(tmp_path / "retriever")
    reranker.save_pretrained(tmp_path / "reranker")
    q = ["a query about cake"]
    docs = ["a recipe for lemon cake", "stock markets fell"]
    e_u = torch.randn(1, 8)
    with torch.no_grad():
        want = model.score(model.encode_queries(q), model.encode_docs(docs)[None], model.user_vectors(e_u))
        want_rr = reranker.score_pairs(q * 2, docs, e_u.expand(2, -1))
    torch.save({"e_u": e_u, "want": want, "want_rr": want_rr}, tmp_path / "want.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from persrag_lightning.models.retriever import PersonalizedRetriever
        m = PersonalizedRetriever.from_pretrained({str(tmp_path / "retriever")!r})
        ref = torch.load({str(tmp_path / "want.pt")!r})
        with torch.no_grad():
            got = m.score(m.encode_queries({q!r}), m.encode_docs({docs!r})[None], m.user_vectors(ref["e_u"]))
        torch.testing.assert_close(got, ref["want"], atol=1e-5, rtol=1e-5)
        assert "lightning" not in sys.modules and "peft" not in sys.modules, sorted(sys.modules)

        from persrag_lightning.models.reranker import PersonalizedReranker
        r = PersonalizedReranker.from_pretrained({str(tmp_path / "reranker")!r})
        with torch.no_grad():
            got = r.score_pairs({q * 2!r}, {docs!r}, ref["e_u"].expand(2, -1))
        torch.testing.assert_close(got, ref["want_rr"], atol=1e-5, rtol=1e-5)
        assert "lightning" not in sys.modules and "peft" not in sys.modules, sorted(sys.modules)
    """)
    run = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]


def test_trained_user_table_is_exported_with_ids(tiny_bert, tmp_path):
    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, train_user_embeddings=True)
    with pytest.raises(ValueError, match="user table"):
        model.save_pretrained(tmp_path / "r")
    table = torch.randn(4, 8)
    model.save_pretrained(tmp_path / "r", user_embeddings=table, user_ids=USERS)
    reloaded = PersonalizedRetriever.from_pretrained(tmp_path / "r")
    assert reloaded.user_ids == USERS
    torch.testing.assert_close(reloaded.user_embeddings, table)


def test_tuned_user_table_is_what_candidates_use(tiny_bert, tmp_path):
    """With train_user_embeddings the exported table is the e_u of the retriever's user term at inference (and in
    the reranker stage's feedback), not the stage-1 table; users it never saw keep their stage-1 embedding."""
    import numpy as np

    from persrag_lightning.data.records import HistoryDoc, LampDataset, User
    from persrag_lightning.retrieval.base import DocStore, Query
    from persrag_lightning.retrieval.candidates import CandidateSource
    from persrag_lightning.retrieval.corpus_retriever import TrainedRetriever

    model = PersonalizedRetriever.from_encoder(tiny_bert, user_dim=8, max_length=64, train_user_embeddings=True)
    table = torch.randn(4, 8)
    model.save_pretrained(tmp_path / "r", user_embeddings=table, user_ids=USERS)
    docs = [HistoryDoc(f"d{i}", (2020, 1, i + 1), {"description": f"film {i}", "tag": "comedy"}) for i in range(3)]
    store = DocStore(LampDataset("LaMP-2", {"u1": User("u1", docs)}, {}))
    retriever = TrainedRetriever(str(tmp_path / "r"), store.corpus, tmp_path / "cache")
    retriever.prepare()
    stage1 = torch.randn(8)
    torch.testing.assert_close(retriever.tuned_user_embedding("u1", stage1), table[1])
    torch.testing.assert_close(retriever.tuned_user_embedding("new", stage1), stage1)
    seen = []
    real_scorer = retriever.scorer
    retriever.scorer = lambda q, e_u: seen.append(e_u) or real_scorer(q, e_u)
    source = CandidateSource(store, retriever, lambda u: [(u, 1.0)], lambda u: stage1, k_per_user=2)
    source.propose([Query("u1", "film")])
    torch.testing.assert_close(seen[0], table[1])
    assert np.array_equal(store.rows("u1"), np.arange(3))


# ---- the LightningModule --------------------------------------------------------------------------------------


class FakeFeedbackData:
    """What the module needs of a FeedbackDataModule: the user table, ids, and loaders of CandidateBatch."""

    def __init__(self, batch: CandidateBatch, dim: int = 8) -> None:
        torch.manual_seed(8)
        self.user_embeddings = torch.randn(len(USERS), dim)
        self.user_ids = list(USERS)
        self.batch = batch

    def as_lightning(self):
        import lightning as L

        outer = self

        class DataModule(L.LightningDataModule):
            user_embeddings = outer.user_embeddings
            user_ids = outer.user_ids

            def train_dataloader(self):
                return torch.utils.data.DataLoader([outer.batch], batch_size=1, collate_fn=lambda x: x[0])

            val_dataloader = train_dataloader

        return DataModule()


def fit_and_check(module, tmp_path, epochs: int = 8):
    """Fit on one fixed batch; the KL must fall, metrics must be logged, checkpoint and export must reload."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    batch = make_batch()
    data = FakeFeedbackData(batch).as_lightning()
    module.attach_datamodule(data)

    def kl() -> float:
        module.eval()
        with torch.no_grad():
            return module.loss(module(batch), batch).item()

    before = kl()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", logger=CSVLogger(tmp_path, name="logs"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=1, log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, datamodule=data)
    after = kl()
    assert after < 0.7 * before, (before, after)

    k = module.settings.eval_k
    lines = next(tmp_path.glob("logs/version_*/metrics.csv")).read_text().splitlines()
    header = lines[0].split(",")
    for name in ("train/kl", "val/kl", f"val/ndcg@{k}", f"val/recall@{k}", f"val/ndcg@{k}_first_stage"):
        assert name in header, name
    col = header.index(f"val/ndcg@{k}_first_stage")
    assert sum(1 for line in lines[1:] if line.split(",")[col]) == 1  # logged once, on the first validation

    trainer.save_checkpoint(tmp_path / "m.ckpt")
    module.eval()
    with torch.no_grad():
        want = module(batch)
    restored = type(module).load_from_checkpoint(tmp_path / "m.ckpt").eval()  # no datamodule
    with torch.no_grad():
        torch.testing.assert_close(restored(batch), want, atol=1e-5, rtol=1e-5)
    return module, data, batch, want


def test_retriever_module_fit_lowers_kl_and_exports(tiny_bert, tmp_path):
    from persrag_lightning.modules.retriever import RetrieverModule

    torch.manual_seed(9)
    module = RetrieverModule(RetrieverSettings(encoder=tiny_bert, max_length=64, alpha=0.3),
                             DistillationSettings(lr=5e-3, warmup_ratio=0.1, lr_schedule="linear"))
    module, data, batch, want = fit_and_check(module, tmp_path)
    assert not module.user_table.weight.requires_grad
    path = module.export(tmp_path / "export", data)
    served = PersonalizedRetriever.from_pretrained(path)
    with torch.no_grad():
        got = served(batch, data.user_embeddings[batch.users])
    torch.testing.assert_close(got[batch.mask], want[batch.mask], atol=1e-5, rtol=1e-5)
