"""Losses of the CFRAG stages, one function per formula of the paper."""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["Negatives", "info_nce", "kl_to_llm_feedback"]

Negatives = Literal["all_views", "cross_view"]


def info_nce(view_a: torch.Tensor, view_b: torch.Tensor, temperature: float = 0.1,
             negatives: Negatives = "all_views", gather_negatives: bool = False) -> torch.Tensor:
    """Eq. 2: symmetric InfoNCE over cosine similarities of two views of the same N users.

    `all_views` (default, the official SimCLR-style code): every one of the 2N views is an anchor
    and the other 2N-2 views are its negatives. `cross_view` is Eq. 2 read literally: anchor e'_u
    against e''_{u-} and the mirrored term, i.e. the mean of two cross-entropies over the N×N
    cross-view similarity matrix. `gather_negatives` (under torch.distributed): every rank's views
    are negatives of every other rank's, see `info_nce_gathered`.

    Args:
        view_a: [N, d] the first view's user embeddings.
        view_b: [N, d] the second view's, row i the same user as in `view_a`.
        temperature: τ of Eq. 2.
        negatives: `all_views` (the official code's) or `cross_view` (Eq. 2 read literally).
        gather_negatives: under torch.distributed, take every rank's views as negatives.
    """
    a = F.normalize(view_a, dim=-1)
    b = F.normalize(view_b, dim=-1)
    if gather_negatives and _world_size() > 1:
        return info_nce_gathered(a, b, temperature, negatives)
    n = a.shape[0]
    if negatives == "cross_view":
        logits = a @ b.T / temperature
        target = torch.arange(n, device=a.device)
        return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))
    z = torch.cat([a, b])
    logits = z @ z.T / temperature
    logits = logits.masked_fill(torch.eye(2 * n, dtype=torch.bool, device=z.device), float("-inf"))
    target = torch.cat([torch.arange(n, 2 * n), torch.arange(n)]).to(z.device)
    return F.cross_entropy(logits, target)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _GatherWithGrad(torch.autograd.Function):
    """all_gather that keeps gradients: backward sums every rank's gradient of the gathered tensor
    (all_reduce, which gloo and NCCL both have) and hands this rank its own rows. Ranks may hold
    different numbers of rows."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        padded = tensor.new_zeros((max(sizes), *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous())
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.start:ctx.start + ctx.size], None, None


def gather_with_grad(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Rows of every rank concatenated in rank order (differentiable), and the offset of this rank's
    rows.

    Args:
        tensor: this rank's rows.
    """
    if _world_size() == 1:
        return tensor, 0
    size = torch.tensor([tensor.shape[0]], device=tensor.device)
    sizes = [torch.zeros_like(size) for _ in range(_world_size())]
    dist.all_gather(sizes, size)
    sizes = [int(s) for s in sizes]
    rank = dist.get_rank()
    return _GatherWithGrad.apply(tensor, sizes, rank), sum(sizes[:rank])


def info_nce_gathered(a: torch.Tensor, b: torch.Tensor, temperature: float = 0.1,
                      negatives: Negatives = "all_views") -> torch.Tensor:
    """Eq. 2 over the global batch under DDP: this rank's (normalised) views are the anchors, every
    rank's views the candidates. Returns world_size × (this rank's share of the global mean), so
    that DDP's gradient average (with the summed gradients of the gather) is exactly the gradient of
    the single-process loss on the global batch; the mean of the returned values over ranks is that
    loss.

    Args:
        a: [N, d] this rank's first views.
        b: [N, d] this rank's second views.
        temperature: τ of Eq. 2.
        negatives: `all_views` or `cross_view`, as `info_nce`.
    """
    world = _world_size()
    both, offset = gather_with_grad(torch.cat([a, b], dim=-1))  # one collective for both views
    all_a, all_b = both.split(a.shape[-1], dim=-1)
    total, n = all_a.shape[0], a.shape[0]
    rows = torch.arange(n, device=a.device) + offset
    if negatives == "cross_view":
        ce = (F.cross_entropy(a @ all_b.T / temperature, rows, reduction="sum")
              + F.cross_entropy(b @ all_a.T / temperature, rows, reduction="sum"))
        return 0.5 * ce * world / total
    z, all_z = torch.cat([a, b]), torch.cat([all_a, all_b])
    logits = z @ all_z.T / temperature
    own = torch.zeros_like(logits, dtype=torch.bool)
    own[torch.arange(2 * n, device=a.device), torch.cat([rows, rows + total])] = True
    logits = logits.masked_fill(own, float("-inf"))
    target = torch.cat([rows + total, rows])
    return F.cross_entropy(logits, target, reduction="sum") * world / (2 * total)


def kl_to_llm_feedback(student_scores: torch.Tensor, teacher_labels: torch.Tensor, mask: torch.Tensor,
                       student_temperature: float = 1.0, teacher_temperature: float = 1.0) -> torch.Tensor:
    """Eq. 6–8 (retriever) and Eq. 6, 11–12 (reranker): KL(p_LLM ‖ p_model) over each row's valid
    candidates.

    p_LLM = softmax(labels / T_t) (Eq. 6), log p_model = log_softmax(scores / T) (Eq. 7 / 11). The
    paper writes KL(p_model ‖ p_LLM) in Eq. 8/12; the official code (and the distillation
    literature) computes KL(p_LLM ‖ p_model), and so do we. Padded slots are replaced by a large
    negative *finite* logit before any arithmetic, so whatever they hold (even NaN/inf) never
    reaches the loss or its gradient; rows with fewer than 2 valid candidates carry no ranking
    signal and are left out of the mean (0 when no row is left).

    Args:
        student_scores: [B, C] the model's scores of each row's candidates.
        teacher_labels: [B, C] the LLM feedback's scores of the same candidates.
        mask: [B, C] True where a candidate is real, False on padding.
        student_temperature: T of Eq. 7 / 11.
        teacher_temperature: T_t of Eq. 6.
    """
    # Eq. 6–8 / 11–12: KL(p_LLM || p_model), the official code's direction
    if student_scores.shape != teacher_labels.shape or student_scores.shape != mask.shape:
        raise ValueError(
            f"scores {tuple(student_scores.shape)}, labels {tuple(teacher_labels.shape)} and mask "
            f"{tuple(mask.shape)} must share one [B, C] shape"
        )
    mask = mask.to(device=student_scores.device, dtype=torch.bool)
    dtype = torch.promote_types(student_scores.dtype, torch.float32)
    # finite: exp() underflows to 0, and subtracting a row max cannot overflow
    fill = torch.finfo(dtype).min / 4
    student = (student_scores.to(dtype) / student_temperature).masked_fill(~mask, fill)
    teacher = (teacher_labels.detach().to(device=student.device, dtype=dtype) / teacher_temperature)
    teacher = teacher.masked_fill(~mask, fill)
    log_p_student = F.log_softmax(student, dim=-1)
    log_p_teacher = F.log_softmax(teacher, dim=-1)
    terms = log_p_teacher.exp() * (log_p_teacher - log_p_student)
    per_row = torch.where(mask, terms, torch.zeros_like(terms)).sum(dim=-1)
    rows = (mask.sum(dim=-1) >= 2).to(dtype)
    # no host sync; 0 when no row qualifies
    return (per_row * rows).sum() / rows.sum().clamp(min=1.0)
