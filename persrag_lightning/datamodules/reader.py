"""DataModule of the reader stage: train questions read with the docs a strategy that needs no
trained stage retrieves (BM25 over the user's own profile by default), and, beside them, the
labelled items of those questions' profiles, each read as a question with the same user's strictly
older items (LaMP's fine-tuned readers learn from the train questions alone; a profile item is a
question the user answered before, so the 2 train questions per user of CFRAG's time-based split
become every item the user labelled before them: docs/fidelity.md).

Nothing here is a dev or test question, and no item the history rules hide from a train question is
read: the profile items come from train questions' own profiles, each read with items dated strictly
before it. A fold of train users (`holdout`) is held out of training: their questions and items
choose the checkpoint and fit the reader's decision, so dev is left to the pipeline's choices
(`holdout: {fold: null}` lets dev questions choose the checkpoint, LaMP's protocol). Texts are
embedded once by the reader's frozen encoder and cached under a fingerprint in `prepare_data`
(with `tune_layers`, also the questions' token states under the frozen lower layers, which the tuned
question tower reads); `setup` only loads them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from persrag_lightning.data.records import Example
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.splits import Holdout, SplitSettings
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.data.tasks import get_task
from persrag_lightning.datamodules.profile_items import (
    collaborative_items,
    older_profile_questions,
    profile_item,
)
from persrag_lightning.datamodules.reader_examples import ReaderExample, ReaderTrainBatch
from persrag_lightning.datamodules.sampling import EpochShuffle, LengthBatches
from persrag_lightning.models.question_tower import lower_states, pad_states
from persrag_lightning.models.reader import ReaderSettings, encoder_digest
from persrag_lightning.models.reader_inputs import (
    batch_from_vectors,
    reader_inputs,
)
from persrag_lightning.models.text_encoder import TextEncoder
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.candidates import CandidateSource
from persrag_lightning.retrieval.strategies import cached_retrieval, strategy_by_name, strategy_config
from persrag_lightning.stages import RUN_DIR
from persrag_lightning.utils import (
    ConfigError,
    as_settings,
    atomic_save_tensors,
    atomic_write_json,
    fingerprint,
    resolve_config_path,
    trainer_validates,
)

__all__ = ["ReaderDataModule", "ReaderExample", "ReaderTrainBatch"]

# v2: provenance and the asker's habit; v3: the held-out fold; v4: neighbours' similarities kept
# through a cached retrieval (strategies.RETRIEVAL_CACHE)
READER_DATA_VERSION = "reader-data/v4"
HELD = "held"  # the stored split of the held-out train users' examples


class ReaderDataModule(L.LightningDataModule):
    """Train the reader on train questions (and their profiles' items), choose its checkpoint on
    the train users it holds out (on dev without a holdout).

    Args:
        task: the LaMP task (a label task: LaMP-1, 2, 3); must match the other stages'.
        data_dir: a folder of LaMP files; None = the embedded SynthLaMP (must match the other
            stages).
        synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None =
            its defaults.
        cache_dir: where generated data, retrievals and the embedded texts are cached, keyed by
            fingerprints.
        strategy: the strategy whose docs the questions are read with, by its name in
            `strategies_config`: one that needs no trained stage (`bm25`, the default: the user's
            own profile by BM25).
        strategies_config: an evaluate config that lists the strategies.
        run_dir: the folder of the run's exported bundles; the placeholder `stages.RUN_DIR` is
            checkpoints/<run_name>.
        k: docs per question, as the evaluation's.
        mix: more strategies (by name) whose docs each train question is also read with, so the
            reader trains on the prompts it will read (e.g. CFRAG's first stage, whose docs are
            mostly neighbours'); held-out users are read with them too, dev (without a holdout) with
            `strategy` alone. None: `strategy` alone.
        profile_items: also train on the labelled items of the train questions' profiles, each read
            with the same profile's items dated strictly before it (False: LaMP's protocol, the
            train questions alone).
        mix_items: also read every profile item with each mix strategy's first stage (CFRAG's top-m
            users' docs dated strictly before the item; datamodules/profile_items.py), so the
            reader learns to read neighbours' docs on as many questions as the asker's own.
        splits: the splits trained and validated on, and how many questions of each.
        holdout: the fold of train users held out of training, whose questions and profile items
            (read as the train ones are) choose the checkpoint and fit the decision; `fold: null`
            validates on `splits.val_split` instead.
        batch_size: questions per step.
        num_workers: DataLoader worker processes.
        seed: seed of the per-epoch shuffle.
    """

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", strategy: str = "bm25",
                 strategies_config: str = "evaluate_cfrag.yaml", run_dir: str = RUN_DIR, k: int = 5,
                 mix: list[str] | None = None, profile_items: bool = True, mix_items: bool = False,
                 splits: SplitSettings = SplitSettings(), holdout: Holdout = Holdout(), batch_size: int = 64,
                 num_workers: int = 0, seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.splits = as_settings(SplitSettings, splits)
        self.holdout = as_settings(Holdout, holdout)
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.task = self.source.task
        spec = get_task(self.task)
        if not spec.labels:
            raise ConfigError(
                f"the reader stage reads label tasks (LaMP-1, LaMP-2, LaMP-3); {spec.name} is a "
                "generation task, whose reader is the LLM"
            )
        self.labels = spec.labels
        if mix_items and not mix:
            raise ConfigError("mix_items: true needs a `mix` strategy (e.g. \"CFRAG (untuned first stage)\")")
        # `mix_items`: the profile items' collaborative reads, shared by every reader of the same data (any
        # holdout), and the mix strategies' first stages
        self.item_reads: dict[str, ReaderExample] = {}
        self.sources: dict[str, CandidateSource] = {}
        self.train_examples: list[ReaderExample] = []
        self.val_examples: list[ReaderExample] = []
        self.vectors: torch.Tensor | None = None
        self.index: dict[str, int] = {}
        self.states: dict[str, torch.Tensor] = {}  # a question's lower token states (tune_layers)

    # ---- the reader's settings come from the module (the encoder is the model's knob) ------------

    @property
    def evaluation_llm_settings(self) -> ReaderSettings:
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if module is None or not hasattr(module, "settings"):
            raise ConfigError("ReaderDataModule: the text encoder is the reader module's (`model.init_args.config`); "
                              "use it with a trainer whose module is a ReaderModule")
        return module.settings

    # ---- examples --------------------------------------------------------------------------------

    def questions(self, dataset, split: str, limit: int | None) -> list[Example]:
        if split not in dataset.examples:
            raise KeyError(
                f"split {split!r} not in {self.source.data_dir} (have {sorted(dataset.examples)})"
            )
        out = sorted(
            (e for e in dataset.examples[split] if e.target is not None), key=lambda e: e.example_id
        )
        return out[:limit] if limit else out

    def read_with(self, store: DocStore, examples: list[Example], name: str,
                  suffix: str = "") -> list[ReaderExample]:
        """`examples` read with the docs strategy `name` retrieves, with their provenance; a mix
        strategy's copy has `suffix` (`@<name>`) on its ids."""
        h, spec = self.hparams, get_task(self.task)
        strategy = strategy_by_name(resolve_config_path(h.strategies_config), name, h.run_dir)
        retrieved, _ = cached_retrieval(
            strategy, store, examples, h.k, h.cache_dir, self.source.data_dir.name
        )
        docs = [store.read_docs(Query(e.user_id, e.query, e.input, e.example_id), ds)
                for e, ds in zip(examples, retrieved)]
        reads = reader_inputs(self.reader_config(), [e.input for e in examples], docs)
        return [ReaderExample(ex.example_id + suffix, read, target) for ex, read in zip(examples, reads)
                if (target := spec.label_index(ex.target)) is not None]

    def build_splits(self, dataset: Any, store: DocStore, vectors: Any) -> dict[str, list[ReaderExample]]:
        """The stored splits: train (its kept users' under a holdout) and, under a holdout, the held
        users' (`HELD`), each built as train is; without one, the validation split's questions read
        with the strategy's docs.

        Args:
            dataset: the loaded LaMP dataset.
            store: the doc store the strategy retrieves from.
            vectors: the frozen encoder, text → unit vector.
        """
        limits = self.splits.fit_limits(trainer_validates(self))
        train = self.questions(dataset, self.splits.train_split, limits.pop(self.splits.train_split))
        if self.holdout.fold is None:
            return {self.splits.train_split: self.build_train(dataset, store, train, vectors),
                    **{split: self.read_with(store, self.questions(dataset, split, limit), self.hparams.strategy)
                       for split, limit in limits.items()}}
        held = [e for e in train if self.holdout.holds(e.user_id)]
        kept = [e for e in train if not self.holdout.holds(e.user_id)]
        if not held or not kept:
            raise ConfigError(f"holdout fold {self.holdout.fold} of {self.holdout.folds} leaves {len(kept)} train and "
                              f"{len(held)} held questions; use fewer folds, or `holdout.fold: null`")
        return {self.splits.train_split: self.build_train(dataset, store, kept, vectors),
                HELD: self.build_train(dataset, store, held, vectors)}

    def build_train(self, dataset: Any, store: DocStore, examples: list[Example],
                    vectors: Any) -> list[ReaderExample]:
        """Train questions read with the strategy's docs, with each mix strategy's docs, and their
        profiles' items (each read with its older items)."""
        h, spec = self.hparams, get_task(self.task)
        out = self.read_with(store, examples, h.strategy)
        for name in h.mix or []:
            out += self.read_with(store, examples, name, f"@{name}")
        if not h.profile_items:
            return out
        asked = {e.example_id for exs in dataset.examples.values() for e in exs}
        seen: set[str] = set()
        mixed = (h.mix or []) if h.mix_items else []
        for ex in examples:
            profile = set(ex.profile)
            # every profile item is context for the items after it; each is a question once
            user_docs = [d for d in dataset.users[ex.user_id].docs if d.doc_id in profile]
            items = older_profile_questions(spec, user_docs, asked | seen, h.k, vectors)
            for doc, older in items:
                read = profile_item(spec, ex.user_id, user_docs, doc, older)
                out.append(ReaderExample(f"{ex.user_id}/{doc.doc_id}", read, spec.doc_label(doc) - 1, "profile"))
            for name in mixed:
                out += self.collaborative(store, ex, [doc for doc, _ in items], name)
            seen.update(d.doc_id for d in user_docs)
        return out

    def collaborative(self, store: DocStore, example: Example, items: list, name: str) -> list[ReaderExample]:
        """`items` of `example`'s profile read with mix strategy `name`'s first stage (`mix_items`),
        from the reads every reader of these data shares (`item_reads`) or made now."""
        spec = get_task(self.task)
        ids = [f"{example.user_id}/{doc.doc_id}@{name}" for doc in items]
        if any(i not in self.item_reads for i in ids):
            reads = collaborative_items(spec, store, self.mix_source(store, name), example, items, self.hparams.k)
            self.item_reads.update({i: ReaderExample(i, read, spec.doc_label(doc) - 1, "profile")
                                    for i, doc, read in zip(ids, items, reads)})
        return [self.item_reads[i] for i in ids]

    def mix_source(self, store: DocStore, name: str) -> CandidateSource:
        """Mix strategy `name`'s first stage, prepared over `store` once."""
        if name not in self.sources:
            h = self.hparams
            strategy = strategy_by_name(resolve_config_path(h.strategies_config), name, h.run_dir)
            strategy.prepare(store)
            if not isinstance(getattr(strategy, "source", None), CandidateSource):
                raise ConfigError(f"mix_items: mix strategy {name!r} has no first stage of similar users to read "
                                  "profile items with; name a CFRAG strategy, or set mix_items: false")
            self.sources[name] = strategy.source
        return self.sources[name]

    def reader_config(self):
        from persrag_lightning.models.reader import ReaderConfig

        return ReaderConfig(**vars(self.evaluation_llm_settings), task=self.task, labels=tuple(self.labels))

    # ---- build once per node, read on every rank -------------------------------------------------

    def cache_path(self) -> Path:
        h, settings = self.hparams, self.evaluation_llm_settings
        dataset = self.source.load()
        strategy = strategy_by_name(resolve_config_path(h.strategies_config), h.strategy, h.run_dir)
        key = fingerprint(READER_DATA_VERSION, strategy_config(strategy), self.mix_key(), h.k, h.profile_items,
                          *(["mix_items"] if h.mix_items else []),
                          [self.holdout.folds, self.holdout.fold],
                          self.splits.fit_limits(trainer_validates(self)), encoder_digest(settings.encoder),
                          settings.max_length, settings.max_docs, self.data_key(dataset))
        return Path(h.cache_dir) / "reader_data" / key

    def mix_key(self) -> list:
        """What identifies the mix strategies' docs: each one's settings, its bundles by digest (a
        retrained stage 1 gives other neighbours)."""
        h, config = self.hparams, resolve_config_path(self.hparams.strategies_config)
        return [strategy_config(strategy_by_name(config, name, h.run_dir)) for name in h.mix or []]

    def data_key(self, dataset: Any) -> list:
        return [self.task, self.source.data_dir.name,
                [(e.example_id, e.input, e.target, e.profile) for exs in dataset.examples.values() for e in exs]]

    def item_reads_path(self, dataset: Any) -> Path:
        """The profile items' collaborative reads (`mix_items`), whatever the holdout and the encoder."""
        key = fingerprint(READER_DATA_VERSION, self.mix_key(), self.hparams.k, self.data_key(dataset))
        return Path(self.hparams.cache_dir) / "reader_data" / f"items-{key}.json"

    def prepare_data(self) -> None:
        """Data, the strategy's retrievals, the examples and every text's vector (cached)."""
        self.source.prepare()
        path = self.cache_path()
        if (path / "examples.json").exists() and (not self.evaluation_llm_settings.tune_layers
                                                 or (path / self.states_file()).exists()):
            return
        settings = self.evaluation_llm_settings
        encoder = TextEncoder.from_pretrained(settings.encoder, max_length=settings.max_length)
        if not (path / "examples.json").exists():
            self.build_examples(path, encoder)
        if settings.tune_layers and not (path / self.states_file()).exists():
            self.build_states(path, encoder)

    def states_file(self) -> str:
        return f"question-states-top{self.evaluation_llm_settings.tune_layers}.safetensors"

    def build_states(self, path: Path, encoder: TextEncoder) -> None:
        """Every stored question's token states under the frozen lower layers, one flat bfloat16
        table and its offsets (the texts' order is written first; the table marks the cache done)."""
        stored = json.loads((path / "examples.json").read_text())
        texts = sorted({row["text"] for rows in stored["splits"].values() for row in rows})
        states = lower_states(encoder, texts, self.evaluation_llm_settings.tune_layers)
        offsets = torch.tensor([0, *np.cumsum([len(x) for x in states]).tolist()], dtype=torch.long)
        flat = torch.cat(states) if states else torch.zeros(0, encoder.dim)
        atomic_write_json(path / f"{self.states_file()}.json", {"texts": texts})
        atomic_save_tensors({"states": flat.to(torch.bfloat16).contiguous(), "offsets": offsets},
                            path / self.states_file())

    def build_examples(self, path: Path, encoder: TextEncoder) -> None:
        """The stored splits' examples and every text's frozen vector, under `path`."""
        dataset = self.source.load()
        store = DocStore(dataset)
        memo: dict[str, torch.Tensor] = {}

        def vectors(texts: list[str]) -> torch.Tensor:
            todo = [t for t in dict.fromkeys(texts) if t not in memo]
            if todo:
                memo.update(zip(todo, encoder.encode(todo)))
            return torch.stack([memo[t] for t in texts])

        items = self.item_reads_path(dataset) if self.hparams.mix_items else None
        if items is not None and items.exists():
            self.item_reads = {row["id"]: ReaderExample.from_json(row) for row in json.loads(items.read_text())}
        known = len(self.item_reads)
        splits = self.build_splits(dataset, store, vectors)
        if items is not None and len(self.item_reads) > known:  # a reader that made none leaves the file as it is
            atomic_write_json(items, [e.to_json() for e in self.item_reads.values()], indent=None)
        texts = sorted(
            {t for exs in splits.values() for e in exs for t in [e.read.text, *(d.text for d in e.read.docs)]}
        )
        table = vectors(texts) if texts else torch.zeros(0, encoder.dim)
        atomic_save_tensors({"vectors": table.contiguous()}, path / "vectors.safetensors")
        atomic_write_json(path / "examples.json", {
            "task": self.task, "labels": list(self.labels), "texts": texts,
            "splits": {s: [e.to_json() for e in exs] for s, exs in splits.items()}})

    def setup(self, stage: str | None = None) -> None:
        if self.vectors is not None:
            return
        path = self.cache_path()
        if not (path / "examples.json").exists():
            raise FileNotFoundError(
                f"reader examples are not built ({path}); run `fit`, whose prepare_data builds them"
            )
        stored = json.loads((path / "examples.json").read_text())
        self.vectors = load_file(str(path / "vectors.safetensors"))["vectors"]
        self.index = {t: i for i, t in enumerate(stored["texts"])}
        if self.evaluation_llm_settings.tune_layers:
            self.states = self.load_states(path)
        loaded = {s: [ReaderExample.from_json(r) for r in rows] for s, rows in stored["splits"].items()}
        self.train_examples = loaded[self.splits.train_split]
        self.val_examples = loaded.get(HELD if self.holdout.fold is not None else self.splits.val_split, [])

    def load_states(self, path: Path) -> dict[str, torch.Tensor]:
        """The questions' lower token states, by text (bfloat16, as stored)."""
        if not (path / self.states_file()).exists():
            raise FileNotFoundError(f"the questions' token states are not built ({path / self.states_file()}); "
                                    "run `fit`, whose prepare_data builds them")
        tensors = load_file(str(path / self.states_file()))
        texts = json.loads((path / f"{self.states_file()}.json").read_text())["texts"]
        flat, offsets = tensors["states"], tensors["offsets"].tolist()
        return {t: flat[offsets[i]:offsets[i + 1]] for i, t in enumerate(texts)}

    @property
    def held_examples(self) -> list[ReaderExample]:
        """The held-out train users' examples (empty without a holdout): what the decision is
        fitted on."""
        return self.val_examples if self.holdout.fold is not None else []

    def label_prior(self) -> list[float]:
        """The share of each label among the trained-on targets (add-one smoothed)."""
        counts = [1.0] * len(self.labels)
        for e in self.train_examples:
            counts[e.target] += 1.0
        return [c / sum(counts) for c in counts]

    # ---- loaders ---------------------------------------------------------------------------------

    def collate(self, examples: list[ReaderExample]) -> ReaderTrainBatch:
        assert self.vectors is not None
        vectors = self.vectors

        def embed(texts: list[str]) -> torch.Tensor:
            return vectors[np.array([self.index[t] for t in texts], dtype=np.int64)]

        batch = batch_from_vectors([e.read for e in examples], embed, self.evaluation_llm_settings.max_docs,
                                   vectors.shape[1], len(self.labels))
        if self.states:  # the tuned tower reads the question's token states, not its frozen vector
            batch.question_states, batch.question_mask = pad_states([self.states[e.read.text].float()
                                                                     for e in examples])
        return ReaderTrainBatch(batch, torch.tensor([e.target for e in examples], dtype=torch.long))

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        distributed = trainer is not None and trainer.world_size > 1
        if self.states and not distributed:  # the tuned tower pays for padding: batches of alike lengths
            lengths = [len(self.states[e.read.text]) for e in self.train_examples]
            return DataLoader(self.train_examples, batch_sampler=LengthBatches(lengths, self.hparams.batch_size,
                                                                               self.hparams.seed),
                              num_workers=self.hparams.num_workers, collate_fn=self.collate)
        sampler = None if distributed else EpochShuffle(len(self.train_examples), self.hparams.seed)
        return DataLoader(self.train_examples, batch_size=self.hparams.batch_size, shuffle=distributed,
                          sampler=sampler, num_workers=self.hparams.num_workers, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_examples, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, collate_fn=self.collate)
