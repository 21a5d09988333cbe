"""The split reranker (`split_layer`, models/reranker_split.py) on a tiny random BERT: its lower pass is the
encoder's own forward with the query and the doc kept apart, a doc's states never depend on the query, the
doc-state cache changes when they are computed and not what, and it trains, exports and distils like any
reranker."""

from __future__ import annotations

import pytest
import torch

from persrag_lightning.models.reranker import PersonalizedReranker, keep_layers
from persrag_lightning.models.reranker_split import DocStateCache, last_layer_cls

pytestmark = pytest.mark.usefixtures("one_thread")

QUERIES = ["what cake to bake", "football results this week", "what cake to bake"]
DOCS = ["a recipe for lemon cake with sugar", "the team won the final", "baking bread needs patience and time"]


@pytest.fixture(scope="module")
def split(tiny_bert) -> PersonalizedReranker:
    torch.manual_seed(0)
    return PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, split_layer=1).eval()


def test_lower_pass_is_the_encoders_forward_with_query_and_doc_apart(tiny_bert, split):
    """The doc part's states at the split layer are what the encoder (cut to that layer) computes over the pair
    `[CLS] q [SEP] d [SEP]` when each part attends to itself only and counts its positions from 0."""
    import copy

    lower = keep_layers(copy.deepcopy(split.encoder), 1).eval()
    tok = split.tokenizer
    q = tok(QUERIES[0], add_special_tokens=False)["input_ids"]
    d = tok(DOCS[0], add_special_tokens=False)["input_ids"]
    ids = torch.tensor([[tok.cls_token_id, *q, tok.sep_token_id, *d, tok.sep_token_id]])
    nq = len(q) + 2
    types = torch.tensor([[0] * nq + [1] * (len(d) + 1)])
    positions = torch.tensor([list(range(nq)) + list(range(len(d) + 1))])
    part = (types[0][:, None] == types[0][None, :])[None, None]  # [1, 1, L, L]: True where attention is allowed
    with torch.no_grad():
        want = lower(input_ids=ids, token_type_ids=types, position_ids=positions, attention_mask=part).last_hidden_state
        doc = split._split.doc_states(split.encoder, [DOCS[0]], 8)[0]
        query, mask = split._split.query_states(split.encoder, [QUERIES[0]])
    torch.testing.assert_close(doc, want[0, nq:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(query[0, :nq], want[0, :nq], atol=1e-5, rtol=1e-5)
    assert int(mask.sum()) == nq


def test_a_docs_states_do_not_depend_on_the_query_or_its_batch(split):
    with torch.no_grad():
        alone = split._split.doc_states(split.encoder, [DOCS[1]], 8)[0]
        batched = split._split.doc_states(split.encoder, DOCS, 2)[1]
        scores = split.score_pairs(QUERIES[:2], [DOCS[1], DOCS[1]], torch.zeros(2, 8))
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)
    # the layers above the split read query and doc together: another query, another score
    assert not torch.allclose(scores[0], scores[1])


def test_cached_doc_states_give_the_same_scores(tiny_bert):
    torch.manual_seed(0)
    model = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, split_layer=1).eval()
    e_u = torch.randn(3, 8)
    with torch.no_grad():
        fresh = model.score_pairs(QUERIES, DOCS, e_u, batch_size=2)
        model.cache_doc_tokens(True, max_doc_state_tokens=10_000)
        first = model.score_pairs(QUERIES, DOCS, e_u, batch_size=3)
        held = len(model._split.cache)
        again = model.score_pairs(list(reversed(QUERIES)), list(reversed(DOCS)), e_u.flip(0), batch_size=1)
    assert held == 3
    torch.testing.assert_close(first, fresh, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again.flip(0), fresh, atol=1e-5, rtol=1e-5)
    model.forget_docs([DOCS[0]])  # a deleted user's doc: out of both caches
    assert model._split.cache.get(DOCS[0]) is None and len(model._split.cache) == 2


