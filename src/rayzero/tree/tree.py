"""The search tree: a frozen dataclass of preallocated tensors (struct of arrays), B trees of N nodes.

Shapes: B = trees (roots), N = num_simulations + 1 nodes per tree, A = actions.
Node ROOT = 0 is the root; the node expanded by simulation i (1-based) has index i.
This module owns the tree's layout, its allocation and its size; filling it is `search.py`'s job.

Per-edge statistics (prior, visits, value, reward, discount of edge (node, action)) live in one packed
tensor `edges` [B, N, EDGE_CHANNELS, A] so that one gather fetches all of a node's child statistics in the
selection walk; the named fields `priors`, `children_visits`, ... are views into it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

ROOT = 0
"""Index of the root node of every tree."""
UNVISITED = -1
"""`children_index` value of an edge whose child has not been expanded."""
NO_PARENT = -1
"""`parents` value of the root (and of node slots never used)."""

# Channels of Tree.edges [B, N, EDGE_CHANNELS, A].
PRIOR, VISITS, VALUE, REWARD, DISCOUNT = range(5)
EDGE_CHANNELS = 5


def tree_map(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    """Apply `fn` to every tensor leaf of a (possibly nested) tuple/list/dict of tensors."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: tree_map(fn, v) for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # NamedTuple
        return type(x)(*(tree_map(fn, v) for v in x))
    if isinstance(x, (tuple, list)):
        return type(x)(tree_map(fn, v) for v in x)
    raise ValueError(f"embedding leaves must be torch.Tensor, got {type(x).__name__}")


def tree_leaves(x: Any) -> list[torch.Tensor]:
    """The tensor leaves of a (possibly nested) tuple/list/dict, in a fixed order."""
    out: list[torch.Tensor] = []
    tree_map(out.append, x)
    return out


def tree_map2(fn: Callable[[torch.Tensor, torch.Tensor], Any], x: Any, y: Any) -> None:
    """Call `fn(a, b)` on matching tensor leaves of two structures of the same layout."""
    for a, b in zip(tree_leaves(x), tree_leaves(y), strict=True):
        fn(a, b)


@dataclasses.dataclass(frozen=True)
class Tree:
    """B search trees of N nodes over A actions; every field is a preallocated [B, N, ...] tensor.

    The dataclass is frozen (the fields are never rebound) but its tensors are written in place.
    Visit counts are stored as float32 (exact up to 2**24) so the scores need no casts.
    """

    node_visits: torch.Tensor
    """[B, N] float32: visits of each node; its own expansion counts as one (root starts at 1)."""
    value_sums: torch.Tensor
    """[B, N] float32: sum of the returns backed up through each node (root starts at its network value)."""
    raw_values: torch.Tensor
    """[B, N] float32: the network's value at each node when it was expanded."""
    rewards: torch.Tensor
    """[B, N] float32: reward of the transition into each node (root: 0)."""
    discounts: torch.Tensor
    """[B, N] float32: discount of the transition into each node (root: 0)."""
    parents: torch.Tensor
    """[B, N] int64: parent of each node; NO_PARENT for the root and unused slots."""
    action_from_parent: torch.Tensor
    """[B, N] int64: action taken at the parent to reach each node; -1 for the root."""
    children_index: torch.Tensor
    """[B, N, A] int64: node index of each child; UNVISITED where not expanded."""
    edges: torch.Tensor
    """[B, N, EDGE_CHANNELS, A] float32: packed per-edge statistics (channels PRIOR, VISITS, VALUE,
    REWARD, DISCOUNT); use the named views below."""
    embeddings: Any
    """[B, N, ...] tensor (or pytree of them): the model state of each node."""
    value_min: torch.Tensor
    """[B] float32: smallest Q seen in each tree (MuZero min-max normalisation; +inf before any)."""
    value_max: torch.Tensor
    """[B] float32: largest Q seen in each tree (-inf before any)."""
    virtual_visits: torch.Tensor | None = None
    """[B, N, A] float32 pending (virtual-loss) visits within a wave; None unless virtual_loss > 1."""

    @property
    def batch_size(self) -> int:
        return self.node_visits.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.node_visits.shape[1]

    @property
    def num_actions(self) -> int:
        return self.children_index.shape[2]

    @property
    def node_values(self) -> torch.Tensor:
        """[B, N] mean backed-up value of each node (0 for unused slots)."""
        return self.value_sums / self.node_visits.clamp_min(1.0)

    @property
    def priors(self) -> torch.Tensor:
        """[B, N, A] prior probabilities of each node's actions (root: after masking and noise)."""
        return self.edges[:, :, PRIOR]

    @property
    def children_visits(self) -> torch.Tensor:
        """[B, N, A] visits of each child."""
        return self.edges[:, :, VISITS]

    @property
    def children_values(self) -> torch.Tensor:
        """[B, N, A] mean value of each child node (0 where unvisited)."""
        return self.edges[:, :, VALUE]

    @property
    def children_rewards(self) -> torch.Tensor:
        """[B, N, A] reward of each edge (0 where unvisited)."""
        return self.edges[:, :, REWARD]

    @property
    def children_discounts(self) -> torch.Tensor:
        """[B, N, A] discount of each edge (0 where unvisited)."""
        return self.edges[:, :, DISCOUNT]

    def qvalues(self, node: int = ROOT) -> torch.Tensor:
        """[B, A] Q = reward + discount * child value of `node`'s children; 0 where unvisited."""
        e = self.edges[:, node]
        q = e[:, REWARD] + e[:, DISCOUNT] * e[:, VALUE]
        return torch.where(e[:, VISITS] > 0, q, torch.zeros_like(q))


def allocate_tree(
    batch_size: int,
    num_nodes: int,
    num_actions: int,
    embedding: Any,
    *,
    device: torch.device,
    virtual_loss: bool = False,
) -> Tree:
    """Allocate B empty trees of `num_nodes` nodes; `embedding` [B, ...] gives the embedding layout."""
    B, N, A = batch_size, num_nodes, num_actions
    f32 = {"dtype": torch.float32, "device": device}
    i64 = {"dtype": torch.int64, "device": device}
    embeddings = tree_map(
        lambda e: torch.zeros((B, N, *e.shape[1:]), dtype=e.dtype, device=device), embedding
    )
    return Tree(
        node_visits=torch.zeros((B, N), **f32),
        value_sums=torch.zeros((B, N), **f32),
        raw_values=torch.zeros((B, N), **f32),
        rewards=torch.zeros((B, N), **f32),
        discounts=torch.zeros((B, N), **f32),
        parents=torch.full((B, N), NO_PARENT, **i64),
        action_from_parent=torch.full((B, N), -1, **i64),
        children_index=torch.full((B, N, A), UNVISITED, **i64),
        edges=torch.zeros((B, N, EDGE_CHANNELS, A), **f32),
        embeddings=embeddings,
        value_min=torch.full((B,), float("inf"), **f32),
        value_max=torch.full((B,), float("-inf"), **f32),
        virtual_visits=torch.zeros((B, N, A), **f32) if virtual_loss else None,
    )


def tree_nbytes(tree: Tree, per_tree: bool = True) -> int:
    """Bytes held by the tree's tensors (embeddings included); per tree (÷ B) unless per_tree=False."""
    total = 0
    for f in dataclasses.fields(tree):
        value = getattr(tree, f.name)
        if value is None:
            continue
        for t in tree_leaves(value):
            total += t.numel() * t.element_size()
    return total // tree.batch_size if per_tree else total
