"""IR metrics of a ranking against LLM-feedback labels: NDCG@k and Recall@k per row, and their means
over informative rows as torchmetrics (summed across DDP ranks)."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torchmetrics import Metric

__all__ = ["RankingNDCG", "RankingRecall", "informative_rows", "ndcg_at_k", "recall_at_k"]


def _check_ranking_inputs(scores: Tensor, labels: Tensor, mask: Tensor, k: int) -> None:
    if scores.dim() != 2 or scores.shape != labels.shape or scores.shape != mask.shape:
        raise ValueError(
            f"scores, labels and mask must share one [B, C] shape; got {tuple(scores.shape)}, "
            f"{tuple(labels.shape)}, {tuple(mask.shape)}"
        )
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be bool, got {mask.dtype}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")


def _order(keys: Tensor, mask: Tensor) -> Tensor:
    """Column order by key descending, ties by index, padded columns always last (whatever their
    key)."""
    keys = torch.where(mask, keys, torch.zeros_like(keys))
    order = torch.sort(keys, dim=1, descending=True, stable=True).indices
    valid_first = torch.sort(
        mask.gather(1, order).to(torch.int8), dim=1, descending=True, stable=True
    ).indices
    return order.gather(1, valid_first)


def _valid_range(labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-row min and max label over valid candidates (0 for rows without any)."""
    any_valid = mask.any(dim=1)
    lo = torch.where(mask, labels, torch.full_like(labels, math.inf)).amin(dim=1)
    hi = torch.where(mask, labels, torch.full_like(labels, -math.inf)).amax(dim=1)
    zero = torch.zeros_like(lo)
    return torch.where(any_valid, lo, zero), torch.where(any_valid, hi, zero)


def _float_labels(labels: Tensor) -> Tensor:
    return labels.to(torch.promote_types(labels.dtype, torch.float32))


def informative_rows(labels: Tensor, mask: Tensor) -> Tensor:
    """Rows whose valid labels are not all equal: only there does a ranking have anything to get
    right."""
    labels = _float_labels(labels)
    lo, hi = _valid_range(labels, mask)
    return mask.any(dim=1) & (hi > lo)


def ndcg_at_k(scores: Tensor, labels: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """NDCG@k of `scores` against graded `labels`; returns (ndcg [B], informative [B] bool).

    Gains are labels minus the row's minimum valid label (feedback scores may be negative, e.g.
    -MAE); discount 1/log2(rank + 1). Rows that are not informative (all valid labels equal, or no
    valid candidate) have IDCG = 0; they get 0.0 and informative=False, and callers must drop them.
    """
    _check_ranking_inputs(scores, labels, mask, k)
    labels = _float_labels(labels)
    lo, _ = _valid_range(labels, mask)
    gains = torch.where(mask, labels - lo[:, None], torch.zeros_like(labels))
    k = min(k, scores.shape[1])
    discount = 1.0 / torch.log2(torch.arange(k, device=labels.device, dtype=labels.dtype) + 2.0)
    top_scored = _order(scores, mask)[:, :k]
    top_ideal = _order(gains, mask)[:, :k]
    dcg = (gains.gather(1, top_scored) * discount).sum(dim=1)
    idcg = (gains.gather(1, top_ideal) * discount).sum(dim=1)
    informative = informative_rows(labels, mask)
    ndcg = torch.where(
        informative, dcg / idcg.clamp_min(torch.finfo(idcg.dtype).tiny), torch.zeros_like(dcg)
    )
    return ndcg, informative


def recall_at_k(scores: Tensor, labels: Tensor, mask: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Share of the ideal top-k (by label, ties by index) found in the top-k by score; (recall [B],
    informative [B]).

    Both top-k sets hold valid candidates only, min(k, #valid) of them. Non-informative rows get
    0.0.
    """
    _check_ranking_inputs(scores, labels, mask, k)
    labels = _float_labels(labels)
    k = min(k, scores.shape[1])
    top_scored = _order(scores, mask)[:, :k]
    top_ideal = _order(labels, mask)[:, :k]
    in_scored = torch.zeros_like(mask).scatter(1, top_scored, mask.gather(1, top_scored))
    in_ideal = torch.zeros_like(mask).scatter(1, top_ideal, mask.gather(1, top_ideal))
    hits = (in_scored & in_ideal).sum(dim=1)
    recall = hits.to(labels.dtype) / in_ideal.sum(dim=1).clamp_min(1)
    informative = informative_rows(labels, mask)
    return torch.where(informative, recall, torch.zeros_like(recall)), informative


class _RankingMetric(Metric):
    """Mean of a per-row ranking metric over informative rows, summed across DDP ranks."""

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, k: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self.add_state(
            "value_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("rows", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def _per_row(self, scores: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def update(self, scores: Tensor, labels: Tensor, mask: Tensor) -> None:
        values, informative = self._per_row(scores.detach(), labels.detach(), mask)
        self.value_sum += values[informative].double().sum().to(self.device)
        self.rows += informative.sum().to(self.device)

    def compute(self) -> Tensor:
        """NaN when no informative row was seen, so an empty validation is visible rather than a
        fake 0."""
        if self.rows == 0:
            return torch.tensor(math.nan, dtype=torch.float64, device=self.value_sum.device)
        return self.value_sum / self.rows


class RankingNDCG(_RankingMetric):
    """Mean NDCG@k over informative rows (see `ndcg_at_k`)."""

    def _per_row(self, scores: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return ndcg_at_k(scores, labels, mask, self.k)


class RankingRecall(_RankingMetric):
    """Mean Recall@k of the ideal top-k over informative rows (see `recall_at_k`)."""

    def _per_row(self, scores: Tensor, labels: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
        return recall_at_k(scores, labels, mask, self.k)
