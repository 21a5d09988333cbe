import math

import pytest
import torch

from persrag_lightning.modules.losses import info_nce


def _cos(u, v):
    return sum(a * b for a, b in zip(u, v)) / math.sqrt(sum(a * a for a in u) * sum(b * b for b in v))


def _reference_all_views(a, b, t):
    """SimCLR NT-Xent written out: each of the 2N views is an anchor, its positive is the other view."""
    z = a + b
    n = len(a)
    total = 0.0
    for i in range(2 * n):
        pos = (i + n) % (2 * n)
        denom = sum(math.exp(_cos(z[i], z[j]) / t) for j in range(2 * n) if j != i)
        total += -math.log(math.exp(_cos(z[i], z[pos]) / t) / denom)
    return total / (2 * n)


def _reference_cross_view(a, b, t):
    """Eq. 2 written out: log-softmax of e'_u against all e''_u-, plus the mirrored term, halved."""
    n = len(a)
    total = 0.0
    for u in range(n):
        pos = _cos(a[u], b[u]) / t
        total += -(pos - math.log(sum(math.exp(_cos(a[u], b[j]) / t) for j in range(n))))
        total += -(pos - math.log(sum(math.exp(_cos(a[j], b[u]) / t) for j in range(n))))
    return total / (2 * n)


A = [[1.0, 0.0, 0.5], [0.2, 1.0, 0.0], [0.0, 0.3, 1.0]]
B = [[0.9, 0.1, 0.4], [0.0, 1.0, 0.3], [0.5, 0.0, 1.0]]


@pytest.mark.parametrize("t", [0.1, 1.0])
def test_info_nce_all_views_matches_hand_computed(t):
    got = info_nce(torch.tensor(A), torch.tensor(B), t, "all_views").item()
    assert got == pytest.approx(_reference_all_views(A, B, t), rel=1e-5)


@pytest.mark.parametrize("t", [0.1, 1.0])
def test_info_nce_cross_view_matches_eq2(t):
    got = info_nce(torch.tensor(A), torch.tensor(B), t, "cross_view").item()
    assert got == pytest.approx(_reference_cross_view(A, B, t), rel=1e-5)


def test_info_nce_is_scale_invariant_and_prefers_matching_views():
    a = torch.tensor(A)
    assert info_nce(a, torch.tensor(B)).item() == pytest.approx(info_nce(3 * a, torch.tensor(B)).item(), rel=1e-5)
    assert info_nce(a, a).item() < info_nce(a, a.flip(0)).item()
