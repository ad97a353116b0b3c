"""Transforms of a node's children's Q-values into the values the action selection uses.

Shapes: rows are nodes (one per tree) [B], A = actions; every function takes [B, A] / [B] tensors.
This module owns the two Q transforms of the search:

* MuZero (`minmax_normalized_q`): Q = reward + discount * child value, normalised to [0, 1] with the
  min and max of all Q values seen so far in *that tree* (MuZero appendix B). Choice for unvisited
  children: normalised Q = 0, i.e. the worst value seen (as MuZero's pseudocode), so an unvisited child
  is chosen through its prior bonus only. While a tree has seen no spread (max <= min) every Q
  normalises to 0, so only priors and visit counts decide; this keeps the score independent of the
  scale of the values.
* Gumbel MuZero (`completed_qvalues`): Q of visited children, the "mixed value" (the network value
  mixed with the prior-weighted mean Q of the visited children, Danihelka et al. 2022 appendix D) for
  unvisited ones, rescaled to [0, 1] by the min and max over the node's children, then multiplied by
  sigma's scale (maxvisit_init + max_b N(b)) * value_scale.

The operations and their order are mirrored exactly by the Triton kernels (kernels.py), so keep the two in
step when editing.
"""

from __future__ import annotations

import torch

RESCALE_EPSILON = 1e-8
"""Smallest max - min range used to rescale completed Q-values (avoids 0/0 when all are equal)."""


def child_q(rewards: torch.Tensor, discounts: torch.Tensor, child_values: torch.Tensor) -> torch.Tensor:
    """[B, A] Q = reward + discount * child value (garbage where unvisited: mask it)."""
    return rewards + discounts * child_values


def minmax_bounds(value_min: torch.Tensor, value_max: torch.Tensor, min_range: float = 0.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1] (low, spread) such that (q - low) / spread is the normalised Q: the tree's (min, max(max - min,
    min_range)) when max > min, else (0, inf), which maps every finite Q to 0. Computed once per selection walk."""
    spread = value_max - value_min
    has_spread = spread > 0
    low = torch.where(has_spread, value_min, 0.0)
    spread = torch.where(has_spread, spread.clamp_min(min_range), float("inf"))
    return low.unsqueeze(-1), spread.unsqueeze(-1)


def minmax_normalized_q(
    q: torch.Tensor, visits: torch.Tensor, low: torch.Tensor, spread: torch.Tensor
) -> torch.Tensor:
    """[B, A] (q - low) / spread of visited children ([B, 1] bounds from `minmax_bounds`); 0 elsewhere."""
    return torch.where(visits > 0, (q - low) / spread, 0.0)


def mixed_value(
    raw_value: torch.Tensor, prior: torch.Tensor, visits: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """[B] (v + sum N * sum_{visited} p q / sum_{visited} p) / (1 + sum N): raw value [B], others [B, A]."""
    visited = visits > 0
    sum_visits = visits.sum(-1)
    p = prior.clamp_min(torch.finfo(prior.dtype).tiny)  # a visited child with prior 0 must still count
    sum_p = torch.where(visited, p, 0.0).sum(-1)
    weighted_q = torch.where(visited, p * q, 0.0).sum(-1) / sum_p.clamp_min(torch.finfo(prior.dtype).tiny)
    return (raw_value + sum_visits * weighted_q) / (sum_visits + 1.0)


def completed_qvalues(
    raw_value: torch.Tensor,
    prior: torch.Tensor,
    visits: torch.Tensor,
    q: torch.Tensor,
    *,
    maxvisit_init: float,
    value_scale: float,
) -> torch.Tensor:
    """[B, A] sigma(completed Q): Q where visited, the mixed value elsewhere, rescaled to [0, 1] over the
    node's children and multiplied by (maxvisit_init + max N) * value_scale."""
    value = mixed_value(raw_value, prior, visits, q)
    completed = torch.where(visits > 0, q, value.unsqueeze(-1))
    lo = completed.amin(-1, keepdim=True)
    hi = completed.amax(-1, keepdim=True)
    completed = (completed - lo) / (hi - lo).clamp_min(RESCALE_EPSILON)
    scale = (maxvisit_init + visits.amax(-1, keepdim=True)) * value_scale
    return scale * completed
