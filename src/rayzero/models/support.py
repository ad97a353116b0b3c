"""Categorical supports for values and rewards, with the invertible transform of Pohlen et al. (2018).

A scalar x is squashed by h(x) = sign(x)(sqrt(|x|+1)-1) + eps*x, then written as a two-hot distribution over
the integer bins [-S, S] (2S+1 bins). The inverse maps an expected bin back through h^-1.
"""

from __future__ import annotations

import torch

EPS = 1e-3


def h(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * (torch.sqrt(torch.abs(x) + 1.0) - 1.0) + EPS * x


def h_inv(y: torch.Tensor) -> torch.Tensor:
    # Closed form of the inverse of h for eps > 0.
    return torch.sign(y) * (
        ((torch.sqrt(1.0 + 4.0 * EPS * (torch.abs(y) + 1.0 + EPS)) - 1.0) / (2.0 * EPS)) ** 2 - 1.0
    )


def scalar_to_support(x: torch.Tensor, support_size: int) -> torch.Tensor:
    """[...] scalars -> [..., 2S+1] two-hot probabilities of h(x)."""
    y = h(x.float()).clamp(-support_size, support_size)
    low = torch.floor(y)
    upper_weight = y - low
    low_index = (low + support_size).long()
    high_index = (low_index + 1).clamp(max=2 * support_size)
    out = torch.zeros(*x.shape, 2 * support_size + 1, device=x.device, dtype=torch.float32)
    out.scatter_add_(-1, low_index.unsqueeze(-1), (1.0 - upper_weight).unsqueeze(-1))
    out.scatter_add_(-1, high_index.unsqueeze(-1), upper_weight.unsqueeze(-1))
    return out


def support_to_scalar(logits: torch.Tensor, support_size: int) -> torch.Tensor:
    """[..., 2S+1] logits -> [...] scalars (expected bin, then h^-1)."""
    probs = torch.softmax(logits.float(), dim=-1)
    bins = torch.arange(-support_size, support_size + 1, device=logits.device, dtype=torch.float32)
    return h_inv((probs * bins).sum(-1))
