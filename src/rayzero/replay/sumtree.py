"""A sum tree over the replay's positions, so prioritised sampling costs O(B log capacity), not O(capacity).

Leaves hold the sampling weight priority**alpha of each position (0 for positions that cannot start an
unroll); each inner node holds the sum of its two children, recomputed from them (never updated by
deltas), so the sums cannot drift. Every operation is vectorised over a batch of positions: one numpy
operation per tree level.
"""

from __future__ import annotations

import numpy as np


class SumTree:
    """Weights of `capacity` leaves; node 1 is the root, node i has children 2i and 2i+1."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.leaves = 1 << max(0, int(capacity - 1).bit_length())
        self.nodes = np.zeros(2 * self.leaves, dtype=np.float64)

    @property
    def total(self) -> float:
        return float(self.nodes[1])

    def weights(self, index: np.ndarray) -> np.ndarray:
        """[B] positions -> [B] their leaf weights."""
        return self.nodes[self.leaves + np.asarray(index, dtype=np.int64)]

    def _refresh(self, parents: np.ndarray) -> None:
        # parents: sorted unique node ids of one level; recompute them and every ancestor from the children.
        while parents.size and parents[0] >= 1:
            self.nodes[parents] = self.nodes[2 * parents] + self.nodes[2 * parents + 1]
            if parents[0] == 1:
                break
            parents = np.unique(parents >> 1)

    def set(self, index: np.ndarray, values: np.ndarray) -> None:
        """[B] positions (duplicates: the last value wins, as in numpy assignment), [B] weights >= 0."""
        index = np.asarray(index, dtype=np.int64)
        if index.size == 0:
            return
        self.nodes[self.leaves + index] = values
        self._refresh(np.unique((self.leaves + index) >> 1))

    def set_range(self, start: int, stop: int, values: np.ndarray | float) -> None:
        """Positions [start, stop) get `values` (a scalar or [stop - start] weights)."""
        if stop <= start:
            return
        lo, hi = self.leaves + start, self.leaves + stop - 1
        self.nodes[lo : hi + 1] = values
        while lo > 1:
            lo, hi = lo >> 1, hi >> 1
            self.nodes[lo : hi + 1] = self.nodes[2 * lo : 2 * hi + 2 : 2] + self.nodes[2 * lo + 1 : 2 * hi + 2 : 2]

    def set_all(self, values: np.ndarray) -> None:
        """[capacity] weights: rebuilds the whole tree (after a restore)."""
        self.nodes[:] = 0.0
        self.set_range(0, self.capacity, values)

    def find(self, mass: np.ndarray) -> np.ndarray:
        """[B] prefix masses in [0, total) -> [B] positions whose cumulative-weight interval holds them."""
        mass = np.array(mass, dtype=np.float64)
        node = np.ones(mass.shape, dtype=np.int64)
        while node[0] < self.leaves:
            left = self.nodes[2 * node]
            right = mass >= left
            mass -= np.where(right, left, 0.0)
            node = 2 * node + right
        return node - self.leaves

    def sample(self, rng: np.random.Generator, size: int) -> np.ndarray:
        """[size] positions drawn i.i.d. with probability weight / total (the total must be > 0)."""
        index = self.find(rng.random(size) * self.total)
        # Rounding at a boundary can land on a zero-weight leaf (a right neighbour); draw those again.
        for _ in range(8):
            bad = self.weights(index) <= 0.0
            if not bad.any():
                return index
            index[bad] = self.find(rng.random(int(bad.sum())) * self.total)
        bad = self.weights(index) <= 0.0
        if bad.any():  # pathological: fall back to the exact O(capacity) draw for the few left
            weights = self.nodes[self.leaves : self.leaves + self.capacity]
            index[bad] = rng.choice(self.capacity, size=int(bad.sum()), p=weights / weights.sum())
        return index
