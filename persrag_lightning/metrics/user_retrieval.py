"""User retrieval quality of stage 1: same-community precision@m, its chance level, and view-retrieval
accuracy, collected over a (possibly distributed) epoch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

__all__ = ["UserRetrievalQuality", "community_chance", "community_precision_at_m", "view_retrieval_accuracy"]


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
