"""Every option scored after a prompt in one forward (tree attention): the prompt once, then each
option's tokens but the last, each seeing the prompt and its own earlier tokens only, their
positions restarting after the prompt, so each option is scored exactly as it would be alone."""

from __future__ import annotations

import torch

__all__ = ["option_scores", "pack_option_tree", "tree_length"]


def tree_length(options: list[list[int]]) -> int:
    """Tokens the options add after a prompt: each option's but the last, which is only predicted."""
    return sum(len(o[:-1]) for o in options)


def _pack_row(ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor, prompt: list[int],
              fed: list[list[int]]) -> None:
    """One left-padded row, written in place: the prompt (causal), then each option's fed tokens
    (seeing the prompt and their own earlier tokens); padding sees itself only."""
    n = len(prompt)
    tail = [t for f in fed for t in f]
    pad = len(ids) - n - len(tail)
    ids[pad:pad + n] = torch.tensor(prompt, dtype=torch.long)
    ids[pad + n:] = torch.tensor(tail, dtype=torch.long)
    positions[pad:pad + n] = torch.arange(n)
    allowed[pad:pad + n, pad:pad + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
    a = pad + n
    for f in fed:
        positions[a:a + len(f)] = n + torch.arange(len(f))
        allowed[a:a + len(f), pad:pad + n] = True
        allowed[a:a + len(f), a:a + len(f)] = torch.tril(torch.ones(len(f), len(f), dtype=torch.bool))
        a += len(f)
    allowed[:pad, :pad] = torch.eye(pad, dtype=torch.bool)


def pack_option_tree(prompts: list[list[int]], options: list[list[int]], pad_id: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch of prompts, each followed by the options' tree, left-padded: (ids, positions, the
    additive 4D attention mask in `dtype`).

    Args:
        prompts: each prompt's token ids.
        options: each option's token ids, the same after every prompt.
        pad_id: the id of the left padding.
        dtype: the model's dtype, the mask's (its minimum blocks attention).
    """
    fed = [o[:-1] for o in options]
    width = max(len(p) for p in prompts) + tree_length(options)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(prompts), width), dtype=torch.long)
    allowed = torch.zeros((len(prompts), width, width), dtype=torch.bool)
    for b, prompt in enumerate(prompts):
        _pack_row(ids[b], positions[b], allowed[b], prompt, fed)
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return ids, positions, mask[:, None]


def option_scores(logp: torch.Tensor, options: list[list[int]]) -> list[float]:
    """Each option's summed log-probability from one row's kept log-probs: position 0 is the
    prompt's last (it scores every option's first token); option k's j-th fed token scores its
    (j+1)-th. An empty option scores 0.

    Args:
        logp: [tree_length + 1, vocab] log-probs, the row's last positions.
        options: each option's token ids, in the order they were packed.
    """
    row, start = [], 0
    for o in options:
        if not o:
            row.append(0.0)
            continue
        total = logp[0, o[0]]
        for j, token in enumerate(o[1:]):
            total = total + logp[1 + start + j, token]
        row.append(float(total))
        start += len(o) - 1
    return row
