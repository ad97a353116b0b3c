"""Sequential halving schedule of Gumbel MuZero's root (Danihelka et al. 2022, "Policy improvement by
planning with Gumbel", section 3 / appendix).

This module owns the schedule only: which visit count the next root simulation must go to.
With m considered actions and n simulations the budget is split into ceil(log2 m) phases; in a phase with
k actions still considered, each of them gets max(1, floor(n / (ceil(log2 m) * k))) more visits, then the
better half (at least 2) stays. Simulation j at the root must visit an action whose visit count equals
`considered_visits(m, n)[j]`; among those the search picks the best g + logits + sigma(completed q), which
is Gumbel-top-k followed by sequential halving without ever materialising the ranking.
"""

from __future__ import annotations

import functools
import math

import torch


@functools.lru_cache(maxsize=256)
def considered_visits(max_num_considered: int, num_simulations: int) -> tuple[int, ...]:
    """The visit count that root simulation j (0-based) goes to, for j < num_simulations.

    Example: m=16, n=50 -> 16 x [0], 8 x [1], then 4 actions x 3 rounds ([2]*4, [3]*4, [4]*4), then
    2 actions x 6 rounds ([5, 5] ... [10, 10]), then [11, 11]: ranked per-action visits
    12, 12, 5, 5, 2, 2, 2, 2, 1 x 8.
    """
    m, n = max_num_considered, num_simulations
    if m <= 1:
        return tuple(range(n))
    phases = math.ceil(math.log2(m))
    visits = [0] * m
    k = m
    seq: list[int] = []
    while len(seq) < n:
        extra = max(1, int(n / (phases * k)))
        for _ in range(extra):
            seq.extend(visits[:k])
            for i in range(k):
                visits[i] += 1
        k = max(2, k // 2)
    return tuple(seq[:n])


_TABLES: dict[tuple[int, int, str], torch.Tensor] = {}


def considered_visits_table(
    max_num_considered: int, num_simulations: int, device: torch.device
) -> torch.Tensor:
    """[m + 1, n] float32: row k is `considered_visits(k, n)` (row 0 unused); cached per device.

    Cached so that a search on CUDA copies it to the device only the first time (a CUDA-graph capture
    must find it in the cache: run the search eagerly once first, as capture.py does).
    """
    key = (max_num_considered, num_simulations, str(device))
    table = _TABLES.get(key)
    if table is None:
        rows = [[0] * num_simulations] + [
            list(considered_visits(k, num_simulations)) for k in range(1, max_num_considered + 1)
        ]
        table = torch.tensor(rows, dtype=torch.float32).to(device)
        _TABLES[key] = table
    return table
