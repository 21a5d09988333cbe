"""Stage 1 end to end on a tiny random BERT: fit → export → reload without Lightning, and the embedding cache."""

from __future__ import annotations

import itertools

import pytest
import torch

from persrag_lightning.cli import main
from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.histories import history_ids, pad_histories
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.models import text_encoder
from persrag_lightning.models.user_encoder import UserEncoder


def fit_args(encoder: str, users: int = 40, epochs: int = 2, *extra: str) -> list[str]:
    return ["fit", "--config", "cfrag_user_encoder.yaml", "--run_name", "t",
            f"--data.init_args.encoder={encoder}", f"--data.init_args.synth.num_users={users}",
            f"--trainer.max_epochs={epochs}", "--trainer.accelerator=cpu", "--data.init_args.batch_size=16",
            "--trainer.enable_progress_bar=false", *extra]


def test_fit_export_reload_reproduces_embeddings(in_tmp_cwd, tiny_bert):
    main(fit_args(tiny_bert))
    bundle = in_tmp_cwd / "checkpoints" / "t" / "user_encoder"
    for name in ("config.json", "model.safetensors", "user_embeddings.safetensors", "user_ids.json", "users.faiss"):
        assert (bundle / name).exists(), name

    encoder = UserEncoder.from_pretrained(bundle)
    source = LampSource("LaMP-2", None, SynthConfig(num_users=40), ".cache/persrag")
    corpus = Corpus.from_dataset(source.load())
    assert encoder.user_ids == corpus.user_ids
    ids = pad_histories([history_ids(corpus.user_rows(i, 100)) for i in range(len(corpus.user_ids))])
    with torch.no_grad():
        recomputed = encoder(ids)
    torch.testing.assert_close(recomputed, encoder.user_embeddings, atol=1e-5, rtol=1e-5)

    top = encoder.similar_users(corpus.user_ids[3], 4)
    assert len(top) == 4 and top[0][0] == corpus.user_ids[3]
    assert top[0][1] == pytest.approx(1.0, abs=1e-4)
    assert all(a[1] >= b[1] for a, b in itertools.pairwise(top))

    metrics = list((in_tmp_cwd / "runs" / "t" / "user_encoder" / "logs").glob("version_*/metrics.csv"))
    assert metrics and "val/view_acc" in metrics[0].read_text().splitlines()[0]


def test_second_run_reuses_corpus_embeddings(in_tmp_cwd, tiny_bert, monkeypatch):
    main(fit_args(tiny_bert, 30, 1))
    cached = list((in_tmp_cwd / ".cache" / "persrag" / "embeddings").iterdir())
    assert len(cached) == 2  # the corpus, and the text "<mask>" that initialises the [mask] row

    def no_reembedding(*args, **kwargs):
        raise AssertionError("the corpus was embedded again")

    monkeypatch.setattr(text_encoder.TextEncoder, "from_pretrained", no_reembedding)
    main(fit_args(tiny_bert, 30, 1))
    assert list((in_tmp_cwd / ".cache" / "persrag" / "embeddings").iterdir()) == cached


@pytest.mark.parametrize("native", [True, False])
def test_corpus_embedding_precision_follows_the_cpu_and_is_in_the_cache_key(tmp_path, tiny_bert, monkeypatch,
                                                                            native):
    import json

    from persrag_lightning import hardware
    from persrag_lightning.models import corpus_embeddings as ce

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    source = LampSource("LaMP-2", None, SynthConfig(num_users=8, docs_per_user=(4, 6)), str(tmp_path / "c"))
    source.prepare()
    corpus = Corpus.from_dataset(source.load())
    assert ce.embedding_precision() == ("bf16" if native else "fp32")
    out = ce.build_corpus_embeddings(corpus, tmp_path, encoder=tiny_bert, max_length=64)
    meta = json.loads((out / "meta.json").read_text())
    assert meta["precision"] == ce.embedding_precision()
    assert out.name == ce.corpus_embedding_key(corpus, tiny_bert, 64, "mean", meta["precision"])
    other = "fp32" if native else "bf16"
    assert out.name != ce.corpus_embedding_key(corpus, tiny_bert, 64, "mean", other)
    table = ce.load_corpus_embeddings(tmp_path, corpus, encoder=tiny_bert, max_length=64)
    assert table.dtype == torch.float32 and table.shape[0] == len(corpus)
    # the other precision, built explicitly: its own folder; the vectors agree to bfloat16's rounding
    ce.build_corpus_embeddings(corpus, tmp_path, encoder=tiny_bert, max_length=64, precision=other)
    explicit = ce.load_corpus_embeddings(tmp_path, corpus, encoder=tiny_bert, max_length=64, precision=other)
    assert not torch.equal(table, explicit)
    assert torch.nn.functional.cosine_similarity(table, explicit).min() > 0.99
    # auto falls back to the table that exists when this machine's precision has none
    import shutil

    shutil.rmtree(out)
    torch.testing.assert_close(ce.load_corpus_embeddings(tmp_path, corpus, encoder=tiny_bert, max_length=64), explicit)
    with pytest.raises(ValueError, match="precision must be one of"):
        ce.embedding_precision("fp16")


