"""The stage graph: every bundle a run exports, the config that trains it, the overrides that make
it this stage, and the bundles it reads. The pipeline trains from this table; a strategy's
missing-bundle error names the command from it. It imports nothing from the package, so every layer
may read it.

A bundle lives at `<export_root>/<run_name>/<bundle>` (`run_folder`, `bundle_path`); a stage's inputs
are bundle names, resolved there, in one place. Before the run is known, a config names a bundle by
its address under `RUN_DIR` (`bundle_address`), which `fill_run_dir` fills.
"""

from __future__ import annotations

import json
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

__all__ = ["CROSS_FIT_FOLDS", "FOLD_READER", "FOLD_READERS", "PAPER_STAGES", "RUN_DIR", "SPLIT_RERANKER", "STAGES", "Key",
           "Stage", "bundle_address", "bundle_path", "cli_overrides", "config_args", "fill_run_dir", "run_folder"]

# which of a preset's per-kind settings a stage takes; `distilled`: a student of stage 3's reranker (no LLM)
StageKind = Literal["user_encoder", "reader", "feedback", "distilled", "generator"]
# the run folder's placeholder in configs and defaults; `fill_run_dir` replaces it with
# <export_root>/<run_name>
RUN_DIR = "{run_dir}"


class Key:
    """The settings a run addresses in its stages' and evaluations' configs, by their dotted keys
    (a stage's `fit` config, the evaluate config): one name for each, where pipeline.json keeps them
    as overrides and where serving reads them back."""

    DATA_DIR = "data.init_args.data_dir"
    TASK = "data.init_args.task"
    STRATEGY = "data.init_args.strategy"  # the generator's prompts
    FEEDBACK_READER = "data.init_args.feedback.reader"
    FEEDBACK_CROSS_FIT = "data.init_args.feedback.cross_fit"
    FEEDBACK_BACKEND = "data.init_args.feedback.llm.backend"
    FEEDBACK_LLM_OPTIONS = "data.init_args.feedback.llm.options"
    JUDGMENTS = "model.init_args.config.judgments"
    ANSWER_MODE = "model.init_args.answer_mode"
    PRECISION = "trainer.precision"
    PROGRESS_BAR = "trainer.enable_progress_bar"
    EVALUATION_TASK = "evaluation.task"
    EVALUATION_DATA_DIR = "evaluation.data_dir"
    SPLIT = "evaluation.split"
    MAX_EXAMPLES = "evaluation.max_examples"
    OUT_DIR = "evaluation.out_dir"
    READER = "evaluation.reader"
    READER_FREE = "evaluation.reader_free"
    REFERENCE = "evaluation.reference"
    VOTES = "evaluation.votes"
    PAIRS = "evaluation.pairs"
    BY_HISTORY = "evaluation.by_history"
    RERANKER_RUNTIME = "evaluation.reranker_runtime"
    LLM = "evaluation.llm."  # the prefix of the reader LLM's settings
    LLM_BACKEND = "evaluation.llm.backend"
    LLM_ANSWER_MODE = "evaluation.llm.answer_mode"
    CALIBRATION = "evaluation.llm.calibration"
    GENERATOR_CALIBRATION = "evaluation.generator_calibration"


@dataclass(frozen=True)
class Stage:
    """One exported bundle and how it is trained."""

    name: str
    config: str          # a file of configs/
    # which of a preset's per-kind settings it takes
    kind: StageKind
    # what makes it this stage, as typed values
    overrides: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)     # config key → the bundle it reads
    # one of the paper's exact chain, trained beside a run whose stage 1 reads judgments
    paper: bool = False
    named: bool = False  # exported under its own name, not the config's default bundle name
    overlays: tuple[str, ...] = ()  # files of configs/ laid over `config`, in order (`--config` after `--config`)

    def override_values(self, run_dir: str = RUN_DIR) -> dict[str, Any]:
        """The `fit` overrides after `--config`, typed: the stage's name, overrides and inputs."""
        named = {"stage_name": self.name} if self.named else {}
        inputs = {key: str(bundle_path(run_dir, bundle)) for key, bundle in self.inputs.items()}
        return {**named, **self.overrides, **inputs}

    def arguments(self, run_dir: str = RUN_DIR) -> list[str]:
        """The `fit` arguments after `--config`: the stage's name, overrides and inputs."""
        return cli_overrides(self.override_values(run_dir))

    def command(self) -> str:
        """The command that trains this stage alone (with the run's --run_name)."""
        return " ".join(["python train.py fit", *config_args(self.config, self.overlays), *self.arguments()])


def config_args(config: str, overlays: tuple[str, ...] | list[str] = ()) -> list[str]:
    """`--config <config>`, then `--config <overlay>` for each overlay, as `train.py fit` reads them.

    Args:
        config: a stage's config file (a name of configs/).
        overlays: files laid over it, in order.
    """
    return [arg for path in (config, *overlays) for arg in ("--config", path)]


def run_folder(export_root: str | Path, run_name: str) -> Path:
    """A run's folder of exported bundles: `<export_root>/<run_name>`."""
    return Path(export_root) / run_name


