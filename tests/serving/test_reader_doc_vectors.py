"""A trained reader's doc vectors made before any question needs them (reading/doc_vectors.py): pinned beyond the
LRU, cached on disk without text, the same label scores as vectors made on first use, made for each user attached,
forgotten with a deleted user, and their cache removed when an export's users are purged."""

from __future__ import annotations

import shutil

import pytest
import torch

from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reader import LabelReader
from persrag_lightning.models.reader_inputs import doc_text
from persrag_lightning.reading.doc_vectors import READER_DOCS, doc_vectors_path, pin_doc_vectors
from persrag_lightning.reading.trained import TrainedReader
from persrag_lightning.serving import CFRAGPipeline
from tests.helpers.reader import tiny_reader_export
from tests.serving.test_serving import run_dir  # noqa: F401  (the module's run, a fixture)

QUESTION = "Which tag does this movie relate to among the following tags? description: a lonely robot tends a garden"


def refuse_to_encode(monkeypatch) -> None:
    def refuse(self, texts):
        raise AssertionError(f"embedded {texts[:2]} again")

    monkeypatch.setattr(LabelReader, "encode_texts", refuse)


def test_pinned_doc_vectors_are_the_encoders_kept_beyond_the_lru_and_cached_without_text(tmp_path, tiny_bert,
                                                                                          monkeypatch):
    export = tiny_reader_export(tmp_path / "reader", tiny_bert, "LaMP-2")
    texts = ["a heist in a casino", "a long " + "and winding " * 8 + "road movie", "space"]
    want = TrainedReader(export).model.embed(texts)
    model, cache = TrainedReader(export).model, tmp_path / "cache"
    assert pin_doc_vectors(model, [*texts, "", texts[0]], cache) == 3  # unique, non-empty
    (path,) = (cache / READER_DOCS).glob("*.safetensors")
    assert path == doc_vectors_path(cache, model, texts)
    assert not any(t.encode() in path.read_bytes() for t in texts)  # vectors only
    refuse_to_encode(monkeypatch)
    torch.testing.assert_close(model.embed(texts), want, atol=1e-5, rtol=1e-5)
    assert not model._vectors  # served from the pinned vectors, not the LRU
    again = TrainedReader(export).model
    assert pin_doc_vectors(again, texts, cache) == 3  # read back from the cache: nothing embedded
    torch.testing.assert_close(again.embed(texts), want, atol=1e-5, rtol=1e-5)
    again.forget([texts[0]])
    assert texts[0] not in again._pinned and texts[1] in again._pinned
    with pytest.raises(AssertionError, match="embedded"):
        again.embed(texts[:1])
    again.text_runtime = "onnx"  # another runtime's vectors are another cache
    assert doc_vectors_path(cache, again, texts) != path


def test_serving_makes_the_readers_doc_vectors_at_load_for_the_store_and_each_user_attached(
        run_dir, tiny_bert, tmp_path, monkeypatch):  # noqa: F811
    """Every stored doc's vector is made at load (and read back from the cache at the next start); a question
    then embeds only its own text, and its label scores are those of vectors made on first use. A new user's docs
    are pinned when attached; a deleted user's leave the reader, with every question it read."""
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    tiny_reader_export(run / "reader", tiny_bert, "LaMP-2")
    settings = {"m": 3, "k_per_user": 2, "k": 3, "cache_dir": str(tmp_path / "cache"), "reader": "reader"}
    lazy = CFRAGPipeline.from_pretrained(run, reader_doc_vectors=False, **settings)
    assert not lazy.reader.model._pinned
    pipe = CFRAGPipeline.from_pretrained(run, **settings)
    store, spec, model = pipe.store, get_task(pipe.task), pipe.reader.model
    stored = {doc_text(spec, store.history_doc(r)) for u in store.corpus.user_ids for r in store.corpus.rows_of(u)}
    assert set(model._pinned) == stored - {""}
    user = store.corpus.user_ids[1]
    docs = [store.history_doc(d.row) for d in pipe.retrieve(user, QUESTION)]
    embedded: list[str] = []
    encode = model.encode_texts
    monkeypatch.setattr(model, "encode_texts", lambda texts: embedded.extend(texts) or encode(texts))
    got = pipe.reader.log_scores(pipe.task, [QUESTION], [docs])
    assert embedded == [spec.extract_query(QUESTION)]  # the question's text only
    torch.testing.assert_close(torch.tensor(got), torch.tensor(lazy.reader.log_scores(pipe.task, [QUESTION], [docs])),
                               atol=1e-5, rtol=1e-5)
    template = store.dataset.users[store.corpus.user_ids[5]].docs
    history = [{"id": f"new-{i}", "date": f"2024-01-{i + 1:02d}",
                "fields": {**d.fields, "description": f"a newcomer's film {i}"}} for i, d in enumerate(template[:4])]
    pipe.add_user("newcomer", history)
    theirs = [doc_text(spec, store.history_doc(r)) for r in store.corpus.rows_of("newcomer")]
    assert all(t in model._pinned for t in theirs)
    assert doc_vectors_path(settings["cache_dir"], model, list(dict.fromkeys(t for t in theirs if t))).is_file()
    pipe.remove_user("newcomer")
    assert not any(t in model._pinned for t in theirs) and not model._vectors  # the questions it read too
    with monkeypatch.context() as patch:
        refuse_to_encode(patch)
        restarted = CFRAGPipeline.from_pretrained(run, **settings)  # the cache, nothing embedded
        assert set(restarted.reader.model._pinned) == stored - {""}
        restarted.add_user("newcomer", history)  # a signed-up user loaded at a restart: their cached vectors
    assert all(t in restarted.reader.model._pinned for t in theirs)


def test_purging_users_removes_the_readers_doc_vector_cache(run_dir, tmp_path):  # noqa: F811
    from persrag_lightning.data.docstore import read_docstore
    from persrag_lightning.serving import purge

    run, state, cache = tmp_path / "run", tmp_path / "state", tmp_path / "cache"
    shutil.copytree(run_dir, run)
    state.mkdir()
    (cache / READER_DOCS).mkdir(parents=True)
    (cache / READER_DOCS / "vectors.safetensors").write_bytes(b"made from the deleted user's docs")
    purge.begin(state, [read_docstore(run / "docstore").user_ids()[0]])
    purge.purge_export(run, state, cache)
    assert not (cache / READER_DOCS).exists()

