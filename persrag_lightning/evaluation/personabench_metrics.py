"""PersonaBench retrieval metrics, as the benchmark's `eval.py` computes them (so
docs/pbr_personabench.md's figures reproduce).

A question's ground truth is one list of alternative segment ids per answer item; every combination
(cartesian product, one id per item) is scored and the best Recall@k and the best NDCG@k are kept
(each maximised on its own, as the benchmark does). Gains are binary, the ideal DCG runs over
min(|set(combination)|, k).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torchmetrics import Metric

__all__ = [
    "PersonaBenchNDCG",
    "PersonaBenchRecall",
    "ground_truth_combinations",
    "personabench_scores",
    "recall_ndcg_for_combination",
]


def ground_truth_combinations(alternatives: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """Cartesian product over the answer items' alternatives: each tuple is one full ground
    truth.

    Args:
        alternatives: per answer item, its accepted document ids.
    """
    return list(itertools.product(*alternatives))


def recall_ndcg_for_combination(retrieved: Sequence[str], combination: Sequence[str], k: int = 5
                                ) -> tuple[float, float]:
    """Recall@k and NDCG@k of a ranking against one ground-truth combination (duplicates count
    once)."""
    top = list(retrieved)[:k]
    gt = set(combination)
    if not gt:
        return 0.0, 0.0
    recall = len(set(top) & gt) / len(gt)
    dcg = sum(1.0 / math.log2(i + 2) for i, s in enumerate(top) if s in gt)
    idcg = sum(1.0 / math.log2(i + 2) for i in range(min(len(gt), k)))
    return recall, dcg / idcg


def personabench_scores(retrieved: Sequence[str], alternatives: Sequence[Sequence[str]], k: int = 5
                        ) -> tuple[float, float]:
    """(best Recall@k, best NDCG@k) over all ground-truth combinations.

    Args:
        retrieved: the ranked document ids.
        alternatives: per answer item, its accepted document ids.
        k: the cut-off.
    """
    best_recall, best_ndcg = 0.0, 0.0
    for combination in ground_truth_combinations(alternatives):
        recall, ndcg = recall_ndcg_for_combination(retrieved, combination, k)
        best_recall, best_ndcg = max(best_recall, recall), max(best_ndcg, ndcg)
    return best_recall, best_ndcg


class _PersonaBenchMetric(Metric):
    """Mean over questions of one of the two scores; sum/count states so a DDP sync stays exact."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    _which = 0

    def __init__(self, k: int = 5, **kwargs) -> None:
        super().__init__(**kwargs)
        self.k = k
        self.add_state(
            "total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("count", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(
        self, retrieved: Sequence[Sequence[str]], alternatives: Sequence[Sequence[Sequence[str]]]
    ) -> None:
        if len(retrieved) != len(alternatives):
            raise ValueError(f"{len(retrieved)} rankings but {len(alternatives)} ground truths")
        for ranking, gt in zip(retrieved, alternatives):
            self.total += personabench_scores(ranking, gt, self.k)[self._which]
            self.count += 1

    def compute(self) -> torch.Tensor:
        return self.total / self.count.clamp(min=1)


class PersonaBenchRecall(_PersonaBenchMetric):
    """Recall@k with the max over ground-truth combinations."""

    _which = 0


class PersonaBenchNDCG(_PersonaBenchMetric):
    """NDCG@k with the max over ground-truth combinations."""

    _which = 1
