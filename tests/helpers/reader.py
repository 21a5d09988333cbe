"""Tiny trained-reader exports for tests: a `LabelReader` over a tiny random encoder (conftest's `tiny_bert`), with
untrained (seeded) fusion and head, saved as the reader stage exports it."""

from __future__ import annotations

from pathlib import Path

import torch

from persrag_lightning.data.records import HistoryDoc
from persrag_lightning.data.tasks import get_task
from persrag_lightning.models.reader import LabelReader, ReaderConfig, encoder_digest
from persrag_lightning.models.text_encoder import TextEncoder

TINY = {"max_length": 32, "max_docs": 3, "dim": 16, "layers": 1, "heads": 2, "dropout": 0.0}


def tiny_config(task: str, embedding_dim: int = 32, encoder: str = "minilm", **settings) -> ReaderConfig:
    """A small reader's config for `task` (its labels), no encoder digest unless `encoder` is a real folder."""
    spec = get_task(task)
    digest = encoder_digest(encoder) if Path(encoder).is_dir() else ""
    return ReaderConfig(**{**TINY, **settings}, encoder=encoder, task=spec.name, labels=tuple(spec.labels),
                        embedding_dim=embedding_dim, encoder_digest=digest)


def tiny_reader(encoder: str, task: str = "LaMP-2", seed: int = 0, **settings) -> LabelReader:
    """A reader over the text encoder at `encoder`, its fusion and head initialised from `seed`."""
    text_encoder = TextEncoder.from_pretrained(encoder, max_length=TINY["max_length"])
    config = tiny_config(task, text_encoder.dim, encoder, **settings)
    torch.manual_seed(seed)
    return LabelReader(config, text_encoder).eval()


def tiny_reader_export(path: Path, encoder: str, task: str = "LaMP-2", seed: int = 0, **settings) -> Path:
    """`tiny_reader` saved at `path` (config.json + weights), as `TrainedReader` opens it."""
    return tiny_reader(encoder, task, seed, **settings).save_pretrained(path)


def labelled_docs(task: str, texts: list[str], labels: list[str]) -> list[HistoryDoc]:
    """Profile items of `task` with these texts and labels (dated in order)."""
    spec = get_task(task)
    text_field = next(f for f in spec.profile_fields if f != spec.label_field)
    return [HistoryDoc(f"d{i}", (2020, 1, i + 1), {text_field: t, spec.label_field: lab})
            for i, (t, lab) in enumerate(zip(texts, labels))]
