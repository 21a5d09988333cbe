"""Which splits a training stage reads, and how many of their examples: one group of a DataModule's
settings (YAML `data.init_args.splits`), the same keys in every stage that has them."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SplitSettings", "SplitSettingsWithTest"]


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