def test_export_subcommand_rewrites_bundle_from_checkpoint(in_tmp_cwd, tiny_bert):
    main(fit_args(tiny_bert, 30, 1))
    bundle = in_tmp_cwd / "checkpoints" / "t" / "user_encoder"
    before = UserEncoder.from_pretrained(bundle).user_embeddings
    (bundle / "model.safetensors").unlink()
    ckpt = next((in_tmp_cwd / "runs" / "t" / "user_encoder").rglob("last.ckpt"))
    args = fit_args(tiny_bert, 30, 1)
    args[0] = "export"
    main([*args, f"--ckpt_path={ckpt}"])
    after = UserEncoder.from_pretrained(bundle).user_embeddings
    torch.testing.assert_close(after, before)  # one epoch: the best checkpoint is the last weights


def test_a_failed_export_keeps_the_previous_bundle_whole(in_tmp_cwd, tiny_bert, monkeypatch):
    import persrag_lightning.models.user_encoder as user_encoder_module

    main(fit_args(tiny_bert, 30, 1))
    bundle = in_tmp_cwd / "checkpoints" / "t" / "user_encoder"
    before = {p.name: p.read_bytes() for p in bundle.iterdir()}

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(user_encoder_module, "save_index", disk_full)  # dies after the weights are written
    args = fit_args(tiny_bert, 30, 1)
    args[0] = "export"
    ckpt = next((in_tmp_cwd / "runs" / "t" / "user_encoder").rglob("last.ckpt"))
    with pytest.raises(OSError, match="disk full"):
        main([*args, f"--ckpt_path={ckpt}"])
    assert {p.name: p.read_bytes() for p in bundle.iterdir()} == before
    assert not [p for p in bundle.parent.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_mask_row_starts_as_the_normalised_embedding_of_the_mask_text(tmp_path, tiny_bert):
    """As the official code: the [mask] row is the unit vector of the frozen encoder's "<mask>" embedding, not a
    N(0, 1) row whose norm (~√d) would dwarf the unit-norm doc rows in the views the mask augmentation makes."""
    from persrag_lightning.data.histories import MASK_ID
    from persrag_lightning.datamodules.user_history import UserHistoryDataModule
    from persrag_lightning.models.user_encoder import UserEncoderConfig

    dm = UserHistoryDataModule(encoder=tiny_bert, encoder_max_length=64, synth=SynthConfig(num_users=8),
                               cache_dir=str(tmp_path))
    dm.prepare_data()
    dm.setup("fit")
    encoder = UserEncoder(UserEncoderConfig(dim=dm.doc_embeddings.shape[1], num_docs=len(dm.corpus)),
                          dm.doc_embeddings, dm.mask_embedding)
    row = encoder.doc_table.weight[MASK_ID].detach()
    assert row.norm().item() == pytest.approx(1.0, abs=1e-5)
    from persrag_lightning.models.corpus_embeddings import embedding_precision

    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=embedding_precision() == "bf16"):  # as the cache's
        expected = text_encoder.TextEncoder.from_pretrained(tiny_bert, max_length=64).encode(["<mask>"])[0]
    torch.testing.assert_close(row, torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-5)
