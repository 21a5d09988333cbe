"""Which splits a training stage reads, and how many of their examples: one group of a DataModule's
settings (YAML `data.init_args.splits`), the same keys in every stage that has them."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["Holdout", "SplitSettings", "SplitSettingsWithTest", "user_fold"]


def user_fold(user_id: str, folds: int) -> int:
    """The fold of `folds` a user falls in, by a stable hash of its id (the same on every machine,
    process and Python: not `hash()`, which is salted per process)."""
    digest = hashlib.sha256(user_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % folds


@dataclass(frozen=True)
class Holdout:
    """Train users a stage holds out of its training (YAML `data.init_args.holdout`): their train
    questions and profile items are read only to stop training and to fit what is fitted after it
    (the reader's decision), so dev is left to the choices made on it.

    Args:
        folds: train users fall in this many folds, by a stable hash of their id (`user_fold`).
        fold: the fold held out; None holds none, and dev selects the epoch (LaMP's protocol).
    """

    folds: int = 5
    fold: int | None = 0

    def __post_init__(self) -> None:
        if self.fold is not None and not (self.folds >= 2 and 0 <= self.fold < self.folds):
            raise ValueError(f"holdout: fold {self.fold} of {self.folds} folds; use 0 ≤ fold < folds, folds ≥ 2")

    def holds(self, user_id: str) -> bool:
        """Whether `user_id`'s train questions and items are held out of training."""
        return self.fold is not None and user_fold(user_id, self.folds) == self.fold


@dataclass(frozen=True)
class SplitSettings:
    """The split a stage trains on and the one it validates on (checkpoint selection), each capped.

    Args:
        train_split: the split trained on.
        val_split: the split validated on (checkpoint selection).
        max_train_examples: cap on train examples (None = all; the first by id, a fixed subset); a
            feedback stage labels m·k candidates of each.
        max_val_examples: cap on validation examples (None = all).
    """

    train_split: str = "train"
    val_split: str = "dev"
    max_train_examples: int | None = None
    max_val_examples: int | None = None

    def fit_limits(self, validates: bool) -> dict[str, int | None]:
        """The splits `fit` reads, each with its cap: train, and the validation split only when the
        trainer validates (a stage that validates nothing reads, labels and retrieves no dev
        example)."""
        if not validates:
            return {self.train_split: self.max_train_examples}
        return {self.train_split: self.max_train_examples, self.val_split: self.max_val_examples}


@dataclass(frozen=True)
class SplitSettingsWithTest(SplitSettings):
    """SplitSettings and the split `test` reports, for a stage whose `test` reads labels of its own.

    Args:
        train_split: the split trained on.
        val_split: the split validated on (checkpoint selection).
        test_split: the split `test` reports; its labels are built only when `test` runs.
        max_train_examples: cap on train examples (None = all; the first by id, a fixed subset); a
            feedback stage labels m·k candidates of each.
        max_val_examples: cap on validation examples (None = all).
        max_test_examples: cap on test examples (None = all).
    """

    test_split: str = "test"
    max_test_examples: int | None = None
