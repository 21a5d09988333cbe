"""DataModule of the generator stage: for each training example, the Table 4 prompt that a strategy
of the evaluation builds (CFRAG by default, any strategy of an evaluate config by name) and the
target.

Retrievals go through the evaluation's content-addressed retrieval cache (`<cache_dir>/retrievals/`,
keyed by the strategy's bundles' content, the examples and k), and the prompts built from them are
cached as well, keyed by that and the tokenizer that fitted them to the budget; both are written in
`prepare_data` (once per node) and only read in `setup`. The history rules are the strategies' own
(data/histories.py): a train question never sees its own item.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import lightning as L
from torch.utils.data import DataLoader

from persrag_lightning.data.records import Example
from persrag_lightning.data.source import LampSource
from persrag_lightning.data.splits import SplitSettings
from persrag_lightning.data.synth import SynthConfig
from persrag_lightning.datamodules.sampling import EpochShuffle
from persrag_lightning.llm.answer import build_prompts
from persrag_lightning.llm.base import resolve_model
from persrag_lightning.llm.prompts import PROMPT_VERSION
from persrag_lightning.retrieval.base import DocStore, Query
from persrag_lightning.retrieval.strategies import cached_retrieval, strategy_by_name, strategy_config
from persrag_lightning.utils import (
    ConfigError,
    as_settings,
    atomic_write_json,
    fingerprint,
    resolve_config_path,
    trainer_validates,
)

__all__ = ["GeneratorBatch", "GeneratorDataModule", "collate_generator"]

PROMPTS_VERSION = "generator-prompts/v1"


@dataclass(frozen=True)
class GeneratorExample:
    """One training pair: the prompt exactly as evaluation would build it, the target, and what it
    holds."""

    example_id: str
    prompt: str
    target: str
    rows: tuple[int, ...] = ()


@dataclass
class GeneratorBatch:
    """Raw text; the module tokenizes (through the LLM backend's own encoding)."""

    example_ids: list[str]
    prompts: list[str]
    targets: list[str]

    def __len__(self) -> int:
        return len(self.prompts)


def collate_generator(examples: list[GeneratorExample]) -> GeneratorBatch:
    return GeneratorBatch([e.example_id for e in examples], [e.prompt for e in examples],
                          [e.target for e in examples])


class TokenCounter:
    """`count_tokens` of a tokenizer, as the hf backend counts (no special tokens): all
    `build_prompts` needs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])


class GeneratorDataModule(L.LightningDataModule):
    """Train on the train split's prompts, validate (select the checkpoint) on dev's with the task's
    LaMP metric.

    Args:
        task: the LaMP task (LaMP-1 ... LaMP-7); must match the other stages'.
        data_dir: a folder of LaMP files; None = the embedded SynthLaMP (must match the other
            stages).
        synth: size and seed of the SynthLaMP dataset (used only when `data_dir` is None); None =
            its defaults.
        cache_dir: where generated data and the retrieved prompts are cached, keyed by fingerprints.
        strategy: the strategy whose retrieved docs fill the training prompts, by its name in
            `strategies_config`.
        strategies_config: an evaluate config that lists the strategies; its `{run_dir}` paths
            resolve to this run's exports.
        run_dir: the folder of the run's exported bundles the strategy reads; `{run_dir}` is
            checkpoints/<run_name>.
        tokenizer: the LLM whose tokenizer fits the docs into `max_prompt_tokens`, as evaluation
            does with the same budget; None = the generator module's `model` (read from the
            trainer's module: the LLM is the module's knob); set it only to use this DataModule
            without a trainer.
        k: docs per prompt, as the evaluation's.
        max_prompt_tokens: token budget of a prompt, as the evaluation's `llm.max_prompt_tokens`.
        splits: the splits trained and validated on (checkpoint selection by the task's LaMP
            metric), and how many examples of each.
        batch_size: prompts per step (ClusterRAG's 16).
        num_workers: DataLoader worker processes.
        seed: seed of the per-epoch shuffle of the train examples.
        reranker_runtime: the evaluation's (`set_reranker_runtime`), so the prompts it trains on are
            retrieved as the evaluation retrieves them.
    """

    def __init__(self, task: str = "LaMP-2", data_dir: str | None = None, synth: SynthConfig | None = None,
                 cache_dir: str = ".cache/persrag", strategy: str = "CFRAG",
                 strategies_config: str = "evaluate_cfrag.yaml", run_dir: str = "{run_dir}",
                 tokenizer: str | None = None, k: int = 5, max_prompt_tokens: int = 512,
                 splits: SplitSettings = SplitSettings(), batch_size: int = 16, num_workers: int = 0,
                 seed: int = 0, reranker_runtime: str = "fp32") -> None:
        super().__init__()
        self.save_hyperparameters()
        # typed, as hyperparameters may hold a dict
        self.splits = as_settings(SplitSettings, splits)
        self.source = LampSource(task, data_dir, synth, cache_dir)
        self.task = self.source.task
        self.train_examples: list[GeneratorExample] = []
        self.val_examples: list[GeneratorExample] = []

    # ---- what the cache is keyed on --------------------------------------------------------------

    def _strategy(self):
        h = self.hparams
        return strategy_by_name(
            resolve_config_path(h.strategies_config), h.strategy, h.run_dir, h.reranker_runtime
        )

    def _splits(self) -> dict[str, int | None]:
        """Train, and dev unless the trainer validates nothing (then no dev prompt is retrieved or
        read)."""
        return self.splits.fit_limits(trainer_validates(self))

    def examples(self, dataset, split: str, limit: int | None) -> list[Example]:
        """A split's labelled examples by id, the first `limit` (a fixed subset, as the feedback
        stage).

        Args:
            dataset: the loaded LaMP dataset.
            split: the split to read.
            limit: how many examples to keep; None keeps all.
        """
        if split not in dataset.examples:
            raise KeyError(
                f"split {split!r} not in {self.source.data_dir} (have {sorted(dataset.examples)})"
            )
        out = sorted(
            (e for e in dataset.examples[split] if e.target is not None), key=lambda e: e.example_id
        )
        return out[:limit] if limit else out

    @property
    def prompt_model(self) -> str:
        """The LLM whose tokenizer fits the prompts: `tokenizer`, else the trainer's generator
        module's model."""
        if self.hparams.tokenizer is not None:
            return self.hparams.tokenizer
        module = getattr(getattr(self, "trainer", None), "lightning_module", None)
        if module is None or "model" not in module.hparams:
            raise ConfigError(
                "GeneratorDataModule: with no trainer's generator module to read it from, set "
                "`tokenizer` (the LLM whose tokenizer fits the prompts)"
            )
        return module.hparams["model"]

    def cache_path(self, strategy, split: str, examples: list[Example]) -> Path:
        h = self.hparams
        digest = hashlib.sha256(json.dumps([(e.example_id, e.user_id, e.input, e.target, e.profile)
                                            for e in examples]).encode()).hexdigest()
        key = fingerprint(PROMPTS_VERSION, strategy_config(strategy), digest, h.k, resolve_model(self.prompt_model).digest,
                          h.max_prompt_tokens, PROMPT_VERSION, self.task, self.source.data_dir.name)
        return Path(h.cache_dir) / "generator_prompts" / key / f"{split}.json"

    # ---- build once per node, read on every rank -------------------------------------------------

    def prepare_data(self) -> None:
        """Data, the strategy's retrievals for train and dev (cached), and the prompts built from
        them (cached)."""
        from persrag_lightning.llm.gguf import load_tokenizer, local_model_path

        self.source.prepare()
        dataset = self.source.load()
        strategy = self._strategy()
        # paths from the unprepared strategy, as `setup` computes them (retrieval prepares it)
        todo = [(split, exs, self.cache_path(strategy, split, exs))
                for split, exs in ((s, self.examples(dataset, s, limit)) for s, limit in self._splits().items())]
        todo = [(split, exs, path) for split, exs, path in todo if not path.exists()]
        if not todo:
            return
        source = resolve_model(self.prompt_model)
        # a GGUF is de-quantised once, so the tokenizer is the one the module trains with
        local_model_path(source)
        counter = TokenCounter(load_tokenizer(source))
        store = DocStore(dataset)
        for split, examples, path in todo:
            retrieved, _ = cached_retrieval(strategy, store, examples, self.hparams.k, self.hparams.cache_dir,
                                            self.source.data_dir.name)
            prompts = build_prompts(self.task, counter, [e.input for e in examples],
                                    [store.read_docs(Query(e.user_id, e.query, e.input, e.example_id), docs)
                                     for e, docs in zip(examples, retrieved)],
                                    self.hparams.max_prompt_tokens)
            atomic_write_json(path, {
                "strategy": strategy.name, "split": split, "task": self.task, "k": self.hparams.k,
                "examples": [{"example_id": e.example_id, "prompt": p, "target": e.target,
                              "rows": [d.row for d in docs]} for e, p, docs in zip(examples, prompts, retrieved)]})

    def setup(self, stage: str | None = None) -> None:
        if self.train_examples:
            return
        dataset = self.source.load()
        strategy = self._strategy()
        loaded = {}
        for split, limit in self._splits().items():
            path = self.cache_path(strategy, split, self.examples(dataset, split, limit))
            if not path.exists():
                raise FileNotFoundError(
                    f"generator prompts of split {split!r} are not built ({path}); run `fit`, "
                    "whose prepare_data builds them"
                )
            loaded[split] = [
                GeneratorExample(r["example_id"], r["prompt"], r["target"], tuple(r["rows"]))
                for r in json.loads(path.read_text())["examples"]
            ]
        s = self.splits
        self.train_examples, self.val_examples = loaded[s.train_split], loaded.get(s.val_split, [])

    # ---- loaders ---------------------------------------------------------------------------------

    def train_dataloader(self) -> DataLoader:
        trainer = getattr(self, "trainer", None)
        distributed = trainer is not None and trainer.world_size > 1
        sampler = None if distributed else EpochShuffle(len(self.train_examples), self.hparams.seed)
        return DataLoader(self.train_examples, batch_size=self.hparams.batch_size, shuffle=distributed,
                          sampler=sampler, num_workers=self.hparams.num_workers, collate_fn=collate_generator)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_examples, batch_size=self.hparams.batch_size, shuffle=False,
                          num_workers=self.hparams.num_workers, collate_fn=collate_generator)