def bundle_address(bundle: str) -> str:
    """A run's bundle named before the run is known (a config's default): `RUN_DIR/<bundle>`."""
    return f"{RUN_DIR}/{bundle}"


def fill_run_dir(obj: Any, run_dir: str) -> Any:
    """`RUN_DIR` → run_dir in every string of `obj`: a string, a list, or a parsed config whose
    namespaces (settings groups included) are changed in place. Returns the filled object.

    Args:
        obj: a string, a list, or a (jsonargparse) Namespace; anything else is returned unchanged.
        run_dir: the run's folder, `run_folder(export_root, run_name)`.
    """
    if isinstance(obj, str):
        return obj.replace(RUN_DIR, run_dir)
    if isinstance(obj, list):
        return [fill_run_dir(x, run_dir) for x in obj]
    if isinstance(obj, Namespace):
        for key, value in vars(obj).items():
            setattr(obj, key, fill_run_dir(value, run_dir))
    return obj


def bundle_path(run_dir: str | Path, bundle: str) -> Path:
    """Where a run's bundle lives: `<run_dir>/<bundle>`, run_dir being
    `<export_root>/<run_name>`."""
    return Path(run_dir) / bundle


def cli_value(value: Any) -> str:
    """A typed override as the text jsonargparse reads back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def cli_overrides(overrides: dict[str, Any]) -> list[str]:
    """`{"data.init_args.candidates.m": 3}` → `["--data.init_args.candidates.m=3"]`; a None value
    means the config's own (no argument)."""
    return [f"--{key}={cli_value(value)}" for key, value in overrides.items() if value is not None]


SPLIT_RERANKER = "reranker_split_l5"  # the split reranker's stage and bundle
_PAPER_ENCODER = {"data.init_args.candidates.user_encoder": "user_encoder_paper"}
CROSS_FIT_FOLDS = 2  # the folds of train users the feedback's readers are cross-fitted over
# reader_fold<f> holds fold f out of its training and labels that fold's feedback questions; the
# feedback's `reader` names them all with the `{fold}` placeholder its cross-fitting fills
FOLD_READER = "reader_fold{fold}"
FOLD_READERS = tuple(FOLD_READER.format(fold=f) for f in range(CROSS_FIT_FOLDS))
STAGES: dict[str, Stage] = {s.name: s for s in (
    Stage("user_encoder", "cfrag_user_encoder.yaml", "user_encoder"),
    # the trained reader of label tasks: BM25's docs, no trained stage needed; it may label the
    # feedback stages
    Stage("reader", "reader.yaml", "reader"),
    # the cross-fitted feedback's readers (`feedback.cross_fit`): each reads the questions of the
    # train users it held out
    *(Stage(name, "reader.yaml", "reader", {"data.init_args.holdout.folds": CROSS_FIT_FOLDS,
                                            "data.init_args.holdout.fold": f}, named=True)
      for f, name in enumerate(FOLD_READERS)),
    Stage("retriever", "cfrag_retriever.yaml", "feedback"),
    # ROPG-style baseline: the retriever tuned on the query user's own candidates, without the user
    # term
    Stage("retriever_ropg", "cfrag_retriever.yaml", "feedback", {"model.init_args.config.alpha": 0.0,
                                                                 "data.init_args.candidates.owners": "self"},
          named=True),
    Stage("reranker", "cfrag_reranker.yaml", "feedback"),
    Stage("reranker_no_user", "cfrag_reranker.yaml", "feedback", {"model.init_args.config.use_user": False},
          named=True),
    # a smaller reranker distilled from stage 3's, for serving latency
    Stage("reranker_distilled", "cfrag_reranker_distilled.yaml", "distilled"),
    # stage 3's reranker distilled into the split reranker (every layer; below the split, query and doc read apart,
    # so serving computes a doc's side once): the reranked order a preset's `split_reranker` serves. Split at 5 of
    # MiniLM's 6: the split measured fastest on the real reviews' long docs (docs/serving/pipeline.md)
    Stage(SPLIT_RERANKER, "cfrag_reranker_distilled.yaml", "distilled", {"model.init_args.config.split_layer": 5},
          named=True, overlays=("overlays/reranker_split.yaml",)),
    Stage("generator", "generator.yaml", "generator"),  # the "+ tuned generator" rows
    # the paper's text-only encoder, its doc table fine-tuned as the official code does whatever a preset sets
    Stage("user_encoder_paper", "cfrag_user_encoder.yaml", "user_encoder",
          {"model.init_args.config.judgments": "none", "model.init_args.training.freeze_doc_table": False},
          paper=True, named=True),
    Stage("retriever_paper", "cfrag_retriever.yaml", "feedback", inputs=_PAPER_ENCODER, paper=True, named=True),
    Stage("reranker_paper", "cfrag_reranker.yaml", "feedback",
          inputs={**_PAPER_ENCODER, "data.init_args.candidates.retriever": "retriever_paper"}, paper=True,
          named=True),
)}
PAPER_STAGES = tuple(name for name, s in STAGES.items() if s.paper)
