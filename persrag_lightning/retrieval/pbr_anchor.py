"""PBR's P-Anchor graph (seed 001, Eqs. 7-10): the similarity graph of a user's chunks, its
transition matrix, PageRank by sparse power iteration, and the anchor embedding. Pure numpy/scipy;
retrieval/pbr.py builds a user's anchor from these with its settings."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp

__all__ = ["PageRankResult", "anchor_embedding", "cosine_similarity_matrix", "pagerank", "sparse_adjacency",
           "transition_matrix"]


def cosine_similarity_matrix(chunk_embs: np.ndarray) -> np.ndarray:
    """Eq. 7, S_ij = <c_i, c_j> / (||c_i|| ||c_j||)."""
    norms = np.linalg.norm(chunk_embs, axis=1, keepdims=True)
    unit = chunk_embs / np.clip(norms, 1e-12, None)
    return unit @ unit.T


def sparse_adjacency(similarity: np.ndarray, theta: float, k2: int, self_in_top_k2: bool = False
                     ) -> sp.csr_matrix:
    """Eq. 8, A_ij = S_ij if S_ij ≥ θ and j ∈ top-k2(i) else 0. top-k2(i) are the k2 most similar
    *other* chunks and the self-loop A_ii = S_ii = 1 is kept besides them (so no row is empty when θ
    ≤ 1); with `self_in_top_k2` the chunk itself is one of its k2 (the authors' code: k2 − 1 real
    neighbours)."""
    n = similarity.shape[0]
    sim = np.array(similarity, dtype=np.float64, copy=True)
    if not self_in_top_k2:
        np.fill_diagonal(sim, -np.inf)  # rank the others only; the self-loop is added back below
    k = min(k2, n if self_in_top_k2 else n - 1)
    if k <= 0:
        top = np.zeros((n, 0), dtype=np.int64)
    elif k < n:
        top = np.argpartition(-sim, k - 1, axis=1)[:, :k]
    else:
        top = np.tile(np.arange(n), (n, 1))
    rows = np.repeat(np.arange(n), top.shape[1])
    cols = top.ravel()
    if not self_in_top_k2:
        rows = np.concatenate([rows, np.arange(n)])
        cols = np.concatenate([cols, np.arange(n)])
    vals = np.asarray(similarity, dtype=np.float64)[rows, cols]
    keep = vals >= theta
    return sp.csr_matrix((vals[keep], (rows[keep], cols[keep])), shape=(n, n))


def transition_matrix(adjacency: sp.csr_matrix) -> sp.csr_matrix:
    """P = norm(A), row-normalised; an empty row (θ > 1 or negative weights) stays empty."""
    sums = np.asarray(adjacency.sum(axis=1)).ravel()
    inv = np.divide(1.0, sums, out=np.zeros_like(sums, dtype=np.float64), where=sums > 0)
    return sp.csr_matrix(sp.diags(inv) @ adjacency)


@dataclass(frozen=True)
class PageRankResult:
    """Stationary distribution π, the power-iteration steps taken, whether the L1 change fell below
    tol, and the last step's L1 change (the residual a non-converged anchor is reported with)."""

    pi: np.ndarray
    steps: int
    converged: bool
    residual: float = 0.0


def pagerank(transition: sp.csr_matrix, damping: float = 0.85, max_iter: int = 50, tol: float = 1e-6
             ) -> PageRankResult:
    """Eq. 9, π(t+1) = α Pᵀ π(t) + (1 − α)/n · 1, from uniform π(0), by sparse power iteration until
    the L1 change is below tol or max_iter steps."""
    n = transition.shape[0]
    if n == 0:
        return PageRankResult(np.zeros(0), 0, True, 0.0)
    pt = sp.csr_matrix(transition.T, dtype=np.float64)
    pi = np.full(n, 1.0 / n)
    teleport = (1.0 - damping) / n
    delta = math.inf
    for step in range(1, max_iter + 1):
        nxt = damping * (pt @ pi) + teleport
        delta = float(np.abs(nxt - pi).sum())
        pi = nxt
        if delta < tol:
            return PageRankResult(pi, step, True, delta)
    return PageRankResult(pi, max_iter, False, delta)


def anchor_embedding(pi: np.ndarray, chunk_embs: np.ndarray) -> np.ndarray:
    """Eq. 10, c_Anchor = Σ_i π_i · c_i."""
    return (pi @ chunk_embs.astype(np.float64)).astype(np.float32)
