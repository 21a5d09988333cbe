"""LaMP task metrics (reproducing the official LaMP evaluation) and IR metrics for rankings, as
torchmetrics.

All states are sums and counts with `dist_reduce_fx="sum"`, so every metric is exact after a DDP
sync. One module per concept: `lamp` (the task metrics and the per-sample feedback score), `primary`
(which metric a task is judged on), `ranking` (NDCG and Recall against feedback labels) and
`user_retrieval` (stage 1's user retrieval quality); their names are importable from here.
"""

from persrag_lightning.metrics.lamp import (
    LampClassificationMetric,
    LampGenerationMetric,
    LampRegressionMetric,
    lamp_metric,
    parse_rating,
    rouge_scorer,
    score_prediction,
)
from persrag_lightning.metrics.primary import HIGHER_IS_BETTER, METRIC_NAMES, PrimaryMetric, primary_metric
from persrag_lightning.metrics.ranking import (
    RankingNDCG,
    RankingRecall,
    informative_rows,
    ndcg_at_k,
    recall_at_k,
)
from persrag_lightning.metrics.user_retrieval import (
    UserRetrievalQuality,
    community_chance,
    community_precision_at_m,
    view_retrieval_accuracy,
)

__all__ = [
    "HIGHER_IS_BETTER",
    "METRIC_NAMES",
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