def test_the_cache_drops_the_least_recently_used_beyond_its_tokens():
    cache = DocStateCache(max_tokens=5)
    cache.put("a", torch.zeros(2, 4))
    cache.put("b", torch.zeros(2, 4))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", torch.zeros(2, 4))
    assert (cache.get("b"), len(cache), cache.tokens) == (None, 2, 4)
    with pytest.raises(ValueError, match="max_tokens"):
        DocStateCache(0)


def test_gradients_reach_the_layers_below_the_split(split):
    model = PersonalizedReranker.from_encoder(split.tokenizer.name_or_path, user_dim=8, split_layer=1).train()
    model.score_pairs(QUERIES, DOCS, torch.randn(3, 8)).sum().backward()
    first = model.encoder.encoder.layer[0].attention.self.query.weight
    assert first.grad is not None and first.grad.abs().sum() > 0


def test_runtimes_and_bad_splits(tiny_bert, tmp_path):
    with pytest.raises(ValueError, match=r"split_layer must be in \[1, 1\]"):
        PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, split_layer=2)
    torch.manual_seed(0)
    model = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8, split_layer=1).eval()
    e_u = torch.randn(3, 8)
    with torch.no_grad():
        fp32 = model.score_pairs(QUERIES, DOCS, e_u)
        model.save_pretrained(tmp_path / "split")
        reloaded = PersonalizedReranker.from_pretrained(tmp_path / "split")
        assert reloaded.config.split_layer == 1
        torch.testing.assert_close(reloaded.score_pairs(QUERIES, DOCS, e_u), fp32, atol=1e-5, rtol=1e-5)
        bf16 = reloaded.for_inference("bf16").score_pairs(QUERIES, DOCS, e_u)
    torch.testing.assert_close(bf16, fp32, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match="runs in torch only"):
        PersonalizedReranker.from_pretrained(tmp_path / "split").for_inference("onnx")


def test_a_split_student_keeps_its_teachers_weights_and_its_split_through_training_and_export(tiny_bert, tmp_path):
    """init_from + split_layer (serving's split reranker, distilled from stage 3's): every weight is the
    teacher's, the split holds in the checkpoint and in the export."""
    from persrag_lightning.models.reranker import RerankerSettings
    from persrag_lightning.modules.reranker import RerankerModule
    from tests.models.test_reranker import USERS, fit_and_reload, make_batch, one_batch_data

    batch, table = make_batch(), torch.randn(len(USERS), 8)
    torch.manual_seed(1)
    teacher = PersonalizedReranker.from_encoder(tiny_bert, user_dim=8)
    teacher_path = teacher.save_pretrained(tmp_path / "teacher")
    student = RerankerModule(RerankerSettings(split_layer=1), init_from=str(teacher_path))
    student.attach_datamodule(one_batch_data(batch, table))
    assert student.model.config.split_layer == 1
    for name, p in teacher.state_dict().items():
        torch.testing.assert_close(student.model.state_dict()[name], p)
    got, resumed, served = fit_and_reload(student, batch, table, tmp_path)
    assert resumed.model.config.split_layer == 1 and served.config.split_layer == 1
    with torch.no_grad():
        torch.testing.assert_close(resumed(batch), got)
        torch.testing.assert_close(served(batch, table[batch.users]), got, atol=1e-5, rtol=1e-5)


def test_the_last_layer_at_cls_alone_is_the_whole_layers_row_zero(split):
    """The score reads the last layer at [CLS] only: the shortcut gives what the whole layer gives there, padding
    included."""
    from transformers.masking_utils import create_bidirectional_mask

    torch.manual_seed(0)
    layer = split.encoder.encoder.layer[-1]
    hidden = torch.randn(3, 7, split.dim)
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])
    with torch.no_grad():
        full = layer(hidden, create_bidirectional_mask(config=split.encoder.config, inputs_embeds=hidden,
                                                       attention_mask=mask))[:, 0]
        torch.testing.assert_close(last_layer_cls(layer, hidden, mask), full, atol=1e-5, rtol=1e-5)
