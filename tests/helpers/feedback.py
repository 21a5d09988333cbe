"""The feedback tests' world (SynthLaMP, its corpus embedded by a tiny encoder, an untrained user-encoder export)
and their FeedbackDataModule, shared with the tests of the readers that label feedback."""

from __future__ import annotations

from pathlib import Path

import torch

from persrag_lightning.data.corpus import Corpus
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.splits import SplitSettingsWithTest
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.datamodules.feedback import FeedbackDataModule
from persrag_lightning.feedback.settings import CandidateSettings, FeedbackSettings
from persrag_lightning.llm.registry import LLMConfig
from persrag_lightning.models.corpus_embeddings import build_corpus_embeddings, load_corpus_embeddings
from persrag_lightning.models.user_encoder import UserEncoder, UserEncoderConfig

SYNTH = SynthConfig(num_users=16, docs_per_user=(6, 10), train_questions_per_user=2, dev_questions_per_user=1)


def feedback_world(root: Path, tiny_bert: str) -> Path:
    """SynthLaMP, its corpus embedded by the tiny encoder, and a user-encoder export (untrained weights)."""
    cache = root / "cache"
    source = LampSource("LaMP-2", None, SYNTH, str(cache))
    source.prepare()
    corpus = Corpus.from_dataset(source.load())
    build_corpus_embeddings(corpus, cache, encoder=tiny_bert)
    table = load_corpus_embeddings(cache, corpus, encoder=tiny_bert)
    torch.manual_seed(0)
    encoder = UserEncoder(UserEncoderConfig(dim=table.shape[1], num_docs=len(corpus)), table).eval()
    encoder.index_users(corpus.user_ids, torch.randn(len(corpus.user_ids), table.shape[1]))
    encoder.save_pretrained(root / "user_encoder")
    return root


def datamodule(root: Path, tiny_bert: str, tiny_llm: str, cache: str = "cache", candidates: dict | None = None,
               feedback: dict | None = None, splits: dict | None = None) -> FeedbackDataModule:
    """The tests' DataModule; `candidates`, `feedback` and `splits` change fields of its settings groups."""
    return FeedbackDataModule(
        task="LaMP-2", synth=SYNTH, cache_dir=str(root / cache), batch_size=4,
        candidates=CandidateSettings(**{"user_encoder": str(root / "user_encoder"), "retriever": tiny_bert, "m": 3,
                                        "k": 2, **(candidates or {})}),
        feedback=FeedbackSettings(**{"llm": LLMConfig(model=tiny_llm, batch_size=8, options={"device": "cpu"}),
                                     "chunk_size": 8, **(feedback or {})}),
        splits=SplitSettingsWithTest(**(splits or {})))
