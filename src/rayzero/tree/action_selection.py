"""Scores of a node's actions for the selection walk, batched over trees (torch path).

Shapes: one node per tree, B rows; A = actions; `e` is a node's packed edge statistics [B, EDGE_CHANNELS, A]
(tree.py). Every scorer returns [B, A] scores whose argmax (first maximum, i.e. lowest index on ties,
identically on CPU and CUDA) is the action to take. This module owns the scoring rules:

* MuZero PUCT: Q_norm + prior * sqrt(N) * (c1 + log((N + c2 + 1) / c2)) / (1 + N(a)), N = the node's
  visits (its expansion counts as one); an unvisited child's Q_norm is the parent's normalised value. sqrt(N) * (c1 + log(...)) comes from a per-search table indexed
  by N, so the torch path and the Triton kernel use the very same float32 coefficients.
* Gumbel MuZero interior: argmax of pi'(a) - N(a) / (1 + sum_b N(b)), pi' = softmax(logits + sigma(completed Q)).
* Gumbel MuZero root: among the actions whose visit count equals the sequential-halving schedule's next
  value, argmax of g(a) + logits(a) + sigma(completed Q)(a).
"""

from __future__ import annotations

import math

import torch

from rayzero.tree.qtransforms import child_q, completed_qvalues, minmax_normalized_q
from rayzero.tree.tree import DISCOUNT, PRIOR, REWARD, VALUE, VISITS

NEG_INF = float("-inf")
LOW_LOGIT = -1e9
"""Floor of the Gumbel root score, so actions with prior 0 stay comparable (and never NaN)."""

_COEF_TABLES: dict[tuple[int, float, float, str], torch.Tensor] = {}


def puct_coefficients(
    max_visits: int, pb_c_init: float, pb_c_base: float, device: torch.device
) -> torch.Tensor:
    """[max_visits + 1] float32: sqrt(n) * (pb_c_init + log((n + pb_c_base + 1) / pb_c_base)) for n = 0..max.

    Computed in float64 on the host and cached per device, so CPU and CUDA (torch path and Triton) use
    bit-identical values; the first use on a device copies it there once (do that before a graph capture).
    """
    key = (max_visits, float(pb_c_init), float(pb_c_base), str(device))
    table = _COEF_TABLES.get(key)
    if table is None:
        values = [
            math.sqrt(n) * (pb_c_init + math.log((n + pb_c_base + 1.0) / pb_c_base))
            for n in range(max_visits + 1)
        ]
        table = torch.tensor(values, dtype=torch.float64).to(torch.float32).to(device)
        _COEF_TABLES[key] = table
    return table


def first_play_q(node_value: torch.Tensor, low: torch.Tensor, spread: torch.Tensor) -> torch.Tensor:
    """[B, 1] the normalised Q an unvisited child is scored at: its parent's value (node_value [B]),
    normalised like the children's Q and clipped to [0, 1]."""
    return ((node_value.unsqueeze(-1) - low) / spread).clamp(0.0, 1.0)


def muzero_scores(
    e: torch.Tensor,
    node_visits: torch.Tensor,
    low: torch.Tensor,
    spread: torch.Tensor,
    coef: torch.Tensor,
    virtual_visits: torch.Tensor | None = None,
    node_value: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, A] PUCT scores of one node per tree: e [B, C, A], node_visits [B], the tree's normalisation
    bounds low/spread [B, 1] (qtransforms.minmax_bounds), coef table (puct_coefficients), node_value [B] the
    node's mean value (value sum / visits).

    Unvisited children are scored at the parent's value (`first_play_q`; 0 when node_value is None), not at
    the tree's minimum: with the minimum, once one child returns anything above it, a child the prior
    disfavours is never tried, and the visit counts just echo the prior.
    With `virtual_visits` [B, A] (pending visits of this wave, virtual loss) each pending visit counts as a
    visit that returned the worst value seen (normalised Q 0), for the child and for the node.
    """
    prior, visits = e[:, PRIOR], e[:, VISITS]
    qn = minmax_normalized_q(child_q(e[:, REWARD], e[:, DISCOUNT], e[:, VALUE]), visits, low, spread)
    unvisited_q = first_play_q(node_value, low, spread) if node_value is not None else 0.0
    if virtual_visits is not None:
        eff_visits = visits + virtual_visits
        qn = torch.where(visits > 0, qn * visits / eff_visits.clamp_min(1.0),
                         torch.where(virtual_visits > 0, 0.0, unvisited_q))
        node_visits = node_visits + virtual_visits.sum(-1)
        visits = eff_visits
    else:
        qn = torch.where(visits > 0, qn, unvisited_q)
    c = coef[node_visits.long()].unsqueeze(-1)
    return qn + prior * c / (1.0 + visits)


def gumbel_interior_scores(
    e: torch.Tensor, raw_value: torch.Tensor, *, maxvisit_init: float, value_scale: float
) -> torch.Tensor:
    """[B, A] pi'(a) - N(a) / (1 + sum N) of one node per tree: e [B, C, A], raw_value [B]."""
    prior, visits = e[:, PRIOR], e[:, VISITS]
    q = child_q(e[:, REWARD], e[:, DISCOUNT], e[:, VALUE])
    sigma_q = completed_qvalues(
        raw_value, prior, visits, q, maxvisit_init=maxvisit_init, value_scale=value_scale
    )
    improved = torch.softmax(torch.log(prior) + sigma_q, dim=-1)
    return improved - visits / (1.0 + visits.sum(-1, keepdim=True))


def gumbel_root_scores(
    e: torch.Tensor,
    raw_value: torch.Tensor,
    log_prior: torch.Tensor,
    gumbel: torch.Tensor,
    considered_visit: torch.Tensor,
    invalid_actions: torch.Tensor | None,
    *,
    maxvisit_init: float,
    value_scale: float,
) -> torch.Tensor:
    """[B, A] Gumbel root scores: e [B, C, A] of the roots, raw_value [B], log_prior [B, A] (-inf on invalid),
    gumbel [B, A] (already scaled), considered_visit [B] (the schedule's visit count for this simulation;
    only actions with exactly that many visits can be chosen), invalid_actions [B, A] bool or None."""
    visits = e[:, VISITS]
    q = child_q(e[:, REWARD], e[:, DISCOUNT], e[:, VALUE])
    sigma_q = completed_qvalues(
        raw_value, e[:, PRIOR], visits, q, maxvisit_init=maxvisit_init, value_scale=value_scale
    )
    score = (gumbel + log_prior + sigma_q).clamp_min(LOW_LOGIT)
    score = torch.where(visits == considered_visit.unsqueeze(-1), score, NEG_INF)
    if invalid_actions is not None:
        score = score.masked_fill(invalid_actions, NEG_INF)
    return score


def mask_root(score: torch.Tensor, invalid_actions: torch.Tensor | None) -> torch.Tensor:
    """[B, A] scores with invalid actions set to -inf (never chosen)."""
    return score if invalid_actions is None else score.masked_fill(invalid_actions, NEG_INF)
