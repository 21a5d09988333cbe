"""LaMP task metrics (reproducing the official LaMP evaluation) and IR metrics for rankings, as
torchmetrics.

All states are sums and counts with `dist_reduce_fx="sum"`, so every metric is exact after a DDP
sync.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from persrag_lightning.data.tasks import get_task

if TYPE_CHECKING:
    from rouge_score.rouge_scorer import RougeScorer

__all__ = [
    "LampClassificationMetric",
    "LampGenerationMetric",
    "LampRegressionMetric",
    "PrimaryMetric",
    "RankingNDCG",
    "RankingRecall",
    "UserRetrievalQuality",
    "community_chance",
    "community_precision_at_m",
    "informative_rows",
    "lamp_metric",
    "ndcg_at_k",
    "parse_rating",
    "primary_metric",
    "recall_at_k",
    "rouge_scorer",
    "score_prediction",
    "view_retrieval_accuracy",
]

# --------------------------------------------------------------------------------------------------
# LaMP metrics
# --------------------------------------------------------------------------------------------------

_ROUGE_SCORER: RougeScorer | None = None


def rouge_scorer() -> RougeScorer:
    """The one shared Google RougeScorer (rouge1, rougeL, no stemmer), built on first use: it is
    called per sample."""
    global _ROUGE_SCORER
    if _ROUGE_SCORER is None:
        from rouge_score.rouge_scorer import RougeScorer

        _ROUGE_SCORER = RougeScorer(["rouge1", "rougeL"], use_stemmer=False)
    return _ROUGE_SCORER


def _check_lengths(preds: Sequence[str], targets: Sequence[str]) -> None:
    if len(preds) != len(targets):
        raise ValueError(f"got {len(preds)} predictions for {len(targets)} targets")


def _parse_gold(target: str) -> float:
    """LaMP-3 gold as float; a bad gold is a data error, not a model error, so it raises."""
    try:
        return float(str(target).strip())
    except ValueError:
        raise ValueError(f"LaMP-3 target {target!r} is not a number") from None


def parse_rating(pred: str, gold: float) -> float:
    """Official LaMP-3 rule: float(pred), else 1.0 or 5.0, whichever is farther from the gold (5.0
    on a tie)."""
    try:
        return float(str(pred).strip())
    except ValueError:
        return 1.0 if abs(1.0 - gold) > abs(5.0 - gold) else 5.0


class LampClassificationMetric(Metric):
    """LaMP-1/2 accuracy and macro-F1 over the label list, as the official sklearn call computes
    them.

    Strings are stripped and mapped to their index in `labels`; anything else maps to -1. Accuracy
    compares indices (so two different out-of-list strings count as equal, as in the official code).
    F1 per label is 2tp / (2tp + fp + fn), 0 when the label is neither present nor predicted
    (sklearn's zero_division default), and the macro average runs over every label of the list,
    never over -1.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, labels: Sequence[str], **kwargs) -> None:
        super().__init__(**kwargs)
        if not labels:
            raise ValueError("LampClassificationMetric needs a non-empty label list")
        self.labels = tuple(labels)
        self._index: dict[str, int] = {}
        for i, label in enumerate(self.labels):
            self._index.setdefault(label, i)  # list.index semantics: first occurrence wins
        n = len(self.labels)
        self.add_state("tp", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("fp", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("fn", default=torch.zeros(n, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("correct", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def label_index(self, text: str) -> int:
        """Index of the stripped string in the label list, -1 when absent (always wrong)."""
        return self._index.get(str(text).strip(), -1)

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        n = len(self.labels)
        p = torch.tensor([self.label_index(x) for x in preds], dtype=torch.long, device=self.device)
        g = torch.tensor(
            [self.label_index(x) for x in targets], dtype=torch.long, device=self.device
        )
        same = p == g
        self.correct += same.sum()
        self.total += p.numel()
        self.tp += torch.bincount(p[same & (p >= 0)], minlength=n)
        self.fp += torch.bincount(p[~same & (p >= 0)], minlength=n)
        self.fn += torch.bincount(g[~same & (g >= 0)], minlength=n)

    def compute(self) -> dict[str, Tensor]:
        tp2 = 2 * self.tp.double()
        denom = tp2 + self.fp + self.fn
        f1 = torch.where(denom > 0, tp2 / denom.clamp_min(1), torch.zeros_like(denom))
        accuracy = self.correct.double() / self.total.clamp_min(1)
        return {"accuracy": accuracy, "f1": f1.mean()}


class LampRegressionMetric(Metric):
    """LaMP-3 MAE and RMSE with the official rule for unparsable ratings; `neg_mae` is there for
    model selection."""

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "abs_error", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "sq_error", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        golds = [_parse_gold(t) for t in targets]
        values = [parse_rating(p, g) for p, g in zip(preds, golds)]
        err = torch.tensor(values, dtype=torch.float64) - torch.tensor(golds, dtype=torch.float64)
        err = err.to(self.device)
        self.abs_error += err.abs().sum()
        self.sq_error += (err * err).sum()
        self.total += err.numel()

    def compute(self) -> dict[str, Tensor]:
        n = self.total.clamp_min(1)
        mae = self.abs_error / n
        return {"mae": mae, "rmse": torch.sqrt(self.sq_error / n), "neg_mae": -mae}


class LampGenerationMetric(Metric):
    """LaMP-4/5/7 ROUGE-1 and ROUGE-L F-measure: arithmetic mean of exact per-example scores.

    The official code reports the `mid` of evaluate's bootstrap aggregate, which equals this mean up
    to bootstrap noise; the plain mean is exact, deterministic and sums across DDP ranks.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state(
            "rouge1_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state(
            "rougeL_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum"
        )
        self.add_state("total", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, preds: Sequence[str], targets: Sequence[str]) -> None:
        _check_lengths(preds, targets)
        scorer = rouge_scorer()
        r1 = rl = 0.0
        for pred, target in zip(preds, targets):
            s = scorer.score(str(target).strip(), str(pred).strip())
            r1 += s["rouge1"].fmeasure
            rl += s["rougeL"].fmeasure
        self.rouge1_sum += r1
        self.rougeL_sum += rl
        self.total += len(preds)

    def compute(self) -> dict[str, Tensor]:
        n = self.total.clamp_min(1)
        return {"rouge-1": self.rouge1_sum / n, "rouge-L": self.rougeL_sum / n}


def lamp_metric(task_name: str) -> Metric:
    """The official metric of a LaMP task (`LaMP-2`, `LaMP_2`, `2`, ...)."""
    spec = get_task(task_name)
    if spec.kind == "classification":
        assert spec.labels is not None
        return LampClassificationMetric(spec.labels)
    if spec.kind == "regression":
        return LampRegressionMetric()
    return LampGenerationMetric()


# The metrics a table reports per task kind (the first is the primary one), and which way each is
# better.
METRIC_NAMES: dict[str, tuple[str, ...]] = {
    "classification": ("accuracy", "f1"),
    "regression": ("mae", "rmse"),
    "generation": ("rouge-1", "rouge-L"),
}
HIGHER_IS_BETTER = {"accuracy": True, "f1": True, "mae": False, "rmse": False, "neg_mae": True,
                    "rouge-1": True, "rouge-L": True}


@dataclass(frozen=True)
class PrimaryMetric:
    """The metric a task's rows are compared on and which way is better: one answer for the tables,
    the dev choices and the checkpoints that monitor `val/metric`.

    Args:
        name: the metric's key in a LaMP metric's output (accuracy, mae or rouge-1).
        greater_is_better: whether a larger value is better (False for MAE).
    """

    name: str
    greater_is_better: bool

    def ascending(self, value: float) -> float:
        """`value` turned so that larger is better (an MAE negated): what a `max` or a `mode: max`
        compares."""
        return value if self.greater_is_better else -value


def primary_metric(task_name: str) -> PrimaryMetric:
    """The task's primary metric: the table's first (accuracy, mae or rouge-1) with its direction.

    Args:
        task_name: a LaMP task (`LaMP-2`, `LaMP_2`, `2`, ...) or a registered label set.
    """
    name = METRIC_NAMES[get_task(task_name).kind][0]
    return PrimaryMetric(name, HIGHER_IS_BETTER[name])


def score_prediction(task_name: str, pred: str, target: str) -> float:
    """Per-sample eval(y, O) of paper Eq. 6, higher is better: the LLM-feedback label of one
    candidate.

    Classification: 1.0 on exact match after strip, else 0.0. Regression: -|rating - gold| with the
    official unparsable rule, where non-finite ratings ("nan", "inf") also count as unparsable so a
    label is never NaN. Generation: ROUGE-1 F-measure.
    """
    kind = get_task(task_name).kind
    if kind == "classification":
        return 1.0 if str(pred).strip() == str(target).strip() else 0.0
    if kind == "regression":
        gold = _parse_gold(target)
        value = parse_rating(pred, gold)
        if not math.isfinite(value):
            value = parse_rating("", gold)
        return -abs(value - gold)
    return float(rouge_scorer().score(str(target).strip(), str(pred).strip())["rouge1"].fmeasure)


# --------------------------------------------------------------------------------------------------
# IR metrics against LLM-feedback rankings
# --------------------------------------------------------------------------------------------------


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


# ---- user retrieval (stage 1): same-community precision@m and view-retrieval accuracy ----

def community_precision_at_m(embeddings: torch.Tensor, communities: torch.Tensor, m: int) -> float:
    """Mean fraction of each user's m nearest other users (cosine) that share their true
    community."""
    z = F.normalize(embeddings.float(), dim=-1)
    sim = z @ z.T
    sim.fill_diagonal_(float("-inf"))
    m = min(m, len(z) - 1)
    if m <= 0:
        return float("nan")
    neighbours = sim.topk(m, dim=1).indices
    return (communities[neighbours] == communities.unsqueeze(1)).float().mean().item()


def community_chance(communities: torch.Tensor) -> float:
    """What `community_precision_at_m` is for random neighbours: the mean over users of the share of
    the *other* users that are in the user's community, (n_c − 1) / (N − 1)."""
    if len(communities) < 2:
        return float("nan")
    sizes = torch.bincount(communities)
    return ((sizes[communities] - 1).float() / (len(communities) - 1)).mean().item()


def view_retrieval_accuracy(view_a: torch.Tensor, view_b: torch.Tensor) -> float:
    """Fraction of users whose view A finds their own view B first among all users' B views."""
    sim = F.normalize(view_a.float(), dim=-1) @ F.normalize(view_b.float(), dim=-1).T
    return (sim.argmax(1) == torch.arange(len(sim), device=sim.device)).float().mean().item()


class UserRetrievalQuality(Metric):
    """Collects every user's embedding and views over a (possibly distributed) epoch, then scores
    them."""

    full_state_update = False

    def __init__(self, m: int = 5, communities: torch.Tensor | None = None) -> None:
        super().__init__()
        self.m = m
        self.communities = communities
        for name in ("users", "full", "view_a", "view_b"):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self, users: torch.Tensor, full: torch.Tensor, view_a: torch.Tensor, view_b: torch.Tensor
    ) -> None:
        self.users.append(users)
        self.full.append(full.detach().float())
        self.view_a.append(view_a.detach().float())
        self.view_b.append(view_b.detach().float())

    def compute(self) -> dict[str, torch.Tensor]:
        users = dim_zero_cat(self.users)
        # a DistributedSampler pads the last batch with repeated users: keep each user once
        order = torch.argsort(users, stable=True)
        users = users[order]
        keep = torch.ones_like(users, dtype=torch.bool)
        keep[1:] = users[1:] != users[:-1]
        pick = order[keep]
        full, a, b = (dim_zero_cat(s)[pick] for s in (self.full, self.view_a, self.view_b))
        out = {"view_acc": torch.tensor(view_retrieval_accuracy(a, b))}
        if self.communities is not None:
            labels = self.communities.to(users.device)[users[keep]]
            if (labels >= 0).all():
                out[f"community_p@{self.m}"] = torch.tensor(
                    community_precision_at_m(full, labels, self.m)
                )
                # random neighbours
                out[f"community_p@{self.m}_chance"] = torch.tensor(community_chance(labels))
        return out
